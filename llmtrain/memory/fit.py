"""`--fit`: the fastest configuration whose estimate fits the GPUs.

For each strategy the GPUs allow and gradient checkpointing off and on, the largest micro-batch that
fits is found (memory only grows with the micro-batch), then the candidates are ranked by a relative
throughput score. Only configurations whose own estimate fits are ever candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory.estimate import estimate
from llmtrain.memory.launch import shipped_config
from llmtrain.memory.params import ModelShape
from llmtrain.memory.spec import GIB, Estimate, TrainSpec

# Ranking heuristic (relative tokens/s; not a prediction, to be calibrated like the memory model):
HALF_SATURATION_TOKENS = 256  # tokens per micro-batch at which a 7B's matmuls reach half their speed
STRATEGY_EFFICIENCY = {"single": 1.0, "ddp": 0.95, "fsdp": 0.9}  # communication left after overlap
MULTI_NODE_EFFICIENCY = 0.9  # inter-node links are slower than NVLink
OFFLOAD_EFFICIENCY = 0.3  # the optimizer step on the host and host<->GPU copies of every shard
MAX_MICRO_BATCH = 256


@dataclass(frozen=True)
class Candidate:
    estimate: Estimate
    score: float

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


def throughput_score(spec: TrainSpec) -> float:
    """Relative tokens/s: GPUs x matmul utilisation at this micro-batch x strategy efficiency / work per
    token (6 units for a full fine-tune's forward and backward, 4 for LoRA's, which computes no weight
    gradients for the base, plus 2 for the forward that gradient checkpointing repeats)."""
    tokens = spec.micro_batch * spec.seq_len
    utilisation = tokens / (tokens + HALF_SATURATION_TOKENS)
    work = (6 if spec.method == "full" else 4) + (2 if spec.grad_checkpointing else 0)
    eff = STRATEGY_EFFICIENCY[spec.strategy] * (MULTI_NODE_EFFICIENCY if spec.num_nodes > 1 else 1.0)
    eff *= OFFLOAD_EFFICIENCY if spec.cpu_offload else 1.0
    return spec.world * utilisation * eff / work


def strategies_for(spec: TrainSpec) -> tuple[str, ...]:
    if spec.cpu_offload:
        return ("fsdp",)
    return ("single",) if spec.world == 1 else ("ddp", "fsdp")


def micro_batch_choices(spec: TrainSpec, global_batch: int | None) -> list[int] | None:
    """Micro-batches that keep `global_batch` examples per step (with an integer accumulation), or None
    for any micro-batch (no global batch to keep, or the GPUs do not divide it)."""
    if not global_batch or global_batch % spec.world:
        return None
    per_gpu = global_batch // spec.world
    return [d for d in range(1, per_gpu + 1) if per_gpu % d == 0]


def largest_fitting(shape: ModelShape, spec: TrainSpec, choices: list[int] | None) -> Estimate | None:
    """The estimate at the largest micro-batch that fits, trying only `choices` when given."""
    if choices is not None:
        for mb in sorted(choices, reverse=True):
            est = estimate(shape, spec.but(micro_batch=mb))
            if est.fits:
                return est
        return None
    best, lo, hi = None, 1, MAX_MICRO_BATCH
    while lo <= hi:  # memory grows with the micro-batch, so bisect
        mid = (lo + hi) // 2
        est = estimate(shape, spec.but(micro_batch=mid))
        if est.fits:
            best, lo = est, mid + 1
        else:
            hi = mid - 1
    return best


def fit(shape: ModelShape, spec: TrainSpec, *, global_batch: int | None = None) -> FitResult:
    """Search strategy x checkpointing x micro-batch on spec's GPUs; keep `global_batch` when given."""
    choices = micro_batch_choices(spec, global_batch)
    candidates = []
    for strategy in strategies_for(spec):
        for ckpt in (False, True):
            est = largest_fitting(shape, spec.but(strategy=strategy, grad_checkpointing=ckpt), choices)
            if est is not None:
                candidates.append(Candidate(est, throughput_score(est.spec)))
    note = None
    if global_batch and choices is None:
        note = (f"{spec.world} GPUs do not divide the global batch of {global_batch}; the micro-batch is "
                "the largest that fits and the global batch changes")
    if not candidates:
        return FitResult(None, (), (), None, (), note)
    # Highest score; on a tie the simpler layout (single, ddp, fsdp) without checkpointing.
    order = {"single": 0, "ddp": 1, "fsdp": 2}
    best = max(candidates, key=lambda c: (round(c.score, 9), -order[c.spec.strategy], not c.spec.grad_checkpointing))
    assert best.estimate.fits, "fit must only recommend configurations that fit"
    s = best.spec
    overrides = [f"train.micro_batch_size={s.micro_batch}",
                 f"model.gradient_checkpointing={str(s.grad_checkpointing).lower()}"]
    if choices is not None:
        overrides.append(f"train.grad_accum_steps={global_batch // (s.world * s.micro_batch)}")
    config, flags = shipped_config(s.strategy, num_gpus=s.num_gpus, num_nodes=s.num_nodes)
    ranked = tuple(sorted(candidates, key=lambda c: -c.score))
    return FitResult(best, ranked, tuple(overrides), config, flags, note)


def recommendation(shape: ModelShape, est: Estimate, *, global_batch: int | None = None) -> str:
    """One line: the headroom when the run fits, otherwise what to change (from a fit search)."""
    gpus = f"{est.spec.world} x {est.spec.gpu_memory_gib:g} GiB"
    if est.fits:
        return f"fits: {est.headroom_bytes / GIB:.1f} GiB to spare per GPU ({gpus})"
    result = fit(shape, est.spec, global_batch=global_batch)
    need = f"does not fit: needs {est.per_gpu_peak_bytes / GIB:.1f} GiB per GPU of {est.spec.gpu_memory_gib:g}"
    if result.best is None:
        more = "" if est.spec.method == "lora" else "LoRA on a bfloat16 base (--method lora --dtype bfloat16), "
        return (f"{need}; no strategy, checkpointing or micro-batch fits {gpus}: try {more}more GPUs, "
                "a shorter --seq-len, or FSDP with --cpu-offload")
    flags = " ".join(result.launch_flags)
    return (f"{need}; on {gpus} use {result.accelerate_config}{' ' + flags if flags else ''} with "
            f"{' '.join(result.overrides)} (see --fit)")
