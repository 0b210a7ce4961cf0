"""Sequence parallelism, the Ulysses design (DeepSpeed Ulysses, ALST), on torch.distributed collectives.

`parallel.sequence_parallel: N` groups N consecutive processes. A group reads one micro-batch (one packed row of the
token budget) and each of its processes keeps 1/N of the row's tokens (`shard_batch`): embeddings, norms, MLPs, the
loss and their activations run on that slice alone. Around attention (`ulysses_attention`), an all-to-all turns the
slices of every head into every token of 1/N of the heads; the run's own varlen attention then runs on the whole
packed row with its real example boundaries, sliding window included, and a second all-to-all turns the output back
into slices. So packing and sliding windows are exact, with no ring and no load balancing. K/V heads fewer than N are
replicated (each K/V head N / Hkv times, so every process gets the K/V head of its query heads); other splits are
refused (`check`).

Gradients: each process backpropagates its slice's summed loss. DDP and FSDP average gradients over every process;
the step multiplies the loss by the processes (not the data ranks) over the window's trained tokens, so the result is
the gradient of the group's summed loss, as one process computes it on the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtrain.data.batching import Counts
from llmtrain.errors import LLMTrainError

NAME = "llmtrain_ulysses"


@dataclass(frozen=True)
class SequenceGroup:
    size: int = 1  # processes that share one sequence
    rank: int = 0  # this process's place in its group: which slice of the row it keeps
    group: object = None  # the torch.distributed process group of this process's sequence group


_GROUP = SequenceGroup()  # set by setup() when the Accelerator is built; one per process, as torch.distributed's own


def sequence_parallel_size() -> int:
    return _GROUP.size


def setup(size: int) -> None:
    """Form the sequence groups (consecutive ranks) once the process group exists; size 1 forgets any earlier one
    (a second train() in one process)."""
    global _GROUP
    if size == 1:
        _GROUP = SequenceGroup()
        return
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):  # every process creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    _GROUP = SequenceGroup(size=size, rank=rank % size, group=mine)


def check(recipe, *, world: int, mesh=None, heads: int | None = None, kv_heads: int | None = None) -> None:
    """Refuse what sequence parallelism does not train, before the model loads (the head counts once known).
    `mesh`: the launch's parallelism_config, if any."""
    n = recipe.parallel.sequence_parallel
    if n == 1:
        return
    key = f"parallel.sequence_parallel={n}"
    if mesh is not None:
        raise LLMTrainError(f"{key} runs on a plain DDP or FSDP launch (accelerate_configs/ddp.yaml, fsdp.yaml); "
                            "this launch has a parallelism_config mesh (HSDP or tensor parallelism), which sequence "
                            "parallelism is not built to compose with yet. Drop the parallelism_config section, or "
                            "set parallel.sequence_parallel=1")
    if world % n:
        raise LLMTrainError(f"{key} splits each sequence over {n} processes, but the launch has {world}: launch a "
                            f"multiple of {n} processes (--num_processes), or set parallel.sequence_parallel to a "
                            f"divisor of {world}")
    if recipe.rl is not None or recipe.preference is not None:
        mode = "online RL (rl:)" if recipe.rl is not None else "preference pairs (preference:)"
        raise LLMTrainError(
            f"{key} trains supervised fine-tuning only; {mode} is refused: "
            + ("its rollout samples whole completions on every process, which a sequence group would have to "
               "sample together" if recipe.rl is not None else
               "its loss needs each sequence's whole log-probability, which the sequence group would have to sum "
               "first")
            + ". Set parallel.sequence_parallel=1, or train the long sequences with model.gradient_checkpointing, "
              "model.activation_offload and model.tiled_mlp on each GPU (docs/long-context.md)")
    if recipe.model.attn_implementation not in ("auto", "varlen"):
        raise LLMTrainError(f"{key} runs llmtrain's varlen attention on the gathered sequence; "
                            f"model.attn_implementation={recipe.model.attn_implementation} is refused. Set it to "
                            "auto")
    if recipe.model.compile:
        raise LLMTrainError(f"{key} with model.compile is untested; set model.compile=false")
    if heads is not None:
        if heads % n:
            raise LLMTrainError(f"{key}: the model's {heads} attention heads do not split into {n} equal groups; "
                                f"set parallel.sequence_parallel to a divisor of {heads}")
        if kv_heads % n and n % kv_heads:
            raise LLMTrainError(f"{key}: the model's {kv_heads} key/value heads neither split into {n} groups nor "
                                f"divide {n} (to be replicated); set parallel.sequence_parallel to a divisor or a "
                                f"multiple of {kv_heads} that divides {heads}")


def shard_batch(batch: dict, counts: Counts, *, size: int, rank: int, pad_id: int) -> tuple[dict, Counts]:
    """This process's slice of a collated packed row: its tokens and positions, the whole row's example boundaries
    (the attention sees the whole row), and the trained positions that fall in the slice, renumbered from it.

    The row is padded to a multiple of `size` with pad tokens that form an example of their own (nothing trains on
    them, and no real token attends to them). Counts: the slice's trained and real tokens; the attention FLOPs of the
    whole row divided by `size` (each process attends for 1/size of the heads)."""
    if "cu_seq_lens" not in batch:
        raise LLMTrainError("sequence parallelism needs packed rows (the varlen attention's example boundaries)")
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens"]
    total = ids.shape[1]
    pad = -total % size
    max_length = batch["max_length"]
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        max_length = max(max_length, pad)
    width = (total + pad) // size
    lo, hi = rank * width, (rank + 1) * width
    index = batch["loss_index"]
    keep = (index >= lo) & (index < hi)
    out = {**batch, "input_ids": ids[:, lo:hi], "position_ids": pos[:, lo:hi], "cu_seq_lens": cu,
           "max_length": max_length, "loss_index": index[keep] - lo, "loss_targets": batch["loss_targets"][keep],
           "loss_example": batch["loss_example"][keep], "examples": len(batch["cu_seq_lens"]) - 1}
    trained = float(keep.sum())
    return out, Counts(units=trained, trained=trained, tokens=float(max(0, min(hi, total) - lo)) * (counts.tokens > 0),
                       squares=counts.squares / size)


class SequenceShards:
    """An objective whose batches are this process's slices (`shard_batch`); everything else is the wrapped
    objective's. Its eval's per-example sums (teacher-forced matches) are summed over the sequence group first."""

    def __init__(self, objective, *, pad_id: int):
        self.objective, self.pad_id = objective, pad_id
        objective.example_sum = example_sum

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def collate(self, examples: list[dict]):
        batch, counts = self.objective.collate(examples)
        return shard_batch(batch, counts, size=_GROUP.size, rank=_GROUP.rank, pad_id=self.pad_id)


def example_sum(*per_example: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-example sums over the sequence group, on its first process only (zeros on the others), so that a sum over
    every process counts each example once."""
    import torch.distributed as dist

    both = torch.stack(per_example)
    dist.all_reduce(both, group=_GROUP.group)
    return tuple(both * (_GROUP.rank == 0))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over the sequence group, of equal chunks along dim 0; its backward is the same exchange of
    the gradient (chunk j of process i goes to process j as its chunk i, and back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        out = torch.empty_like(x)  # of a contiguous x: empty_like keeps a view's strides, which the exchange ignores
        dist.all_to_all_single(out, x, group=_GROUP.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(grad)


def _to_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(1, H, T/n, D) slices of every head -> (1, H/n, T, D): every token of this process's heads."""
    _, h, s, d = x.shape
    out = _AllToAll.apply(x[0].reshape(n, h // n, s, d))  # chunk j: the heads of process j; back: slice i of process i
    return out.transpose(0, 1).reshape(1, h // n, n * s, d)


def _to_sequence(x: torch.Tensor, n: int) -> torch.Tensor:
    """(1, T, H/n, D) every token of this process's heads -> (1, T/n, H, D): its slice of every head."""
    _, t, h, d = x.shape
    out = _AllToAll.apply(x[0].reshape(n, t // n, h, d))  # chunk j: slice j; back: the heads of process i
    return out.transpose(0, 1).reshape(1, t // n, n * h, d)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature around llmtrain's varlen attention: query (1, Hq, T/n, D), key/value
    (1, Hkv, T/n, D) -> (1, T/n, Hq, D), attending over the whole packed row."""
    from llmtrain.model.attention import varlen_attention_forward

    n = _GROUP.size
    if key.shape[1] < n:  # fewer K/V heads than processes: each goes to the processes of its query heads
        key, value = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (key, value))
    out, weights = varlen_attention_forward(module, _to_heads(query, n), _to_heads(key, n), _to_heads(value, n),
                                            attention_mask, **kwargs)
    return _to_sequence(out, n), weights


def attach(model) -> None:
    """Make the model's attention the Ulysses one (its varlen attention inside); generation switches to SDPA as it
    does from the varlen attention (model.generate.cached_attention)."""
    from transformers import AttentionInterface

    from llmtrain.model.loss import causal_lm

    AttentionInterface.register(NAME, ulysses_attention)
    causal_lm(model).config._attn_implementation = NAME


def describe(size: int, world: int) -> str:
    """The start-up line's words for the layout."""
    return (f"sequence parallelism: each sequence split over {size} processes (Ulysses all-to-all around attention), "
            f"{world // size} data-parallel group{'s' if world // size > 1 else ''}")

