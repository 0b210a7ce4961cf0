"""What the objectives that sample share (GRPO, RLOO as its subclass, and on-policy distillation): the policy put in
sampling order for a window (`sampling`), its completions drawn by the recipe's sampler (`sample`), each prompt and
completion made a trained row (`completion_rows`), and PPO's clipped surrogate (`clipped_surrogate`, per token for
GRPO, per sequence for RLOO).

Each completion depends only on the run's seed, the step, its row and its place in the group
(model.generate.completion_seed), so 2 processes sample what 1 does (up to a rounding of the logits that the
batch's other rows move: docs/rl.md) and a resumed run draws the same.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from llmtrain.data.formats import IGNORE


@contextmanager
def sampling(lm):
    """`lm` (the unwrapped policy) as it samples inside the block: in eval mode (no dropout, as vLLM samples; the
    update after it trains with dropout) and, under FSDP, every unit gathered once for the whole window (sharded
    again before the update). Its train mode is restored after, whatever happened."""
    from llmtrain.parallel.fsdp import gathered_for_generation

    was_training = lm.training
    lm.eval()
    try:
        with gathered_for_generation(lm):
            yield
    finally:
        lm.train(was_training)


def held_whole(reference):
    """A block in which a full fine-tune's frozen copy (model/reference.Reference) runs forwards with no collective:
    under FSDP every unit gathered once and kept whole (fsdp.gathered_for_generation, as `sampling` holds the policy),
    whatever each process then runs, which the rollout needs (RLOO's KL, GRPO's once-a-round reference: a process runs
    as many reference passes as its completions fill, and under sequence parallelism the group's first alone runs
    them). Costs the whole decoder in its dtype beside its shards while the block runs (the estimate counts it:
    spec.rollout_reference). LoRA's moving reference (model/reference.AdapterReference) swaps its snapshot into the
    policy's gathered weights inside it (`held`). Any other reference (None: LoRA's adapter off), or no FSDP: nothing
    to do."""
    from contextlib import nullcontext

    from llmtrain.parallel.fsdp import gathered_for_generation

    if callable(getattr(reference, "held", None)):  # LoRA's moving reference: its swap into the gathered weights
        return reference.held()
    module = getattr(reference, "module", None)
    return gathered_for_generation(module) if module is not None else nullcontext()


def sample(lm, sampler: str, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int, temperature: float,
           top_p: float, stop_ids, pad_id: int, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
           copy: str = "off", logps: bool = False) -> list:
    """The completions of `prompts`, one per seed, by `sampler` (rl.sampler / distill.sampler: the captured graph,
    the cached loop, or transformers' generate; model/fast_sample.py picks what runs); copy: rl.merged_copy (the
    fast sampler's generation copy of a LoRA policy's weights); logps: each a generate.Drawn, with the sampler's
    log-probability of each token (rl.sampler_correction's)."""
    from llmtrain.model.fast_sample import sampler_for

    return sampler_for(lm, sampler, copy=copy)(lm, prompts, seeds=seeds, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                    repetition_penalty=repetition_penalty, stop_ids=stop_ids, pad_id=pad_id,
                                    logps=logps)


def here(compute):
    """`compute()`, here: where a micro-batch's scoring (and, with tools, its sampling) runs on a process of its own.
    Under sequence parallelism the objective's `on_first_of_group` is instead the group's first process's, given to
    the others (parallel/sequence/shards.on_first_of_group)."""
    return compute()


def all_here(draw, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
    """`draw(prompts, seeds)`: every completion of a micro-batch sampled on this process. Under sequence parallelism
    the objective's `share_sampling` is instead each process of the group sampling its share of them
    (parallel/sequence/shards.shared_sampling), every process getting them all."""
    return draw(prompts, seeds)


def completion_rows(prompts: list[list[int]], completions: list[list[int]],
                    masks: list[list[int]] | None = None) -> list[dict]:
    """Each prompt and its completion as one tokenised row: the completion's tokens trained, the prompt's not, nor
    a completion's tokens whose mask is 0 (the tools' results: TRL's tool_mask)."""
    if masks is None:
        return [{"input_ids": p + c, "labels": [IGNORE] * len(p) + c} for p, c in zip(prompts, completions)]
    return [{"input_ids": p + c, "labels": [IGNORE] * len(p) + [t if k else IGNORE for t, k in zip(c, m)]}
            for p, c, m in zip(prompts, completions, masks)]


def clipped_surrogate(logps: torch.Tensor, advantages: torch.Tensor, *, old_logps: torch.Tensor | None,
                      epsilon: float, epsilon_high: float | None, log_ratio: torch.Tensor | None = None,
                      delta: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a loss: (-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A), the ratio
    exp(logps - old_logps), and whether the clip mattered: the ratio below the range with A < 0 or above it with
    A > 0). Per token (GRPO: each completion's advantage repeated over its tokens) or per sequence (RLOO: summed
    log-probabilities); epsilon_high None: epsilon. old_logps None: the policy that sampled is this one (one update a
    generation round), so the ratio is exp(logps - logps.detach()): 1 in value, carrying the gradient. `log_ratio`:
    the log of the ratio, given (GSPO's: each token its completion's mean), instead of logps - old_logps. `delta`
    (INTELLECT-2's two-sided clipping, TRL's): the unclipped term's ratio capped at delta as well (the returned
    ratio is not: the KL's weight is the ratio itself, as TRL's)."""
    low, high = 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high)
    if log_ratio is None:
        log_ratio = logps - (logps.detach() if old_logps is None else old_logps)
    ratio = torch.exp(log_ratio)
    capped = ratio if delta is None else ratio.clamp(max=delta)
    loss = -torch.min(capped * advantages, torch.clamp(ratio, low, high) * advantages)
    clipped = ((capped < low) & (advantages < 0)) | ((capped > high) & (advantages > 0))
    return loss, ratio, clipped
