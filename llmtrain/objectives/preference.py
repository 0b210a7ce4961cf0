"""Preference tuning on pairs: the losses, as pure functions of summed log-probabilities, and the objective that
trains them padding-free on the same loop, step and metering as supervised fine-tuning.

A micro-batch holds whole pairs: each pair's chosen and rejected sequences (prompt + answer) go into the same row,
one after the other, with restarting position ids (varlen attention: no sequence attends to another), or as
padded rows without packing. A sequence's log-probability is the sum over its answer tokens (the trained labels,
up to and including the end of turn) of log p(token), taken chunk by chunk from the final hidden states, as the
SFT loss does (loss.py): full [tokens x vocab] logits never exist. The loss of a step is the mean over the pairs
of the whole accumulation window on all processes (Counts.units = pairs).

The reference log-probabilities (dpo, ipo): LoRA runs take them from the same model with the adapter disabled,
under no_grad (no second copy of the weights); full fine-tunes from one no-grad pass with the initial weights
before training (`precompute`), cached with the tokenised data and found again by a resume. simpo and orpo have
none (config.REFERENCE_FREE).
"""

from __future__ import annotations

import math
import signal
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from llmtrain.data.batching import Counts, collate, with_loss_positions
from llmtrain.data.formats import IGNORE
from llmtrain.errors import Stopped
from llmtrain.model.loss import compute_loss
from llmtrain.model.reference import forward_of
from llmtrain.parallel.collectives import any_process, on_main
from llmtrain.parallel.mesh import data_ranks

# TRL's names for the same numbers (DPOTrainer), so runs can be compared line by line.
STATS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected"]
# and ORPO's own (TRL's ORPOTrainer): its NLL term, the mean log sigmoid of the log odds ratio, and the log odds ratio
# (its logps/ are each answer's mean log-probability per token, as TRL's ORPOTrainer logs them)
ORPO_STATS = ["nll_loss", "log_odds_ratio", "log_odds_chosen"]
# TRL's DPOTrainer metrics of the answers' tokens: the entropy of every answer token, the mean logit (over the
# vocabulary) of the chosen and of the rejected answers' tokens, and the share of the chosen answers' tokens that are
# the argmax; summed over the tokens (loss.PAIR_STATS, the policy pass), then divided by TOKEN_COUNTS, each answer's
# trained tokens summed over the pairs
TOKEN_STATS = ["entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"]
TOKEN_COUNTS = ["tokens/chosen", "tokens/rejected"]


def stat_names(cfg) -> list[str]:
    """The statistics pairs_loss returns for the preference: section `cfg`, in order."""
    return STATS + (ORPO_STATS if cfg.loss == "orpo" else []) + TOKEN_STATS + TOKEN_COUNTS


def pair_metrics(names: list[str], stats: list[float], pairs: float) -> dict[str, float]:
    """The metrics line's numbers from stat_names' sums: per pair, and TOKEN_STATS per token (of both answers, the
    chosen or the rejected ones); the counts themselves are not logged."""
    s = dict(zip(names, stats))
    chosen, rejected = max(s.pop("tokens/chosen"), 1.0), max(s.pop("tokens/rejected"), 1.0)
    per = {"entropy": chosen + rejected, "logits/chosen": chosen, "logits/rejected": rejected,
           "mean_token_accuracy": chosen}
    return {name: value / per.get(name, max(pairs, 1)) for name, value in s.items()}


def token_sums(stats: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """TOKEN_STATS' sums from the trained tokens' loss.PAIR_STATS `stats` [tokens, 4] and each token's sequence
    (chosen answers even, rejected odd)."""
    chosen = sequence % 2 == 0
    return torch.stack([stats[:, 0].sum(), stats[chosen, 2].sum(), stats[~chosen, 2].sum(), stats[chosen, 3].sum()])


def pair_losses(kind: str, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *,
                beta: float, gamma: float = 0.0, smoothing: float = 0.0, tau: float = 0.05,
                divergence: str = "reverse_kl",
                f_alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards of the chosen and rejected answers, from the summed answer
    log-probabilities of the policy (and of the reference) and the answers' token counts.

    - dpo (Rafailov et al. 2023, the sigmoid loss): -log sigmoid(beta ((pc - rc) - (pr - rr))); rewards
      beta (p - r).
    - ipo (Azar et al. 2023, as TRL computes it): ((pc - rc)/nc - (pr - rr)/nr - 1/(2 beta))^2, the log-ratios
      per answer token; rewards as dpo.
    - simpo (Meng et al. 2024, no reference): -log sigmoid(beta (pc/nc - pr/nr) - gamma); rewards beta p/n.
    - orpo (Hong et al. 2024, no reference): with a = p/n, each answer's mean log-probability per token, the chosen
      answer's negative log-likelihood -ac plus beta (the paper's lambda) x -log sigmoid of the log odds ratio
      log(e^ac / (1 - e^ac)) - log(e^ar / (1 - e^ar)); rewards beta a, as TRL's ORPOTrainer logs them.
    - TRL's other DPOTrainer loss_types (PAIR_LOSSES), each of the chosen and rejected log-ratios to the reference,
      as TRL 1.16 computes them; rewards as dpo.
    - aot and aot_unpaired (Melnyk et al. 2024, TRL's): dpo's loss with cDPO's conservative label smoothing
      (-(1-e) log sigmoid(x) - e log sigmoid(-x)), of the sorted policy margins against the sorted reference margins
      of the micro-batch (aot), or of its sorted chosen log-ratios against its sorted rejected ones (aot_unpaired):
      n losses that belong to no pair in particular, whose sum is the batch's.
    `divergence` (f-DPO): each log-ratio enters dpo, ipo, sigmoid_norm and PAIR_LOSSES as f_score of it (the
    config refuses another than reverse_kl where it has no meaning); the rewards stay beta x the log-ratios.
    """
    if kind == "simpo":
        rc_, rr_ = beta * chosen / chosen_tokens, beta * rejected / rejected_tokens
        return -F.logsigmoid(rc_ - rr_ - gamma), rc_, rr_
    if kind == "orpo":
        ac, ar = chosen / chosen_tokens, rejected / rejected_tokens
        return -ac - beta * F.logsigmoid(log_odds_ratio(ac, ar)), beta * ac, beta * ar
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    rewards = beta * chosen_ratio, beta * rejected_ratio
    if kind == "aot":  # the margins sorted, the policy's against the reference's
        return _aot(torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values, beta,
                    smoothing), *rewards
    if kind == "aot_unpaired":
        return _aot(torch.sort(chosen_ratio).values - torch.sort(rejected_ratio).values, beta, smoothing), *rewards
    c, r = f_score(chosen_ratio, divergence, f_alpha), f_score(rejected_ratio, divergence, f_alpha)
    if kind == "dpo":
        return -F.logsigmoid(beta * (c - r)), *rewards
    if kind == "ipo":
        delta = c / chosen_tokens - r / rejected_tokens
        return (delta - 1 / (2 * beta)) ** 2, *rewards
    if kind == "sigmoid_norm":
        delta = c / chosen_tokens - r / rejected_tokens
        return -F.logsigmoid(beta * delta), *rewards
    if kind in PAIR_LOSSES:
        return PAIR_LOSSES[kind](c, r, beta, smoothing, tau), *rewards
    raise ValueError(f"unknown preference loss {kind!r}")


def f_score(ratio: torch.Tensor, divergence: str, alpha: float | None) -> torch.Tensor:
    """f'(e^u) of a log-ratio u for f-DPO's divergence (TRL 1.16's f_divergence_type): reverse_kl u; forward_kl
    1 - e^-u; js_divergence log 2 + log sigmoid(u); alpha_divergence (e^((alpha-1) u) - 1) / (alpha - 1), its
    exponent held at most 80 (TRL's fp32 bound: e^80 is finite)."""
    if divergence == "reverse_kl":
        return ratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-ratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(ratio)
    if divergence == "alpha_divergence":
        return torch.expm1(((alpha - 1) * ratio).clamp(max=80.0)) / (alpha - 1)
    raise ValueError(f"unknown f_divergence {divergence!r}")


def _aot(delta: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps


def _exo_pair(c, r, beta, eps, tau):
    """EXO (Ji et al. 2024, eq. 16): KL from softmax(beta x the log-ratios) over the pair to (1 - eps, eps)."""
    z = beta * (c - r)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))


def _discopop(c, r, beta, eps, tau):
    """DiscoPOP (eq. 5): the logistic and exponential losses mixed by sigmoid(logits / tau)."""
    z = beta * (c - r)
    mix = torch.sigmoid(z / tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


# TRL 1.16's DPOTrainer loss_types on the log-ratios c (chosen) and r (rejected): f(c, r, beta, label_smoothing, tau)
PAIR_LOSSES = {
    "hinge": lambda c, r, beta, eps, tau: torch.relu(1 - beta * (c - r)),
    "robust": lambda c, r, beta, eps, tau: (-(1 - eps) * F.logsigmoid(beta * (c - r))
                                             + eps * F.logsigmoid(-beta * (c - r))) / (1 - 2 * eps),
    "exo_pair": _exo_pair,
    "nca_pair": lambda c, r, beta, eps, tau: (-F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c)
                                               - 0.5 * F.logsigmoid(-beta * r)),
    "bco_pair": lambda c, r, beta, eps, tau: -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r),
    "sppo_hard": lambda c, r, beta, eps, tau: (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
    "apo_zero": lambda c, r, beta, eps, tau: 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r),
    "apo_down": lambda c, r, beta, eps, tau: torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * (c - r)),
    "discopop": _discopop,
}


def log_odds_ratio(ac: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio of two answers from their mean log-probabilities per token: log(e^ac / (1 - e^ac)) -
    log(e^ar / (1 - e^ar))."""
    return (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (Maechler 2012, TRL's log1mexp). x is held below -1e-12: an
    answer whose every token has probability 1 in float32 (x exactly 0) would give log 0 and a NaN gradient."""
    x = x.clamp(max=-1e-12)
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pairs_loss(cfg, logps: torch.Tensor, tokens: torch.Tensor, ref_chosen: torch.Tensor | None,
               ref_rejected: torch.Tensor | None, weights: torch.Tensor | None = None,
               metrics: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed preference loss (the preference: section's) of the pairs whose sequences' summed answer
    log-probabilities and trained tokens are `logps` and `tokens` (chosen, rejected, chosen, ...), and its
    statistics (STATS, summed over the pairs). A list of losses: their sum weighted by preference.loss_weights
    (each a mean over pairs, as TRL's, so the sum of the weighted means). With preference.sft_weight, each pair's
    loss adds the weight times its chosen answer's mean negative log-likelihood per token: a mean over pairs, as the
    rest of the loss, so accumulation and packing leave it unchanged (TRL's loss_type [sigmoid, sft] takes the
    micro-batch's mean over its chosen tokens instead: the same where the chosen answers are equally long).
    `weights` (preference.wpo): each sequence's wpo_weights; each pair's loss, its sft term's too (as TRL's), times
    its two answers' product. `metrics`: TOKEN_STATS' sums (token_sums), statistics after the pairs' with the
    answers' token counts (zeros where None).
    """
    losses, mix = 0.0, cfg.weighted
    for name, weight in mix:  # a list of losses (MPO's mix): their weighted sum; the rewards are the same
        loss, chosen_rewards, rejected_rewards = pair_losses(
            name, logps[0::2], logps[1::2], ref_chosen, ref_rejected, tokens[0::2], tokens[1::2],
            beta=cfg.beta, gamma=cfg.simpo_gamma, smoothing=cfg.label_smoothing, tau=cfg.discopop_tau,
            divergence=cfg.f_divergence, f_alpha=cfg.f_alpha)
        losses = losses + weight * loss if len(mix) > 1 else loss  # one loss: as it is, unscaled
    if cfg.sft_weight:  # RPO: each pair's chosen answer's negative log-likelihood per token
        losses = losses + cfg.sft_weight * -logps[0::2] / tokens[0::2]
    if weights is not None:
        losses = losses * weights[0::2] * weights[1::2]
    with torch.no_grad():
        stats = [chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                 (chosen_rewards - rejected_rewards).sum(), logps[0::2].sum(), logps[1::2].sum()]
        ac, ar = logps[0::2] / tokens[0::2], logps[1::2] / tokens[1::2]
        if cfg.loss == "simpo":  # its logps per answer token, from which its rewards come, as TRL's CPOTrainer logs
            stats[4:] = [ac.sum(), ar.sum()]
        if cfg.loss == "orpo":  # its logps per answer token, as TRL's ORPOTrainer; ORPO_STATS, summed over the pairs
            odds = log_odds_ratio(ac, ar)
            stats[4:] = [ac.sum(), ar.sum(), -ac.sum(), F.logsigmoid(odds).sum(), odds.sum()]
        stats += [*(metrics if metrics is not None else logps.new_zeros(len(TOKEN_STATS))),
                  tokens[0::2].sum(), tokens[1::2].sum()]
    return losses.sum(), torch.stack(stats)


def ld_weights(sequence: torch.Tensor, tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's weight of each trained token (TRL's ld_alpha), from its sequence (non-decreasing: a sequence's
    tokens are consecutive, chosen then rejected of each pair) and each sequence's trained tokens: 1 for the first
    min(chosen, rejected) tokens of each answer of a pair, alpha after them."""
    starts = torch.cumsum(tokens, 0) - tokens
    position = torch.arange(len(sequence), dtype=torch.float32) - starts[sequence]
    shared = torch.minimum(tokens[0::2], tokens[1::2]).repeat_interleave(2)
    return torch.where(position < shared[sequence], 1.0, alpha)


def sequence_sums(token_loss: torch.Tensor, sequence: torch.Tensor, n: int) -> torch.Tensor:
    """Each of `n` sequences' summed log-probability (fp32) from its trained tokens' cross-entropies (-log p) and each
    token's sequence."""
    return -torch.zeros(n, device=token_loss.device, dtype=torch.float32).index_add(0, sequence, token_loss.float())


def wpo_weights(token_loss: torch.Tensor, log_sum_sq: torch.Tensor, sequence: torch.Tensor, tokens: torch.Tensor,
                total=None) -> torch.Tensor:
    """WPO's weight of each sequence (TRL's use_weighting), without gradient: exp of the mean over its trained tokens
    of log p(token) - log sum_v p_v^2, from their cross-entropies (-log p) and log sums of squares; `total` as
    sequence_logps' (each sequence's sum over its slices)."""
    with torch.no_grad():
        aligned = sequence_sums(token_loss.detach() + log_sum_sq, sequence, tokens.numel())  # sum of log p - lss
        if total is not None:
            aligned = total(aligned)
        return torch.exp(aligned / tokens.clamp(min=1))


def _sequences_pass(model, batch: dict, *, with_aux: bool, total, wpo: bool, metrics: bool = False):
    """One forward of a collated batch's sequences: (each one's summed answer log-probability, with
    preference.ld_alpha each token weighted by ld_weights; the batch's load-balancing loss where `with_aux`, else
    None; each sequence's wpo_weights where `wpo`, else None; TOKEN_STATS' sums where `metrics`, else None). `total`
    as sequence_logps'."""
    stat = _pass_stat(wpo=wpo, metrics=metrics)
    out = compute_loss(model, batch, per_token=True, return_aux=with_aux, stat=stat)
    token_loss, *extra = out if (stat or with_aux) else (out,)
    per_token = extra.pop(0) if stat else None
    aux = extra[0] if with_aux else None
    logps, weights, sums = _pass_sums(token_loss, per_token, batch["loss_example"], batch["sequence_tokens"],
                                      ld_weight=batch.get("loss_ld_weight"), total=total, wpo=wpo, metrics=metrics)
    return logps, aux, weights, sums


def _pass_stat(*, wpo: bool, metrics: bool) -> str | None:
    """What a pass takes beside each token's cross-entropy (-log p): loss.PAIR_STATS with `metrics` (WPO's log sum of
    squares among them), that alone for `wpo`, else nothing."""
    return "pairs" if metrics else "log_sum_sq" if wpo else None


def _pass_sums(token_loss: torch.Tensor, per_token: torch.Tensor | None, sequence: torch.Tensor, tokens: torch.Tensor,
               *, ld_weight: torch.Tensor | None, total, wpo: bool, metrics: bool):
    """From one pass's trained tokens (their cross-entropies, the statistic _pass_stat asked for, each one's sequence)
    and each sequence's trained tokens: (each sequence's summed answer log-probability, each token weighted by
    `ld_weight` where given; its wpo_weights where `wpo`, else None; TOKEN_STATS' sums where `metrics`, else None).
    The batch's pass and a pipeline's last stage both (Preference, StagePairs); `total` as sequence_logps'."""
    logps = sequence_sums(token_loss * ld_weight if ld_weight is not None else token_loss, sequence, tokens.numel())
    if total is not None:
        logps = total(logps)
    log_sum_sq = (per_token[:, 1] if metrics else per_token) if wpo else None
    weights = wpo_weights(token_loss, log_sum_sq, sequence, tokens, total) if wpo else None
    return logps, weights, (token_sums(per_token, sequence) if metrics else None)


def sequence_logps(model, batch: dict, *, with_aux: bool = False, total=None):
    """Summed answer log-probability of every sequence of a collated batch (on the device), in batch order (with
    preference.ld_alpha, each token weighted: ld_weights); with_aux: and the batch's load-balancing loss (a mixture of
    experts under model.router_aux_loss_coef, loss.attach_loss). `total`: each sequence's sum from the parts of it on
    each process (sequence parallelism: shards.sequence_sum, differentiable; None: the batch holds whole
    sequences)."""
    logps, aux, _, _ = _sequences_pass(model, batch, with_aux=with_aux, total=total, wpo=False)
    return (logps, aux) if with_aux else logps


def policy_logps(model, batch: dict, router_aux: float | None, *, aux: bool, total=None, wpo: bool = False,
                 metrics: bool = False):
    """The policy pass's sequence_logps; where model.router_aux_loss_coef weighs it in training (`aux`), that pass's
    load-balancing loss, else None (preference pairs and KTO, as TRL adds it to their mean loss); with wpo
    (preference.wpo), each sequence's wpo_weights from the same pass, else None; with `metrics`, TOKEN_STATS' sums
    of the pass (token_sums), else None."""
    return _sequences_pass(model, batch, with_aux=aux and router_aux is not None, total=total, wpo=wpo,
                           metrics=metrics)


class Preference:
    """The preference objective (objective.Objective): pairs in, a preference loss out."""

    whole_sequences = True  # its loss reads each sequence's whole log-probability (parallel/sequence/shards.py)
    sequence_sum = None  # sequence parallelism: a sequence's log-probability from its slices' parts
    slice_stats = tuple(TOKEN_STATS)  # sequence parallelism: each slice's own tokens', added up (the rest: whole)
    eval_rows = True  # its eval sums are eval_row's [loss, statistics, pairs]

    def __init__(self, cfg, *, pad_id: int, packing: bool, reference: str, model=None, router_aux: float | None = None,
                 copy=None):
        self.cfg, self.pad_id, self.packing, self.reference = cfg, pad_id, packing, reference
        self.model = model  # unwrapped: its adapter is disabled for the reference forward
        # model/reference.py's: reference copy's frozen copy, or LoRA's moving adapter; None: the adapter disabled
        self.copy = copy
        # model.router_aux_loss_coef: the policy pass's load-balancing loss joins the loss, as TRL's DPOTrainer adds it
        self.router_aux = router_aux
        self.columns = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels") + (
            ("ref_chosen", "ref_rejected") if reference == "precomputed" else ())

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        """Chosen then rejected of each pair, as consecutive sequences of one packed row (or padded rows)."""
        sequences = [{"input_ids": e[f"{side}_ids"], "labels": e[f"{side}_labels"]}
                     for e in examples for side in ("chosen", "rejected")]
        batch = with_loss_positions(collate(sequences, pad_id=self.pad_id, packing=self.packing))
        batch["sequence_tokens"] = torch.bincount(batch["loss_example"], minlength=len(sequences)).float()
        if self.cfg.ld_alpha is not None:
            batch["loss_ld_weight"] = ld_weights(batch["loss_example"], batch["sequence_tokens"], self.cfg.ld_alpha)
        if self.reference == "precomputed" and examples:
            batch["reference"] = torch.tensor([[e["ref_chosen"], e["ref_rejected"]] for e in examples],
                                              dtype=torch.float32)
        return batch, Counts.of(sequences, units=len(examples), trained=len(batch["loss_index"]))

    def _reference(self, batch: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.reference == "none":
            return None, None
        if self.reference == "precomputed":
            return batch["reference"][:, 0], batch["reference"][:, 1]
        model, context = forward_of(self.model, self.copy)
        with torch.no_grad(), context:
            ref = self.logps(model, batch)
        return ref[0::2], ref[1::2]

    def logps(self, model, batch: dict) -> torch.Tensor:
        """sequence_logps of the batch's sequences, whole (summed over a sequence group)."""
        return sequence_logps(model, batch, total=self.sequence_sum)

    def reference_free(self) -> Preference:
        """The same objective without a reference: the pass that precomputes it."""
        return Preference(self.cfg, pad_id=self.pad_id, packing=self.packing, reference="none")

    def loss(self, model, batch: dict, *, aux: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' summed loss and statistics; under model.router_aux_loss_coef (and `aux`: training), plus the
        weight times the load-balancing loss of the micro-batch's one pass times its pairs (so that the step's loss
        is the pairs' mean plus the weight times the micro-batches' pair-weighted mean of it: on one micro-batch,
        TRL's), and that times the pairs last among the statistics."""
        ref_chosen, ref_rejected = self._reference(batch)  # first: its no-grad forward leaves no graph behind
        logps, router, weights, metrics = policy_logps(model, batch, self.router_aux, aux=aux,
                                                       total=self.sequence_sum, wpo=self.cfg.wpo, metrics=True)
        loss, stats = pairs_loss(self.cfg, logps, batch["sequence_tokens"], ref_chosen, ref_rejected, weights,
                                 metrics)
        if router is None:
            return loss, stats
        pairs = logps.numel() // 2
        return loss + self.router_aux * router * pairs, torch.cat([stats, (router.detach().float() * pairs)[None]])

    @property
    def stats(self) -> list[str]:
        """The names of the loss's statistics (the load-balancing loss's, last, where it trains)."""
        return stat_names(self.cfg)

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        names = stat_names(self.cfg)
        out = pair_metrics(names, stats[: len(names)], units)
        return {**out, **({"aux_loss": stats[len(names)] / max(units, 1)} if len(stats) > len(names) else {})}

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        from llmtrain.data.batching import to_device

        pairs = batch["sequence_tokens"].numel() // 2
        loss, stats = self.loss(model, to_device(batch, device), aux=False)  # evaluation: the preference loss alone
        return eval_row(loss, stats, pairs)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, *stats, pairs = sums
        return {"eval_loss": loss / max(pairs, 1),
                **{f"eval_{k}": v for k, v in self.step_metrics(stats, pairs).items()}}


def eval_row(loss: torch.Tensor, stats: torch.Tensor, pairs: int) -> torch.Tensor:
    """A micro-batch's eval sums of pairs, float64: [loss, statistics, pairs] (Preference.eval_metrics reads them)."""
    return torch.cat([loss.detach().reshape(1), stats, loss.new_tensor([pairs])]).double()


class StagePairs:
    """Preference pairs on pipeline stages (parallel/pipeline/schedule.py): the last stage's loss. A micro-batch
    reaches the last stage as the final hidden states of one row of `slots` tokens, with the [slots, 4] float32
    targets of `targets`: at each trained position its token, its sequence's index in the row (-1 elsewhere) and its
    weight in the sequence's sum (1; LD-DPO's ld_weights), and at slot k the k-th sequence's reference
    log-probability and its trained tokens (-1 past the last sequence).
    The reference is precomputed through the stages before training (`logps`, the pass precompute_reference runs:
    the starting weights, or LoRA's adapter disabled); with preference.reference=adapter (or copy, a full
    fine-tune's) it is run through them before each step instead, forward only with the adapter disabled (or the
    copy exchanged in: `follow`), in `prepare`. From these, the sequences' log-probabilities, the pairs' loss and
    their statistics are Preference's own (the same functions)."""

    WIDTH = 5  # the target columns; an objective built on these (StageKTO) adds its own after them

    def __init__(self, cfg, *, reference: str, adapter_off=None):
        self.cfg, self.reference, self.adapter_off = cfg, reference, adapter_off

    def follow(self, reference, model) -> None:
        """The reference passes through the stages run `reference` instead of the adapter off: LoRA's moving one
        (sync_reference: model/reference.AdapterReference), each stage's part of the adapter's snapshot swapped into
        its weights (the adapter disabled until the first sync), or a full fine-tune's frozen copy
        (model/reference.StageCopy), each stage's part exchanged into its weights."""
        self.adapter_off = lambda: forward_of(model, reference)[1]

    @property
    def stats(self) -> int:
        """The loss's statistics (the load-balancing loss's, the schedule adds after them: Pipeline._loss)."""
        return len(stat_names(self.cfg))

    def units(self, target: torch.Tensor) -> int:
        """The row's pairs: what model.router_aux_loss_coef's load-balancing loss is weighed by (Preference.loss)."""
        return int((target[:, 3] >= 0).sum()) // 2

    @property
    def eval_size(self) -> int:
        return self.stats + 2  # [loss, statistics, pairs], as Preference.eval_sums

    def prepare(self, pipeline, batches: list[dict]) -> list[dict]:
        """preference.reference adapter or copy: the window's micro-batches with their sequences' reference
        log-probabilities (the model with its adapter disabled or the copy exchanged in, forward only through the
        stages; on the last stage), before the step or the eval that reads them; otherwise as they are (their
        reference precomputed)."""
        if self.reference not in ("adapter", "copy"):
            return batches
        with torch.no_grad(), self.adapter_off():
            reference = pipeline.sequence_logps(batches)
        if reference is None:  # not the last stage: nothing reads the targets here
            return batches
        return [{**b, "reference": r[: len(b.get("sequence_tokens", ()))].float().cpu()}
                for b, r in zip(batches, reference)]

    def targets(self, batch: dict, slots: int) -> torch.Tensor:
        """[1, slots, 5] float32 of a packed micro-batch (none: an idle row). Token ids are exact in float32 below
        2^24."""
        out = torch.zeros(slots, self.WIDTH)
        out[:, 0], out[:, 1], out[:, 3], out[:, 4] = IGNORE, -1.0, -1.0, 1.0
        if (tokens := batch.get("sequence_tokens")) is not None and len(tokens):
            index = batch["loss_index"]
            out[index, 0] = batch["loss_targets"].float()
            out[index, 1] = batch["loss_example"].float()
            if "loss_ld_weight" in batch:
                out[index, 4] = batch["loss_ld_weight"]
            out[: len(tokens), 3] = tokens
            if "reference" in batch:
                out[: len(tokens), 2] = batch["reference"].reshape(-1)  # chosen, rejected of each pair in turn
        return out[None]

    def _logps(self, head, hidden: torch.Tensor, target: torch.Tensor, *, wpo: bool = False, metrics: bool = False):
        """Each sequence's summed answer log-probability on the row (None where it holds no sequence); with
        `metrics` (the policy's pass), (those, each one's wpo_weights where `wpo` else None, TOKEN_STATS' sums)."""
        n = int((target[:, 3] >= 0).sum())
        if n == 0:
            return None
        at = (target[:, 1] >= 0).nonzero().flatten()
        stat = _pass_stat(wpo=wpo, metrics=metrics)
        token_loss, per_token = head(hidden[at], targets=target[at, 0].long(), per_token=True,
                                     **({"stat": stat} if stat else {}))
        out = _pass_sums(token_loss, per_token, target[at, 1].long(), target[:n, 3], ld_weight=target[at, 4],
                         total=None, wpo=wpo, metrics=metrics)
        return out if metrics else out[0]

    def _loss(self, head, hidden: torch.Tensor, target: torch.Tensor):
        out = self._logps(head, hidden, target, wpo=self.cfg.wpo, metrics=True)
        if out is None:
            return None, 0
        logps, weights, metrics = out
        n, ref = logps.numel(), target[: logps.numel(), 2]
        chosen, rejected = (ref[0::2], ref[1::2]) if self.reference != "none" else (None, None)
        return pairs_loss(self.cfg, logps, target[:n, 3], chosen, rejected, weights, metrics), n // 2

    def loss(self, head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's summed pair loss and statistics (a row of no pair: a zero loss that still reaches the head)."""
        out, _ = self._loss(head, hidden, target)
        if out is None:
            return head(hidden[:1]).float().sum() * 0.0, hidden.new_zeros(self.stats, dtype=torch.float32)
        return out

    def eval_sums(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, pairs = self._loss(head, hidden, target)
        if out is None:
            return torch.zeros(self.eval_size, dtype=torch.float64, device=hidden.device)
        return eval_row(*out, pairs)

    def logps(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[slots] float64: the row's sequences' log-probabilities in order, zeros after them (the reference pass)."""
        out = torch.zeros(target.shape[0], dtype=torch.float64, device=hidden.device)
        if (logps := self._logps(head, hidden, target)) is not None:
            out[: logps.numel()] = logps.double()
        return out


def precompute_reference(model, dataset, accelerator, objective: Preference, *, batch_size: int,
                         batch_tokens: int | None, cache, needed: list[int] | None = None,
                         on_batch=lambda done, total: None, pipeline=None, adapter_off=nullcontext,
                         stop_signal=lambda: 0) -> torch.Tensor:
    """The reference log-probabilities [pairs, 2] (chosen, rejected) of the pairs of `dataset` the run uses
    (`needed`: the examples its steps visit; None: all), with the model as it is now (the initial weights; LoRA:
    inside `adapter_off`, its adapter disabled), under no_grad. `cache` (a file) keeps every pair computed so far,
    NaN for the others: a resume, a longer run or a later run with the same model computes only what is missing.
    Each process computes its share and one collective sums them, so all hold the whole; `on_batch(done, total)`
    after each micro-batch. `pipeline` (parallel.pipeline_parallel): the stages run M micro-batches a pass, and the
    last stage alone holds their results."""
    import os

    from llmtrain.data.batching import StandIn, global_micro_batches, rank_view, to_device

    values = torch.load(cache) if cache.is_file() else torch.full((len(dataset), 2), math.nan, dtype=torch.float64)
    todo = [i for i in (range(len(dataset)) if needed is None else needed) if math.isnan(values[i, 0])]
    if not todo:
        return values
    (world, rank), device = data_ranks(accelerator), accelerator.device
    plain = objective.reference_free()  # under sequence parallelism: its slices, each sequence summed over them
    computed = torch.zeros(len(dataset), 2, dtype=torch.float64, device=device)
    lengths = dataset.select(todo)["length"] if batch_tokens else None
    batches = global_micro_batches(len(todo), seed=0, epoch=0, world_size=world, micro_batch_size=batch_size,
                                   micro_batch_tokens=batch_tokens, lengths=lengths, shuffle=False)
    mine, per_pass = list(rank_view(batches, rank)), pipeline.micro_batches if pipeline is not None else 1
    done = torch.zeros(len(dataset), dtype=torch.float64, device=device)  # 1 where this process computed the pair
    stopped = False
    was_training = model.training
    model.eval()
    # a stop request (`stop_signal()`: SIGTERM, Ctrl-C) ends the pass after a batch, keeping what it computed (it had
    # kept nothing: a preemption during a long pass lost all of it; audit 54); several processes vote after each pass
    with torch.no_grad(), adapter_off():
        for start in range(0, len(mine), per_pass):
            parts = []
            for part in mine[start : start + per_pass]:
                idx = [todo[i] for i in part]
                rows = dataset[idx]
                batch, _ = plain.collate([dict(zip(plain.columns, v)) for v in zip(*(rows[c] for c in plain.columns))])
                parts.append((part, idx, batch))
            if pipeline is None:  # a stand-in's too (FSDP gathers in it)
                logps = [plain.logps(model, to_device(parts[0][2], device))]
            else:  # none off the last stage
                logps = pipeline.sequence_logps([batch for _, _, batch in parts]) or []
            for (part, idx, _), sums in zip(parts, logps):
                if not isinstance(part, StandIn):
                    sums = sums[: 2 * len(idx)].double()  # a stage's row: zeros after its sequences
                    computed[idx] = torch.stack([sums[0::2], sums[1::2]], dim=1)
                    done[idx] = 1.0
            on_batch(start + len(parts), len(batches))
            if stopped := any_process(accelerator, bool(stop_signal())):  # they stop after the same pass
                break
    model.train(was_training)
    if accelerator.num_processes > 1:  # a TP or sequence group's processes computed the same pairs: counted once;
        # a pipeline's last stage alone holds them
        copies = 1 if pipeline is not None else accelerator.num_processes // world
        computed = accelerator.reduce(computed, reduction="sum") / copies
        done = accelerator.reduce(done, reduction="sum")
    done = done.cpu()  # one copy from the device, not one read a pair
    kept = [i for i in todo if done[i] > 0]
    values[kept] = computed.cpu()[kept]
    def write():  # written whole under a temporary name: a crash never leaves half a file
        tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}")
        torch.save(values, tmp)
        tmp.replace(cache)

    on_main(accelerator, write)  # the others wait for it (and get its error, should it fail)
    if stopped:  # on request: the pairs computed are in the cache
        signum = stop_signal() or signal.SIGTERM  # a process that got no signal stops with its peers
        rest = ("the same command computes only the rest, then trains" if len(kept) < len(todo) else
                "the same command trains without computing them again")
        raise Stopped(f"{signal.Signals(signum).name} during the reference log-probabilities: the {len(kept)} pairs "
                      f"computed of the {len(todo)} left are kept in {cache}; {rest}", signum)
    return values
