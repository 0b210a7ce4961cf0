"""Sequence parallelism, the Ulysses design (DeepSpeed Ulysses, ALST), on torch.distributed collectives: the groups
and the checks. Each process's slice of a row: objectives/sequence.py; the attention: model/ulysses.py.

`parallel.sequence_parallel: N` groups N consecutive processes. A group reads one micro-batch (one packed row of the
token budget) and each of its processes keeps 1/N of the row's tokens (objectives/sequence.shard_batch): embeddings, norms, MLPs, the
loss and their activations run on that slice alone. Around attention (model/ulysses.py), an all-to-all turns the
slices of every head into every token of 1/N of the heads; the run's own varlen attention then runs on the whole
packed row with its real example boundaries, sliding window included, and a second all-to-all turns the output back
into slices. So packing and sliding windows are exact, with no ring and no load balancing. K/V heads fewer than N are
replicated (each K/V head N / Hkv times, so every process gets the K/V head of its query heads); other splits are
refused with the rest of the layout (capabilities.model_problems).

Gradients: each process backpropagates its slice's summed loss. DDP and FSDP average gradients over every process;
the step multiplies the loss by the processes (not the data ranks) over the window's trained tokens, so the result is
the gradient of the group's summed loss, as one process computes it on the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceGroup:
    size: int = 1  # processes that share one sequence
    rank: int = 0  # this process's place in its group: which slice of the row it keeps
    group: object = None  # the torch.distributed process group of this process's sequence group


def make_group(size: int) -> SequenceGroup:
    """This process's sequence group, the groups formed (consecutive ranks) once the process group exists; size 1:
    none. Kept with the run's other groups (parallel/groups.py), never in a module global."""
    if size == 1:
        return SequenceGroup()
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):  # every process creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceGroup(size=size, rank=rank % size, group=mine)


def describe(size: int, world: int) -> str:
    """The start-up line's words for the layout."""
    return (f"sequence parallelism: each sequence split over {size} processes (Ulysses all-to-all around attention), "
            f"{world // size} data-parallel group{'s' if world // size > 1 else ''}")
