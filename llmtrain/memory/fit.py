"""`--fit`: the fastest configuration whose estimate fits the GPUs, and how many GPUs would do when none fits.

For each strategy the GPUs allow and gradient checkpointing off and on, the largest micro-batch that
fits with room (FIT_SHARE of the card) is found (memory only grows with the micro-batch), then the
candidates are ranked by a relative throughput score. Only configurations whose own estimate fits are
ever candidates. A micro-batch is a number of examples, or a token budget when the run has one
(train.micro_batch_tokens). Across several nodes the strategies are DDP, FSDP and HSDP, and the mesh whose
network time per step is smallest (comms.py) is preferred among those that fit; a full fine-tune across nodes also
tries pipelines of whole nodes (P stages, FSDP inside each: memory/pipeline.py), taken where the model's step time per
token beats that mesh's. When nothing fits, FSDP is tried on more GPUs (whole nodes past one) until something does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.errors import LLMTrainError
from llmtrain.memory import estimate_run, traffic_run
from llmtrain.memory.comms import Network, Traffic, forward_flops, no_grad_flops
from llmtrain.memory.launch import shipped_config
from llmtrain.memory.params import ModelShape
from llmtrain.memory.spec import GIB, Estimate, TrainSpec
from llmtrain.parallel.pipeline.split import bubble_fraction

# Ranking heuristic (relative tokens/s; not a prediction, to be calibrated like the memory model):
HALF_SATURATION_TOKENS = 256  # tokens per micro-batch at which a 7B's matmuls reach half their speed
STRATEGY_EFFICIENCY = {"single": 1.0, "ddp": 0.95, "fsdp": 0.9, "hsdp": 0.9}  # communication left after overlap
MULTI_NODE_EFFICIENCY = 0.9  # inter-node links are slower than NVLink
OFFLOAD_EFFICIENCY = 0.3  # the optimizer step on the host and host<->GPU copies of every shard
MAX_MICRO_BATCH = 256  # examples; a token budget goes up to MAX_MICRO_BATCH * seq_len
MAX_GPUS = 64  # the "how many GPUs" search stops here (8 nodes of 8)
NODE_GPUS = 8  # GPUs per node assumed past one node, when one GPU was given
# --fit recommends only what its estimate puts at or under this share of the card: the room is for the estimate's
# own error (its target is +-10%, not yet calibrated on a GPU: docs/memory.md) and for fragmentation that a long
# run's changing shapes add. The 80 GB H100 has 79.65 GiB (81559 MiB), not 80.
FIT_SHARE = 0.9


def fits_with_room(est: Estimate) -> bool:
    return est.per_gpu_peak_bytes <= FIT_SHARE * est.gpu_memory_bytes


@dataclass(frozen=True)
class Candidate:
    estimate: Estimate
    score: float
    traffic: Traffic

    @property
    def spec(self) -> TrainSpec:
        return self.estimate.spec


@dataclass(frozen=True)
class FitResult:
    best: Candidate | None
    candidates: tuple[Candidate, ...]  # the best micro-batch of each (strategy, checkpointing) that fits
    overrides: tuple[str, ...]  # recipe key=value overrides for the best
    accelerate_config: str | None
    launch_flags: tuple[str, ...]  # `accelerate launch` flags that adapt the config's process counts
    note: str | None = None
    more_gpus: FitResult | None = None  # nothing fits: the search on the fewest GPUs where something does


def size(spec: TrainSpec) -> int:
    """The micro-batch as the recipe counts it (train.micro_batch_tokens or train.micro_batch_size): tokens (a
    budget), or examples (pairs, prompts), each spec.per_example sequences."""
    return spec.micro_batch_tokens or spec.micro_batch // spec.per_example


def with_size(spec: TrainSpec, n: int) -> TrainSpec:
    return spec.but(micro_batch_tokens=n) if spec.micro_batch_tokens else spec.but(micro_batch=n * spec.per_example)


def throughput_score(spec: TrainSpec, shape: ModelShape | None = None) -> float:
    """Relative tokens/s: GPUs x matmul utilisation at this micro-batch x strategy efficiency / work per
    token (6 units for a full fine-tune's forward and backward, 4 for LoRA's, which computes no weight
    gradients for the base, plus 2 for the forward that gradient checkpointing repeats, and 2 for each no-grad
    forward the step runs besides, in forwards of the trained model: a reference's, a teacher's; comms.no_grad_flops,
    given the model's shape)."""
    utilisation = spec.gpu_tokens / (spec.gpu_tokens + HALF_SATURATION_TOKENS)
    work = (6 if spec.method == "full" else 4) + (2 if spec.gradient_checkpointing else 0)
    if shape is not None:
        work += 2 * no_grad_flops(shape, spec) / forward_flops(shape, spec)
    eff = STRATEGY_EFFICIENCY[spec.strategy] * (MULTI_NODE_EFFICIENCY if spec.num_nodes > 1 else 1.0)
    eff *= OFFLOAD_EFFICIENCY if spec.cpu_offload else 1.0
    # a pipeline idles in its bubble
    eff *= 1 - bubble_fraction(spec.pipeline_parallel, spec.grad_accum_steps, spec.chunks)
    return spec.world * utilisation * eff / work


def layout(spec: TrainSpec) -> str:
    """The strategy as --fit's table names it: a pipeline's stages and the strategy inside them."""
    return f"pp{spec.pipeline_parallel} x {spec.strategy}" if spec.pipeline_parallel > 1 else spec.strategy


def seconds_per_token(c: Candidate) -> float:
    """The model's step time per token of the global batch: comparable between pipelines and data-parallel meshes
    (comms.Traffic.step_s)."""
    return c.traffic.step_s / (c.spec.tokens * c.spec.grad_accum_steps * c.spec.data_ranks)


def network_per_token(c: Candidate) -> float:
    """Seconds of collectives per token trained: comparable between micro-batches and accumulations."""
    return c.traffic.network_s / (c.spec.gpu_tokens * c.spec.grad_accum_steps)


def shardable(spec: TrainSpec) -> bool:
    """Whether FSDP may hold the run, as the capability table says of its recipe (spec.unshardable: e.g. a random
    start's reference copy): --fit proposes no FSDP, HSDP, offload or FSDP inside pipeline stages for it otherwise."""
    return spec.unshardable is None


def strategies_for(spec: TrainSpec) -> tuple[str, ...]:
    if not shardable(spec):  # offload is FSDP's
        return () if spec.cpu_offload else ("single",) if spec.world == 1 else ("ddp",)
    if spec.cpu_offload:
        return ("fsdp",)
    if spec.num_nodes > 1 and spec.num_gpus > 1:
        return ("ddp", "fsdp", "hsdp")
    return ("single",) if spec.world == 1 else ("ddp", "fsdp")


def micro_batch_choices(spec: TrainSpec, global_batch: int | None) -> list[int] | None:
    """Micro-batches (examples, or token budgets) that keep `global_batch` per step with an integer
    accumulation, or None for any micro-batch (no global batch to keep, or the data-parallel ranks do not divide it).
    A budget is never lowered below the run's own or seq_len, whichever is smaller, so examples still fit."""
    if not global_batch or global_batch % spec.data_ranks:
        return None
    per_gpu = global_batch // spec.data_ranks
    return [d for d in range(least_micro_batch(spec), per_gpu + 1) if per_gpu % d == 0]


def least_micro_batch(spec: TrainSpec) -> int:
    """The smallest micro-batch --fit tries: spec.min_examples examples (KTO's 2), or a budget that holds that many
    sequences of seq_len (never below the run's own budget where that is smaller: its data fits it)."""
    if spec.micro_batch_tokens:
        return min(spec.micro_batch_tokens, spec.min_examples * spec.seq_len)
    return spec.min_examples


def largest_fitting(shape: ModelShape, spec: TrainSpec, choices: list[int] | None,
                    global_batch: int | None = None) -> Estimate | None:
    """The estimate at the largest micro-batch that fits, trying only `choices` when given (each with the
    accumulation that keeps `global_batch`: what is held between micro-batches depends on it)."""
    if choices is not None:
        for n in sorted(choices, reverse=True):
            est = estimate_run(shape, with_size(spec, n).but(grad_accum_steps=global_batch // spec.data_ranks // n))
            if fits_with_room(est):
                return est
        return None
    best = None
    lo, hi = least_micro_batch(spec), MAX_MICRO_BATCH * (spec.seq_len if spec.micro_batch_tokens else 1)
    while lo <= hi:  # memory grows with the micro-batch, so bisect
        mid = (lo + hi) // 2
        est = estimate_run(shape, with_size(spec, mid))
        if fits_with_room(est):
            best, lo = est, mid + 1
        else:
            hi = mid - 1
    return best


def _search(shape: ModelShape, spec: TrainSpec, global_batch: int | None, network: Network = Network()) -> FitResult:
    choices = micro_batch_choices(spec, global_batch)
    candidates = []
    for strategy in strategies_for(spec):
        # FSDP and HSDP: gradients accumulated as shards (the default, least memory) and, where it fits, unsharded
        # (one reduce-scatter a step: less traffic, which matters only where it crosses the network)
        for accumulate in ("sharded", "unsharded") if strategy in ("fsdp", "hsdp") else (spec.fsdp_accumulate,):
            for ckpt in (False, True):
                try:
                    est = largest_fitting(shape, spec.but(strategy=strategy, gradient_checkpointing=ckpt,
                                                          fsdp_accumulate=accumulate), choices, global_batch)
                except LLMTrainError:  # a layout the run cannot take (activation offload without checkpointing,
                    continue  # the tiled MLP under FSDP, a sequence group the GPUs do not divide): not a candidate
                if est is not None and not (accumulate == "unsharded" and est.spec.grad_accum_steps == 1):  # == sharded
                    candidates.append(Candidate(est, throughput_score(est.spec, shape),
                                                traffic_run(shape, est.spec, network)))
    note = None
    if global_batch and choices is None:
        note = (f"{spec.data_ranks} data-parallel ranks do not divide the global batch of {global_batch}; the "
                "micro-batch is the largest that fits and the global batch changes")
    if not candidates:
        return FitResult(None, (), (), None, (), note)
    # Highest score; on a tie the simpler layout (single, ddp, fsdp) without checkpointing, gradients sharded.
    order = {"single": 0, "ddp": 1, "fsdp": 2, "hsdp": 3}
    best = max(candidates, key=lambda c: (round(c.score, 9), -order[c.spec.strategy], not c.spec.gradient_checkpointing,
                                          c.spec.fsdp_accumulate == "sharded"))
    if spec.num_nodes > 1:  # across nodes: the mesh that spends least time on the network per token, at its best
        best_of = {}
        for c in sorted(candidates, key=lambda c: (c.score, c.spec.fsdp_accumulate == "sharded")):  # ascending:
            best_of[c.spec.strategy, c.spec.fsdp_accumulate] = c  # each layout keeps its highest score
        best = min(best_of.values(), key=lambda c: (network_per_token(c), -c.score,
                                                    c.spec.fsdp_accumulate != "sharded"))
        pipelines = pipeline_candidates(shape, spec, global_batch, network)
        candidates += pipelines
        faster = min(pipelines, key=seconds_per_token, default=None)
        if faster is not None and seconds_per_token(faster) < seconds_per_token(best):
            best = faster
    assert fits_with_room(best.estimate), "fit must only recommend configurations that fit"
    s = best.spec
    key = "train.micro_batch_tokens" if s.micro_batch_tokens else "train.micro_batch_size"
    overrides = [f"{key}={size(s)}", f"model.gradient_checkpointing={str(s.gradient_checkpointing).lower()}"]
    if choices is not None:
        overrides.append(f"train.grad_accum_steps={s.grad_accum_steps}")
    if s.fsdp_accumulate != spec.fsdp_accumulate and s.sharded:
        overrides.append(f"train.fsdp_accumulate={s.fsdp_accumulate}")
    if s.pipeline_parallel > 1:
        overrides.append(f"parallel.pipeline_parallel={s.pipeline_parallel}")
    config, flags = shipped_config(s.strategy, num_gpus=s.num_gpus, num_nodes=s.num_nodes)
    ranked = tuple(sorted(candidates, key=lambda c: -c.score))
    return FitResult(best, ranked, tuple(overrides), config, flags, note)


def pipeline_candidates(shape: ModelShape, spec: TrainSpec, global_batch: int | None,
                        network: Network) -> list[Candidate]:
    """Full fine-tuning across nodes: pipelines of P stages of whole nodes (P dividing the nodes), FSDP inside each
    stage, spec's schedule, checkpointing off and on. Not the largest micro-batch that fits, as for the others: fewer,
    larger micro-batches widen the bubble; of the micro-batches that keep the global batch (P times the accumulation
    on 1/P of the data ranks) and fit, the one with the least step time per token (without a global batch to keep, the
    largest that fits, at P times the run's accumulation)."""
    out = []
    if spec.method != "full" or not shardable(spec):  # LoRA across nodes: DDP (or HSDP), whose traffic is the
        return out  # adapters
    for p in (p for p in range(2, spec.num_nodes + 1) if spec.num_nodes % p == 0):
        for ckpt in (False, True):
            run = spec.but(strategy="fsdp", pipeline_parallel=p, gradient_checkpointing=ckpt, fsdp_accumulate="sharded")
            choices = micro_batch_choices(run, global_batch)
            if choices is None:  # no global batch to keep: P x the accumulation, the tokens a step of the others
                run = run.but(grad_accum_steps=spec.grad_accum_steps * p)
            runs = [run] if choices is None else \
                [with_size(run, n).but(grad_accum_steps=global_batch // run.data_ranks // n) for n in choices]
            found = []
            for each in runs:
                try:
                    est = largest_fitting(shape, each, None) if choices is None else estimate_run(shape, each)
                except LLMTrainError:  # not a layout the pipeline takes (LoRA, offload, fewer micro-batches than
                    continue  # 1F1B's stages, more stages than layers, ...)
                if est is not None and fits_with_room(est):
                    found.append(Candidate(est, throughput_score(est.spec, shape),
                                           traffic_run(shape, est.spec, network)))
            if found:
                out.append(min(found, key=seconds_per_token))
    return out


def more_gpus(shape: ModelShape, spec: TrainSpec, *, global_batch: int | None = None,
              network: Network = Network()) -> FitResult | None:
    """The search on the fewest GPUs beyond spec's with which something fits: FSDP shards weights, gradients
    and optimizer state, so its per-GPU share shrinks with the GPUs (activations do not). Within a node
    2, 4, ... GPUs, then whole nodes of spec.num_gpus (NODE_GPUS when one was given); None up to MAX_GPUS."""
    if not shardable(spec):  # more GPUs under DDP hold as much each: only FSDP's shards shrink
        return None
    per_node = spec.num_gpus if spec.num_gpus > 1 else NODE_GPUS
    sizes = [w for w in (2, 4) if w < per_node] + list(range(per_node, MAX_GPUS + 1, per_node))
    for world in (w for w in sizes if w > spec.world and w % spec.sequence_parallel == 0):
        nodes = max(1, world // per_node)
        result = _search(shape, spec.but(strategy="fsdp", num_gpus=world // nodes, num_nodes=nodes), global_batch,
                         network)
        if result.best is not None:
            return result
    return None


def fit(shape: ModelShape, spec: TrainSpec, *, global_batch: int | None = None,
        network: Network = Network()) -> FitResult:
    """Search strategy x checkpointing x micro-batch on spec's GPUs; keep `global_batch` (examples, or tokens
    with a budget) when given. When nothing fits, also the fewest GPUs that would do (`more_gpus`). The search is
    over the data-parallel layouts (DDP, FSDP, HSDP: tp 1); an FSDP x TP launch is estimated as it is, not searched."""
    spec = spec.but(tp=1, pipeline_parallel=1)  # across nodes the search tries pipelines itself (the run's schedule)
    result = _search(shape, spec, global_batch, network)
    if result.best is None and spec.method == "lora" and not spec.quantize:
        # LoRA that does not fit these GPUs on a 16-bit base: the same adapters on a 4-bit base (QLoRA).
        qlora = _search(shape, spec.but(quantize="nf4"), global_batch, network)
        if qlora.best is not None:
            return replace(qlora, overrides=(*qlora.overrides, "model.quantize=nf4"))
    if result.best is None and spec.method == "full" and spec.optimizer == "adamw":
        # A full fine-tune whose AdamW state does not fit these GPUs: bitsandbytes' 8-bit moments (a quarter of fp32
        # AdamW's state; FSDP shards them too) before more GPUs.
        eight = _search(shape, spec.but(optimizer="adamw_8bit"), global_batch, network)
        if eight.best is not None:
            return replace(eight, overrides=(*eight.overrides, "train.optimizer=adamw_8bit"))
    if result.best is None:
        result = replace(result, more_gpus=more_gpus(shape, spec, global_batch=global_batch, network=network))
    return result


def launch_line(result: FitResult) -> str:
    """`--config_file CONFIG [flags]` for the best configuration of a search."""
    flags = " ".join(result.launch_flags)
    return f"--config_file {result.accelerate_config}{' ' + flags if flags else ''}"


def recommendation(shape: ModelShape, est: Estimate, *, global_batch: int | None = None,
                   network: Network = Network()) -> str:
    """One line: the headroom when the run fits, otherwise what to change (from a fit search)."""
    gpus = f"{est.spec.world} x {est.spec.gpu_memory_gib:g} GiB"
    if est.fits:
        return f"fits: {est.headroom_bytes / GIB:.1f} GiB to spare per GPU ({gpus})"
    result = fit(shape, est.spec, global_batch=global_batch, network=network)
    need = f"does not fit: needs {est.per_gpu_peak_bytes / GIB:.1f} GiB per GPU of {est.spec.gpu_memory_gib:g}"
    if result.best is None:
        more = result.more_gpus
        if more is not None:
            s = more.best.spec
            return (f"{need}; no strategy, checkpointing or micro-batch fits {gpus}, but FSDP on {s.world} GPUs "
                    f"does ({more.best.estimate.per_gpu_peak_bytes / GIB:.1f} GiB per GPU): {launch_line(more)} "
                    f"with {' '.join(more.overrides)} (see --fit)")
        nor = (f", nor FSDP on up to {MAX_GPUS} GPUs" if shardable(est.spec) else
               f" (FSDP, whose shards shrink with more GPUs, is out: {est.spec.unshardable})")
        return f"{need}; nothing fits {gpus}{nor}: {overflow_advice(est)}"
    return f"{need}; on {gpus} use {launch_line(result)} with {' '.join(result.overrides)} (see --fit)"


# The parts of a GPU's peak that the model's size makes (sharded by FSDP, offloaded by --cpu-offload); the rest
# (activations, logits, temporaries, the KV cache) the micro-batch makes, and only fewer tokens or recomputing shrink.
STATE_PARTS = ("weights", "gradients", "optimizer", "ddp_buckets", "fsdp_buffers", "autocast_copies")


def overflow_advice(est: Estimate) -> str:
    """What to change when nothing fits: for each of the two halves of the peak that does not fit the card by itself
    (the larger when neither does alone), what shrinks that half, leaving out what the run already does. The card
    holds `room` allocated bytes: its memory less the CUDA context and NCCL, over the allocator's slack."""
    s, parts = est.spec, est.breakdown
    fixed = est.per_gpu_peak_bytes - est.per_gpu_peak_reserved_bytes
    room = (est.gpu_memory_bytes - fixed) * est.per_gpu_peak_allocated_bytes / est.per_gpu_peak_reserved_bytes
    states = sum(parts.get(k, 0) for k in STATE_PARTS)
    batch = sum(n for k, n in parts.items() if k not in (*STATE_PARTS, "overhead"))
    advice = []
    if batch > room or states <= room and batch >= states:
        fewer = [] if s.gradient_checkpointing else ["gradient checkpointing (model.gradient_checkpointing=true / "
                                                 "--grad-checkpointing)"]
        if s.gradient_checkpointing and not s.activation_offload:
            fewer.append("activation offload (model.activation_offload=true / --activation-offload)")
        if not s.tiled_mlp and not s.sharded:
            fewer.append("a tiled MLP (model.tiled_mlp=true / --tiled-mlp)")
        if s.num_generations and s.rl_micro_batch_tokens is None:
            fewer.append("the update in passes of fewer tokens (rl.micro_batch_tokens, e.g. 8192)")
        if s.world > s.sequence_parallel and s.kernel == "varlen" and s.tp == 1 and not s.num_generations:
            fewer.append(f"a larger sequence group (parallel.sequence_parallel / --sequence-parallel, now "
                         f"{s.sequence_parallel}, up to the {s.world} GPUs: each holds 1/N of the tokens)")
        if s.micro_batch_tokens:
            fewer.append("a smaller token budget (train.micro_batch_tokens / --micro-batch-tokens)")
        elif s.micro_batch > s.per_example * s.min_examples:
            fewer.append("fewer examples a micro-batch (train.micro_batch_size / --micro-batch)")
        fewer.append("shorter sequences (data.max_seq_len / --seq-len)")
        if parts.get("logits", 0) >= max(parts.get("activations", 0), parts.get("temporaries", 0)):
            fewer.append("smaller loss chunks (train.loss_chunk_tokens / --loss-chunk-tokens)")
        advice.append(f"what the micro-batch keeps (activations, logits) is {batch / GIB:.1f} GiB per GPU, and FSDP "
                      f"does not divide it: try {', '.join(fewer)}")
    if states > room or batch <= room and states > batch:
        smaller = [] if s.cpu_offload else ["FSDP with --cpu-offload"]  # (FSDP alone on up to MAX_GPUS did not do)
        if not shardable(s):
            smaller = []  # the table's refusal says what else to do
        smaller += ["LoRA on a bfloat16 base (--method lora --dtype bfloat16)"] if s.method == "full" else \
            [] if s.quantize else ["QLoRA (model.quantize=nf4 / --quantize nf4)"]
        if s.method == "full" and s.optimizer == "adamw":
            smaller.append("8-bit AdamW (train.optimizer=adamw_8bit / --optimizer adamw_8bit)")
        advice.append(f"weights, gradients and optimizer state are {states / GIB:.1f} GiB per GPU: try "
                      f"{', '.join(smaller) or 'a smaller model'}")
    return "; ".join(advice)


def out_of_memory_text(est: Estimate | None, *, step: int, detail: str, recipe_path: str) -> str:
    """The paragraph a run that ran out of GPU memory ends with: where, torch's figure, the estimate against the card,
    and what to change (what --fit would search, and overflow_advice's parts)."""
    where = f"in step {step + 1}" if step >= 0 else "before the first step"
    text = f"the GPU ran out of memory {where} ({detail})."
    if est is not None:
        verdict = "does not fit" if not est.fits else "fits, so the estimate is short of this run"
        text += (f" llmtrain's estimate for this run is {est.per_gpu_peak_bytes / GIB:.1f} GiB per GPU on this "
                 f"{est.spec.gpu_memory_gib:.1f} GiB GPU: it {verdict}.")
        if not est.fits:
            text += f" What shrinks it: {overflow_advice(est)}."
    return text + (f" `llmtrain estimate-memory {recipe_path} --fit` names a configuration that fits; "
                   "nothing else was written for this step (checkpoints saved before it are intact).")


LONGEST_STEP = 1024  # --longest-context answers in multiples of this many tokens
LONGEST_MOST = 1 << 24  # and looks no further than 16M tokens


def at_context(spec: TrainSpec, tokens: int) -> TrainSpec:
    """The run with sequences of `tokens` (data.max_seq_len that long), one a micro-batch (KTO's: two, its
    min_examples), the token budget holding them; an eval during training batched by the same budget."""
    budget = tokens * spec.min_examples
    evals = dict(eval_micro_batch=1, eval_micro_batch_tokens=budget) if spec.eval_micro_batch else {}
    return spec.but(micro_batch=1, micro_batch_tokens=budget, seq_len=tokens, **evals)


def longest_context(shape: ModelShape, spec: TrainSpec) -> Estimate | None:
    """The estimate at the longest context (a multiple of LONGEST_STEP tokens, one sequence a micro-batch) that fits
    with room, as --fit requires (FIT_SHARE of the card); None when not even LONGEST_STEP tokens do. Bisection: the
    peak only grows with the tokens."""
    def fitting(n: int) -> Estimate | None:
        est = estimate_run(shape, at_context(spec, n * LONGEST_STEP))
        return est if fits_with_room(est) else None

    lo, hi = 0, LONGEST_MOST // LONGEST_STEP  # fitting(lo) holds (or lo is 0), fitting(hi + 1) is not known to
    best = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = fitting(mid)
        if found is not None:
            lo, best = mid, found
        else:
            hi = mid - 1
    return best
