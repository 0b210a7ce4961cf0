"""Data order and collation: which examples each process sees, and how they become tensors.

The order is a pure function of (seed, epoch) (and, with token budgets, of the example lengths), so
resuming needs only the epoch and the position in it.

A *global* micro-batch is what all processes run together in one forward pass:
- by examples: `micro_batch_size * world_size` consecutive examples of the epoch's permutation; rank r
  takes its r-th slice. Two processes with micro-batch 2 see exactly the examples one process with
  micro-batch 4 sees, which is what makes the runs comparable.
- by tokens (`train.micro_batch_tokens`): `world_size` consecutive bins of the epoch's bin list; rank r
  takes bin r. The bins do not depend on the number of processes, so 2 processes x 2 accumulation steps
  train on the same bins per step as 1 process x 4.
"""

from __future__ import annotations

import bisect
import functools
import math
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llmtrain.config import VARLEN_SETTINGS
from llmtrain.data.formats import IGNORE
from llmtrain.errors import LLMTrainError


class Counts(NamedTuple):
    """What one micro-batch (or window) holds, counted on the CPU when it is collated: no GPU read is needed."""

    units: float  # what the loss is averaged over (the step's denominator)
    trained: float  # tokens that reach the LM head with a target (FLOPs of the head, trained_tokens_seen)
    tokens: float  # real input tokens, padding not counted (tokens/s, tokens_seen)
    squares: float  # sum of squared example lengths (attention FLOPs)

    def plus(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(self, other)))

    @classmethod
    def of(cls, sequences, *, units: float, trained: float) -> Counts:
        """The counts of a micro-batch of `sequences` (rows with input_ids, or id lists): its real tokens and their
        squares from the sequences' lengths, `units` and `trained` as the objective counts them."""
        lengths = [len(s["input_ids"]) if isinstance(s, dict) else len(s) for s in sequences]
        return cls(units=float(units), trained=float(trained), tokens=float(sum(lengths)),
                   squares=float(sum(n * n for n in lengths)))

    @classmethod
    def none(cls) -> Counts:
        """Nothing: an idle rank's stand-in, or the start of a sum."""
        return cls(0.0, 0.0, 0.0, 0.0)


def epoch_order(num_examples: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(num_examples))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_examples, generator=g).tolist()


def token_bins(lengths: list[int], budget: int, *, seed: int, epoch: int,
               order: list[int] | None = None) -> list[list[int]]:
    """Whole examples packed into bins of at most `budget` tokens, best-fit decreasing; a pure function of
    (lengths, budget, seed, epoch).

    Longest first, each example goes into the fullest bin it still fits in (a new bin when none has room).
    Equal lengths keep the epoch's shuffled order, and the finished bins are shuffled too, so neither the
    bins' content nor their order repeats from epoch to epoch, and long examples are not all at the start.
    `order`: the epoch's examples where they are not a shuffle of all of them (a mixture's, mixture.py).
    """
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than the budget {budget}")
    order = sorted(epoch_order(len(lengths), seed=seed, epoch=epoch) if order is None else order,
                   key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin index), kept sorted: best fit is a bisection
    for i in order:
        k = bisect.bisect_left(room, (lengths[i], -1))  # the bin with the least room that still fits
        if k == len(room):
            bins.append([])
            free, b = budget, len(bins) - 1
        else:
            free, b = room.pop(k)
        bins[b].append(i)
        bisect.insort(room, (free - lengths[i], b))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_919)
    return [bins[j] for j in torch.randperm(len(bins), generator=g).tolist()]


def global_micro_batches(num_examples: int, *, seed: int, epoch: int, world_size: int, micro_batch_size: int = 1,
                         micro_batch_tokens: int | None = None, lengths: list[int] | None = None,
                         shuffle: bool = True, order: list[int] | None = None) -> list[list[list[int]]]:
    """Every global micro-batch of one epoch, each as `world_size` lists of example indices (one per rank).

    Every example appears exactly once (or, given the epoch's `order`, as often as it has it: a mixture's). Every rank
    gets the same number of micro-batches (collectives would hang otherwise); a rank whose share of the last global
    micro-batch is empty gets an empty list, which it runs as a stand-in (`rank_view`).
    """
    if micro_batch_tokens is not None:
        bins = token_bins(lengths, micro_batch_tokens, seed=seed, epoch=epoch, order=order)
        return [bins[s : s + world_size] + [[]] * (s + world_size - len(bins))
                for s in range(0, len(bins), world_size)]
    if order is None:
        order = epoch_order(num_examples, seed=seed, epoch=epoch, shuffle=shuffle)
    per_global = micro_batch_size * world_size
    out = []
    for start in range(0, len(order), per_global):
        chunk = order[start : start + per_global]
        # Spread a short last chunk evenly so no rank idles while another has two examples too many.
        per_rank = -(-len(chunk) // world_size)
        out.append([chunk[r * per_rank : (r + 1) * per_rank] for r in range(world_size)])
    return out


class StandIn(list):
    """An idle rank's place in a global micro-batch: the first rank's examples, run with weight 0. The rank runs
    them through the objective's normal path (every forward a working rank runs: reference, KL, teacher, sampling),
    so FSDP's per-forward collectives line up without any objective counting its passes; the loop multiplies the
    loss and statistics by 0 (`batch_weight`) and the counts are none, so nothing is trained or reported."""


def rank_view(global_batches: list[list[list[int]]], rank: int) -> list[list[int]]:
    """This rank's micro-batches of `global_batches`: its own example indices, a StandIn where it has none."""
    return [g[rank] or StandIn(g[0]) for g in global_batches]


def batch_weight(batch: dict) -> float:
    """A micro-batch's weight in its step: 0 for an idle rank's stand-in, else 1."""
    return batch.get("batch_weight", 1.0)


def rank_micro_batches(num_examples: int, *, seed: int, epoch: int, micro_batch_size: int, rank: int,
                       world_size: int, shuffle: bool = True, micro_batch_tokens: int | None = None,
                       lengths: list[int] | None = None) -> list[list[int]]:
    """Example indices of every micro-batch this rank runs in one epoch (see global_micro_batches)."""
    return [g[rank] for g in global_micro_batches(
        num_examples, seed=seed, epoch=epoch, world_size=world_size, micro_batch_size=micro_batch_size,
        micro_batch_tokens=micro_batch_tokens, lengths=lengths, shuffle=shuffle)]


def collate(examples: list[dict], *, pad_id: int, packing: bool) -> dict[str, torch.Tensor]:
    """Turn examples into model inputs plus `targets`, the labels already shifted by one per example.

    Shifting per example (the last position of each example gets -100) keeps a boundary token from being
    trained to predict the next example's first token, with or without packing.
    - padded: one row per example, right-padded, with an attention mask.
    - packed: one row holding every example back to back, no padding and no attention mask; the
      position ids restart at 0 for each example. `cu_seq_lens` (the examples' boundaries, [0, l1,
      l1+l2, ...]) and `max_length` let the varlen attention attend within each example; with sdpa or
      eager, transformers turns the restarts into a block-diagonal causal mask instead.
    Everything is computed here, on the CPU, so the training step never asks the GPU for a count.
    """
    if not examples:  # a pipeline's filler for a short last window: one token, nothing trained
        examples = [{"input_ids": [pad_id], "labels": [IGNORE]}]
    ids = [list(e["input_ids"]) for e in examples]
    targets = [list(e["labels"][1:]) + [IGNORE] for e in examples]
    if packing:
        lengths = [len(x) for x in ids]
        return {
            "input_ids": torch.tensor([sum(ids, [])]),
            "position_ids": torch.tensor([[p for n in lengths for p in range(n)]]),
            "targets": torch.tensor([sum(targets, [])]),
            "cu_seq_lens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
            "max_length": max(lengths),
        }
    width = max(len(x) for x in ids)
    pad = [width - len(x) for x in ids]
    return {
        "input_ids": torch.tensor([x + [pad_id] * n for x, n in zip(ids, pad)]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * n for x, n in zip(ids, pad)]),
        "position_ids": torch.tensor([list(range(len(x))) + [0] * n for x, n in zip(ids, pad)]),
        "targets": torch.tensor([t + [IGNORE] * n for t, n in zip(targets, pad)]),
    }


# --------------------------------------------------------------------------- one optimizer step's data


@dataclass
class Window:
    """This rank's micro-batches of one optimizer step, collated on the CPU (pinned when bound for a GPU)."""

    epoch: int
    end: int  # index of the epoch's next micro-batch after this window
    epoch_done: bool  # the window ends the epoch: the position rolls over to the next epoch before any save
    batches: list[dict]
    counts: Counts  # this rank's real examples, summed over the window's micro-batches
    rollouts: list = field(default_factory=list)  # online RL: one record per completion sampled (rollouts.jsonl)
    sampled: bool = False  # online RL: the batches are a round's completions already (loop/rounds.py), not prompts


def with_loss_positions(batch: dict) -> dict:
    """Add the trained positions (flat indices), their targets and their example number, from the CPU batch;
    drop the full `targets`. The loss then sends only trained positions through the LM head."""
    targets = batch.pop("targets")
    flat = targets.flatten()
    index = (flat != IGNORE).nonzero().flatten()
    if "cu_seq_lens" in batch:  # packed: examples are the segments of the row
        cu = batch["cu_seq_lens"]
        example = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    else:  # padded: one example per row
        example = torch.arange(targets.shape[0]).repeat_interleave(targets.shape[1])
    return {**batch, "loss_index": index, "loss_targets": flat[index], "loss_example": example[index]}


def fixed_row(batch: dict, slots: int, *, pad_id: int,
              key: str = "train.micro_batch_tokens") -> dict[str, torch.Tensor]:
    """One packed micro-batch (CausalLM.collate's) as a row of exactly `slots` tokens: input_ids, position_ids,
    targets [1, slots] and cu_seq_lens [1, slots + 1], the padding one more segment that trains nothing. `key`: the
    setting `slots` is (online RL's passes: rl.micro_batch_tokens)."""
    ids, pos = batch["input_ids"].reshape(-1), batch["position_ids"].reshape(-1)
    n = len(ids)
    if n > slots:
        raise LLMTrainError(f"a packed micro-batch of {n} tokens is longer than {key}={slots}: every micro-batch is "
                            f"one row of that many slots. Raise {key}, or lower data.max_seq_len until the longest "
                            "example fits (a preference pair is both its sequences: at most half the budget each; an "
                            "online RL sequence is its prompt and rl.max_completion_tokens)")
    targets = torch.full((n,), IGNORE, dtype=torch.long)
    targets[batch["loss_index"]] = batch["loss_targets"]
    pad = slots - n
    cu = batch["cu_seq_lens"].to(torch.int32)  # a token budget packs rows (config: pipelines need one)
    cu = torch.cat([cu, torch.full((slots + 1 - len(cu),), slots, dtype=torch.int32)])  # the pad segment ends at T
    return {"input_ids": torch.cat([ids, torch.full((pad,), pad_id, dtype=ids.dtype)])[None],
            "position_ids": torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])[None],
            "targets": torch.cat([targets, torch.full((pad,), IGNORE, dtype=torch.long)])[None],
            "cu_seq_lens": cu[None]}


def packs(*, packing: bool, micro_batch_tokens: int | None, attn_implementation: str) -> bool:
    """Micro-batches are padding-free packed rows: asked for, implied by a token budget, or required by the
    varlen attention (which reads the example boundaries of a packed row). The one rule; the estimate asks it too
    (memory.spec.TrainSpec.packed)."""
    return bool(packing or micro_batch_tokens or attn_implementation in VARLEN_SETTINGS)


def packs_rows(recipe) -> bool:
    """`packs` for a recipe's data.packing, train.micro_batch_tokens and model.attn_implementation."""
    return packs(packing=recipe.data.packing, micro_batch_tokens=recipe.train.micro_batch_tokens,
                 attn_implementation=recipe.model.attn_implementation)


def to_device(batch: dict, device) -> dict:
    # non_blocking: the copy from pinned memory overlaps with whatever the GPU is still doing.
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class DataPlan:
    """Every global micro-batch of each epoch, computed once per epoch (the last two are kept), and what follows
    from it: steps per epoch, packing efficiency, and each rank's own view (`for_rank`)."""

    def __init__(self, lengths: list[int], *, seed: int, world: int, micro_batch_size: int,
                 micro_batch_tokens: int | None, mixture=None):
        self.lengths, self.world, self.budget = lengths, world, micro_batch_tokens
        self.epoch = functools.lru_cache(maxsize=2)(functools.partial(
            _plan_epoch, lengths, seed=seed, world=world, micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens, mixture=mixture))

    def for_rank(self, rank: int):
        """plan(epoch) -> this rank's micro-batches of that epoch, read from the global plan."""
        return lambda epoch: rank_view(self.epoch(epoch), rank)

    def steps_per_epoch(self, epoch: int, accum: int) -> int:
        return math.ceil(len(self.epoch(epoch)) / accum)

    def steps_in(self, epochs: int, accum: int) -> int:
        """Optimizer steps of `accum` micro-batches over `epochs` epochs: each epoch's own count where token bins
        differ from epoch to epoch, else the first's times the epochs (every epoch has the same rows, so as many
        micro-batches; a large train.epochs is a product, not a plan of every epoch)."""
        if not self.budget:
            return epochs * self.steps_per_epoch(0, accum)
        return sum(self.steps_per_epoch(e, accum) for e in range(epochs))

    def global_batches_in(self, steps: int, accum: int) -> Iterator[list[list[int]]]:
        """The global micro-batches the first `steps` optimizer steps run, in order, crossing epochs as `windows`
        does (each a list of one list of example indices per rank)."""
        epoch, micro, batches = 0, 0, self.epoch(0)
        for _ in range(steps):
            if micro >= len(batches):
                epoch, micro, batches = epoch + 1, 0, self.epoch(epoch + 1)
            yield from batches[micro: micro + accum]
            micro += len(batches[micro: micro + accum])

    def examples_in(self, steps: int, accum: int) -> list[int]:
        """The examples the first `steps` optimizer steps train on (sorted); read up to where every example is."""
        seen: set[int] = set()
        for global_batch in self.global_batches_in(steps, accum):
            seen.update(i for idx in global_batch for i in idx)
            if len(seen) == len(self.lengths):  # all of them: the rest of a long run adds none
                break
        return sorted(seen)

    def bins(self) -> int:
        """Token bins of the first epoch (idle ranks' empty places not counted)."""
        return sum(len(g) - g.count([]) for g in self.epoch(0))

    def packing_efficiency(self) -> float | None:
        """Real tokens / token budget over the first epoch's bins; None without a token budget."""
        if not self.budget:
            return None
        return sum(self.lengths[i] for g in self.epoch(0) for idx in g for i in idx) / (self.bins() * self.budget)


def _plan_epoch(lengths, epoch: int, *, seed, world, micro_batch_size, micro_batch_tokens, mixture):
    return global_micro_batches(len(lengths), seed=seed, epoch=epoch, world_size=world,
                                micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                                lengths=lengths,
                                order=mixture.order(seed=seed, epoch=epoch) if mixture is not None else None)


def windows(dataset, plan, *, epoch: int, micro: int, steps: int, accum: int, collate, pin: bool,
            columns: tuple[str, ...] = ("input_ids", "labels")) -> Iterator[Window]:
    """The next `steps` windows from (epoch, micro), crossing epochs; `plan(epoch)` is this rank's
    micro-batches of that epoch (rank_view: a StandIn is collated as it is, with weight 0 and no counts),
    `collate(examples) -> (batch, Counts)` the objective's (objective.py), fed the dataset's `columns`. Pure and
    deterministic: run ahead in a thread (prefetch) without changing anything."""
    batches = plan(epoch)
    for _ in range(steps):
        if micro >= len(batches):
            epoch, micro, batches = epoch + 1, 0, plan(epoch + 1)
        idx_lists = batches[micro : micro + accum]
        collated, counts = [], None
        for idx in idx_lists:
            rows = dataset[list(idx)]  # never empty: rank_view gives an idle place a StandIn
            batch, n = collate([dict(zip(columns, values)) for values in zip(*(rows[c] for c in columns))])
            if isinstance(idx, StandIn):
                batch, n = {**batch, "batch_weight": 0.0}, Counts.none()
            counts = n if counts is None else counts.plus(n)
            collated.append({k: v.pin_memory() if pin and isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        micro += len(idx_lists)
        yield Window(epoch=epoch, end=micro, epoch_done=micro >= len(batches), batches=collated, counts=counts)


def prefetch(iterable, depth: int = 2):
    """Iterate `iterable` in a background thread, `depth` items ahead: the next window is read, collated
    and pinned while the GPU computes this one. Order is unchanged; an error in the thread is raised here.

    The thread lives until the consumer is done, not until its last item is made: a thread that ran torch's
    OpenMP regions (the collate) and exited while the main thread still trained made each later step about 20x
    slower on the CPU (the last 2 steps of a 30-step tiny run at 72-177 tokens/s against ~3,000, 2 OpenMP threads;
    kept alive: ~4,300)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def offer(item) -> bool:  # put, unless the consumer has gone: then False
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in iterable:
                if not offer(item):
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            offer(e)
            return
        if offer(done):
            stop.wait()  # until the consumer has finished (see above)

    thread = threading.Thread(target=produce, daemon=True, name="llmtrain-prefetch")
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:  # also when the consumer stops early (a signal, an error): the thread ends before we go on
        stop.set()
        thread.join()
