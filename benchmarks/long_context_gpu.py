"""Long context on one GPU (issue 42's device measurement): the longest context that trains, and tokens/s with plain
checkpointing, model.activation_offload, model.tiled_mlp and both, against `llmtrain estimate-memory`.

    python benchmarks/long_context_gpu.py --config DIR_WITH_CONFIG_JSON --work /tmp/work/long --out long.jsonl

(benchmarks/gpu_session.sh long runs it on Llama-3.1-8B's shape; its CPU rehearsal, GPU_SESSION_DRY=1, on a
2-layer model of hidden 128 at 1/64 of the lengths.) benchmarks/long_context.py is the CPU mode: peak host memory
of one step of 7B-shaped layers.

What runs: QLoRA as llmtrain trains it (llmtrain.model.modeling.load_model with model.quantize=nf4 from random bf16
weights written once to --work, LoRA r=16 on every linear, dropout 0, bf16 autocast, gradient checkpointing, varlen
attention, the chunked loss, fused AdamW, kernels none unless --kernels) on one example of T random tokens a step,
every token trained (micro_batch_tokens = max_seq_len = T). Each row: torch.cuda.max_memory_allocated and
max_memory_reserved, the host's peak RSS, tokens/s (the first step excluded as warm-up), and what
`llmtrain estimate-memory --json` predicts for the same recipe on the full model (per_gpu_peak_allocated_bytes,
per_gpu_peak_reserved_bytes, host_ram_bytes). One JSON line a run to --out.

  search: everything on (offload + tiled MLP), T doubling from 16K to 512K, --search-steps (2) at each, stopping at
          the first out-of-memory. One process runs the sizes in order (emptying the CUDA cache between them); an
          OOM in a process that ran a smaller size first is retried in a fresh process, so the size that ends the
          search failed with a clean CUDA state.
  table:  T = 16K, 32K, 64K for plain, offload, tiled, both: --table-steps (3) each, tokens/s over the last 2.
          One process per configuration, the sizes in increasing order.

Fewer layers, and why the peak is still the 32-layer model's. At 256K tokens one step of the full 32-layer 8B takes
about 4 minutes on an H100 (causal attention alone, forward + recompute + backward, ~8e16 FLOPs), so the budget of
one device call (about 4 minutes for the whole mode, model building included) cannot run the full model at long
contexts. Instead the runs build --search-layers (2) or --table-layers (4) of the config's decoder layers and hold
a GPU "ballast" allocation standing in for the others: each missing layer's 4-bit weights, quantisation state and
LoRA parameters (measured on a built layer), its LoRA gradients and AdamW states, and, where the layer inputs stay
on the GPU (no offload), its checkpointed input (T x hidden x 2 bytes). With offload every layer input but the last
layer's goes to the host and at most two are back on the GPU in backward, however many layers there are, so the
memory of 2 real layers + ballast is the 32-layer model's GPU peak (max_memory_allocated counts the ballast; the
rows give it as ballast_gib). The host side is projected, not allocated: host_projected_gib is the measured peak RSS
plus the missing layers' offloaded inputs (each a pinned buffer, which torch's host allocator rounds up to a power
of two). A search size whose projected host memory exceeds the machine's (MemAvailable plus this process's RSS,
less 4 GiB) is not run: its row says status host_memory (--no-host-gate runs it anyway). tokens/s of 2 or 4 layers is
not the 8B's: compare the configurations with each other (offload's and tiling's cost), not with the full model's
speed. --search-layers 32 --table-layers 32 run the real model where time allows (the random weights of all layers
are then written once, ~16 GB).

Time: with --budget-s (gpu_session.sh passes 210), no size is started when predicted (the previous size's seconds
times the square of the length ratio) to end after the budget: its row says skipped (--budget-s). Expected on one
H100 with the defaults: about 4 to 5 minutes in all.

The tokens are random ids (the memory and time of a step do not depend on them; RoPE positions beyond the config's
max_position_embeddings are computed as any other, as model.rope_scaling would make them legitimate).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import CONFIGS, packed_batch, rss_bytes  # benchmarks/ is not a package

GIB = 2**30


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def layer_input_bytes(tokens: int, hidden: int) -> int:
    return tokens * hidden * 2  # bf16 residual stream


def host_copy_bytes(tokens: int, hidden: int, cuda: bool) -> int:
    """Host memory of one offloaded layer input: pinned on CUDA, where torch's host allocator rounds every block up
    to a power of two (CachingHostAllocator: PowerOf2Ceil), so 400K tokens of an 8B take 4 GiB a layer, not 3.1."""
    size = layer_input_bytes(tokens, hidden)
    return pow2(size) if cuda else size


def read_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ---------------------------------------------------------------------------------------------- worker: weights
def save_weights(config_dir: str, layer_counts: list[int], work: Path) -> None:
    """Random bf16 weights with the most layers asked for, written once per layer count (load_model quantises
    weights it reads: model.quantize with model.random_init is refused)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"  # a random init on the CPU of an 8B layer takes long
    config = AutoConfig.from_pretrained(config_dir)
    config.num_hidden_layers = max(layer_counts)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for n in sorted(set(layer_counts), reverse=True):
        model.model.layers = model.model.layers[:n]
        model.config.num_hidden_layers = n
        model.save_pretrained(work / f"weights-{n}")


# ---------------------------------------------------------------------------------------------- worker: steps
def tensor_bytes(module) -> int:
    """Bytes of a module's parameters and buffers, with bitsandbytes' quantisation state of its 4-bit weights."""
    seen, total = set(), 0
    tensors = list(module.parameters()) + list(module.buffers())
    for p in list(tensors):
        state = getattr(p, "quant_state", None)
        for s in (state, getattr(state, "state2", None)):
            if s is not None:
                tensors += [t for t in (s.absmax, s.code, getattr(s, "offset", None)) if t is not None]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def build(args):
    import torch

    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.loss import attach_loss, causal_lm
    from llmtrain.model.modeling import build_optimizer, load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(name_or_path=str(Path(args.work) / f"weights-{args.layers}"), dtype="bfloat16", quantize="nf4",
                      attn_implementation="varlen", kernels=args.kernels, gradient_checkpointing=True,
                      **CONFIGS[args.worker])
    torch.manual_seed(0)
    model = load_model(cfg, LoraConfig(r=args.lora_r, dropout=0.0), device=device,
                       compute_dtype=torch.bfloat16).train()
    attach_loss(model, chunk=4096)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                fused=device.type == "cuda")
    layer = causal_lm(model).model.layers[0]
    per_layer = tensor_bytes(layer) + 3 * sum(p.numel() * p.element_size() for p in layer.parameters()
                                              if p.requires_grad)  # + gradient and AdamW's two states
    return model, optimizer, device, per_layer


def ballast_bytes(args, tokens: int, per_layer: int, hidden: int) -> int:
    missing = args.target_layers - args.layers
    kept_inputs = 0 if CONFIGS[args.worker].get("activation_offload") else layer_input_bytes(tokens, hidden)
    return max(missing, 0) * (per_layer + kept_inputs)


def host_available() -> int:
    """Bytes the host can still give: MemAvailable, or less where a cgroup (a container) limits this process."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    have = int(meminfo["MemAvailable"].split()[0]) * 1024
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            return min(have, int(Path(f"/sys/fs/cgroup/{limit}").read_text()) -
                       int(Path(f"/sys/fs/cgroup/{usage}").read_text()))
        except (OSError, ValueError):  # no such cgroup file, or "max": no limit
            continue
    return have


def refusal(args, tokens: int, hidden: int, cuda: bool, last: tuple[int, float] | None) -> dict | None:
    """Why this size is not run, or None. The host: would the full model's offloaded layer inputs fit it? The
    time: would the size, at the last size's seconds times the square of the length ratio (attention), end after
    the parent's --budget-s?"""
    if CONFIGS[args.worker].get("activation_offload") and not args.no_host_gate:
        need = (args.target_layers - 1) * host_copy_bytes(tokens, hidden, cuda)
        have = host_available() + rss_bytes() - 4 * GIB
        if need > have:
            return {"status": "host_memory", "host_needed_gib": gib(need), "host_have_gib": gib(have)}
    predicted = last[1] * (tokens / last[0]) ** 2 if last else 0.0
    if args.deadline and time.time() + predicted > args.deadline:
        return {"status": "skipped (--budget-s)", "predicted_s": round(predicted)}
    return None


def steps_at(model, optimizer, device, tokens: int, args, vocab: int) -> dict:
    """args.steps optimizer steps on one example of `tokens` random tokens: losses and seconds of each."""
    import torch

    from llmtrain.data.batching import to_device
    from llmtrain.model.loss import compute_loss

    batch = to_device(packed_batch(tokens, tokens, vocab), device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, seconds = [], []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compute_loss(model, batch)
        (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item() / tokens, 4))  # the host sync ends the step
        seconds.append(round(time.perf_counter() - start, 3))
    timed = seconds[1:] or seconds
    return {"losses": losses, "step_s": seconds, "tokens_per_s": round(tokens * len(timed) / sum(timed), 1)}


def measure(args, model, optimizer, device, tokens: int, ballast: int, vocab: int) -> dict:
    """The steps at one size with the ballast held, and the peaks; status oom where memory ran out."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    status, out, held = "ok", {}, []
    try:
        if cuda:  # the missing layers' memory, held through the steps
            held.append(torch.empty(ballast, dtype=torch.uint8, device=device))
        out = steps_at(model, optimizer, device, tokens, args, vocab)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # a kernel's own allocation fails as a RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        status, out = "oom", {"error": str(e).splitlines()[0][:300]}
    held.clear()
    optimizer.zero_grad(set_to_none=True)
    return {"status": status, **out,
            "max_allocated_gib": gib(torch.cuda.max_memory_allocated()) if cuda else None,
            "max_reserved_gib": gib(torch.cuda.max_memory_reserved()) if cuda else None,
            "ballast_gib": gib(ballast), "ballast_allocated": cuda}


def worker(args) -> None:
    """One process: build once, then each size in order; a JSON line each; stop at the first OOM or refusal."""
    if args.worker == "save":
        return save_weights(args.config, args.tokens, Path(args.work))
    shape = read_config(str(Path(args.work) / f"weights-{args.layers}"))
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    model, optimizer, device, per_layer = build(args)
    cuda, last = device.type == "cuda", None
    for tokens in args.tokens:
        row = {"phase": args.phase, "config": args.worker, "tokens": tokens, "layers": args.layers,
               "target_layers": args.target_layers, "fresh_process": tokens == args.tokens[0]}
        if (refused := refusal(args, tokens, hidden, cuda, last)) is not None:
            return print(json.dumps({**row, **refused}), flush=True)
        row.update(measure(args, model, optimizer, device, tokens, ballast_bytes(args, tokens, per_layer, hidden),
                           vocab))
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        offloaded = (args.target_layers - args.layers) * host_copy_bytes(tokens, hidden, cuda) \
            if CONFIGS[args.worker].get("activation_offload") else 0
        print(json.dumps({**row, "host_peak_gib": gib(peak_rss), "host_projected_gib": gib(peak_rss + offloaded)}),
              flush=True)
        if row["status"] != "ok":
            return None
        last = (tokens, sum(row["step_s"]))
    return None


# ---------------------------------------------------------------------------------------------- parent
def estimate(args, recipe: Path, name: str, tokens: int) -> dict:
    """`llmtrain estimate-memory --json` for the full model in this configuration at `tokens` (exit 4, does not fit,
    still prints the estimate)."""
    offload, tiled = (CONFIGS[name].get(key) for key in ("activation_offload", "tiled_mlp"))
    cmd = [sys.executable, "-m", "llmtrain", "estimate-memory", str(recipe), f"train.micro_batch_tokens={tokens}",
           f"data.max_seq_len={tokens}", f"model.activation_offload={'true' if offload else 'false'}",
           f"model.tiled_mlp={'true' if tiled else 'null'}", "--json"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)  # exit 4: does not fit
    try:
        got = json.loads(proc.stdout)
    except ValueError:
        return {"estimate_error": (proc.stderr or proc.stdout)[-300:]}
    return {"est_allocated_gib": gib(got["per_gpu_peak_allocated_bytes"]),
            "est_reserved_gib": gib(got["per_gpu_peak_reserved_bytes"]), "est_peak_phase": got.get("peak_phase"),
            "est_host_gib": gib(got.get("host_ram_bytes"))}


def estimate_recipe(args, work: Path) -> Path:
    """The recipe of these runs on the config's full model (the lengths are overrides)."""
    path = work / "estimate.yaml"
    path.write_text(
        f"model: {{name_or_path: {Path(args.config).resolve()}, dtype: bfloat16, quantize: nf4, "
        f"gradient_checkpointing: true, attn_implementation: varlen, kernels: {args.kernels}}}\n"
        f"lora: {{r: {args.lora_r}, alpha: {2 * args.lora_r}, dropout: 0.0}}\n"
        f"data: {{path: {work}/unused.jsonl, format: text, max_seq_len: 1024}}\n"
        "train: {micro_batch_size: 1, micro_batch_tokens: 1024, mixed_precision: bf16, eval_batch_size: null}\n"
        f"output_dir: {work}/unused-run\n")
    return path


class Session:
    """The workers of one call, their JSON lines (with the estimate added) to --out, and the time budget."""

    def __init__(self, args):
        self.args, self.start = args, time.monotonic()
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.target = read_config(args.config)["num_hidden_layers"]
        recipe = estimate_recipe(args, self.work)
        wanted = {("both", t) for t in args.search if "search" in args.phases} | \
            {(c, t) for c in args.table_configs for t in args.table if "table" in args.phases}
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
        self.estimates = {key: pool.submit(estimate, args, recipe, *key) for key in sorted(wanted)}

    def emit(self, row: dict) -> dict:
        future = self.estimates.get((row["config"], row["tokens"]))
        if future is not None:
            row.update(future.result())
            if row.get("max_allocated_gib") and row.get("est_allocated_gib"):
                row["allocated_over_estimate"] = round(row["max_allocated_gib"] / row["est_allocated_gib"], 3)
        with open(self.args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return row

    def over_budget(self) -> bool:
        return bool(self.args.budget_s) and time.monotonic() - self.start > self.args.budget_s

    def worker(self, phase: str, name: str, sizes: list[int], steps: int, layers: int) -> list[dict]:
        """One worker process over `sizes`; its rows, plus one for the size it died at (killed, crashed)."""
        if self.over_budget():
            return [self.emit({"phase": phase, "config": name, "tokens": t, "status": "skipped (--budget-s)"})
                    for t in sizes]
        a = self.args
        deadline = time.time() + a.budget_s - (time.monotonic() - self.start) if a.budget_s else 0
        cmd = [sys.executable, __file__, "--worker", name, "--phase", phase, "--work", str(self.work), "--config",
               a.config, "--tokens", *map(str, sizes), "--steps", str(steps), "--layers", str(layers),
               "--target-layers", str(self.target), "--kernels", a.kernels, "--lora-r", str(a.lora_r),
               "--deadline", str(deadline)]
        proc = subprocess.Popen(cmd + ["--no-host-gate"] * a.no_host_gate, stdout=subprocess.PIPE, text=True)
        rows = [self.emit(json.loads(line)) for line in proc.stdout if line.startswith("{")]
        rc = proc.wait()
        missing = [t for t in sizes if t not in {r["tokens"] for r in rows}]
        if missing and (not rows or rows[-1]["status"] == "ok"):
            rows.append(self.emit({"phase": phase, "config": name, "tokens": missing[0], "status": "crashed",
                                   "rc": rc, "layers": layers}))
        return rows

    def search(self) -> None:
        a, sizes, ok = self.args, list(self.args.search), []
        while sizes:
            rows = self.worker("search", "both", sizes, a.search_steps, a.search_layers)
            ok += [r["tokens"] for r in rows if r["status"] == "ok"]
            last = rows[-1]
            if last["status"] != "oom" or last.get("fresh_process"):
                break
            # an OOM after smaller sizes in the same process: the size again in a fresh one
            again = self.worker("search", "both", [last["tokens"]], a.search_steps, a.search_layers)
            if again[-1]["status"] != "ok":
                break
            ok.append(last["tokens"])
            sizes = sizes[sizes.index(last["tokens"]) + 1:]
        self.emit({"phase": "search", "config": "both", "tokens": None, "longest_trained_tokens": max(ok, default=None),
                   "layers": a.search_layers, "target_layers": self.target})

    def table(self) -> None:
        for name in self.args.table_configs:
            self.worker("table", name, self.args.table, self.args.table_steps, self.args.table_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a folder with the config.json of the model (all layers)")
    parser.add_argument("--work", default="/tmp/work/long", help="random weights and the estimate's recipe go here")
    parser.add_argument("--out", default="long.jsonl", help="JSON lines are appended to it")
    parser.add_argument("--phases", nargs="+", choices=["search", "table"], default=["search", "table"])
    parser.add_argument("--search", type=int, nargs="+", default=[2**k * 16384 for k in range(6)])
    parser.add_argument("--search-steps", type=int, default=2)
    parser.add_argument("--search-layers", type=int, default=2)
    parser.add_argument("--table", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--table-configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--table-steps", type=int, default=3)
    parser.add_argument("--table-layers", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--kernels", choices=["none", "liger", "auto"], default="none")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="start no size predicted to end after this many seconds (0: no limit)")
    parser.add_argument("--no-host-gate", action="store_true", help="run sizes whose offload the host cannot hold")
    for hidden in ("--worker", "--phase"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    for hidden in ("--tokens", "--steps", "--layers", "--target-layers"):
        parser.add_argument(hidden, type=int, nargs="+" if hidden == "--tokens" else None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    session = Session(args)
    layer_counts = [n for n, phase in ((args.search_layers, "search"), (args.table_layers, "table"))
                    if phase in args.phases]
    subprocess.run([sys.executable, __file__, "--worker", "save", "--config", args.config, "--work", str(session.work),
                    "--tokens", *map(str, layer_counts)], check=True)
    if "search" in args.phases:
        session.search()
    if "table" in args.phases:
        session.table()


if __name__ == "__main__":
    main()
