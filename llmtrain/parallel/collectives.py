"""Reductions across processes, each one collective: numbers summed over all processes (`global_sum`) or over
the data-parallel ranks (`data_sum`: a tensor-parallel group's batch counted once), lists gathered in rank order (`gathered`), and a
device tensor summed over all processes without a host sync (`device_sum`).
"""

from __future__ import annotations

import torch

from llmtrain.parallel.mesh import tensor_parallel_size


def global_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers over all processes in one collective."""
    return _summed(accelerator, values).tolist()


def gathered(accelerator, items: list) -> list:
    """Every data rank's list, concatenated in rank order, on every process (picklable items: online RL's rollout
    records, the numbers its statistics are taken over). The processes of a tensor-parallel group sample, score and
    hold the same completions: the group's first (TP groups are consecutive ranks) gives them, once."""
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    first = accelerator.process_index % tensor_parallel_size(accelerator) == 0
    return gather_object(list(items) if first else [])


def device_sum(accelerator, t: torch.Tensor) -> torch.Tensor:
    """A tensor on the device summed over all processes (one all-reduce, no host sync): a statistic a loss needs
    within the step (KTO's KL estimate). Not differentiable: for detached values."""
    if accelerator.num_processes == 1:
        return t
    return accelerator.reduce(t, reduction="sum")  # on a copy: `t` itself is left as it was


def data_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers of the batches (losses, token counts) over the data-parallel ranks, in one collective over all
    processes: the processes of a tensor-parallel group hold the same batch and the same loss (the row-wise layers
    all-reduce their outputs), so the sum over all processes counts each batch tp times. Exact for counts; for
    losses the float64 sum of tp equal values divided by tp is the value."""
    tp = tensor_parallel_size(accelerator)
    return (_summed(accelerator, values) / tp).tolist()


def _summed(accelerator, values) -> torch.Tensor:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t
