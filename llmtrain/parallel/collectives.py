"""Reductions across processes, each one collective: numbers summed over all processes (`global_sum`) or over
the data-parallel ranks (`data_sum`: a tensor-parallel group's batch counted once), a flag of any process
(`any_process`), lists gathered in rank order
(`gathered`), a device tensor summed over all processes without a host sync (`device_sum`), a computation run on
a group's first process, its result given to the others (`on_first`; `on_sampling_group_first`: the user's code of
online RL under tensor parallelism or on pipeline stages), one run on the main process alone (`on_main`) or
before the others (`main_first`), its error handed to the others, and one run on each process whose errors each
hands to the others (`agreed`).
"""

from __future__ import annotations

import torch

from llmtrain.parallel.mesh import tensor_parallel_size


def global_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers over all processes in one collective."""
    return _summed(accelerator, values).tolist()


def any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process (one collective with several, none with one): every process decides alike,
    as a stop request that reached some of them."""
    if accelerator.num_processes == 1:
        return bool(flag)
    return global_sum(accelerator, bool(flag))[0] > 0


def gathered(accelerator, items: list) -> list:
    """Every data rank's list, concatenated in rank order, on every process (picklable items: online RL's rollout
    records, the numbers its statistics are taken over). The processes of a tensor-parallel group sample, score and
    hold the same completions, and so do a pipeline's stages: the group's first (TP groups are consecutive ranks; a
    pipeline's first stage, ranks 0 to replicas - 1, in replica order) gives them, once."""
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    from llmtrain.parallel.groups import groups

    first = (accelerator.process_index % tensor_parallel_size(accelerator) == 0
             and groups(accelerator).pipeline.rank == 0)
    return gather_object(list(items) if first else [])


def gathered_in(group, items: list) -> list:
    """Every list of `group`'s processes (a torch process group), concatenated in their order, on each of them: the
    last pipeline stages' tokens over the pipelines (a stage's replicas, PipelineGroup.data_group), whose quantile
    rl.top_entropy_quantile takes over every data rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(items), group=group)
    return [x for part in out for x in part]


def on_first(compute, *, group, share: bool = True):
    """`compute()` run on the first process of `group` (a torch process group; None: every process), its result
    given to the others: what must happen once for processes that hold the same batch (a reward function's call, a
    tool's, an environment's; their side effects too). `share=False`: the others get None (what the first writes for
    everyone: `on_main`). An error there reaches the others as its words (errors.Relayed) instead of leaving them
    waiting for a result that never comes; the first raises the error itself."""
    import torch.distributed as dist

    from llmtrain.errors import LLMTrainError, Relayed

    box, error = [None], None  # (True, the result or None) or (False, the error in words)
    if dist.get_rank(group) == 0:
        try:
            result = compute()
            box[0] = (True, result if share else None)
        except Exception as e:
            error = e
            who = "the main process" if group is None else "the group's first process"
            box[0] = (False, str(e) if isinstance(e, LLMTrainError) else f"{who} stopped ({type(e).__name__}: {e})")
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    done, shared = box[0]
    if error is not None:
        raise error
    if not done:
        raise Relayed(shared)
    return result if dist.get_rank(group) == 0 else shared


def on_main(accelerator, compute, *, share: bool = False):
    """`compute()` on the main process alone (what it writes for every process: the tokenised data's cache, final/),
    the others waiting for it (they get None; `share`: its result, what the main process's disk says). An error there
    reaches the others (errors.Relayed, its words) instead of leaving them at a barrier it never reaches, whose broken
    connection each would report with a traceback."""
    if accelerator.num_processes == 1:
        return compute()
    return on_first(compute, group=None, share=share)


def agreed(accelerator, compute):
    """`compute()` on every process, each doing its own part (under FSDP the main process reads the weights that the
    others, building an empty model, receive in prepare), then each one's error handed to the others (errors.Relayed)
    before any goes on: a model the main process alone could not read (no weights file, a damaged one) had been its
    paragraph, and on every other process the traceback of the next collective's broken connection (audit 34)."""
    if accelerator.num_processes == 1:
        return compute()
    import torch.distributed as dist

    from llmtrain.errors import LLMTrainError, Relayed

    result, error, said = None, None, None
    try:
        result = compute()
    except Exception as e:
        error = e
        said = str(e) if isinstance(e, LLMTrainError) else \
            f"process {accelerator.process_index} stopped ({type(e).__name__}: {e})"
    every = [None] * accelerator.num_processes
    dist.all_gather_object(every, said)
    if error is not None:
        raise error
    if (first := next((x for x in every if x is not None), None)) is not None:
        raise Relayed(first)
    return result


def main_first(accelerator, compute):
    """`compute()` on the main process, then on the others (which read what it cached: the tokenised data), as
    accelerate's main_process_first, with `on_main`'s handing of its error to the others."""
    result = on_main(accelerator, compute)
    return result if accelerator.is_main_process else compute()


def on_sampling_group_first(accelerator):
    """Where online RL runs the user's code (its reward functions, tools and environment: GRPO.user_code): on this
    process (None) without tensor parallelism or pipeline stages; with them, on the TP group's first process or the
    pipeline's first stage, its result given to the others (`on_first`), as they all sample the same completions and
    a function's side effects (a file written, a call to a service) must happen once."""
    from functools import partial

    from llmtrain.parallel.groups import groups

    if (pipeline := groups(accelerator).pipeline).size > 1:
        return partial(on_first, group=pipeline.group)
    if tensor_parallel_size(accelerator) == 1:
        return None
    return partial(on_first, group=accelerator.torch_device_mesh["tp"].get_group())


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
