"""This process's sequence group: the processes that share one packed row (consecutive ranks), made once per
run and kept with its Accelerator (parallel/groups.py), and the start-up line's words for the layout."""

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
