"""GRPO (Shao et al. 2024, DeepSeekMath): the loss of one policy update on scored completions, as pure functions.

A step of online RL samples `num_generations` completions of each prompt, scores them (rewards.py), and turns
each group's rewards into advantages (`group_advantages`: reward minus the group's mean, divided by the group's
std unless scale_rewards is none). The policy update is one forward over the completions (each after its prompt;
only completion tokens count) with the clipped surrogate of PPO per token and, with beta > 0, the k3 estimate of
the KL divergence to the reference, weighted by the ratio for its unbiased gradient (`token_losses`). With one
update per generation round (num_iterations 1) the old policy is the current one: the ratio is 1 in value and
carries the gradient of the log-probability.

Normalisation, as TRL 1.16's GRPOTrainer normalises each loss_type, written in this package's contract (an
objective's loss is a SUM over its loss units; the step divides by the units of the whole window on every
process, so any split over micro-batches and processes gives the same loss and gradient):
- dapo (TRL's default): every completion token of the generation batch weighs the same: sum over tokens, units =
  completion tokens.
- grpo: each completion's mean over its tokens, then the mean over completions: tokens weigh 1 / their
  completion's length, units = completions.
- dr_grpo: the sum over tokens divided by completions x max_completion_tokens: units = completions x
  max_completion_tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["dapo", "grpo", "dr_grpo"]
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not a division by zero


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaN (a reward function's None): NaN where fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt().squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, *,
                     scale_rewards: Literal["group", "none"]) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each completion's group std) of `rewards` [prompts x num_generations], a prompt's completions
    consecutive. NaN rewards (no reward function applied) are left out of their group's mean and std and get
    advantage 0. A group whose rewards are all equal has std 0 and advantages 0: it teaches nothing
    (`frac_reward_zero_std` counts such groups)."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    std = (_nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros(len(grouped), dtype=rewards.dtype,
                                                                              device=rewards.device))
    std = std.repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), std


def token_losses(logps: torch.Tensor, advantages: torch.Tensor, *, old_logps: torch.Tensor | None = None,
                 ref_logps: torch.Tensor | None = None, epsilon: float, epsilon_high: float | None = None,
                 beta: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per completion token: (loss, k3 KL to the reference or None, clipped: whether the ratio was clipped where it
    mattered). `advantages` are per token (each completion's, repeated over its tokens). old_logps None: the
    policy that sampled is this one (one update a generation round), so the ratio is exp(logps - logps.detach())."""
    old = logps.detach() if old_logps is None else old_logps
    low, high = 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high)
    ratio = torch.exp(logps - old)
    loss = -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
    kl = None
    if beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        # times the ratio (1 in value, not in gradient): the unbiased reverse-KL gradient of DeepSeek-V3.2, TRL
        # 1.16's default (use_bias_correction_kl)
        loss = loss + beta * kl * ratio
    return loss, kl, clipped


def token_weights(completion: torch.Tensor, lengths: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """Each completion token's weight in the loss sum: 1 / its completion's length for grpo, else 1. `completion`
    maps each token to its completion, `lengths` counts each completion's tokens."""
    if loss_type == "grpo":
        return 1.0 / lengths.clamp(min=1).to(torch.float32)[completion]
    return torch.ones(len(completion), dtype=torch.float32, device=completion.device)


def loss_units(lengths: torch.Tensor, loss_type: LossType, *, max_completion_tokens: int) -> float:
    """What the summed loss of these completions is divided by, summed over the whole window on every process:
    completion tokens (dapo), completions (grpo), completions x max_completion_tokens (dr_grpo)."""
    if loss_type == "dapo":
        return float(lengths.sum())
    if loss_type == "grpo":
        return float(len(lengths))
    return float(len(lengths) * max_completion_tokens)
