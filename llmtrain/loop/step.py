"""One optimizer step (`train_step`) and one pass over the eval set (`evaluate`), for any objective
(objective.py).

Loss normalisation: the loss of an optimizer step is the objective's summed loss over every micro-batch of the
accumulation window on every process, divided by the loss units (trained tokens, for SFT) of that whole window.
So micro-batch 8 x accumulation 1, micro-batch 1 x accumulation 8 and 2 processes x micro-batch 4 all give the
same loss and the same gradient, however the tokens are spread over the examples.

Host syncs: the counts come from the CPU batches (batching.windows) and are summed over processes in one
collective per step, kept on the device for the backward pass; the gradient norm (and, with several processes,
the summed counts and stop votes) is read back once per step, after the backward. The loss stays on the device
until a logging step (meter.Meter.line).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from llmtrain.data.batching import Counts, batch_weight, global_micro_batches, rank_view, to_device, windows
from llmtrain.loop.determinism import sampling_warn_only
from llmtrain.objectives.objective import Objective
from llmtrain.parallel.collectives import data_sum
from llmtrain.parallel.fsdp import accumulating
from llmtrain.parallel.groups import groups
from llmtrain.parallel.mesh import data_ranks, tensor_parallel_size


@dataclass(frozen=True)
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss (on the device): read back on logging steps only
    stats_sum: torch.Tensor  # this rank's summed objective statistics (on the device; empty for SFT)
    counts: Counts  # the window's counts, summed over every process
    grad_norm: float  # the global norm before clipping (NaN or inf: the update was skipped)
    lr: float  # the learning rate of this update
    skipped: bool  # no update: the gradient norm was not finite (every rank agrees: it is the global norm)
    stop_voted: bool  # some process had a stop signal when the step began (several processes only)
    rollouts: list | tuple = ()  # online RL: this rank's completions, one record each (rollouts.jsonl)
    window: object = None  # the window as it trained (online RL: its completions, for a round's later updates)
    # fp16's dynamic loss scale (train.mixed_precision fp16 on a GPU: Accelerate's GradScaler) after this step, and
    # whether the step was skipped for its overflow alone (the scale halved; not a bad step while it is >= 1)
    loss_scale: float | None = None
    overflow: bool = False


def train_step(model, optimizer, scheduler, accelerator, objective: Objective, window, *,
               max_grad_norm: float | None, stop_signal: int, fsdp_accumulate: str, step: int = 0,
               pipeline=None) -> StepResult:
    """Forward and backward over the window's micro-batches, clip, and the optimizer step unless the gradient
    norm is not finite. An objective with a rollout (online RL) first turns the window's prompts into scored
    completions, sampled by the model as it is before this step (`step`: the steps taken before it), unless the
    window holds a generation round's completions already (rl.num_iterations: loop/rounds.py). `pipeline`
    (parallel/pipeline/schedule.py): this process's stages, which run the window's micro-batches through their schedule."""
    # the processes gradients are averaged over: every data rank, and the processes of a sequence group (each holds
    # a slice's loss); a TP group's processes hold one loss between them
    averaged = accelerator.num_processes // tensor_parallel_size(accelerator)
    if (rollout := getattr(objective, "rollout", None)) is not None and not window.sampled:  # before the counts
        with sampling_warn_only():  # train.deterministic: the sampler's float cumsum has no strict CUDA kernel
            window = rollout(window, step=step)
    counts = torch.tensor([*window.counts, float(stop_signal > 0)], dtype=torch.float64)
    denominator = max(window.counts.units, 1.0)  # one process: a Python number, no device round trip
    if accelerator.num_processes > 1:  # the one collective of the step: every rank needs the window's loss units
        counts = accelerator.reduce(counts.to(accelerator.device, non_blocking=True), reduction="sum")
        # Each TP group's processes hold the same window: its counts are in the sum tp times (the stop votes are
        # summed over every process, so that a TP group never splits over a signal).
        counts[:-1] /= tensor_parallel_size(accelerator) * groups(accelerator).pipeline.size  # a pipeline's stages too
        denominator = counts[0].clamp(min=1.0).float()  # stays on the device: no host sync
    if getattr(objective, "per_trained", False):  # a term averaged over the window's trained tokens, not its loss
        # units (GRPO's entropy bonus): each pass gets the window's units per trained token, on every process
        trained = counts[1].clamp(min=1.0).float() if accelerator.num_processes > 1 else max(window.counts.trained, 1.0)
        for batch in window.batches:
            batch["units_per_trained"] = denominator / trained
    loss_sum, stats_sum = torch.zeros((), device=accelerator.device), None
    if pipeline is not None:  # the schedule runs every micro-batch; the replicas' gradients are summed after it
        loss_sum, stats_sum = pipeline.run(window.batches, scale=1.0 / denominator)
    for i, batch in enumerate(window.batches if pipeline is None else ()):
        # DDP all-reduces the gradients on the window's last micro-batch only; the others accumulate locally.
        # FSDP reduce-scatters every micro-batch by default, so only gradient shards are held between them
        # (fsdp.accumulating says what each setting sends and holds).
        last = i == len(window.batches) - 1
        with nullcontext() if last else accumulating(accelerator, model, fsdp_accumulate):
            loss, stats = objective.loss(model, to_device(batch, accelerator.device))
            if (weight := batch_weight(batch)) != 1.0:  # an idle rank's stand-in: its passes ran, nothing counts
                loss, stats = loss * weight, stats * weight
            # DDP and FSDP average gradients over the data ranks, hence the factor `averaged`: the result is
            # d(sum of all losses in the window) / (loss units in the window).
            accelerator.backward(loss * averaged / denominator)
        loss_sum += loss.detach()
        stats_sum = stats if stats_sum is None else stats_sum + stats
    clip = pipeline.clip_grad_norm_ if pipeline is not None else partial(accelerator.clip_grad_norm_,
                                                                           model.parameters())
    if pipeline is not None:  # fp16: each stage's gradients unscaled (Accelerate's clip does it for the others)
        pipeline.unscale(optimizer)
    grad_norm = float(clip(max_grad_norm or float("inf")))  # host sync
    # After the norm's sync the reduced counts are ready: reading them costs no further wait.
    *summed, votes = counts.tolist()
    lr = scheduler.get_last_lr()[0]  # the lr of this update
    skipped = not math.isfinite(grad_norm)  # the global norm: all ranks skip together
    # fp16's loss scale (Accelerate's GradScaler): its step skips an update whose unscaled gradients overflowed and
    # halves the scale, and it must run every step (its update() closes the step: without it the next step's unscale
    # raises, and the scale never falls)
    scaler = getattr(optimizer, "scaler", None)
    if not skipped or scaler is not None:
        optimizer.step()
    if pipeline is not None:  # the stages' plain optimizers: their loss scale settled by the global norm
        pipeline.update_scale(optimizer, skipped)
        scaler = pipeline.loss_scaler
    scale = float(scaler.get_scale()) if scaler is not None else None
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if (after := getattr(objective, "after_window", None)) is not None:  # the window's statistics, every process's
        after(data_sum(accelerator, *stats_sum.tolist()))  # (GRPO's adaptive entropy control: one sync a step)
    return StepResult(loss_sum=loss_sum, stats_sum=stats_sum, counts=Counts(*summed), grad_norm=grad_norm, lr=lr,
                      skipped=skipped, stop_voted=votes > 0, rollouts=window.rollouts, window=window,
                      loss_scale=scale, overflow=skipped and scale is not None and scale >= 1.0)


@torch.no_grad()
def evaluate(model, dataset, accelerator, objective: Objective, *, batch_size: int, batch_tokens: int | None,
             on_batch=lambda done, total: None, pipeline=None) -> dict:
    """The objective's eval metrics over the whole eval set, sharded over ranks, in its natural order. `pipeline`:
    the stages evaluate M micro-batches a pass (parallel.pipeline_parallel; a supervised run's eval sums)."""
    return objective.eval_metrics(eval_sums(model, dataset, accelerator, objective, batch_size=batch_size,
                                            batch_tokens=batch_tokens, on_batch=on_batch, pipeline=pipeline))


def eval_sums(model, dataset, accelerator, objective: Objective, *, batch_size: int, batch_tokens: int | None,
              on_batch=lambda done, total: None, pipeline=None) -> list[float]:
    """What `evaluate` reports, before it becomes metrics: the objective's eval sums over the eval set, summed over
    the data-parallel ranks (sums of parts of an eval set add up to the whole's)."""
    model.eval()
    world, rank = data_ranks(accelerator)
    batches = global_micro_batches(len(dataset), seed=0, epoch=0, world_size=world,
                                   micro_batch_size=batch_size, micro_batch_tokens=batch_tokens,
                                   lengths=dataset["length"] if batch_tokens else None, shuffle=False)
    plan = rank_view(batches, rank)
    # the stages' forward-only passes, M micro-batches at a time; online RL's eval samples through them instead
    # (GRPO.eval_sums: every process of a pipeline, its last stage counting)
    staged = pipeline is not None and not getattr(objective, "evaluates_by_sampling", False)
    totals, accum = None, pipeline.micro_batches if staged else 1
    passes = -(-len(plan) // accum)
    # train.deterministic: an eval that samples (online RL's, rl.num_generations_eval's at temperature) is warn-only as
    # the rollout is; the forward-only evals stay strict
    relaxed = sampling_warn_only() if getattr(objective, "evaluates_by_sampling", False) else nullcontext()
    try:  # on_batch may end the eval (a stop request: train.EvalCut), the model back in training mode
        with relaxed:
            for done, window in enumerate(windows(dataset, lambda _: plan, epoch=0, micro=0, steps=passes,
                                                  accum=accum, collate=objective.collate, pin=False,
                                                  columns=objective.columns)):
                on_batch(done, passes)
                first = window.batches[0]
                sums = (pipeline.evaluate(window.batches) if staged
                        else objective.eval_sums(model, first, accelerator.device) * batch_weight(first))
                totals = sums if totals is None else totals + sums
    finally:
        model.train()
    return data_sum(accelerator, *totals.tolist())
