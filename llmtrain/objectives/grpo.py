"""GRPO (Shao et al. 2024, DeepSeekMath): the loss of one policy update on scored completions, as pure functions.

A step of online RL samples `num_generations` completions of each prompt, scores them (rewards.py), and turns
each group's rewards into advantages (`group_advantages`: reward minus the group's mean, divided by the group's
std, or by the step's over every process with scale_rewards batch: `batch_moments`, or not with none). The
policy update is one forward over the completions (each after its prompt; only completion tokens count) with the
clipped surrogate of PPO per token and, with beta > 0, the k3 estimate of the KL divergence to the reference,
weighted by the ratio for its unbiased gradient (`token_losses`). With one update per generation round
(rl.num_iterations 1) the old policy is the current one: the ratio is 1 in value and carries the gradient of the
log-probability. With more (TRL's num_iterations), the rollout also takes each
completion token's log-probability under the policy as it sampled (`loss_old_logps`, no gradient), and every
update of the round (loop/rounds.py) divides by it: the ratio moves, and epsilon's clip binds.

Normalisation, as TRL 1.16's GRPOTrainer normalises each loss_type, written in this package's contract (an
objective's loss is a SUM over its loss units; the step divides by the units of the whole window on every
process, so any split over micro-batches and processes gives the same loss and gradient):
- dapo (TRL's default): every completion token of the generation batch weighs the same: sum over tokens, units =
  completion tokens.
- grpo: each completion's mean over its tokens, then the mean over completions: tokens weigh 1 / their
  completion's length, units = completions.
- dr_grpo: the sum over tokens divided by completions x max_completion_tokens: units = completions x
  max_completion_tokens.
- luspo (TRL's; GSPO's loss with each completion weighed by its length): the sum over each completion's tokens,
  then the mean over completions: tokens weigh 1, units = completions.
- cispo (MiniMax-M1's, TRL's) and vespo (TRL's): normalised as dapo; sapo (TRL's): normalised as grpo; each its
  own token loss (`token_losses`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from itertools import accumulate
from typing import Literal

import torch

from llmtrain.config import sampling_of
from llmtrain.data.batching import Counts, batch_weight
from llmtrain.model.generate import Stops
from llmtrain.model.reference import forward_of
from llmtrain.objectives.preference import StagePairs
from llmtrain.objectives.rollouts import (all_here, clipped_surrogate, completion_rows, held_whole, here, sample,
                                          sampling)

LossType = Literal["dapo", "grpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not a division by zero


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaN (a reward function's None): NaN where fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt().squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, *,
                     scale_rewards: Literal["group", "batch", "none"]) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each completion's group std) of `rewards` [prompts x num_generations], a prompt's completions
    consecutive. NaN rewards (no reward function applied) are left out of their group's mean and std and get
    advantage 0. A group whose rewards are all equal has std 0 and advantages 0: it teaches nothing
    (`frac_reward_zero_std` counts such groups). scale_rewards batch: not divided here (the rollout divides by
    batch_moments' std of every process's rewards)."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    std = (_nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros(len(grouped), dtype=rewards.dtype,
                                                                              device=rewards.device))
    std = std.repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), std


def normalized_then_summed(per_function: torch.Tensor, weights: list[float], num_generations: int) -> torch.Tensor:
    """multi_objective_aggregation normalize_then_sum (GDPO, TRL's): each reward function's rewards [completions x
    functions] normalised in their group ((r - group mean) / (group std + STD_EPS), a None left out), then summed
    with the weights; NaN where no function applied. The step's advantages are these over every process, shifted
    to mean 0 and divided by their std + STD_EPS (batch_moments)."""
    grouped = per_function.view(-1, num_generations, per_function.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = (_nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(mean))
    normalised = ((grouped - mean) / (std + STD_EPS)).view(-1, per_function.shape[1])
    summed = (normalised * torch.tensor(weights, dtype=per_function.dtype)).nansum(dim=1)
    return torch.where(per_function.isnan().all(dim=1), torch.full_like(summed, float("nan")), summed)


def batch_moments(values: list[float | None]) -> tuple[float, float]:
    """(mean, unbiased std + STD_EPS) of the step's values on every process, a None left out (TRL's nanmean and
    nanstd; the std 0 below two values): normalize_then_sum's shift and divisor of the sums, scale_rewards batch's
    divisor of the rewards."""
    x = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
    mean = torch.nan_to_num(torch.nanmean(x), nan=0.0)
    return float(mean), float(torch.nan_to_num(_nanstd(x[None], dim=1), nan=0.0)) + STD_EPS


def token_losses(logps: torch.Tensor, advantages: torch.Tensor, *, old_logps: torch.Tensor | None = None,
                 ref_logps: torch.Tensor | None = None, epsilon: float, epsilon_high: float | None = None,
                 beta: float = 0.0, log_ratio: torch.Tensor | None = None, delta: float | None = None,
                 cispo: bool = False, sapo: tuple[float, float] | None = None, keep: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, kl_ratio: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per completion token: (loss, k3 KL to the reference as TRL logs it, times the ratio under `kl_ratio`, or None,
    clipped: whether the ratio was clipped where it mattered). `advantages` are per token (each completion's,
    repeated over its tokens). old_logps None: the policy that sampled is this one (one update a generation round),
    so the ratio is exp(logps - logps.detach()).
    `log_ratio`: each token's log-ratio given instead (importance_sampling_level sequence: sequence_log_ratios);
    `delta`: rl.delta's cap of the unclipped ratio. cispo (MiniMax-M1's, TRL's): the policy gradient weighted by
    the ratio capped at epsilon_high (itself the cap, e.g. 5, not 1 + it), the weight without gradient:
    -min(ratio, epsilon_high).detach() A log p, so a capped token still trains (PPO's clip drops its gradient);
    clipped: the ratio above the cap with A > 0. sapo (Soft Adaptive Policy Optimization, TRL's): (temperature for
    A > 0, for A <= 0); PPO's hard clip replaced by a smooth gate, -sigmoid(t (ratio - 1)) 4 / t A, whose gradient
    at ratio 1 is the plain policy gradient's and fades as the ratio moves away; nothing is clipped. `keep`: the
    tokens whose policy term counts (rl.off_policy_mask_threshold: off_policy_keep), the KL term counting for all.
    `weights` (vespo: vespo_weights, no gradient): the policy gradient -weights A log p; nothing is clipped.
    kl_ratio (rl.use_bias_correction_kl): the KL term times the ratio (False: the k3 term alone, TRL before 1.16)."""
    if log_ratio is None:
        log_ratio = logps - (logps.detach() if old_logps is None else old_logps)
    if weights is not None:
        ratio = torch.exp(log_ratio)
        loss = -weights * advantages * logps
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    elif sapo is not None:
        ratio = torch.exp(log_ratio)
        t = torch.where(advantages > 0, sapo[0], sapo[1])
        loss = -torch.sigmoid(t * (ratio - 1)) * 4 / t * advantages
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    elif cispo:
        ratio = torch.exp(log_ratio)
        loss = -ratio.clamp(max=epsilon_high).detach() * advantages * logps
        clipped = (ratio > epsilon_high) & (advantages > 0)
    else:
        loss, ratio, clipped = clipped_surrogate(logps, advantages, old_logps=old_logps, epsilon=epsilon,
                                                 epsilon_high=epsilon_high, log_ratio=log_ratio, delta=delta)
    if keep is not None:
        loss = loss * keep
    kl = None
    if beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        # times the ratio (1 in value, not in gradient): the unbiased reverse-KL gradient of DeepSeek-V3.2, TRL
        # 1.16's default (use_bias_correction_kl)
        if kl_ratio:
            kl = kl * ratio
        loss = loss + beta * kl  # TRL's order: beta x (k3 x ratio)
        kl = kl.detach()  # the metric as TRL 1.16 logs it: the term the loss weighs
    return loss, kl, clipped


def sequence_log_ratios(logps: torch.Tensor, old_logps: torch.Tensor | None, completion: torch.Tensor,
                        lengths: torch.Tensor, n: int, *, group_sum=None) -> torch.Tensor:
    """GSPO's log-ratio (importance_sampling_level sequence, as TRL's): each token gets its completion's mean over its
    tokens of logps - old_logps (old None: logps detached, the ratio 1 in value). `completion`: each token's
    completion (0 to n - 1), `lengths`: each token's completion's token count; `group_sum`: under sequence
    parallelism the sum of a completion's parts over the group's slices."""
    log_ratio = logps - (logps.detach() if old_logps is None else old_logps)
    means = log_ratio.new_zeros(n).index_add(0, completion, log_ratio / lengths)
    if group_sum is not None:
        means = group_sum(means)
    return means[completion]


def off_policy_keep(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, completion: torch.Tensor,
                    lengths: torch.Tensor, n: int, *, threshold: float, group_sum=None) -> torch.Tensor:
    """rl.off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence masking, TRL's): per completion token,
    whether its completion's policy term counts: its advantage is >= 0, or the mean over its tokens of
    old_logps - logps (a KL estimate of the policy that sampled to this one, no gradient) is <= threshold. Arguments
    as sequence_log_ratios's."""
    drift = -sequence_log_ratios(logps.detach(), old_logps, completion, lengths, n, group_sum=group_sum)
    return ((advantages >= 0) | (drift <= threshold)).to(logps.dtype)


@torch.no_grad()
def sampler_weights(policy: torch.Tensor, sampler: torch.Tensor, completion: torch.Tensor, n: int, *, mode: str,
                    low: float | None, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rl.sampler_correction (TRL's vLLM importance sampling correction): (each trained token's weight, the ratios
    it was made of: one a token, or one a completion). A token's ratio is exp(policy - sampler): its log-probability
    under the policy as it sampled over the sampler's own; sequence_* modes take a completion's, exp of the sum over
    its tokens (`completion`: each token's, of `n`). *_truncate clamps it to [low, high] (low None: no bound),
    *_mask makes it 0 outside them."""
    log_ratio = policy - sampler
    if mode.startswith("sequence"):
        log_ratio = log_ratio.new_zeros(n).index_add(0, completion, log_ratio)
    ratio = log_ratio.exp()
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = torch.where((ratio > high) | (ratio < (-math.inf if low is None else low)), 0.0, ratio)
    return (ratio[completion] if mode.startswith("sequence") else ratio), ratio


@torch.no_grad()
def high_entropy_keep(entropy: torch.Tensor, quantile: float, *, gather=None, counts: bool = True) -> torch.Tensor:
    """rl.top_entropy_quantile (TRL's get_high_entropy_mask; "Beyond the 80/20 Rule"): per trained token, whether
    its policy term counts: its entropy is at least the (1 - quantile) quantile (torch.quantile's linear
    interpolation) of the forward pass's trained tokens' entropies on every process. `gather`: every process's
    list, concatenated (one process: None); `counts` False: a stand-in pass (batch weight 0), whose tokens join no
    quantile but whose process still takes part in the gather. Nothing pooled: no token counts."""
    mine = entropy.float().tolist() if counts else []
    pooled = torch.tensor(gather(mine) if gather is not None else mine, dtype=torch.float32).sort().values
    if not pooled.numel():
        return torch.zeros_like(entropy)
    # torch.quantile's arithmetic (lerp between the two order statistics), without its limit of 2^24 values
    at = (1.0 - quantile) * (pooled.numel() - 1)
    below, above = pooled[math.floor(at)], pooled[math.ceil(at)]
    threshold = torch.lerp(below, above, torch.tensor(at - math.floor(at), dtype=torch.float32))
    return (entropy >= threshold.to(entropy.device)).to(entropy.dtype)


@torch.no_grad()
def vespo_weights(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                  completion: torch.Tensor, n: int, *, k: tuple[float, float], lam: tuple[float, float],
                  group_sum=None, sampler_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's weight (TRL's get_gamma_weights) per completion token: phi(w) = e^lam w^k e^(-lam w), 1 at w = 1, of
    its completion's whole ratio w = exp(the sum of its tokens' log-ratios, each clamped to +-20, the sum to
    [log 1e-8, 20]); k and lam (for an advantage >= 0, for one < 0). old_logps None: w = 1. `group_sum`: under
    sequence parallelism the sum of a completion's parts over the slices. `sampler_weights` (rl.sampler_correction's
    token ratios, sampler_weights): each one's log, clamped to [log 1e-8, 20], joins its token's log-ratio (TRL's)."""
    log_ratio = (logps - (logps if old_logps is None else old_logps)).clamp(-20.0, 20.0)
    if sampler_weights is not None:
        log_ratio = log_ratio + sampler_weights.log().clamp(math.log(1e-8), 20.0)
    sums = log_ratio.new_zeros(n).index_add(0, completion, log_ratio)
    if group_sum is not None:
        sums = group_sum(sums)
    log_w = sums.clamp(math.log(1e-8), 20.0)[completion]
    nonneg = advantages >= 0
    k_ = torch.where(nonneg, k[0], k[1])
    lam_ = torch.where(nonneg, lam[0], lam[1]).clamp(min=1e-4)
    return torch.exp(lam_ + k_ * log_w - lam_ * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_weights(completion: torch.Tensor, lengths: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """Each completion token's weight in the loss sum: 1 / its completion's length for grpo (and sapo), else 1.
    `completion` maps each token to its completion, `lengths` counts each completion's tokens."""
    if loss_type in ("grpo", "sapo"):
        return 1.0 / lengths.clamp(min=1).to(torch.float32)[completion]
    return torch.ones(len(completion), dtype=torch.float32, device=completion.device)


def loss_units(lengths: torch.Tensor, loss_type: LossType, *, max_completion_tokens: int) -> float:
    """What the summed loss of these completions is divided by, summed over the whole window on every process:
    completion tokens (dapo, cispo, vespo), completions (grpo, sapo, luspo), completions x max_completion_tokens
    (dr_grpo)."""
    if loss_type in ("dapo", "cispo", "vespo"):
        return float(lengths.sum())
    if loss_type in ("grpo", "sapo", "luspo"):
        return float(len(lengths))
    return float(len(lengths) * max_completion_tokens)


def token_chunks(sizes: list[int], budget: int | None) -> list[list[int]]:
    """The sequences (their indices, in order) of each forward/backward pass: consecutive ones while their tokens
    fit `budget` (rl.micro_batch_tokens; a sequence is never split, one longer than it goes alone); None: one pass
    for all of them."""
    if budget is None:
        return [list(range(len(sizes)))]
    parts, used = [[]], 0
    for i, n in enumerate(sizes):
        if parts[-1] and used + n > budget:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += n
    return parts


def policy_loss(rl, logps: torch.Tensor, entropy: torch.Tensor, batch: dict, *, ref: torch.Tensor | None,
                shared_sum=None, gather_tokens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's loss of one pass, summed (before the entropy bonus), and its statistics (LOSS_STATS), from the policy's
    log-probability and entropy of each trained token (`logps`, `entropy`: one process's forward, or the last
    pipeline stage's head: StageGRPO) and the pass's `loss_` columns (advantages, weights, lengths, each token's
    completion, old and sampler log-probabilities where the rollout took them); `ref`: the reference's, beta > 0.
    `shared_sum`, `gather_tokens`: under sequence parallelism, a completion's sums and the tokens' entropies over the
    group (GRPO's)."""
    old, log_ratio, share = batch.get("loss_old_logps"), None, 1.0 / batch["loss_lengths"]
    if rl.importance_sampling_level == "sequence":  # GSPO: one ratio a completion
        log_ratio = sequence_log_ratios(logps, old, batch["loss_example"], batch["loss_lengths"],
                                        batch["completions"], group_sum=shared_sum)
    # the policy that sampled, to the off-policy mask: the sampler's own log-probabilities where it gave them
    # (rl.sampler_correction: TRL's with vLLM, both drifts seen), else the policy's at the rollout
    sampled = batch.get("loss_sampler_logps", old)
    keep = (off_policy_keep(logps, sampled, batch["loss_advantages"], batch["loss_example"],
                            batch["loss_lengths"], batch["completions"], threshold=rl.off_policy_mask_threshold,
                            group_sum=shared_sum)
            if rl.off_policy_mask_threshold is not None and sampled is not None else None)
    if rl.top_entropy_quantile < 1.0:  # the high-entropy tokens' policy terms only, over the pass everywhere
        high = high_entropy_keep(entropy, rl.top_entropy_quantile, gather=gather_tokens,
                                 counts=batch_weight(batch) > 0)
        keep = high if keep is None else keep * high
    correction = batch.get("loss_sampler_weights")  # rl.sampler_correction: vespo's in its weight, else a factor
    phi = (vespo_weights(logps, old, batch["loss_advantages"], batch["loss_example"], batch["completions"],
                         k=(rl.vespo_k_pos, rl.vespo_k_neg), lam=(rl.vespo_lambda_pos, rl.vespo_lambda_neg),
                         group_sum=shared_sum, sampler_weights=correction)
           if rl.loss_type == "vespo" else None)
    if correction is not None and phi is None:  # the policy term times the ratio (TRL's), the KL term not
        keep = correction if keep is None else keep * correction
    losses, kl, clipped = token_losses(logps, batch["loss_advantages"], old_logps=old, ref_logps=ref,
                                       epsilon=rl.epsilon, epsilon_high=rl.epsilon_high, beta=rl.beta,
                                       log_ratio=log_ratio, delta=rl.delta, cispo=rl.loss_type == "cispo",
                                       sapo=((rl.sapo_temperature_pos, rl.sapo_temperature_neg)
                                             if rl.loss_type == "sapo" else None), keep=keep, weights=phi,
                                       kl_ratio=rl.use_bias_correction_kl)
    total = (losses * batch["loss_weights"]).sum()
    with torch.no_grad():
        stats = torch.stack([kl.sum() if kl is not None else logps.new_zeros(()), clipped.float().sum(),
                             logps.new_tensor(float(logps.numel())), (clipped * share).sum(), share.sum(),
                             entropy.sum(), (phi * share).sum() if phi is not None else logps.new_zeros(()),
                             total])
    return total, stats


# --------------------------------------------------------------------------- the objective the loop runs

# The metrics' names are TRL's (GRPOTrainer), so runs can be compared line by line.
# reward_squares and scored: TRL's reward_std is the std of the step's scored rewards (not a mean of the groups' stds)
FLAT_STEPS = 5  # steps in a row of all-zero advantages before a run is told it is learning nothing (`unscored`)
# the step the eval's sampled completions take their seeds from (rl.num_generations_eval): one of their own, the same
# at every eval, so two evals' numbers differ by the policy and not by the draws
EVAL_STEP = -1
# length: the completions' tokens; truncated: those ended by max_completion_tokens (TRL's completions/clipped_ratio;
# named apart from LOSS_STATS' PPO clip, which had shadowed it: GRPO logged 0 with every completion cut); trained: the
# tokens trained (rl.mask_truncated_completions drops the truncated ones')
# sampler_*: rl.sampler_correction's |policy - sampler| log-probability summed over the trained tokens, and its
# ratios (a token's, or a completion's) summed and counted
ROLLOUT_STATS = ["completions", "reward", "reward_squares", "scored", "zero_std", "length", "truncated",
                 "generation_s", "reward_s", "tool_calls", "tool_failures", "trained", "sampler_difference",
                 "sampler_ratio", "sampler_ratios"]
# clipped and sequences: each token's share of its completion (1 / its tokens), so they add up to completions over
# any split of the tokens (importance_sampling_level sequence logs the clipped share of completions, as TRL)
# entropy: the policy's, summed over the completion tokens (TRL's `entropy`, their mean); phi: vespo's weight, each
# token's share of it (its completion's phi, summed); policy: the loss without the entropy bonus (TRL's policy_loss)
LOSS_STATS = ["kl", "clipped_tokens", "tokens", "clipped", "sequences", "entropy", "phi", "policy"]


class EntropyControl:
    """rl.entropy_coef, the entropy bonus's coefficient, and rl.use_adaptive_entropy's controller of it (TRL's
    GRPOTrainer, after Skywork-OR1): `applied` is what a step's loss multiplies the mean entropy by; `update`, after
    each step, moves the coefficient by the step's mean entropy over every process. Checkpointed with the run
    (accelerate's register_for_checkpointing), so a resumed run applies what the uninterrupted one would."""

    def __init__(self, rl):
        self.rl = rl
        self.coef = rl.entropy_coef
        self.seen = math.inf  # the last step's mean entropy: none yet, so the first step applies nothing (TRL's)

    def applied(self) -> float:
        rl = self.rl
        return self.coef if not rl.use_adaptive_entropy or self.seen <= rl.entropy_target else 0.0

    def update(self, entropy: float) -> None:
        rl = self.rl
        if not rl.use_adaptive_entropy:
            return
        self.coef = (min(self.coef + rl.entropy_coef_delta, rl.entropy_coef_max) if entropy <= rl.entropy_target
                     else max(self.coef - rl.entropy_coef_delta, rl.entropy_coef_min))
        self.seen = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.seen = state["coef"], state["seen"]


class GRPO:
    """Online RL (objective.Objective, plus `rollout`): a micro-batch is train.micro_batch_size prompts; the step's
    rollout samples rl.num_generations completions of each with the model being trained (model/generate.py: each
    from its own seed), scores them (rewards.py), turns each group's rewards into advantages, and packs prompt +
    completion sequences padding-free; `loss` is then the GRPO loss of those sequences, only completion tokens
    counting, log-probabilities from the chunked per-token path (no full logits). rloo.RLOO changes the advantages,
    the loss and their metrics through the methods marked as its hooks."""

    advantage_stats: tuple[str, ...] = ()  # rollout statistics the advantages add (RLOO's)
    evaluates_by_sampling = True  # its eval samples (on pipeline stages through them, not a forward-only pass)
    shared_sum = None  # sequence parallelism: a completion's GSPO log-ratio from its slices' parts (shards.shared_sum)
    loss_stats: tuple[str, ...] = tuple(LOSS_STATS)

    def __init__(self, rl, *, tokenizer, pad_id: int, packing: bool, seed: int, rewards, model, columns,
                 stop_ids, world: int, sources: tuple[str, str | None] = ("the data", None), state=None,
                 runner=None, gather=None, template: str | None = None, render=None, user_code=None, reference=None,
                 stages=None):
        self.rl, self.tokenizer, self.pad_id, self.packing, self.seed = rl, tokenizer, pad_id, packing, seed
        self.rewards = rewards  # (name, function, weight): rewards.build_rewards
        self.lm = model  # unwrapped: generates, and with its adapter disabled is the reference (beta > 0)
        # beta > 0, model/reference.py's: a full fine-tune's frozen copy, or LoRA's moving adapter; None: LoRA's
        self.reference = reference
        from llmtrain.objectives.rewards import AsyncRunner, RewardLogs, reward_columns

        self.reward_columns = reward_columns(columns)  # {the user's name: the prepared column}
        self.columns = ("input_ids", "row", "prompt", *self.reward_columns.values())
        self.stop_ids, self.world = Stops.of(stop_ids), world
        self.sources = sources  # (train, eval): the files the errors name
        self.state = state  # the trainer_state reward functions get (rewards.trainer_state); the rollout moves it
        self.logs = RewardLogs()  # log_metric's numbers since the last metrics line
        # every process's list, concatenated, on every process (collectives.gathered); one process: its own
        self.gather = gather if gather is not None else list
        # every process's numbers, concatenated: the same gather, but under sequence parallelism from every slice
        # (the wrapper makes `gather` take the group's first only): a pass's token entropies
        self.gather_tokens = gather
        # runs a micro-batch's scoring (train and eval; and its sampling, with tools): here; under sequence
        # parallelism on the group's first process, its result given to the others; share_sampling: where a
        # micro-batch's completions are drawn (without tools), the group's processes each drawing a share of them
        # (parallel/sequence/shards.SequenceShards sets all three)
        self.on_first_of_group, self.share_sampling = here, all_here
        # where the user's code runs (the reward functions, the tools, an environment): here; under tensor
        # parallelism on the TP group's first process, its result given to the other (collectives.
        # on_sampling_group_first): both sample the same completions, and a function's side effects happen once
        self.user_code = user_code if user_code is not None else here
        # the event loop of the async reward functions, for the whole run (the start-up check's, where it ran one)
        self.runner = runner if runner is not None else AsyncRunner()
        self.warned: set[str] = set()  # reward functions already said to have scored nothing
        self.flat_steps = 0  # steps in a row whose every advantage was 0: nothing trained (`unscored` says so once)
        self.flat_said = False
        self.tools = None  # rl.tools, rl.environment: tool_calls.Tools (the functions, the template's call syntax)
        self.render = render  # a prompt (the row's, an environment's observation added) to its tokens
        self._environments: list = []  # the rollout's rl.environment instances, one per completion
        if rl.tools or rl.environment:
            from llmtrain.objectives.tool_calls import Tools, check_reset

            self.tools = Tools.of_run(rl, tokenizer=tokenizer, template=template, stop_ids=self.stop_ids,
                                      runner=self.runner)
            if self.tools.environment is not None:
                check_reset(rl.environment, self.tools.environment, list(self.reward_columns))
            if callable(getattr(self.tools.environment, "get_reward", None)):  # TRL's: a reward named after it
                rewards = self.rewards = [*rewards, (self.tools.environment.__name__, self._environment_reward(), 1.0)]
        answer_columns = [self.reward_columns.get(c.column, c.column) for c in rl.rewards if c.type == "answer_match"]
        self.expected_column = answer_columns[0] if answer_columns else None  # the eval samples' expected text
        self.stats = [*ROLLOUT_STATS, *self.advantage_stats, *(f"rewards/{n}/sum" for n, _, _ in rewards),
                      *(f"rewards/{n}/count" for n, _, _ in rewards), *self.loss_stats]
        assert len(set(self.stats)) == len(self.stats), "a statistic's name twice: step_metrics would read one"
        # rl.entropy_coef (rl.use_adaptive_entropy): the bonus's coefficient, its state saved with the checkpoints;
        # the step gives each pass the window's loss units per trained token (`per_trained`)
        self.entropy = EntropyControl(rl) if getattr(rl, "entropy_bonus", False) else None
        self.per_trained = self.entropy is not None
        adaptive = self.entropy is not None and rl.use_adaptive_entropy
        self.checkpointed = (self.entropy,) if adaptive else ()
        self.after_window = self._control_entropy if adaptive else None  # the step calls it after each window
        # rl.sampler_correction: the rollout's sampler gives each token's log-probability, the policy's are taken
        # after it, and the window's largest |difference| and extreme ratios go to its metrics line
        self.correcting = rl.sampler_correction is not None
        # pipeline stages (parallel/pipeline/schedule.Pipeline): they sample, each process of a pipeline the same
        # completions through them, and the last stage's head takes the loss (StageGRPO); `drawing`: the stages as
        # one causal LM while a rollout or an eval samples
        self.stages, self.drawing = stages, None
        self.sampler_extremes: dict[str, float] = {}

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        """The prompts as they are: the rollout makes the tensors (and the counts) once the completions exist."""
        return {"examples": examples}, Counts.none()

    # ---- the rollout: sample, score, pack

    def rollout(self, window, *, step: int):
        """The window with each micro-batch's prompts replaced by their scored, packed completions, its counts
        recounted, and `rollouts` (one record per completion, for rollouts.jsonl) filled in."""
        import dataclasses

        batches, counts, records, extremes = [], None, [], []
        if self.state is not None:  # what a reward function sees: the steps done, as TRL's global_step
            self.state.global_step, self.state.epoch = step, float(window.epoch)
        with self._sampling(), self._rollout_reference():
            drawn = self._draw_window(window.batches, step)
            for b, each in zip(window.batches, drawn):
                parts, n, recs = self.on_first_of_group(
                    lambda: self._rollout_batch(b["examples"], step, stand_in=not batch_weight(b), drawn=each))
                batches += parts
                extremes += [part.pop("sampler_extremes", None) for part in parts]
                counts = n if counts is None else counts.plus(n)
                records += recs
        if self.rl.multi_objective_aggregation == "normalize_then_sum" or self.rl.scale_rewards == "batch":
            # over the step's completions on every process: one gather of floats a step
            if self.rl.multi_objective_aggregation == "normalize_then_sum":  # the sums, to mean 0 and std 1
                shift, divisor = batch_moments(self.gather([r["advantage"] for r in records]))
            else:  # each reward minus its group's mean, over the std of every reward
                shift, divisor = 0.0, batch_moments(self.gather([r["reward"] for r in records]))[1]
            for batch in batches:
                batch["loss_advantages"] = torch.nan_to_num((batch["loss_advantages"] - shift) / divisor, nan=0.0)
            for record in records:
                record["advantage"] = 0.0 if record["advantage"] is None else (record["advantage"] - shift) / divisor
        if self.correcting:  # the step's largest |difference| and extreme ratios over every process: one gather
            if self.stages is not None:  # the last stage's (its policy log-probabilities), given to the pipeline's
                # first stage, which gathers for it (its passes are the last stage's: the same completions)
                rows = torch.tensor([e or [math.nan] * 3 for e in extremes], dtype=torch.float64).reshape(-1, 3)
                extremes = self.stages.from_last(rows).tolist()
            self.sampler_extremes = _extremes(self.gather([e for e in extremes if e and not math.isnan(e[0])]))
        if self.rl.micro_batch_tokens is not None and self.world > 1:
            # Every rank must run as many forward/backward passes (FSDP gathers and reduce-scatters in each): the
            # ranks with fewer run their last pass again with weight 0. One small gather a step.
            most = max(self.gather([len(batches)]))
            batches += [{**batches[-1], "batch_weight": 0.0} for _ in range(most - len(batches))]
        if self.state is not None:  # an eval after this step's update sees it done
            self.state.global_step = step + 1
        return dataclasses.replace(window, batches=batches, counts=counts, rollouts=records)

    @contextmanager
    def _sampling(self):
        """The policy in sampling order for the block (rollouts.sampling: eval mode, FSDP's units gathered); on
        pipeline stages, the stages as one causal LM (Pipeline.sampling), which `_generate` then samples with."""
        if self.stages is None:
            with sampling(self.lm):
                yield
            return
        with self.stages.sampling() as lm:
            self.drawing = lm
            try:
                yield
            finally:
                self.drawing = None

    def _reference_once(self) -> bool:
        """Whether the rollout takes the reference's log-probabilities of the update's passes (`loss_ref_logps`), once
        a round, so that the round's updates run no reference forward each (capabilities.reference_in_rollout: RLOO's
        KL; GRPO's with rl.num_iterations > 1, but for LoRA's moving reference, AdapterReference, which runs in each
        update's passes as every reference does with one update a round)."""
        from llmtrain.capabilities import reference_in_rollout
        from llmtrain.model.reference import AdapterReference

        return reference_in_rollout(self.rl, moving_adapter=isinstance(self.reference, AdapterReference))

    def _rollout_reference(self):
        """The context the rollout holds a full fine-tune's frozen copy in: gathered whole under FSDP where the
        rollout runs it (rollouts.held_whole: a process runs as many passes as its completions fill, and under
        sequence parallelism the group's first alone), else nothing."""
        return held_whole(self.reference) if self._reference_once() else nullcontext()

    def _reference_logps(self, batches: list[dict]) -> list[torch.Tensor]:
        """Each pass's trained tokens' log-probabilities under the reference (the frozen copy, or the adapter off or
        moved), at rl.temperature, no gradient, on the model's device."""
        from llmtrain.data.batching import to_device
        from llmtrain.model.loss import compute_loss

        reference, context = forward_of(self.lm, self.reference)
        if self.stages is not None:
            return self._staged_logps(batches, context)
        with torch.no_grad(), context:
            return [-compute_loss(reference, to_device(b, self.lm.device), per_token=True,
                                  temperature=self.rl.temperature).float() for b in batches]

    def _staged_logps(self, batches: list[dict], context) -> list[torch.Tensor]:
        """On pipeline stages, each pass's trained tokens' log-probabilities at rl.temperature inside `context` (the
        model as it is, or the reference's), forward only through the stages M passes at a time (every process of
        the pipeline runs them): the last stage's values; zeros on the others, which train nothing from them (the
        last stage's head loss reads them; RLOO's KL is given to the others by the last: RLOO._advantages)."""
        with torch.no_grad(), context:
            out = self.stages.token_logps(batches)
        if out is None:
            return [torch.zeros(b["loss_index"].numel(), device=self.lm.device) for b in batches]
        return [o[b["loss_index"].reshape(-1).to(o.device)] for o, b in zip(out, batches)]

    def _prompts(self, examples: list[dict], step: int) -> tuple[list[list[int]], list[int]]:
        """Each completion's prompt tokens and seed: num_generations of each example, consecutive."""
        from llmtrain.model.generate import completion_seed

        g = self.rl.num_generations
        return ([list(e["input_ids"]) for e in examples for _ in range(g)],
                [completion_seed(self.seed, step, e["row"], k) for e in examples for k in range(g)])

    def _draw(self, examples: list[dict], step: int) -> tuple[list[list[int]], float]:
        """(the examples' completions, the seconds spent) without tools, drawn where share_sampling draws them."""
        import time

        begun = time.perf_counter()
        completions = self.share_sampling(
            lambda prompts, seeds: self._generate(prompts, seeds, logps=self.correcting),
            *self._prompts(examples, step))
        return completions, time.perf_counter() - begun

    def _draw_window(self, batches: list[dict], step: int) -> list[tuple[list, float] | None]:
        """Each micro-batch's (completions, seconds) without tools (None each with tools: the tool loop samples in
        _rollout_batch): drawn a micro-batch at a time, or with rl.generation_batch=step in one call for the window
        and split back, each its share of the seconds by its completions (TRL's steps_per_generation at its default;
        the same completions, each completion's seed being its own)."""
        if self.tools is not None:
            return [None] * len(batches)
        if self.rl.generation_batch == "micro_batch" or len(batches) == 1:
            return [self._draw(b["examples"], step) for b in batches]
        completions, seconds = self._draw([e for b in batches for e in b["examples"]], step)
        sizes = [len(b["examples"]) * self.rl.num_generations for b in batches]
        starts = accumulate(sizes, initial=0)
        return [(completions[i:i + n], seconds * n / len(completions)) for i, n in zip(starts, sizes)]

    def _rollout_batch(self, examples: list[dict], step: int, *, stand_in: bool = False,
                       drawn: tuple[list[list[int]], float] | None = None) -> tuple[list[dict], Counts, list[dict]]:
        """The examples' completions (`drawn` already, without tools: _draw), scored and packed into passes, their
        counts and rollouts.jsonl records. An idle rank's stand-in (batching.StandIn) is sampled and packed as a real
        micro-batch, but never scored (a reward function runs only on what trains) nor counted nor logged; its
        passes have weight 0."""
        import time

        from llmtrain.objectives.rewards import RewardLogs

        rl, g = self.rl, self.rl.num_generations
        prompt_ids, seeds = self._prompts(examples, step)
        begun, tooled = time.perf_counter(), None
        if drawn is not None:
            completions, generation_s = drawn
        else:
            completions, tooled = self._complete(prompt_ids, seeds, rows=[e for e in examples for _ in range(g)],
                                                 logps=self.correcting)
            generation_s = time.perf_counter() - begun
        sampled = None  # rl.sampler_correction: the sampler's log-probability of each completion token
        if self.correcting:
            sampled = [t.logps for t in tooled] if tooled else [d.logps for d in completions]
            completions = completions if tooled else [d.ids for d in completions]
        if stand_in:
            texts, total, extra, reward_s = [""] * len(completions), torch.zeros(len(completions)), RewardLogs(), 0.0
            per_function = torch.full((len(completions), len(self.rewards)), float("nan"))
        else:
            scoring = time.perf_counter()
            texts, per_function, total, extra = self._score(examples, completions, g, where=self.sources[0],
                                                            tooled=tooled)
            reward_s = time.perf_counter() - scoring
        for name, values in extra.metrics.items():
            self.logs.metrics[name] += values
        rows = [e["row"] + 1 for e in examples for _ in range(g)]
        clipped = [not self.stop_ids.ends(c) for c in completions]  # ended by max_completion_tokens
        masks, dropped = [t.mask for t in tooled] if tooled else None, 0
        if rl.mask_truncated_completions:  # DAPO's overlong filtering: a clipped completion trains none of its tokens
            # (its reward still counts in its group's advantages; its length stays in completions/mean_length)
            masks = masks or [[1] * len(c) for c in completions]
            dropped = sum(sum(m) for m, cut in zip(masks, clipped) if cut)
            masks = [[0] * len(m) if cut else m for m, cut in zip(masks, clipped)]
        sequences = completion_rows(prompt_ids, completions, masks=masks)
        batches, parts, lengths = self._passes(sequences)
        if rl.num_iterations > 1 or self.correcting:  # the round's later updates divide by the policy as it sampled
            for batch, logps in zip(batches, self._sampling_logps(batches)):
                batch["loss_old_logps"] = logps.cpu()
        if self._reference_once():  # the round's updates read them, with no reference forward of their own
            for batch, logps in zip(batches, self._reference_logps(batches)):
                batch["loss_ref_logps"] = logps.cpu()
        # (on pipeline stages the policy's log-probabilities are the last stage's alone, and so are the ratios its
        # loss reads: _staged_logps)
        correcting = self.correcting and (self.stages is None or self.stages.last is not None)
        correction = self._correct(batches, parts, sampled, masks) if correcting else [0.0] * 3
        advantages, std, more, columns = self._advantages(total, g, batches, parts, per_function=per_function)
        for batch, part, n in zip(batches, parts, lengths.split([len(part) for part in parts])):
            self._attach(batch, advantages[part], n)
        scored = ~per_function.isnan()
        # float64: reward_std comes from these sums of squares, which float32 cancelled away for rewards far from 0
        # (1000 +- 0.05: a std of 0.0 said for 0.052, audit 6)
        stats = torch.tensor([
            len(completions), float(total.double().nansum()), float((total.double().nan_to_num() ** 2).sum()),
            float((~total.isnan()).sum()), float((std < 1e-8).sum()), float(lengths.sum()) + dropped,
            float(sum(clipped)), generation_s / self.world, reward_s / self.world,
            sum(len(t.calls) for t in tooled or []), sum(t.failures for t in tooled or []), float(lengths.sum()),
            *correction, *more, *per_function.nan_to_num().sum(0).tolist(),
            *scored.sum(0).tolist()],
            dtype=torch.float64)
        for k, batch in enumerate(batches):  # the passes' statistics are summed: the rollout's go in once
            batch["rollout_stats"] = stats if k == 0 else torch.zeros_like(stats)
        if stand_in:
            return ([{**{k: v for k, v in batch.items() if k != "sampler_extremes"}, "batch_weight": 0.0}
                     for batch in batches], Counts.none(), [])
        counts = Counts.of(sequences, units=self._loss_units(lengths), trained=float(lengths.sum()))
        names = [n for n, _, _ in self.rewards]
        records = [{"step": step + 1, "row": rows[i], "generation": i % g,
                    "prompt": self.tokenizer.decode(prompt_ids[i], skip_special_tokens=False),
                    "completion": texts[i], "prompt_ids": prompt_ids[i], "completion_ids": completions[i],
                    **{name: _number(per_function[i, k]) for k, name in enumerate(names)},
                    "reward": _number(total[i]), "advantage": _number(advantages[i]),
                    **{column: values[i] for column, values in columns.items()},
                    # the tools' calls, results and failures, and where the results' (untrained) tokens are
                    **({"tool_calls": tooled[i].calls, "tool_mask": tooled[i].mask,
                        "unreadable_tool_turns": tooled[i].unreadable} if tooled else {}),
                    # log_extra's columns, where a function gave one value per completion (as TRL's table needs)
                    **{column: values[i] for column, values in extra.extra.items() if len(values) == len(completions)}}
                   for i in range(len(completions))]
        return batches, counts, records

    def _passes(self, sequences: list[dict]) -> tuple[list[dict], list[list[int]], torch.Tensor]:
        """The update's batches of the sequences (one packed row each; several under rl.micro_batch_tokens), the
        sequences of each, and each completion's trained tokens."""
        from llmtrain.data.batching import collate, with_loss_positions

        batches, parts, lengths = [], [], []
        for part in token_chunks([len(s["input_ids"]) for s in sequences], self.rl.micro_batch_tokens):
            batch = with_loss_positions(collate([sequences[i] for i in part], pad_id=self.pad_id,
                                                packing=self.packing))
            lengths.append(torch.bincount(batch["loss_example"], minlength=len(part)))  # loss_example: its completion
            batches.append(batch)
            parts.append(part)
        return batches, parts, torch.cat(lengths)

    def _sampling_logps(self, batches: list[dict]) -> list[torch.Tensor]:
        """Each pass's trained tokens' log-probabilities (at rl.temperature, no gradient, on the model's device)
        under the policy as it sampled: in eval mode, within the rollout (under FSDP while the whole model is
        gathered: no collective per pass). rl.num_iterations > 1's old log-probabilities (TRL's old_per_token_logps,
        kept on the CPU with the round), and RLOO's for its KL.
        Under sequence parallelism, on the group's first process over whole rows (each process then keeps its
        slice's, as the other `loss_` columns)."""
        from llmtrain.data.batching import to_device
        from llmtrain.model.loss import compute_loss

        if self.stages is not None:
            return self._staged_logps(batches, nullcontext())
        with torch.no_grad():
            return [-compute_loss(self.lm, to_device(b, self.lm.device), per_token=True,
                                  temperature=self.rl.temperature).float() for b in batches]

    def _correct(self, batches: list[dict], parts: list[list[int]], sampled: list[list[float]],
                 masks: list[list[int]] | None) -> list[float]:
        """rl.sampler_correction: each pass's `loss_sampler_logps` (the sampler's log-probability of each trained
        token, a completion's tokens whose mask is 0 left out as the passes leave them) and `loss_sampler_weights`
        (sampler_weights), and its `sampler_extremes` (the largest |policy - sampler|, the smallest and largest
        ratio); returns the rollout's sums of |policy - sampler|, of the ratios and their count."""
        rl, sums = self.rl, [0.0, 0.0, 0.0]
        for batch, part in zip(batches, parts):
            logps = [lp for i in part for lp, m in zip(sampled[i], masks[i] if masks else [1] * len(sampled[i])) if m]
            batch["loss_sampler_logps"] = torch.tensor(logps, dtype=torch.float32)
            policy = batch["loss_old_logps"]
            if policy.shape != batch["loss_sampler_logps"].shape:  # the passes' trained tokens are what was drawn
                raise RuntimeError(f"rl.sampler_correction: {len(logps)} sampled tokens for {policy.numel()} trained")
            batch["loss_sampler_weights"], ratios = sampler_weights(
                policy, batch["loss_sampler_logps"], batch["loss_example"], len(part), mode=rl.sampler_correction,
                low=rl.sampler_correction_min, high=rl.sampler_correction_max)
            difference = (policy - batch["loss_sampler_logps"]).abs()
            sums = [sums[0] + float(difference.sum()), sums[1] + float(ratios.sum()), sums[2] + ratios.numel()]
            if ratios.numel():
                batch["sampler_extremes"] = [float(difference.max()) if difference.numel() else 0.0,
                                             float(ratios.min()), float(ratios.max())]
        return sums

    def _advantages(self, total: torch.Tensor, g: int, batches: list[dict], parts: list[list[int]], *,
                    per_function: torch.Tensor):
        """(RLOO's hook) Each completion's advantage from the summed rewards `total`, each one's group std, more
        rollout statistics (advantage_stats) and more columns for rollouts.jsonl."""
        if self.rl.multi_objective_aggregation == "normalize_then_sum":  # each function in its group, then the sum
            # (normalised over the step in rollout: until then an advantage is the sum, NaN where none applied)
            summed = normalized_then_summed(per_function, [w for _, _, w in self.rewards], g)
            return summed, _nanstd(summed.view(-1, g), dim=1).repeat_interleave(g), [], {}
        advantages, std = group_advantages(total, g, scale_rewards=self.rl.scale_rewards)
        return advantages, std, [], {}

    def _loss_units(self, lengths: torch.Tensor) -> float:
        """(RLOO's hook) What these completions' summed loss is divided by (see loss_units)."""
        return loss_units(lengths, self.rl.loss_type, max_completion_tokens=self.rl.max_completion_tokens)

    def _attach(self, batch: dict, advantages: torch.Tensor, lengths: torch.Tensor) -> None:
        """(RLOO's hook) Put a pass's advantages (one per completion) in its batch: each token gets its completion's,
        and its weight in the loss sum (which depends on its own completion only: any split gives the same)."""
        completion = batch["loss_example"]
        batch["loss_advantages"] = advantages.float()[completion]  # "loss_": one per trained position
        batch["loss_weights"] = token_weights(completion, lengths, self.rl.loss_type)
        batch["loss_lengths"] = lengths.clamp(min=1).float()[completion]  # its completion's tokens, whole
        batch["completions"] = len(lengths)

    def _generate(self, prompt_ids: list[list[int]], seeds: list[int], *, greedy: bool = False,
                  max_new_tokens: int | None = None, logps: bool = False) -> list:
        """The completions of `prompt_ids`, one per seed, with rl.sampler (the caller gathers FSDP's units): sampled
        as the rl: section says, or greedy (the eval's, unpenalised); logps: each a generate.Drawn (its tokens and the
        sampler's log-probability of each)."""
        rl = self.rl
        sampling = dict(temperature=0.0, top_p=1.0) if greedy else sampling_of(rl)
        # on pipeline stages the stages as one causal LM (`drawing`), which rl.sampler reference's loop decodes
        lm = self.drawing if self.drawing is not None else self.lm
        return sample(lm, rl.sampler, prompt_ids, seeds, max_new_tokens=max_new_tokens or rl.max_completion_tokens,
                      stop_ids=self.stop_ids, pad_id=self.pad_id, copy=rl.merged_copy, logps=logps, **sampling)

    def _complete(self, prompt_ids: list[list[int]], seeds: list[int], *, rows: list[dict], greedy: bool = False,
                  logps: bool = False):
        """(the completions, their tool_calls.ToolRollout or None without tools): each sampled to its end, its
        tools' calls run and their results appended where rl.tools or rl.environment are given (`rows`: each
        completion's prompt row; an environment is reset with it, and what reset returns is added to the prompt:
        `prompt_ids` is changed in place)."""
        if self.tools is None:
            return self._generate(prompt_ids, seeds, greedy=greedy, logps=logps), None
        from llmtrain.objectives.tool_calls import observed, sample_with_tools

        def reset() -> list:
            """The rollout's environments (on the process that runs the user's code), each reset with its row."""
            self._environments = self.tools.environments(len(prompt_ids))
            # TRL's: reset with the row; an observation joins the prompt's last message
            return [None if environment is None else self._reset(environment, row)
                    for environment, row in zip(self._environments, rows)]  # text: what travels to the other

        seen = [None] * len(rows)  # each completion's prompt with its environment's observation
        for i, (observation, row) in enumerate(zip(self.user_code(reset), rows)):
            if observation is not None:
                seen[i] = observed(row["prompt"], observation)
                prompt_ids[i] = self.render(seen[i], row["row"])

        def turn(prompts, turn_seeds, room):
            return self._generate(prompts, turn_seeds, greedy=greedy, max_new_tokens=room, logps=logps)

        tooled = sample_with_tools(turn, prompt_ids, seeds, tools=self.tools,
                                   max_new_tokens=self.rl.max_completion_tokens, max_rounds=self.rl.max_tool_calls,
                                   environments=self._environments, user_code=self.user_code, logps=logps)
        for t, prompt in zip(tooled, seen):
            t.prompt = prompt
        return [t.ids for t in tooled], tooled

    def _reset(self, environment, row: dict) -> str | None:
        """rl.environment's reset of one rollout's instance with its row (TRL's: prompt=, each column by name), its
        observation as text; one that raises said in a paragraph naming the class's line and the row (a traceback at
        step 1, before)."""
        from llmtrain.objectives.rewards import raised

        try:
            observation = environment.reset(prompt=row["prompt"], **{
                name: row[stored] for name, stored in self.reward_columns.items()})
        except Exception as e:
            raise raised(f"{self.rl.environment}.reset", e, f"row {row['row']}", type(environment).reset,
                          what="rl.environment", on="the prompt of ") from e
        return None if observation is None else str(observation)

    def _environment_reward(self):
        """rl.environment's get_reward as a reward function: each completion's instance's (TRL's; async or not)."""
        import inspect

        if inspect.iscoroutinefunction(self.tools.environment.get_reward):
            async def environment_reward(completions, **kwargs):
                return [await e.get_reward() for e in self._environments]
        else:
            def environment_reward(completions, **kwargs):
                return [e.get_reward() for e in self._environments]
        return environment_reward

    def _score(self, examples: list[dict], completions: list[list[int]], g: int, *, where: str, tooled=None):
        """(texts, each reward [completions x functions], their weighted sum, what the functions logged: a
        rewards.RewardLogs) of the completions of `examples`, `g` consecutive completions per example, scored as TRL
        scores them (rewards.score) where the user's code runs (user_code); `where`: the examples' file, for the
        errors; `tooled`: their tool calls (rl.tools)."""
        from llmtrain.objectives.rewards import RewardLogs, score

        texts = [self.stop_ids.reply(self.tokenizer.decode(c, skip_special_tokens=True)) for c in completions]
        prompts = [e["prompt"] for e in examples for _ in range(g)]
        # TRL's convention: a conversational prompt's completion is a list with one assistant message; with tools,
        # the conversation after the prompt (assistant turns with their tool_calls, the tools' messages)
        if tooled:
            shown = [t.messages for t in tooled]
            # the prompt each was sampled from: with its environment's observation (TRL's; it had been the row's)
            prompts = [p if t.prompt is None else t.prompt for p, t in zip(prompts, tooled)]
        else:
            shown = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(prompts[0], list) else texts
        columns = {name: [e[stored] for e in examples for _ in range(g)]
                   for name, stored in self.reward_columns.items()}
        def scored():  # what the functions log comes back with their rewards, from where they ran
            logs = RewardLogs()
            return *score(self.rewards, prompts, shown, completion_ids=[list(c) for c in completions],
                          columns=columns, rows=[e["row"] + 1 for e in examples for _ in range(g)], where=where,
                          state=self.state, logs=logs, runner=self.runner), logs

        return texts, *self.user_code(scored)

    def unscored(self, records: list[dict]) -> list[str]:
        """Warnings, each said once a run: a reward function that scored none of a step's completions (None for
        every one; `records`: the step's rollouts from every process). TRL warns too: such a function adds nothing
        to the step's rewards, and if every function is silent the step trains nothing (loss 0). And FLAT_STEPS
        steps in a row whose every advantage is 0 (each prompt's completions rewarded alike): the policy has not
        moved, which the loss (about 0 in any GRPO run) does not show (make demo-tools after an SFT that had not
        learned to copy the tool's result: reward 0.000 for 40 steps, without a word)."""
        notes = []
        for name, _, _ in self.rewards:
            if records and name not in self.warned and all(r[name] is None for r in records):
                self.warned.add(name)
                notes.append(f"warning (rewards): reward function {name} returned None for all {len(records)} "
                             f"completions of step {records[0]['step']}: nothing it scores counts (None means 'does "
                             "not apply'). Check its columns and what it returns; said once a run.")
        if records:
            self.flat_steps = self.flat_steps + 1 if all(abs(r["advantage"]) < 1e-6 for r in records) else 0
        if self.flat_steps == FLAT_STEPS and not self.flat_said:
            self.flat_said = True
            rewards = sorted({r["reward"] for r in records})
            why = ("no completion was rewarded (every reward 0): check the reward functions against rollouts.jsonl's "
                   "completions and the data's columns, or start from a model that succeeds now and then (an SFT run "
                   "first: docs/rl.md)" if rewards == [0.0] else
                   f"the rewards were {', '.join(f'{x:g}' for x in rewards[:4])}{' ...' if len(rewards) > 4 else ''}, "
                   "each prompt's alike: sample more completions a prompt (rl.num_generations) or at a higher "
                   "rl.temperature, or use rewards that tell a prompt's completions apart")
            notes.append(f"warning (rewards): for {FLAT_STEPS} steps in a row (to step {records[0]['step']}) every "
                         f"prompt's completions got the same reward, so every advantage was 0 and the policy did not "
                         f"move{' but for the KL term' if self.rl.beta else ''}: {why}. Said once a run.")
        return notes

    # ---- the update

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        from llmtrain.model.loss import ENTROPY_TRAINED, compute_loss

        rl, ref = self.rl, None
        rollout = batch["rollout_stats"].to(batch["input_ids"].device)
        if rl.beta:  # taken in the rollout once a round (_reference_once), else here first: its no-grad forward
            # leaves no graph behind
            ref = batch["loss_ref_logps"] if "loss_ref_logps" in batch else self._reference_logps([batch])[0]
        bonus = self.entropy  # the entropy bonus: the entropy with its gradient
        losses, entropy = compute_loss(model, batch, per_token=True, temperature=rl.temperature,
                                       stat=ENTROPY_TRAINED if bonus is not None else "entropy")
        total, stats = policy_loss(rl, -losses.float(), entropy, batch, ref=ref, shared_sum=self.shared_sum,
                                   gather_tokens=self.gather_tokens)
        if bonus is not None:  # minus coef x the window's mean entropy: each token's entropy / the window's trained
            # tokens, in the loss's units (the step divides the sum by the window's units)
            total = total - bonus.applied() * batch["units_per_trained"] * entropy.sum()
        return total, torch.cat([rollout, stats])

    def _control_entropy(self, stats: list[float]) -> None:
        """After each step, on every process (`after_window`): rl.use_adaptive_entropy's controller moves the
        coefficient by the step's mean entropy (`stats`: the window's statistics summed over every process)."""
        s = dict(zip(self.stats, stats))
        self.entropy.update(s["entropy"] / max(s["tokens"], 1.0))

    def _reward_metrics(self, s: dict, n: float) -> dict[str, float]:
        """reward and reward_std as TRL logs them: the mean and the unbiased std (its nanstd) of the step's scored
        completions' rewards on every process, from their sums (no std below 2); frac_reward_zero_std. A step no
        reward function scored has no reward (TRL logs None; it had been a mean of 0 over nothing)."""
        scored = s["scored"]
        mean = s["reward"] / max(scored, 1.0)
        out = {"reward": mean} if scored else {}
        if scored > 1:
            out["reward_std"] = (max(s["reward_squares"] - scored * mean * mean, 0.0) / (scored - 1)) ** 0.5
        return {**out, "frac_reward_zero_std": s["zero_std"] / n}

    def _policy_metrics(self, s: dict, n: float) -> dict[str, float]:
        """(RLOO's hook) kl (beta > 0), clip_ratio/region_mean (of the completion tokens, or of the completions with
        importance_sampling_level sequence: TRL's; cispo_clip_ratio, the share above the cap, for cispo) and entropy
        (the policy's mean over the completion tokens)."""
        tokens = max(s["tokens"], 1.0)
        clip = (s["clipped"] / max(s["sequences"], 1e-9) if self.rl.importance_sampling_level == "sequence" else
                s["clipped_tokens"] / tokens)
        name = "cispo_clip_ratio" if self.rl.loss_type == "cispo" else "clip_ratio/region_mean"  # TRL's names
        return {**({"kl": s["kl"] / tokens} if self.rl.beta else {}),
                # sapo and vespo clip nothing (TRL logs no clip share): vespo's mean weight a completion instead
                **({} if self.rl.loss_type == "sapo" else
                   {"vespo/phi_seq_mean": s["phi"] / max(s["sequences"], 1e-9)} if self.rl.loss_type == "vespo" else
                   {name: clip}),
                "entropy": s["entropy"] / tokens}

    def _bonus_metrics(self, s: dict, units: float) -> dict[str, float]:
        """With the entropy bonus, TRL's: the coefficient after the step (the controller's), and the loss without
        the bonus."""
        if self.entropy is None:
            return {}
        return {"entropy_coef": self.entropy.coef, "policy_loss": s["policy"] / max(units, 1.0)}

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        from llmtrain.objectives.rewards import metric_means

        s = dict(zip(self.stats, stats))
        if not s["completions"]:  # only updates that reused a round's completions (rl.num_iterations): nothing sampled
            return {**self._policy_metrics(s, 0.0), **self._bonus_metrics(s, units)}
        n = max(s["completions"], 1.0)
        out = self._reward_metrics(s, n)
        for name, _, _ in self.rewards:
            if s[f"rewards/{name}/count"]:
                out[f"rewards/{name}/mean"] = s[f"rewards/{name}/sum"] / s[f"rewards/{name}/count"]
        out.update({"completions/mean_length": s["length"] / n, "completions/clipped_ratio": s["truncated"] / n})
        out.update(self._policy_metrics(s, n))
        out.update(self._bonus_metrics(s, units))
        if self.tools is not None:  # TRL's: calls per completion, failures per call
            out["tools/call_frequency"] = s["tool_calls"] / n
            out["tools/failure_frequency"] = s["tool_failures"] / s["tool_calls"] if s["tool_calls"] else 0.0
        if self.correcting:  # TRL's: the sampler's distance from the policy, and the ratios that correct for it
            out["sampling/sampling_logp_difference/mean"] = s["sampler_difference"] / max(s["trained"], 1.0)
            out["sampling/importance_sampling_ratio/mean"] = s["sampler_ratio"] / max(s["sampler_ratios"], 1.0)
            out.update(self.sampler_extremes)
        out["generation_s"], out["reward_s"] = s["generation_s"], s["reward_s"]
        out["generation_tokens_per_s"] = s["length"] / max(s["generation_s"], 1e-9)
        # log_metric's numbers since the last line, averaged over every process's (every rank makes this call, so
        # the gather is a collective they all reach); never over ours
        means = metric_means(self.gather(self.logs.metric_sums()))
        out.update({name: mean for name, mean in means.items() if name not in out})
        self.logs.metrics.clear()
        return out

    # ---- evaluation: held-out prompts, one greedy completion each

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        """[completions scored, summed reward, each reward's sum, each reward's count, prompts, prompts passed] of one
        greedy completion per eval prompt, or rl.num_generations_eval sampled ones (EVAL_STEP's seeds); a completion
        no function scores (every one None) is not scored; a prompt passes where one of its completions' first
        answer_match is 1."""
        from llmtrain.model.generate import completion_seed
        from llmtrain.parallel.fsdp import gathered_for_generation

        examples, g = batch["examples"], self.rl.num_generations_eval or 1

        def sums() -> torch.Tensor:
            prompt_ids = [list(e["input_ids"]) for e in examples for _ in range(g)]
            if self.rl.num_generations_eval is None:
                completions, tooled = self._complete(prompt_ids, [0] * len(examples), rows=examples, greedy=True)
            else:
                seeds = [completion_seed(self.seed, EVAL_STEP, e["row"], k) for e in examples for k in range(g)]
                completions, tooled = self._complete(prompt_ids, seeds, rows=[e for e in examples for _ in range(g)])
            _, per_function, total, _ = self._score(examples, completions, g,
                                                    where=self.sources[1] or self.sources[0], tooled=tooled)
            first = self._first_answer_match()
            passed = (float((per_function[:, first].nan_to_num().view(-1, g) >= 1).any(1).sum())
                      if first is not None else 0.0)
            return torch.tensor([float((~total.isnan()).sum()), float(total.nansum()),
                                 *per_function.nan_to_num().sum(0).tolist(), *(~per_function.isnan()).sum(0).tolist(),
                                 len(examples), passed], dtype=torch.float64)

        if self.stages is not None:  # every process of a pipeline samples and scores them: its last stage counts them
            with self._sampling():
                return sums() * float(self.stages.last is not None)
        with gathered_for_generation(self.lm):
            return self.on_first_of_group(sums)

    def _first_answer_match(self) -> int | None:
        """The index of the first answer_match reward among the functions (eval_answer_accuracy's), or None."""
        return next((i for i, c in enumerate(self.rl.rewards) if c.type == "answer_match"), None)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        k = len(self.rewards)
        scored, reward, per, counts, (prompts, passed) = (sums[0], sums[1], sums[2:2 + k], sums[2 + k:2 + 2 * k],
                                                          sums[-2:])
        # the mean of the scored completions', as the train lines' reward and TRL's nanmean (an unscored one had
        # counted as 0: 0.495 where every scored completion had 1.0)
        out = {"eval_reward": reward / max(scored, 1)}
        for (name, _, _), total, count in zip(self.rewards, per, counts):
            if count:  # a function that scored nothing has no mean (as in the train lines)
                out[f"eval_rewards/{name}/mean"] = total / count
        first = self._first_answer_match()
        if first is not None and counts[first]:
            out["eval_answer_accuracy"] = per[first] / counts[first]  # the first answer_match's mean
            if (self.rl.num_generations_eval or 1) > 1:  # pass@N: a prompt with one right answer among its N
                out[f"eval_answer_pass@{self.rl.num_generations_eval}"] = passed / max(prompts, 1)
        return out


def _extremes(values: list[list[float]]) -> dict[str, float]:
    """rl.sampler_correction's metrics of the step's passes ([largest |difference|, smallest ratio, largest ratio]
    each, every process's), by TRL's names; none without a pass."""
    if not values:
        return {}
    return {"sampling/sampling_logp_difference/max": max(v[0] for v in values),
            "sampling/importance_sampling_ratio/min": min(v[1] for v in values),
            "sampling/importance_sampling_ratio/max": max(v[2] for v in values)}


def _number(value: torch.Tensor) -> float | None:
    v = float(value)
    return None if v != v else v  # NaN (no reward function applied) is None in the JSON


class StageGRPO:
    """GRPO on pipeline stages (parallel/pipeline/schedule.py): the last stage's loss. The rollout runs on every
    process of a pipeline alike (the same completions, sampled through the stages: GRPO.stages), and its passes
    (packed rows of rl.micro_batch_tokens slots) reach the last stage as the final hidden states with the [slots, 12]
    float32 targets of `targets`: at each trained position its token, advantage, weight in the sum, completion's
    length, completion, reference log-probability (beta > 0: the model with its adapter disabled, or LoRA's moving
    reference, forward only through the stages before the step: `prepare`; with rl.num_iterations > 1, the rollout's
    once a round) and old log-probability (rl.num_iterations > 1: the policy's as it sampled, the rollout's through
    the stages) and, with rl.sampler_correction, the sampler's log-probability and the correction's weight (both
    the last stage's own: the rollout takes them where the policy's are); at slot k the pass's k-th rollout
    statistic; at slot 0 its completions and (the entropy bonus) the window's loss units per trained token. From
    these the loss and its statistics are GRPO's own (`policy_loss`, the entropy bonus of the run's GRPO.entropy,
    rl.top_entropy_quantile's quantile over the last stages of every pipeline: `gather_tokens`), so that 2 stages
    train what one process trains."""

    WIDTH = 12

    def __init__(self, rl, *, rollout_stats: int, adapter_off=None):
        self.rl, self.rollout_size, self.adapter_off = rl, rollout_stats, adapter_off
        self.stats = rollout_stats + len(LOSS_STATS)
        self.entropy: EntropyControl | None = None  # the run's GRPO's entropy bonus (objective.objective_for)
        self.gather_tokens = None  # the last stages' lists over the pipelines (None: one pipeline)

    follow = StagePairs.follow  # LoRA's moving reference (rl.sync_reference): the reference pass runs its snapshot

    def prepare(self, pipeline, batches: list[dict]) -> list[dict]:
        """beta > 0: the passes with each trained token's reference log-probability at its slot (on the last stage),
        forward only through the stages with the adapter disabled, as one process's GRPO.loss takes it first; as they
        are where the rollout took them once a round (GRPO._reference_once: rl.num_iterations > 1)."""
        if not self.rl.beta or all("loss_ref_logps" in b for b in batches):
            return batches
        with torch.no_grad(), self.adapter_off():
            reference = pipeline.token_logps(batches)
        if reference is None:  # not the last stage: nothing reads the targets here
            return batches
        return [{**b, "ref_slots": r.float().cpu()} for b, r in zip(batches, reference)]

    def targets(self, batch: dict, slots: int) -> torch.Tensor:
        """[1, slots, WIDTH] float64 of a pass (none: an idle row): the rollout's statistics keep their float64 sums
        (reward_std's squares); the loss reads the rest in float32 (`loss`), as one process does."""
        from llmtrain.data.formats import IGNORE

        out = torch.zeros(slots, self.WIDTH)
        out[:, 0] = IGNORE
        at = batch["loss_index"].reshape(-1)
        if len(at):  # (before the advantages: the rollout's passes through the stages, RLOO's KL)
            out[at, 0], out[at, 4] = batch["loss_targets"].float(), batch["loss_example"].float()
            if "loss_old_logps" in batch:  # rl.num_iterations > 1, rl.sampler_correction: the policy's as it sampled
                out[at, 8] = batch["loss_old_logps"].float()
            if "loss_sampler_weights" in batch:  # rl.sampler_correction: the sampler's, and each token's weight
                out[at, 10], out[at, 11] = batch["loss_sampler_logps"].float(), batch["loss_sampler_weights"].float()
        if "units_per_trained" in batch:  # the entropy bonus's share of each trained token (loop/step.py)
            out[0, 9] = float(batch["units_per_trained"])
        if "rollout_stats" in batch:
            self._fill(out, batch, at)
        out = out.double()  # (exactly the float32 values) the rollout's statistics' float64 sums beside them
        if "rollout_stats" in batch:
            stats = batch["rollout_stats"]
            assert len(stats) == self.rollout_size <= slots, (len(stats), self.rollout_size, slots)
            out[: len(stats), 6] = stats
        return out[None]

    def _fill(self, out: torch.Tensor, batch: dict, at: torch.Tensor) -> None:
        """A scored pass's own columns: each trained token's advantage, weight and completion's length, the
        reference's log-probabilities at their slots, the completions at slot 0."""
        for column, key in ((1, "loss_advantages"), (2, "loss_weights"), (3, "loss_lengths")):
            out[at, column] = batch[key].float()
        if "ref_slots" in batch:
            out[:, 5] = batch["ref_slots"]
        elif "loss_ref_logps" in batch:  # the rollout's, once a round
            out[at, 5] = batch["loss_ref_logps"].float()
        out[0, 7] = batch["completions"]

    def _trained(self, target: torch.Tensor) -> torch.Tensor:
        from llmtrain.data.formats import IGNORE

        return (target[:, 0] != IGNORE).nonzero().flatten()

    def token_logps(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[slots] float32: each trained token's log-probability at the sampling temperature at its slot (the
        reference pass)."""
        out = torch.zeros(target.shape[0], dtype=torch.float32, device=hidden.device)
        if (at := self._trained(target)).numel():
            losses, _ = head(hidden[at], targets=target[at, 0].long(), per_token=True, temperature=self.rl.temperature)
            out[at] = -losses.float()
        return out

    def loss(self, head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's summed GRPO loss and its statistics (the rollout's, then LOSS_STATS), as GRPO.loss returns
        them; a row that trains nothing: a zero loss that still reaches the head."""
        from llmtrain.model.loss import ENTROPY_TRAINED

        rollout, target = target[: self.rollout_size, 6], target.float()  # (the statistics in float64, `targets`)
        at = self._trained(target)
        if at.numel() == 0:  # (an idle row still takes part in the quantile's gather, as an idle rank's pass does)
            if self.gather_tokens is not None and self.rl.top_entropy_quantile < 1.0:
                self.gather_tokens([])
            return head(hidden[:1]).float().sum() * 0.0, hidden.new_zeros(self.stats, dtype=torch.float64)
        bonus = self.entropy  # the entropy bonus: the entropy with its gradient
        losses, entropy = head(hidden[at], targets=target[at, 0].long(), per_token=True,
                               temperature=self.rl.temperature, stat=ENTROPY_TRAINED if bonus else "entropy")
        t = target[at]
        batch = {"loss_advantages": t[:, 1], "loss_weights": t[:, 2], "loss_lengths": t[:, 3],
                 "loss_example": t[:, 4].long(), "completions": int(target[0, 7]),
                 **({"loss_old_logps": t[:, 8]} if self.rl.num_iterations > 1 or self.rl.sampler_correction else {}),
                 **({"loss_sampler_logps": t[:, 10], "loss_sampler_weights": t[:, 11]}
                    if self.rl.sampler_correction else {})}
        total, stats = policy_loss(self.rl, -losses.float(), entropy, batch, ref=t[:, 5] if self.rl.beta else None,
                                   gather_tokens=self.gather_tokens)
        if bonus is not None:  # as GRPO.loss: minus coef x each trained token's entropy x the window's units per token
            total = total - bonus.applied() * target[0, 9] * entropy.sum()
        return total, torch.cat([rollout, stats.double()])
