"""On-policy distillation (Agarwal et al. 2024, GKD), as TRL 1.16's DistillationTrainer computes it: the student
learns the teacher's next-token distribution on completions it samples itself.

A step's completions: with probability distill.lmbda (a coin per step, drawn from the run's seed and the step, so
every process and a resumed run draw the same) the student samples each prompt's completion (the fast sampler, as
online RL samples: each completion from its own seed, so 2 processes sample what 1 does); otherwise the step trains
on the data's completions (GKD's off-policy batches; TRL's DistillationTrainer is lmbda 1). The prompt is what comes
before a row's first trained token.

The loss, TRL's generalised JSD per completion token, between the student's distribution p_s and the teacher's p_t
(both softmax(logits / temperature)):
- beta 0: the forward KL(p_t || p_s) = sum_v p_t (log p_t - log p_s);
- beta 1: the reverse KL(p_s || p_t) (TRL's default);
- otherwise, with the mixture m = (1 - beta) p_s + beta p_t: beta KL(p_t || m) + (1 - beta) KL(p_s || m).
TRL sums it over the completion tokens of the whole generation batch (every process, every accumulation step) and
divides by their number: here the loss is the SUM over completion tokens and the step divides by the window's
(Counts.units = completion tokens), objective.py's contract.

Memory: the teacher runs its decoder once over the packed row under no_grad and keeps the hidden states of the
trained positions only ([tokens, teacher hidden]). Both LM heads then run chunk by chunk inside the student's head
(loss.chunked_token_loss): a chunk's student and teacher logits exist together, never a micro-batch's, and the chunk
is recomputed in backward.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from llmtrain.config import sampling_of
from llmtrain.data.batching import Counts, batch_weight, collate, with_loss_positions
from llmtrain.data.formats import prompt_length
from llmtrain.model.generate import Stops
from llmtrain.model.loss import causal_lm, compute_loss, decoder_inputs, decoder_name, logit_transform
from llmtrain.objectives.rollouts import all_here, completion_rows, sample, sampling

# Statistics summed over the window and processes; step_metrics names them as TRL does where TRL has the number.
# (length, clipped: of the student's own completions only)
ROLLOUT_STATS = ["completions", "length", "clipped", "on_policy", "generation_s"]
LOSS_STATS = ["entropy", "hits", "agree"]


def divergence(student: torch.Tensor, teacher: torch.Tensor, *, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (rows of logits already divided by the temperature, fp32): TRL's generalised JSD of the student's
    distribution to the teacher's, and the student's entropy (detached)."""
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    if beta == 0.0:
        value = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        value = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        value = (beta * (log_t.exp() * (log_t - log_m)).sum(-1)
                 + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1))
    with torch.no_grad():
        entropy = -(log_s.exp() * log_s).sum(-1)
    return value, entropy


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """The step's coin: whether the student samples this step's completions. A pure function of the run's seed and
    the step, so every process and a resumed run agree without any state or collective."""
    if lmbda >= 1.0:
        return True
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return float(torch.rand(1, generator=g, dtype=torch.float64)) < lmbda


def split_prompt(example: dict) -> list[int]:
    """A row's prompt: its tokens before the first trained one."""
    return list(example["input_ids"][:prompt_length(example["labels"])])


class Distill:
    """On-policy distillation (objective.Objective, plus `rollout`): a micro-batch is train.micro_batch_size rows;
    the rollout swaps their completions for the student's on on-policy steps; `loss` is the summed divergence to
    the teacher over the completion tokens; eval is the divergence on the data's completions (teacher-forced)."""

    columns = ("input_ids", "labels", "row")

    def __init__(self, cfg, *, teacher, model, pad_id: int, packing: bool, seed: int, stop_ids,
                 world: int, stages=None):
        self.cfg, self.pad_id, self.packing, self.seed = cfg, pad_id, packing, seed
        # frozen, eval mode (model/teacher.py); on pipeline stages the last stage's alone (None on the others)
        self.teacher = causal_lm(teacher) if teacher is not None else None
        # what its own forward does to its head's logits
        self.teacher_logits = logit_transform(self.teacher) if teacher is not None else None
        self.lm = model  # the unwrapped student: it samples
        self.stop_ids, self.world = Stops.of(stop_ids), world
        self.stats = [*ROLLOUT_STATS, *LOSS_STATS]
        self.share_sampling = all_here  # where a micro-batch's completions are drawn (rollouts.all_here)
        # pipeline stages (parallel/pipeline/schedule.Pipeline): the student samples through them (every process of
        # a pipeline the same completions) and the last stage, which holds the teacher, takes the loss (StageDistill)
        self.stages = stages

    def _batch(self, sequences: list[dict], prompts: list[tuple[list[int], int]]) -> tuple[dict, Counts]:
        batch = with_loss_positions(collate(sequences, pad_id=self.pad_id, packing=self.packing))
        trained = len(batch["loss_index"])
        batch["prompts"] = prompts  # (prompt ids, row) of each sequence: what the rollout samples from
        return batch, Counts.of(sequences, units=trained, trained=trained)

    def collate(self, examples: list[dict]) -> tuple[dict, Counts]:
        """The rows as they are (the off-policy batch, and eval's), packed; their prompts kept for the rollout."""
        sequences = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        return self._batch(sequences, [(split_prompt(e), e["row"]) for e in examples])

    # ---- the rollout: the coin, then the student's completions

    def rollout(self, window, *, step: int):
        """The window with each micro-batch's completions sampled by the student (on-policy steps) or kept (the
        others), its counts recounted, and each micro-batch's completion statistics added."""
        if not on_policy(self.seed, step, self.cfg.lmbda):
            for b in window.batches:
                b["rollout_stats"] = torch.tensor([len(b["prompts"]), 0, 0, 0, 0], dtype=torch.float32)
            return window
        batches, counts = [], Counts.none()
        with sampling(self.lm) if self.stages is None else self.stages.sampling() as drawing:
            for b in window.batches:
                batch, n = self._sample(b["prompts"], step, drawing=drawing)
                if not batch_weight(b):  # an idle rank's stand-in: sampled and trained as a real one, counting nothing
                    batch, n = {**batch, "batch_weight": 0.0}, Counts.none()
                batches.append(batch)
                counts = counts.plus(n)
        return dataclasses.replace(window, batches=batches, counts=counts)

    def _sample(self, prompts: list[tuple[list[int], int]], step: int, *, drawing=None) -> tuple[dict, Counts]:
        """The prompts' completions, sampled by the student (`drawing`: pipeline stages as one causal LM, which
        distill.sampler reference's loop decodes through), packed as a micro-batch."""
        from llmtrain.model.generate import completion_seed

        cfg = self.cfg
        lm = drawing if drawing is not None else self.lm
        begun = time.perf_counter()
        completions = self.share_sampling(
            lambda ids, seeds: sample(lm, cfg.sampler, ids, seeds, max_new_tokens=cfg.max_completion_tokens,
                                      stop_ids=self.stop_ids, pad_id=self.pad_id, copy=cfg.merged_copy,
                                      **sampling_of(cfg)),
            [p for p, _ in prompts], [completion_seed(self.seed, step, row, 0) for _, row in prompts])
        spent = time.perf_counter() - begun
        sequences = completion_rows([p for p, _ in prompts], completions)
        out, counts = self._batch(sequences, prompts)
        clipped = sum(not self.stop_ids.ends(c) for c in completions)  # ended by max_completion_tokens
        out["rollout_stats"] = torch.tensor([len(completions), counts.trained, clipped, len(completions),
                                             spent / self.world], dtype=torch.float32)
        return out, counts

    # ---- the update

    def _teacher_hidden(self, batch: dict) -> torch.Tensor:
        """The teacher's final hidden states at the trained positions, under no_grad: [tokens, teacher hidden]."""
        with torch.no_grad():
            decoder = getattr(self.teacher, decoder_name(self.teacher))
            hidden = decoder(**decoder_inputs(batch), use_cache=False).last_hidden_state
            return hidden.flatten(0, 1)[batch["loss_index"]]

    def _token_loss(self, teacher_hidden: torch.Tensor):
        """The divergence of one chunk of the student's logits (loss.chunked_token_loss) to the teacher's logits on
        the same tokens, made here from the teacher's hidden states; and [entropy, student argmax = the token,
        student argmax = teacher argmax] summed."""
        head, t, own = self.teacher.lm_head, self.cfg.temperature, self.teacher_logits

        def token_loss(logits: torch.Tensor, targets: torch.Tensor, start: int):
            with torch.no_grad():
                teacher = own(F.linear(teacher_hidden[start : start + len(logits)], head.weight, head.bias)).float() / t
            student = logits.float() / t  # the student's own transform is in its logits already
            value, entropy = divergence(student, teacher, beta=self.cfg.beta)
            with torch.no_grad():
                picked = student.argmax(-1)
                stats = torch.stack([entropy.sum(), (picked == targets).sum().float(),
                                     (picked == teacher.argmax(-1)).sum().float()])
            return value.sum(), stats

        return token_loss

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = batch.get("rollout_stats")
        rollout = rollout if rollout is not None else batch["input_ids"].new_zeros(len(ROLLOUT_STATS),
                                                                                   dtype=torch.float32)
        hidden = self._teacher_hidden(batch)
        loss, stats = compute_loss(model, batch, token_loss=self._token_loss(hidden))
        return loss, torch.cat([rollout.to(stats.device), stats])

    def step_metrics(self, stats: list[float], units: float) -> dict[str, float]:
        s = dict(zip(self.stats, stats))
        tokens = max(units, 1.0)
        out = {"entropy": s["entropy"] / tokens, "token_accuracy": s["hits"] / tokens,
               "teacher_agreement": s["agree"] / tokens, "on_policy": s["on_policy"] / max(s["completions"], 1.0)}
        if s["on_policy"]:  # TRL's completion metrics: of the student's own completions
            out.update({"completions/mean_length": s["length"] / s["on_policy"],
                        "completions/clipped_ratio": s["clipped"] / s["on_policy"], "generation_s": s["generation_s"]})
        return out

    # ---- evaluation: the data's completions, teacher-forced

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        """[summed divergence, tokens, entropy, student argmax = the token, student argmax = teacher argmax]."""
        from llmtrain.data.batching import to_device

        batch = to_device(batch, device)
        hidden = self._teacher_hidden(batch)
        loss, stats = compute_loss(model, batch, token_loss=self._token_loss(hidden))
        tokens = batch["loss_index"].new_tensor(batch["loss_index"].numel())
        return torch.cat([torch.stack([loss.double(), tokens.double()]), stats.double()]).cpu()

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        value, tokens, entropy, hits, agree = sums
        n = max(tokens, 1.0)
        return {"eval_loss": value / n, "eval_entropy": entropy / n, "eval_token_accuracy": hits / n,
                "eval_teacher_agreement": agree / n}


class StageDistill:
    """Distillation on pipeline stages (parallel/pipeline/schedule.py): the last stage's loss. The last stage's
    processes alone hold the teacher (whole); before a window's passes (and an eval's) they run its decoder over each
    micro-batch's packed row (`prepare`, no grad: Distill._teacher_hidden, its hidden states at the trained
    positions) and keep them for the window; a micro-batch reaches the last stage as the student's final hidden
    states with the [slots, 3] float32 targets of `targets`: at each trained position its token, at slot 0 the
    micro-batch's place among the window's kept teacher states, at slot k the k-th rollout statistic. The loss and its
    statistics are then Distill's own (its chunked divergence inside the student's head: Distill._token_loss)."""

    WIDTH = 3
    stats = len(ROLLOUT_STATS) + len(LOSS_STATS)
    eval_size = 2 + len(LOSS_STATS)  # [loss, tokens, statistics], as Distill.eval_sums

    def __init__(self):
        self.objective: Distill | None = None  # the run's (objective.objective_for gives it)
        self.held: list[torch.Tensor] = []

    def prepare(self, pipeline, batches: list[dict]) -> list[dict]:
        """The teacher's hidden states of each micro-batch's trained positions, kept on the last stage; the batches
        numbered so that their targets find them."""
        if pipeline.last is None:
            return batches
        from llmtrain.data.batching import to_device

        self.held = []  # the last window's, freed before this one's forwards
        self.held = [self.objective._teacher_hidden(to_device(b, pipeline.device)) for b in batches]
        return [{**b, "teacher_index": k} for k, b in enumerate(batches)]

    def targets(self, batch: dict, slots: int) -> torch.Tensor:
        from llmtrain.data.formats import IGNORE

        out = torch.zeros(slots, self.WIDTH)
        out[:, 0] = IGNORE
        if len(at := batch["loss_index"].reshape(-1)):
            out[at, 0] = batch["loss_targets"].float()
        out[0, 1] = batch.get("teacher_index", -1)
        if (stats := batch.get("rollout_stats")) is not None:
            out[: len(stats), 2] = stats
        return out[None]

    def _loss(self, head, hidden: torch.Tensor, target: torch.Tensor):
        at = (target[:, 0] >= 0).nonzero().flatten()
        if at.numel() == 0:
            return None
        teacher = self.held[int(target[0, 1])]
        return head(hidden[at], targets=target[at, 0].long(), token_loss=self.objective._token_loss(teacher))

    def loss(self, head, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's summed divergence and its statistics (the rollout's, then LOSS_STATS), as Distill.loss returns
        them; a row that trains nothing: a zero loss that still reaches the head."""
        if (out := self._loss(head, hidden, target)) is None:
            return head(hidden[:1]).float().sum() * 0.0, hidden.new_zeros(self.stats, dtype=torch.float32)
        loss, stats = out
        return loss, torch.cat([target[: len(ROLLOUT_STATS), 2].to(stats.dtype), stats])

    def eval_sums(self, head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if (out := self._loss(head, hidden, target)) is None:
            return torch.zeros(self.eval_size, dtype=torch.float64, device=hidden.device)
        loss, stats = out
        tokens = float((target[:, 0] >= 0).sum())
        return torch.cat([torch.stack([loss.double(), loss.new_tensor(tokens, dtype=torch.float64)]),
                          stats.double()])
