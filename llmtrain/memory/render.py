"""Rich tables for `llmtrain estimate-memory`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmtrain.memory.comms import Traffic
from llmtrain.memory.fit import FIT_SHARE, FitResult, launch_line, layout, size
from llmtrain.memory.spec import COMPONENTS, GIB, Estimate, TrainSpec

WHAT = {
    "weights": "parameters in their storage dtype{shard}",
    "gradients": "gradients of trainable parameters{shard}",
    "optimizer": "AdamW state{shard}",
    "activations": "tensors saved for backward",
    "logits": "one loss chunk's logits and cross-entropy",
    "autocast_copies": "16-bit copies of fp32 weights under autocast",
    "ddp_buckets": "DDP gradient buckets",
    "fsdp_buffers": "all-gathered FSDP units in flight",
    "temporaries": "short-lived tensors (a layer's, or the loss's)",
    "kv_cache": "the sampler's KV cache{cache}",
    "generation_copy": "the sampler's merged copy of the adapted linears (rl.merged_copy)",
    "pipeline_buffers": "the pipeline's receive buffers (activations and gradients, one per micro-batch)",
    "teacher": "distillation's teacher: its weights (whole on every GPU, or sharded by FSDP; on pipeline stages the "
               "last stage's), forward and chunk logits",
    "reward_models": "online RL's reward models (rl.rewards): their weights, whole on every GPU",
    "overhead": "CUDA context, NCCL, allocator slack (reserved - allocated)",
}


def say(text: str) -> None:
    """A line of prose on stdout, wrapped at the terminal's width (80 columns where it is no terminal) as the tables
    are: typer.echo had printed --longest-context's 543 characters on one line."""
    Console().print(text, highlight=False, markup=False)


def gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def describe(spec: TrainSpec) -> str:
    where = "1 GPU" if spec.world == 1 else f"{spec.num_gpus} GPUs x {spec.num_nodes} node(s)"
    method = "full fine-tune" if spec.method == "full" else f"{'QLoRA' if spec.quantize else 'LoRA'} r={spec.lora_r}"
    mp = "no autocast" if spec.mixed_precision == "no" else f"{spec.mixed_precision} autocast"
    if spec.micro_batch_tokens:
        batch = f"packed bins of <= {spec.micro_batch_tokens} tokens (examples <= {spec.seq_len})"
    elif spec.packed:
        batch = f"packed {spec.micro_batch} x {spec.seq_len} tokens"
    else:
        batch = f"micro-batch {spec.micro_batch} x {spec.seq_len} tokens, padded"
    ckpt = "checkpointing on" if spec.gradient_checkpointing else "checkpointing off"
    ckpt += " (inputs offloaded to the host)" if spec.activation_offload else ""
    ckpt += f"; MLP tiled ({'hidden-size' if spec.tiled_mlp is True else spec.tiled_mlp}-token shards)" \
        if spec.tiled_mlp else ""
    off = ", cpu offload" if spec.cpu_offload else ""
    if spec.sharded and spec.grad_accum_steps > 1 and spec.fsdp_accumulate == "unsharded":
        off += ", gradients accumulated unsharded"
    attn = "varlen (auto)" if spec.attn_implementation == "auto" else spec.attn_implementation
    strategy = spec.strategy
    tp = f" x {spec.tp} tensor-parallel" if spec.tp > 1 else ""
    if strategy == "hsdp":
        strategy = f"hsdp{' x tp' if tp else ''} ({spec.num_nodes} replicas x {spec.shards} shards{tp})"
    elif tp:
        strategy = f"fsdp x tp ({spec.shards} shards{tp})"
    weights = (f"{spec.quantize} 4-bit base (its other weights {spec.dtype})" if spec.quantize
               else f"{spec.dtype} weights")
    if spec.pipeline_parallel > 1:
        strategy = (f"pipeline {spec.pipeline_parallel} ({spec.pipeline_schedule}"
                    f"{f', {spec.chunks} chunks a GPU' if spec.chunks > 1 else ''}) x {strategy} "
                    f"{spec.world // spec.pipeline_parallel}")
    if spec.sequence_parallel > 1:
        batch += (f", split over sequence groups of {spec.sequence_parallel} GPUs ({spec.gpu_tokens:,} tokens a GPU; "
                  f"{spec.data_ranks} data-parallel rank{'s' if spec.data_ranks > 1 else ''})")
    return (f"{method}, {strategy} on {where}{off}; {batch}; {weights}, {mp}; {ckpt}; "
            f"{attn} attention; loss chunks of {spec.loss_chunk_tokens} tokens; "
            f"{'8-bit AdamW (bitsandbytes)' if spec.optimizer == 'adamw_8bit' else 'AdamW'}")


def render_estimate(est: Estimate, advice: str, *, traffic: Traffic | None = None, launch_mp: str | None = None,
                    console: Console | None = None, beside=()) -> None:
    console = console or Console()
    spec = est.spec
    shard = (f", 1/{spec.tp} TP slice, 1/{spec.shards} shard" if spec.tp > 1 else
             f", 1/{spec.shards} shard" if spec.sharded else "")
    peak = est.peak_phase.replace("_", " ")
    table = Table(title=f"Per-GPU memory: {escape(est.model)}", title_justify="left",
                  caption=f"GiB at peak: each part at the {peak} phase; they add up to the total. Largest: each "
                  "part's own maximum over the step, at another phase where it differs.", caption_justify="left")
    table.add_column("component")
    table.add_column("GiB at peak", justify="right")
    table.add_column("largest", justify="right")
    table.add_column("what")
    largest = est.largest()
    overhead = est.breakdown["overhead"]
    for name in COMPONENTS:
        at_peak = est.breakdown.get(name, 0)
        most, phase = (overhead, est.peak_phase) if name == "overhead" else largest.get(name, (0, est.peak_phase))
        if at_peak or most or name in COMPONENTS[:6]:
            where = f" (largest at {phase.replace('_', ' ')})" if most > at_peak else ""
            what = WHAT[name].format(shard=shard, cache=(
                " (the reference loop's: the prompts', grown a token at a time)" if spec.reference_sampler else
                " (static: the fast sampler's, allocated whole)"))
            if name == "weights" and (spec.frozen_reference or spec.adapter_reference):
                what += ("; with the reference's frozen copy" if spec.frozen_reference else
                         "; with the reference's snapshot of the adapters and its spare (sync_reference)")
            table.add_row(name, gib(at_peak), gib(most),
                          ("8-bit " + what if name == "optimizer" and spec.optimizer == "adamw_8bit" else what) + where)
    table.add_section()
    table.add_row("[bold]total per GPU[/]", f"[bold]{gib(est.per_gpu_peak_bytes)}[/]", "", f"at the {peak} phase")
    console.print(f"{describe(spec)}")
    base = est.params_total - est.params_trainable if est.spec.method == "lora" else 0  # peft adds the adapters
    console.print(f"parameters: {est.params_total:,} total, {est.params_trainable:,} trainable"
                  + (f" (the base's {base:,} and the adapters' {est.params_trainable:,})" if base else ""))
    console.print(table)
    console.print(f"allocated {gib(est.per_gpu_peak_allocated_bytes)} GiB (torch max_memory_allocated), "
                  f"reserved {gib(est.per_gpu_peak_reserved_bytes)} GiB (max_memory_reserved)")
    phases = ", ".join(f"{k} {gib(v)}" for k, v in est.phases.items())
    console.print(f"[dim]allocated GiB by phase: {phases}[/]")
    verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"
    console.print(f"{verdict} in {spec.gpu_memory_gib:g} GiB per GPU; host RAM for loading: "
                  f"{gib(est.host_ram_bytes)} GiB per node")
    for line in long_context_lines(est):
        console.print(line)
    for note in est.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
    if launch_mp is not None and launch_mp != spec.mixed_precision:
        console.print(f"[dim]note: the launch config says mixed_precision={launch_mp}; llmtrain uses the "
                      f"recipe's ({spec.mixed_precision})[/]")
    if est.pipeline:
        render_stages(est, console=console)
    if traffic is not None:
        render_traffic(traffic, console=console)
    if beside:
        render_compared(beside, console=console)
    console.print(f"recommendation: {escape(advice)}", highlight=False)


def long_context_lines(est: Estimate) -> list[str]:
    """model.activation_offload and model.tiled_mlp, each on a line of its own: what they keep off the GPU and, for
    the offload, what they put in host memory."""
    lc, spec, lines = est.long_context, est.spec, []
    if "offload_host_bytes" in lc:
        per_node = lc["offload_host_bytes"] * spec.num_gpus
        lines.append(f"activation offload: {gib(lc['offload_gpu_saved_bytes'])} GiB of checkpointed layer inputs kept "
                     f"off the GPU; {gib(lc['offload_host_bytes'])} GiB of pinned host RAM per process "
                     f"({gib(per_node)} GiB per node), beside the host RAM for loading")
    if "mlp_shard_tokens" in lc:
        lines.append(f"tiled MLP: shards of {lc['mlp_shard_tokens']:,} tokens; {gib(lc['tiled_mlp_saved_bytes'])} GiB "
                     "less at the peak than the MLP over the whole micro-batch")
    return lines


def render_traffic(traffic: Traffic, *, console: Console | None = None) -> None:
    """What one GPU sends per optimizer step, the time it takes, and the step's compute beside it."""
    console = console or Console()
    net = traffic.network
    if traffic.sampling_s:
        console.print(f"sampling: {traffic.sampling_s:.2f} s of the step's compute (the prompts' prefill, then "
                      f"max_completion_tokens decode steps, each reading the weights and the KV cache at "
                      f"{net.hbm_tbps:g} TB/s)", highlight=False)
    if traffic.forwards_s:
        console.print(f"no-grad forwards: {traffic.forwards_s:.2f} s of the step's compute ({traffic.forwards_what}; "
                      "MFU leaves them out, the step runs them)", highlight=False)
    if not traffic.parts:
        console.print(f"network: none (one GPU); compute {traffic.compute_s:.2f} s per step at {net.mfu:.0%} MFU of "
                      f"{net.peak_tflops:g} TFLOP/s")
        return
    across = (f", {traffic.inter_bytes / 1e9:,.2f} GB across nodes ({traffic.inter_s:.3f} s at {net.inter_gbps:,g} "
              "Gb/s)") if traffic.inter_bytes else ""
    console.print(f"network per GPU per step: {traffic.intra_bytes / 1e9:,.2f} GB within the node "
                  f"({traffic.intra_s:.3f} s at {net.intra_gbps:,g} Gb/s){across}; compute {traffic.compute_s:.3f} s "
                  f"at {net.mfu:.0%} MFU of {net.peak_tflops:g} TFLOP/s", highlight=False)
    for what, intra, inter in traffic.parts:
        across = f", {inter / 1e9:,.2f} GB across" if traffic.inter_bytes else ""
        console.print(f"[dim]  {what}: {intra / 1e9:,.2f} GB within{across}[/]", highlight=False)
    if traffic.sequence is not None:
        console.print(sequence_line(traffic), highlight=False)
    if traffic.pipeline is not None:
        console.print(pipeline_line(traffic), highlight=False)
    if traffic.network_bound:
        console.print(f"[yellow]network-bound:[/] the collectives ({traffic.network_s:.3f} s) outlast the compute "
                      f"they can overlap ({traffic.compute_s:.3f} s); fewer, larger steps (a larger micro-batch, less "
                      "accumulation under FSDP), HSDP across nodes, or DDP for LoRA send less", highlight=False)


def render_stages(est: Estimate, *, console: Console) -> None:
    """A pipeline's stages: each GPU's layers, state, activations in flight and peak; the worst decides the fit."""
    pp = est.pipeline
    table = Table(title=f"Pipeline stages ({pp['schedule']}, {pp['micro_batches']} micro-batches a step, "
                        f"{pp['stage_gpus']} GPU(s) a stage; GiB per GPU)", title_justify="left",
                  caption=f"state: weights, gradients and AdamW state; held: the activations of the micro-batches in "
                  f"flight; buffers: torch's receive buffers. Bubble {pp['bubble']:.1%} of the step; the worst stage "
                  f"(stage {pp['worst_stage']}) is the estimate above", caption_justify="left")
    for col in ("stage", "layers", "holds", "params", "state", "in flight", "held", "buffers", "peak", "at"):
        table.add_column(col, justify="left" if col in ("stage", "layers", "holds", "at") else "right",
                         no_wrap=col in ("stage", "layers"))
    for s in pp["stages"]:
        holds = ", ".join([*(["embeddings"] if s["embedding"] else []), *(["head + loss"] if s["head"] else [])])
        table.add_row(f"stage {s['rank']}", " + ".join(f"{a}-{b - 1}" for a, b in s["layers"]), holds or "-",
                      f"{s['params'] / 1e9:,.2f} B", gib(s["state_bytes"]), "+".join(map(str, s["in_flight"])),
                      gib(s["in_flight_activation_bytes"]), gib(s["receive_buffer_bytes"]),
                      gib(s["per_gpu_peak_bytes"]), s["peak_phase"].replace("_", " "))
    console.print(table)


def render_compared(rows, *, console: Console) -> None:
    """The pipeline beside DDP, FSDP and HSDP on the same GPUs at the same global batch, by the model's step time;
    the verdict is between layouts that fit the GPUs."""
    net, memory = rows[0][2].network, rows[0][1].spec.gpu_memory_gib
    table = Table(title=f"The same global batch on these GPUs (step time by the model: {net.intra_gbps:,g} Gb/s "
                        f"within a node, {net.inter_gbps:,g} Gb/s a GPU between nodes)", title_justify="left")
    for col in ("layout", "GiB per GPU", f"fits {memory:g} GiB", "compute s", "network s", "step s"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=col == "layout")
    for label, e, t in rows:
        table.add_row(label, gib(e.per_gpu_peak_bytes), "yes" if e.fits else "no", f"{t.compute_s:.3f}",
                      f"{t.network_s:.3f}", f"{t.step_s:.3f}")
    console.print(table)
    if reason := rows[0][1].spec.unshardable_unstaged:  # (compared leaves them out)
        console.print(f"FSDP and HSDP are left out: {reason}", highlight=False)
    pipe, best = rows[0], min((r for r in rows[1:] if r[1].fits), key=lambda r: r[2].step_s, default=None)
    if best is None:
        console.print(f"by the model: none of the others fits {memory:g} GiB per GPU", highlight=False)
    else:
        ratio = best[2].step_s / pipe[2].step_s
        verdict = (f"the pipeline is {ratio:.2f}x as fast as {best[0]}" if ratio > 1 else
                   f"{best[0]} is {1 / ratio:.2f}x as fast as the pipeline")
        console.print(f"by the model, {verdict} (the fastest of the others that fit)"
                      f"{'' if pipe[1].fits else f'; the pipeline does not fit {memory:g} GiB per GPU'}",
                      highlight=False)


def pipeline_line(traffic: Traffic) -> str:
    """The boundary sends of the pacing stage and the bubble."""
    pp, net = traffic.pipeline, traffic.network
    return (f"pipeline: a boundary send is {pp.send_bytes / 2**20:,.0f} MiB at most (a micro-batch's hidden states, "
            "and any per-layer inputs and shared keys and values handed on with them); stage "
            f"{pp.rank} sends {(pp.p2p_intra + pp.p2p_inter) / 1e9:,.2f} GB a step "
            f"({pp.p2p_inter / 1e9:,.2f} GB across nodes), {pp.p2p_s(net):.3f} s; bubble {pp.bubble:.1%}; "
            f"step {traffic.step_s:.3f} s = (max(compute "
            f"{traffic.compute_s:.3f}, collectives {traffic.collectives_s:.3f}) + sends) / (1 - bubble)")


def sequence_line(traffic: Traffic) -> str:
    """Sequence parallelism's all-to-alls: what one GPU sends a step, over which link the model assumes, their time
    there and over InfiniBand, beside the compute."""
    sq, net = traffic.sequence, traffic.network
    t = sq.times(net)
    head = (f"sequence parallelism: all-to-alls of q, k, v and the attention output (and their gradients; "
            f"{sq.passes} rounds a layer a micro-batch), {sq.per_layer / 1e9:,.2f} GB a layer per round, "
            f"{sq.sent / 1e9:,.2f} GB sent per GPU per step")
    if sq.spans_nodes:
        where = (f"the group of {sq.group} spans nodes of {sq.gpus_per_node} GPUs: {sq.intra / 1e9:,.2f} GB over "
                 f"NVLink and {sq.inter / 1e9:,.2f} GB over InfiniBand, {t['seconds']:.3f} s at {net.intra_gbps:,g} / "
                 f"{net.inter_gbps:,g} Gb/s (all within a node it would take {t['nvlink_s']:.3f} s)")
    else:
        where = (f"the group of {sq.group} is within a node, over NVLink: {t['nvlink_s']:.3f} s at "
                 f"{net.intra_gbps:,g} Gb/s ({t['infiniband_s']:.3f} s were it over InfiniBand at {net.inter_gbps:,g} "
                 "Gb/s)")
    return f"{head}; {where}; compute {traffic.compute_s:.3f} s"


def fit_command(result: FitResult, target: tuple[str, tuple[str, ...]]) -> str:
    """`llmtrain launch` of the recipe with the search's configuration: the recipe's own overrides, less those of a
    key the search sets (whose value it gives), then the search's."""
    recipe, given = target
    keys = {o.split("=", 1)[0] for o in result.overrides}
    kept = [o for o in given if o.split("=", 1)[0] not in keys]
    return " ".join(["llmtrain launch", launch_line(result), recipe, *kept, *result.overrides])


def render_fit(result: FitResult, *, target: tuple[str, tuple[str, ...]] | None,
               console: Console | None = None) -> None:
    console = console or Console()
    if result.note:
        console.print(f"[dim]note: {escape(result.note)}[/]")
    if result.best is None:
        console.print("[red]--fit: no strategy, checkpointing or micro-batch fits these GPUs.[/]")
        if result.more_gpus is None:
            return
        result = result.more_gpus
        console.print(f"With FSDP on {result.best.spec.world} GPUs ({result.best.spec.num_nodes} node(s)) "
                      "something does (the fewest GPUs that fit):")
    for changed, what in (("model.quantize=nf4", "LoRA on a 16-bit base fits none of these GPUs; on a 4-bit base "
                                                  "(QLoRA) it does"),
                          ("train.optimizer=adamw_8bit", "AdamW's state fits none of these GPUs; bitsandbytes' 8-bit "
                                                         "AdamW (a quarter of its state) does")):
        if changed in result.overrides:
            console.print(f"--fit: {what} ({changed}):", highlight=False)
    by_tokens = result.best.spec.micro_batch_tokens is not None
    room = FIT_SHARE * result.best.spec.gpu_memory_gib
    table = Table(title=f"Configurations that fit (largest micro-batch each, in {FIT_SHARE:.0%} of the card: "
                        f"{room:.1f} GiB, the rest is room for the estimate's error)", title_justify="left")
    several = result.best.spec.world > 1
    # short headers, said in full in the caption: at 80 columns rich cut the long ones ("checkpo…", "throughp…")
    for col in ("strategy", "ckpt", "grads", "tokens" if by_tokens else "micro", "GiB/GPU", "speed",
                *(["net s/step"] if several else [])):
        table.add_column(col, justify="right" if col != "strategy" else "left", no_wrap=True)
    batch = "tokens: train.micro_batch_tokens" if by_tokens else "micro: train.micro_batch_size"
    table.caption = ("ckpt: model.gradient_checkpointing; grads: the gradients held between micro-batches "
                     f"(train.fsdp_accumulate); {batch}; speed: throughput relative to the fastest"
                     + ("; net s/step: network seconds a step (across nodes)" if several else ""))
    table.caption_justify = "left"
    top = max(c.score for c in result.candidates)
    for c in result.candidates:
        s, t = c.spec, c.traffic
        held = ("shards" if s.fsdp_accumulate == "sharded" else "unsharded") if s.sharded else "-"
        table.add_row(layout(s), "on" if s.gradient_checkpointing else "off", held, str(size(s)),
                      gib(c.estimate.per_gpu_peak_bytes), f"{c.score / top:.2f}",
                      *([f"{t.network_s:.3f} ({t.inter_s:.3f})"] if several else []))
    console.print(table)
    console.print(f"use: {launch_line(result)}", highlight=False)
    console.print(f"overrides: {' '.join(result.overrides)}", highlight=False)
    if target:
        console.print(f"  {escape(fit_command(result, target))}", highlight=False, soft_wrap=True)
