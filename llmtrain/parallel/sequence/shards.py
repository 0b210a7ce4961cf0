"""Sequence parallelism's side of the objective: each process of a sequence group collates its slice of the group's
packed row (`shard_batch`); the eval's per-example sums, each sequence's log-probability or score (the losses of whole
sequences: preference pairs, KTO, reward models, RLOO) and a mixture of experts' load-balancing sums are added over the
group. Online RL and distillation sample a share of each micro-batch on each process (`shared_sampling`), score on the
group's first (`on_first_of_group`), and split the rows after."""

from __future__ import annotations

from functools import partial

import torch

from llmtrain.data.batching import Counts, batch_weight
from llmtrain.errors import LLMTrainError
from llmtrain.parallel.sequence.group import SequenceGroup


def shard_batch(batch: dict, counts: Counts, *, size: int, rank: int, pad_id: int,
                whole_sequences: bool = False) -> tuple[dict, Counts]:
    """This process's slice of a collated packed row: its tokens and positions, the whole row's example boundaries
    (the attention sees the whole row), and the trained positions (or a reward model's scored ones) that fall in the
    slice, renumbered from it. A second packed row under "kl:" names (KTO's KL sequences) is split the same way.

    The row is padded to a multiple of `size` with pad tokens that form an example of their own (nothing trains on
    them, and no real token attends to them). Counts: the slice's trained and real tokens; the attention FLOPs of the
    whole row divided by `size` (each process attends for 1/size of the heads); the loss units: the slice's trained
    tokens, or, for an objective of `whole_sequences` (pairs, examples: its loss is a function of each sequence's
    sum over the group), the micro-batch's units on the group's first process and none on the others."""
    out, held = _shard_row(batch, size=size, rank=rank, pad_id=pad_id)
    if kl := {k[3:]: v for k, v in batch.items() if k.startswith("kl:")}:  # KTO's KL row: split alike, its tokens
        # not counted (forwarded without a gradient, as one process's KTO counts them: audit 40)
        kl, _ = _shard_row(kl, size=size, rank=rank, pad_id=pad_id)
        out.update({f"kl:{k}": v for k, v in kl.items()})
    trained = float(len(out["loss_index"] if "loss_index" in out else out["score_index"]))
    units = (counts.units if rank == 0 else 0.0) if whole_sequences else trained
    return out, Counts(units=units, trained=trained, tokens=held * (counts.tokens > 0), squares=counts.squares / size)


def _shard_row(batch: dict, *, size: int, rank: int, pad_id: int) -> tuple[dict, float]:
    """One packed row's slice (shard_batch) and the real tokens it holds."""
    if "cu_seq_lens" not in batch:
        raise LLMTrainError("sequence parallelism needs packed rows (the varlen attention's example boundaries)")
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens"]
    total = ids.shape[1]
    pad = -total % size
    max_length = batch["max_length"]
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        max_length = max(max_length, pad)
    width = (total + pad) // size
    lo, hi = rank * width, (rank + 1) * width
    held = max(0, min(hi, total) - lo)  # the slice's real tokens: the first `held` (the pad example comes last)
    out = {**batch, "input_ids": ids[:, lo:hi], "position_ids": pos[:, lo:hi], "cu_seq_lens": cu,
           "max_length": max_length, "examples": len(batch["cu_seq_lens"]) - 1, "real_tokens": held,
           "row_tokens": total}  # the group row's tokens before the padding (NEFTune draws for those alone)
    if "loss_index" in batch:  # and every "loss_" tensor of one value per trained position (GRPO's advantages)
        index = batch["loss_index"]
        keep = (index >= lo) & (index < hi)
        out.update({k: v[keep] for k, v in batch.items() if k.startswith("loss_") and isinstance(v, torch.Tensor)},
                   loss_index=index[keep] - lo)
    if "score_index" in batch:  # a reward model: each sequence's scored token, on the process whose slice holds it
        index = batch["score_index"]
        keep = (index >= lo) & (index < hi)
        out.update(score_index=index[keep] - lo, score_sequence=keep.nonzero().flatten(), sequences=len(index))
    return out, float(held)


class SequenceShards:
    """An objective whose batches are this process's slices (`shard_batch`); everything else is the wrapped
    objective's. Its eval's per-example sums (teacher-forced matches) are summed over the sequence group first.

    An objective of whole sequences (`whole_sequences`: preference pairs, KTO, a reward model) sums each sequence's
    log-probability or score over the group (`sequence_sum`, set on it here) and computes its loss from the sums on
    every process of the group. Each process backpropagates that same loss through its own slice, so the group's
    gradient is the loss's once; its value, statistics and units count on the group's first process only, but for
    the statistics of each slice's own tokens (`slice_stats`, of the objective's `stats`: RLOO's entropy), which
    add up over the group."""

    def __init__(self, objective, *, pad_id: int, group: SequenceGroup):
        self.objective, self.pad_id, self.group = objective, pad_id, group
        self.whole = getattr(objective, "whole_sequences", False)
        objective.example_sum = partial(example_sum, group=group)
        objective.sequence_sum = partial(sequence_sum, group=group.group)
        objective.shared_sum = partial(shared_sum, group=group.group)  # GSPO's ratio, read by each slice's tokens
        # online RL and distillation: a group is one data rank for its rollout (see rollout)
        self.samples = hasattr(objective, "rollout")
        if self.samples:
            self.rollout = self._rollout  # only then: the step looks for a rollout
            objective.share_sampling = partial(shared_sampling, group=group)
        if hasattr(objective, "on_first_of_group"):  # online RL's scoring (and sampling with tools)
            # the models the first process runs there: the policy and a full fine-tune's frozen copy (RLOO's KL,
            # GRPO's once-a-round reference)
            copy = getattr(getattr(objective, "reference", None), "module", None)
            objective.on_first_of_group = partial(on_first_of_group, group=group,
                                                  models=[objective.lm] + ([copy] if copy is not None else []))
        if everyone := getattr(objective, "gather", None):  # what RL gathers over every process, from its first
            objective.gather = lambda items: everyone(list(items) if group.rank == 0 else [])

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def collate(self, examples: list[dict]):
        batch, counts = self.objective.collate(examples)
        if self.samples:  # the rollout makes (or keeps) the rows, and splits them
            return batch, counts
        return shard_batch(batch, counts, size=self.group.size, rank=self.group.rank, pad_id=self.pad_id,
                           whole_sequences=self.whole)

    def _rollout(self, window, *, step: int):
        """Online RL and distillation: each process of the group samples its share of the completions of the
        micro-batches the group shares, and all get them all (`shared_sampling`); the first process scores them (and,
        with tools, samples them all: an environment's state stays where its calls ran) as one process of its data
        rank would, its records, rollout statistics, reward logs and gathers counted there only. Every process then
        keeps its slice of each packed row (distillation's off-policy rows too). The loss units (completions or
        completion tokens, whole) count on the first process; the trained and real tokens are each slice's."""
        import dataclasses

        window = self.objective.rollout(window, step=step)
        first, size, rank = self.group.rank == 0, self.group.size, self.group.rank
        batches, trained, held = [], 0.0, 0.0
        for batch in window.batches:
            batch, tokens = _shard_row(batch, size=size, rank=rank, pad_id=self.pad_id)
            if not first and "rollout_stats" in batch:
                batch["rollout_stats"] = torch.zeros_like(batch["rollout_stats"])
            batches.append(batch)
            trained += len(batch["loss_index"]) * batch_weight(batch)  # a stand-in pass (weight 0) counts nothing
            held += tokens * batch_weight(batch)
        c = window.counts
        counts = Counts(units=c.units if first else 0.0, trained=trained, tokens=held * (c.tokens > 0),
                        squares=c.squares / size)
        return dataclasses.replace(window, batches=batches, counts=counts, rollouts=window.rollouts if first else [])

    def loss(self, model, batch: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats = self.objective.loss(model, batch, **kwargs)
        if not self.whole or self.group.rank == 0:
            return loss, stats
        return loss - loss.detach(), stats * self._slice_stats(stats)  # the same gradient, counted on the first

    def _slice_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """1 for the statistics each slice counts for its own tokens (the objective's `slice_stats`), 0 elsewhere."""
        own = getattr(self.objective, "slice_stats", ())  # named in the objective's `stats` (online RL's names)
        keep = [float(n in own) for n in self.objective.stats] if own else []
        keep += [0.0] * (len(stats) - len(keep))  # any after the names (preference pairs' load-balancing loss)
        return torch.tensor(keep, dtype=stats.dtype, device=stats.device)

    def eval_sums(self, model, batch: dict, device) -> torch.Tensor:
        if self.samples and "cu_seq_lens" in batch:  # distillation's teacher-forced rows: sums over the slices
            batch, _ = shard_batch(batch, Counts.none(), size=self.group.size, rank=self.group.rank, pad_id=self.pad_id)
            return self.objective.eval_sums(model, batch, device)
        sums = self.objective.eval_sums(model, batch, device)  # online RL's: sampled and scored on the first process
        if not (self.whole or self.samples) or self.group.rank == 0:
            return sums
        if getattr(self.objective, "eval_rows", False):  # [loss, statistics, pairs]: each slice's own statistics
            return sums * torch.cat([sums.new_zeros(1), self._slice_stats(sums[1:-1]), sums.new_zeros(1)])
        return sums * 0

    def reference_free(self) -> SequenceShards:
        """The wrapped preference objective without its reference (its precomputing pass), split the same way."""
        return SequenceShards(self.objective.reference_free(), pad_id=self.pad_id, group=self.group)


class _GroupSum(torch.autograd.Function):
    """A sum over a process group whose backward passes the gradient through unchanged: every process computes the
    same loss from the sum and backpropagates it through its own part, so the parts' gradients add up to the sum's
    once (an all-reduce in the backward would count it once per process)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SharedSum(_GroupSum):
    """A sum over a process group that each process's loss reads for its own tokens (GSPO's ratio of a completion,
    applied to each process's slice of it): the losses differ, so the backward sums their gradients over the group and
    each part gets the whole loss's gradient."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def shared_sum(parts: torch.Tensor, *, group) -> torch.Tensor:
    """Each sequence's sum from every process's part of it, read by every process's own loss (`_SharedSum`)."""
    return _SharedSum.apply(parts, group)


def sequence_sum(parts: torch.Tensor, *, group) -> torch.Tensor:
    """Each sequence's sum (a log-probability, a score) from every process's part of it (its slice's tokens), on
    every process of the sequence group; differentiable (`_GroupSum`)."""
    return _GroupSum.apply(parts, group)


def shared_sampling(draw, prompts: list[list[int]], seeds: list[int], *,
                    group: SequenceGroup) -> list[list[int]]:
    """Every completion of a micro-batch the group shares, on every process of the group: each process draws every
    N-th (`draw(its prompts, their seeds)`), and one all-gather of token ids puts them back in order. Each completion
    depends on its seed alone (model/generate.completion_seed), so the share a process draws does not change it; the
    KV cache of a process holds 1/N of the rows."""
    import torch.distributed as dist

    n, mine = group.size, range(group.rank, len(prompts), group.size)
    drawn = draw([prompts[i] for i in mine], [seeds[i] for i in mine])
    everyone = [None] * n
    dist.all_gather_object(everyone, drawn, group=group.group)
    out = [None] * len(prompts)
    for r, part in enumerate(everyone):
        for i, completion in zip(range(r, len(prompts), n), part):
            out[i] = completion
    return out


def on_first_of_group(compute, *, group: SequenceGroup, models: list):
    """`compute()` run on the group's first process, its result (or its error) given to the others
    (collectives.on_first): online RL's scoring of a micro-batch the group shares (reward functions run once), and its
    sampling with tools (an environment's state stays on one process). The first process attends there with
    llmtrain's varlen attention on whole rows (the log-probabilities taken before the update: the policy's and a full
    fine-tune's frozen copy's, the `models`), not the group's all-to-all, which the others do not join."""
    from contextlib import ExitStack

    from llmtrain.model.attention import NAME
    from llmtrain.model.generate import attention_as
    from llmtrain.model.loss import causal_lm
    from llmtrain.parallel.collectives import on_first

    def whole_rows():
        with ExitStack() as stack:
            for model in models:
                stack.enter_context(attention_as(causal_lm(model).config, NAME))
            return compute()

    return on_first(whole_rows, group=group.group)


def balance_sums(counts: torch.Tensor, probs: torch.Tensor, rows: int, *, group, whole: bool):
    """The load-balancing loss's sums (each expert's routed tokens and routing probability, and the rows: model/
    loss.router_aux_loss) from every slice of the group, on every process. `whole`: the loss is computed alike on
    every process and each backpropagates it through its own slice (a loss of whole sequences: `_GroupSum`); else
    each process's loss holds its own part of the group's (supervised fine-tuning: its slice's tokens times the
    balance), so the group's loss is their sum and the probabilities' backward is an all-reduce too."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    counted = torch.cat([counts, counts.new_tensor([rows])])
    dist.all_reduce(counted, group=group)  # routed tokens and rows: no gradient
    probs = _GroupSum.apply(probs, group) if whole else all_reduce(probs, group=group)
    return counted[:-1], probs, counted[-1]


def example_sum(*per_example: torch.Tensor, group: SequenceGroup) -> tuple[torch.Tensor, ...]:
    """Per-example sums over the sequence group, on its first process only (zeros on the others), so that a sum over
    every process counts each example once."""
    import torch.distributed as dist

    both = torch.stack(per_example)
    dist.all_reduce(both, group=group.group)
    return tuple(both * (group.rank == 0))
