"""Rich tables for `llmtrain estimate-memory`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from llmtrain.memory.fit import FitResult
from llmtrain.memory.spec import COMPONENTS, GIB, Estimate, TrainSpec

WHAT = {
    "weights": "parameters in their storage dtype{shard}",
    "gradients": "gradients of trainable parameters{shard}",
    "optimizer": "{optimizer} state{shard}",
    "activations": "tensors saved for backward",
    "logits": "logits and cross-entropy (fp32)",
    "autocast_copies": "16-bit copies of fp32 weights under autocast",
    "ddp_buckets": "DDP gradient buckets",
    "fsdp_buffers": "all-gathered FSDP units in flight",
    "temporaries": "short-lived tensors of one layer",
    "overhead": "CUDA context, NCCL, allocator slack (reserved - allocated)",
}


def gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def describe(spec: TrainSpec) -> str:
    where = "1 GPU" if spec.world == 1 else f"{spec.num_gpus} GPUs x {spec.num_nodes} node(s)"
    method = "full fine-tune" if spec.method == "full" else f"LoRA r={spec.lora_r}"
    mp = "no autocast" if spec.mixed_precision == "no" else f"{spec.mixed_precision} autocast"
    batch = (f"packed {spec.micro_batch} x {spec.seq_len} tokens" if spec.packing
             else f"micro-batch {spec.micro_batch} x {spec.seq_len} tokens")
    ckpt = "checkpointing on" if spec.grad_checkpointing else "checkpointing off"
    off = ", cpu offload" if spec.cpu_offload else ""
    return (f"{method}, {spec.strategy} on {where}{off}; {batch}; {spec.dtype} weights, {mp}; {ckpt}; "
            f"{spec.attn}; {spec.optimizer}")


def render_estimate(est: Estimate, advice: str, *, launch_mp: str | None = None,
                    console: Console | None = None) -> None:
    console = console or Console()
    spec = est.spec
    shard = f", 1/{spec.world} shard" if spec.strategy == "fsdp" else ""
    table = Table(title=f"Per-GPU memory: {est.model}", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("what")
    for name in COMPONENTS:
        if name in est.breakdown and (est.breakdown[name] or name in COMPONENTS[:6]):
            table.add_row(name, gib(est.breakdown[name]), WHAT[name].format(shard=shard, optimizer=spec.optimizer))
    table.add_section()
    table.add_row("[bold]total per GPU[/]", f"[bold]{gib(est.per_gpu_peak_bytes)}[/]",
                  f"at the {est.peak_phase.replace('_', ' ')} phase")
    console.print(f"{describe(spec)}")
    console.print(f"parameters: {est.params_total:,} total, {est.params_trainable:,} trainable")
    console.print(table)
    console.print(f"allocated {gib(est.per_gpu_peak_allocated_bytes)} GiB (torch max_memory_allocated), "
                  f"reserved {gib(est.per_gpu_peak_reserved_bytes)} GiB (max_memory_reserved)")
    phases = ", ".join(f"{k} {gib(v)}" for k, v in est.phases.items())
    console.print(f"[dim]allocated GiB by phase: {phases}[/]")
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"
    console.print(f"{verdict} in {spec.gpu_memory_gib:g} GiB per GPU; host RAM for loading: "
                  f"{gib(est.host_ram_bytes)} GiB per node")
    for note in est.notes:
        console.print(f"[dim]note: {note}[/]")
    if launch_mp is not None and launch_mp != spec.mixed_precision:
        console.print(f"[dim]note: the launch config says mixed_precision={launch_mp}; llmtrain uses the "
                      f"recipe's ({spec.mixed_precision})[/]")
    console.print(f"recommendation: {advice}", highlight=False)


def render_fit(result: FitResult, *, target: str | None, console: Console | None = None) -> None:
    console = console or Console()
    if result.note:
        console.print(f"[dim]note: {result.note}[/]")
    if result.best is None:
        console.print("[red]--fit: no strategy, checkpointing or micro-batch fits these GPUs.[/]")
        return
    table = Table(title="Configurations that fit (largest micro-batch each)", title_justify="left")
    for col in ("strategy", "checkpointing", "micro-batch", "GiB per GPU", "relative throughput"):
        table.add_column(col, justify="right" if col != "strategy" else "left")
    top = result.candidates[0].score
    for c in result.candidates:
        s = c.spec
        table.add_row(s.strategy, "on" if s.grad_checkpointing else "off", str(s.micro_batch),
                      gib(c.estimate.per_gpu_peak_bytes), f"{c.score / top:.2f}")
    console.print(table)
    flags = " ".join(result.launch_flags)
    console.print(f"use: --config_file {result.accelerate_config}{' ' + flags if flags else ''}")
    console.print(f"overrides: {' '.join(result.overrides)}", highlight=False)
    if target:
        console.print(f"  accelerate launch --config_file {result.accelerate_config}{' ' + flags if flags else ''} "
                      f"-m llmtrain finetune {target} {' '.join(result.overrides)}", highlight=False, soft_wrap=True)
