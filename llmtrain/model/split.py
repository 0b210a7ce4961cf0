"""Tensors that tensor parallelism or FSDP split across processes (DTensors): this process's part of one, and a DoRA
row norm summed over the processes that each hold some of the row's columns. The layouts themselves are made in
parallel/; model code that reads a split weight (the merged generation copy, the reference copy) uses these."""
from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own storage here: a DTensor's local part (a view: writing it writes the tensor), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def row_norms_summed(norm: torch.Tensor, group) -> torch.Tensor:
    """Each row's norm from the norms of this process's part of it (a row-wise split layer: the processes of `group`
    each hold some of every row's columns): the root of the parts' squares summed (one all-reduce of `rows` numbers)."""
    import torch.distributed as dist

    norm = norm.square()
    dist.all_reduce(norm, group=group)
    return norm.sqrt()
