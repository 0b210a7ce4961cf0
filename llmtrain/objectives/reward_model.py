"""Reward models (the reward_model: section): TRL 1.16's RewardTrainer loss on preference pairs, padding-free on the
same loop, step and metering as supervised fine-tuning.

The model is the decoder under a one-output sequence-classification head (modeling.load_model(reward_head=True)).
A micro-batch holds whole pairs: each pair's chosen and rejected sequences (prompt + answer, as data/pairs.py
encodes them) are consecutive sequences of one packed row (or padded rows), and each sequence's score is the head
applied to the hidden state of its last non-pad token only (model/score.py): the scores of the other tokens are
never computed.

The loss of a pair, TRL's compute_loss: -log sigmoid(r_chosen - r_rejected - margin) (margin: the data's optional
`margin` column, else 0), plus center_rewards_coefficient (r_chosen + r_rejected)^2 where it is set. TRL takes the
mean over the micro-batch's pairs; here the step divides the sum by the pairs of the window (Counts.units = pairs),
the same on one micro-batch and the same over any split of a window into micro-batches and processes.

Metrics, under TRL's names: accuracy (the fraction of pairs with r_chosen > r_rejected), margin (the mean of
r_chosen - r_rejected) and mean_reward (of every scored sequence); and rewards/chosen, rewards/rejected, their means.
TRL's min_reward and max_reward are not logged: the step's statistics are sums over the window and processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.data.batching import Counts, collate, to_device
from llmtrain.data.formats import IGNORE
from llmtrain.model.score import scored_position, sequence_scores
from llmtrain.objectives.preference import Preference, eval_row

# Statistics summed over the window (and processes); step_metrics divides them by the pairs.
STATS = ["accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected"]


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None, *,
                center_rewards_coefficient: float | None) -> torch.Tensor:
    """Per-pair losses from the scores of the chosen and rejected sequences: the Bradley-Terry loss, less the pair's
    margin where given, plus the centring term where its coefficient is set (TRL's RewardTrainer.compute_loss, its
    means taken over the pairs by the step)."""
    diff = chosen - rejected
    losses = -F.logsigmoid(diff - margin if margin is not None else diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def pairs_loss(scores: torch.Tensor, margin: torch.Tensor | None, *,
               center_rewards_coefficient: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of the pairs whose scores are `scores` (chosen, rejected, chosen, ...) and their statistics
    (STATS, summed)."""
    chosen, rejected = scores[0::2], scores[1::2]
    losses = pair_losses(chosen, rejected, margin, center_rewards_coefficient=center_rewards_coefficient)
    with torch.no_grad():
        stats = torch.stack([(chosen > rejected).float().sum(), (chosen - rejected).sum(),
                             (chosen + rejected).sum() / 2, chosen.sum(), rejected.sum()])
    return losses.sum(), stats


class StageScores:
    """A reward model on pipeline stages (parallel/pipeline/schedule.py): the last stage's score head and loss. A
    micro-batch reaches the last stage as the final hidden states of one row of `slots` tokens, with the [slots, 2]
    targets of `targets` (each sequence's index at the token its score is read at, -1 elsewhere; a pair's margin
    beside its chosen sequence's index), from which the scores, the pairs' loss and their statistics are RewardModel's
    own (the same functions)."""

    stats = len(STATS)  # the loss's statistics
    eval_size = len(STATS) + 2  # [loss, statistics, pairs], as RewardModel.eval_sums

    def __init__(self, cfg):
        self.cfg = cfg

    def targets(self, batch: dict, slots: int) -> torch.Tensor:
        """[1, slots, 2] float32: a packed micro-batch's scored positions and margins (none: an idle row)."""
        out = torch.zeros(slots, 2)
        out[:, 0] = -1.0
        if (index := batch.get("score_index")) is not None and len(index):
            out[index, 0] = torch.arange(len(index), dtype=torch.float32)
            if "margin" in batch:  # else 0: the same loss as none (x - 0 is x)
                out[index[0::2], 1] = batch["margin"].float()
        return out[None]

    def _scores(self, head, hidden: torch.Tensor, target: torch.Tensor):
        """(each sequence's score in order, its pairs' margins) of one row; None where it holds no pair."""
        at = (target[:, 0] >= 0).nonzero().flatten()
        if at.numel() == 0:
            return None, None
        order = target[at, 0].long().argsort()
        at = at[order]
        scores = head(hidden[at]).float().squeeze(-1)
        return scores, target[at[0::2], 1]

    def loss(self, head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's summed pair loss and statistics (a row of no pair: a zero loss that still reaches the head)."""
        scores, margin = self._scores(head, hidden, target)
        if scores is None:
            return head(hidden[:1]).float().sum() * 0.0, hidden.new_zeros(self.stats, dtype=torch.float32)
        return pairs_loss(scores, margin, center_rewards_coefficient=self.cfg.center_rewards_coefficient)

    def eval_sums(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        scores, margin = self._scores(head, hidden, target)
        if scores is None:
            return torch.zeros(self.eval_size, dtype=torch.float64, device=hidden.device)
        loss, stats = pairs_loss(scores, margin, center_rewards_coefficient=self.cfg.center_rewards_coefficient)
        return eval_row(loss, stats, len(scores) // 2)


class RewardModel:
    """The reward-model objective (objective.Objective): pairs in, scores and the Bradley-Terry loss out."""

    whole_sequences = True  # its loss reads each sequence's score (parallel/sequence/shards.py)
    sequence_sum = None  # sequence parallelism: a score from the slice that holds the sequence's last token

    def __init__(self, cfg, *, pad_id: int, score_pad_id: int | None, packing: bool, margin: bool):
        """pad_id: what padded rows are filled with; score_pad_id: the model's config.pad_token_id, whose
        positions a score is never read at (transformers' rule); margin: the data has TRL's margin column."""
        self.cfg, self.pad_id, self.score_pad_id, self.packing = cfg, pad_id, score_pad_id, packing
        self.columns = ("chosen_ids", "rejected_ids") + (("margin",) if margin else ())

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        """Chosen then rejected of each pair, as consecutive sequences of one packed row (or padded rows), and the
        flat position of each sequence's scored token."""
        sequences = [list(e[f"{side}_ids"]) for e in examples for side in ("chosen", "rejected")]
        batch = collate([{"input_ids": s, "labels": [IGNORE] * len(s)} for s in sequences], pad_id=self.pad_id,
                        packing=self.packing)
        del batch["targets"]  # nothing is predicted: a reward model reads one hidden state per sequence
        width = batch["input_ids"].shape[1]
        starts, at = [], 0
        for s in sequences:  # packed: each sequence starts where the previous ended; padded: at its own row
            starts.append(at)
            at += len(s) if self.packing else width
        batch["score_index"] = torch.tensor([start + scored_position(s, self.score_pad_id)
                                             for start, s in zip(starts, sequences)], dtype=torch.long)
        if "margin" in self.columns and examples:
            batch["margin"] = torch.tensor([float(e["margin"]) for e in examples], dtype=torch.float32)
        return batch, Counts.of(sequences, units=len(examples), trained=len(sequences))

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sequence_scores(model, batch)
        if self.sequence_sum is not None:
            scores = self.sequence_sum(scores)
        return pairs_loss(scores, batch.get("margin"), center_rewards_coefficient=self.cfg.center_rewards_coefficient)

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        return {name: value / max(units, 1) for name, value in zip(STATS, stats)}

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        pairs = batch.get("sequences", batch["score_index"].numel()) // 2
        loss, stats = self.loss(model, to_device(batch, device))
        return eval_row(loss, stats, pairs)

    # [loss, statistics, pairs] summed over the eval set: the mean loss and each metric as DPO's eval lines have them
    eval_metrics = Preference.eval_metrics
