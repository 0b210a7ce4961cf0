"""RLOO (Ahmadian et al. 2024, "Back to Basics"): TRL 1.16's RLOOTrainer, as a variant of the GRPO objective.

The rollout is GRPO's (grpo.py: the sampler, the rewards, the packed passes, rollouts.jsonl, exact resume); what
RLOO changes, as TRL's RLOOTrainer does it:
- The KL goes into the reward, not the loss: with beta > 0, each completion's reward loses beta x its summed
  first-order log-ratio to the reference (k1: log pi_old - log pi_ref over its tokens, which can be negative), the
  log-probabilities taken without gradient right after sampling (TRL's old_per_token_logps and ref_per_token_logps).
- The advantage is the reward minus the mean of the OTHER completions of its prompt (the leave-one-out baseline),
  over the ones some reward function scored; optionally normalised over the whole step (normalize_advantages).
  A reward function's None and a group with one scored completion give advantage 0.
- The loss is per sequence: the ratio is exp(sum of the completion's log-probabilities - the same at sampling),
  clipped as PPO's, and the loss is the mean over completions. In this package's contract (a SUM over loss units,
  divided by the window's units on every process): a sum over completions, units = completions. TRL takes the
  mean of each micro-batch and divides by the accumulation steps; its micro-batches are equal, so that is the same.
With one update per generation round (rl.num_iterations 1) the sampling policy is the one being updated: the ratio
is 1 in value and carries the gradient of the sequence's log-probability; with more, each update of the round
divides by the sequence's summed log-probability as it was sampled (grpo.py).

The metrics keep TRL's names and meanings: `reward` and `reward_std` over the scored completions of the step (every
process), `kl` the mean per-token k1 over every completion token, `clip_ratio/region_mean` per sequence.
"""

from __future__ import annotations

import torch

from llmtrain.data.batching import batch_weight, to_device
from llmtrain.model.loss import compute_loss
from llmtrain.objectives.grpo import GRPO, STD_EPS, StageGRPO, _nanstd
from llmtrain.objectives.rollouts import clipped_surrogate


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each completion's group std) of `rewards` [prompts x num_generations], a prompt's completions
    consecutive: each reward minus the mean of its group's other scored rewards (NaN: scored by no function). NaN
    stays NaN where there is no baseline (the completion unscored, or alone scored in its group): the caller zeroes
    them after any normalisation, as TRL does."""
    grouped = rewards.view(-1, num_generations)
    scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    return rewards - baselines.view(-1), std


def normalized(advantages: torch.Tensor, over: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's normalize_advantages: over every scored completion of the step (`over`: every process's; NaN left out),
    mean 0 and std 1."""
    over = advantages if over is None else over
    return (advantages - torch.nanmean(over)) / (_nanstd(over, dim=0) + STD_EPS)


def sequence_sums(per_token: torch.Tensor, completion: torch.Tensor, n: int) -> torch.Tensor:
    """Each of the `n` completions' sum over its tokens (`completion`: each token's completion; one with no token
    sums to 0, as TRL's masked sum does)."""
    return per_token.new_zeros(n).index_add(0, completion, per_token)


def sequence_losses(logps: torch.Tensor, advantages: torch.Tensor, *, old_logps: torch.Tensor | None = None,
                    epsilon: float, epsilon_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion: (loss, clipped: whether the ratio was clipped where it mattered), from its summed
    log-probability `logps`. old_logps None: the policy that sampled is this one (the ratio is 1 in value)."""
    loss, _, clipped = clipped_surrogate(logps, advantages, old_logps=old_logps, epsilon=epsilon,
                                         epsilon_high=epsilon_high)
    return loss, clipped


def completion_logps(model, batch: dict, *, temperature: float, entropy: bool = False):
    """Every completion token's log-probability at the sampling temperature, from the chunked per-token loss path
    (no full logits); with entropy, and each token's entropy (no gradient)."""
    if entropy:
        losses, entropies = compute_loss(model, batch, per_token=True, temperature=temperature, stat="entropy")
        return -losses.float(), entropies
    return -compute_loss(model, batch, per_token=True, temperature=temperature).float()


class RLOO(GRPO):
    """GRPO's rollout and evaluation, with RLOO's reward (KL penalised), advantage, loss and metrics."""

    # rollout statistics beside GRPO's: the summed k1 over every completion token
    whole_sequences = True  # its loss reads each completion's whole log-probability (parallel/sequence/shards.py)
    sequence_sum = None  # sequence parallelism: a completion's log-probability from its slices' parts
    advantage_stats = ("kl",)
    # entropy, tokens: the policy's entropy summed over the completion tokens, and those tokens
    loss_stats = ("clipped_sequences", "sequences", "entropy", "entropy_tokens")
    slice_stats = ("entropy", "entropy_tokens")  # sequence parallelism: each slice's own tokens', added up

    def _advantages(self, total, g, batches, parts, *, per_function):
        rl = self.rl
        kl = torch.zeros_like(total)
        if rl.beta:  # the policy as it sampled: rl.num_iterations > 1's old log-probabilities, else taken here
            policy = ([b["loss_old_logps"] for b in batches] if all("loss_old_logps" in b for b in batches)
                      else self._sampling_logps(batches))
            kl = torch.cat([self._sequence_kl(b, len(part), p) for b, part, p in zip(batches, parts, policy)])
            if self.stages is not None:  # the last stage's (it alone holds the log-probabilities), to every stage
                kl = self.stages.from_last(kl)
        rewards = total if rl.reward_clip_range is None else total.clamp(*rl.reward_clip_range)
        advantages, std = leave_one_out_advantages(rewards - rl.beta * kl, g)
        return advantages, std, [float(kl.sum())], ({"kl": kl.tolist()} if rl.beta else {})

    def _sequence_kl(self, batch: dict, n: int, policy: torch.Tensor) -> torch.Tensor:
        """Each completion's summed k1 log-ratio of the policy as it sampled (`policy`: each trained token's
        log-probability) to the reference (the LoRA adapter disabled, or a full fine-tune's frozen copy), without
        gradient: TRL's old and reference log-probabilities, taken before the update. Within the rollout, so under
        FSDP while the whole model (and a full fine-tune's copy: GRPO._rollout_reference) is gathered (no collective
        per pass); the reference's are the rollout's (GRPO._reference_once)."""
        batch = to_device(batch, self.lm.device)
        return sequence_sums(policy.to(self.lm.device) - batch["loss_ref_logps"], batch["loss_example"], n).cpu()

    def _loss_units(self, lengths: torch.Tensor) -> float:
        return float(len(lengths))  # the mean over completions

    def _attach(self, batch: dict, advantages: torch.Tensor, lengths: torch.Tensor) -> None:
        batch["advantages"] = advantages.float()  # one per completion, NaN until rollout() zeroes them

    def rollout(self, window, *, step: int):
        """GRPO's rollout, then the step's advantages: normalised over every process's completions where asked
        (one gather of floats a step), and those without a baseline zeroed, in the batches and in rollouts.jsonl."""
        window = super().rollout(window, step=step)
        passes = [b for b in window.batches if batch_weight(b)]  # not an idle rank's stand-ins (weight 0)
        for b in window.batches:
            if not batch_weight(b):  # finite, so that weight 0 leaves nothing (their NaNs would survive a product)
                b["advantages"] = torch.nan_to_num(b["advantages"], nan=0.0)
        mine = torch.cat([b["advantages"] for b in passes]) if passes else torch.zeros(0)
        final = mine
        if self.rl.normalize_advantages:
            # float64: the same statistics whatever the processes' order of the completions (1 process equals 2)
            everyone = torch.tensor(self.gather(mine.tolist()), dtype=torch.float64)
            final = normalized(mine.double(), over=everyone).float()
        final = torch.nan_to_num(final, nan=0.0)
        start = 0
        for b in passes:
            b["advantages"] = final[start:start + len(b["advantages"])]
            start += len(b["advantages"])
        for record, value in zip(window.rollouts, final.tolist()):  # in the order of the passes' completions
            record["advantage"] = value
        return window

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = batch["rollout_stats"].to(batch["input_ids"].device)
        logps, entropy = completion_logps(model, batch, temperature=self.rl.temperature, entropy=True)
        n = len(batch["advantages"])
        sequences = sequence_sums(logps, batch["loss_example"], n)
        old = (sequence_sums(batch["loss_old_logps"].to(logps.device), batch["loss_example"], n)
               if "loss_old_logps" in batch else None)  # rl.num_iterations > 1: as it was sampled
        if self.sequence_sum is not None:
            sequences = self.sequence_sum(sequences)
            old = self.sequence_sum(old) if old is not None else None
        losses, clipped = sequence_losses(sequences, batch["advantages"], old_logps=old, epsilon=self.rl.epsilon,
                                          epsilon_high=self.rl.epsilon_high)
        stats = torch.stack([clipped.float().sum(), logps.new_tensor(float(n)), entropy.sum(),
                             logps.new_tensor(float(logps.numel()))]).detach()
        return losses.sum(), torch.cat([rollout, stats])

    def _policy_metrics(self, s: dict, n: float) -> dict[str, float]:
        # a rollout's, per trained token (TRL's: over the completion mask, the clipped ones left out where masked)
        out = {"kl": s["kl"] / max(s["trained"], 1.0)} if self.rl.beta and s["completions"] else {}
        return {**out, "clip_ratio/region_mean": s["clipped_sequences"] / max(s["sequences"], 1.0),
                "entropy": s["entropy"] / max(s["entropy_tokens"], 1.0)}


class StageRLOO(StageGRPO):
    """RLOO on pipeline stages: GRPO's rollout through the stages (its KL's log-probabilities forward only through
    them, inside the rollout, the last stage's KL given to the others: Pipeline.from_last), and the last stage's loss
    RLOO's own: each completion's summed log-probability (its tokens' completion in column 4) and its advantage (at
    slot k the k-th completion's, column 1), PPO's clipped surrogate per sequence (`sequence_losses`), with
    rl.num_iterations > 1 against each completion's summed old log-probability (column 8's, the rollout's)."""

    def __init__(self, rl, *, rollout_stats: int):
        super().__init__(rl, rollout_stats=rollout_stats)
        self.stats = rollout_stats + len(RLOO.loss_stats)

    def prepare(self, pipeline, batches: list[dict]) -> list[dict]:
        return batches  # the reference ran in the rollout (its KL is in the rewards)

    def _fill(self, out: torch.Tensor, batch: dict, at: torch.Tensor) -> None:
        advantages = batch["advantages"]
        out[: len(advantages), 1] = advantages.float()
        out[0, 7] = len(advantages)

    def loss(self, head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rollout, target = target[: self.rollout_size, 6], target.float()  # (the statistics in float64: GRPO's targets)
        at = self._trained(target)
        if at.numel() == 0:
            return head(hidden[:1]).float().sum() * 0.0, hidden.new_zeros(self.stats, dtype=torch.float64)
        losses, entropy = head(hidden[at], targets=target[at, 0].long(), per_token=True,
                               temperature=self.rl.temperature, stat="entropy")
        logps, n, example = -losses.float(), int(target[0, 7]), target[at, 4].long()
        sequences = sequence_sums(logps, example, n)
        old = sequence_sums(target[at, 8], example, n) if self.rl.num_iterations > 1 else None  # as it was sampled
        losses, clipped = sequence_losses(sequences, target[:n, 1], old_logps=old, epsilon=self.rl.epsilon,
                                          epsilon_high=self.rl.epsilon_high)
        stats = torch.stack([clipped.float().sum(), logps.new_tensor(float(n)), entropy.sum(),
                             logps.new_tensor(float(logps.numel()))]).detach()
        return losses.sum(), torch.cat([rollout, stats.double()])
