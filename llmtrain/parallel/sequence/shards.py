"""Sequence parallelism's side of the objective: each process of a sequence group collates its
slice of the group's packed row (`shard_batch`), and the eval's per-example sums are summed over the group."""

from __future__ import annotations

from functools import partial

import torch

from llmtrain.data.batching import Counts
from llmtrain.errors import LLMTrainError
from llmtrain.parallel.sequence.group import SequenceGroup


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

    def __init__(self, objective, *, pad_id: int, group: SequenceGroup):
        self.objective, self.pad_id, self.group = objective, pad_id, group
        objective.example_sum = partial(example_sum, group=group)

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def collate(self, examples: list[dict]):
        batch, counts = self.objective.collate(examples)
        return shard_batch(batch, counts, size=self.group.size, rank=self.group.rank, pad_id=self.pad_id)


def example_sum(*per_example: torch.Tensor, group: SequenceGroup) -> tuple[torch.Tensor, ...]:
    """Per-example sums over the sequence group, on its first process only (zeros on the others), so that a sum over
    every process counts each example once."""
    import torch.distributed as dist

    both = torch.stack(per_example)
    dist.all_reduce(both, group=group.group)
    return tuple(both * (group.rank == 0))
