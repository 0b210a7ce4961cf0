"""Data order and collation: which examples each process sees, and how they become tensors.

The order is a pure function of (seed, epoch), so resuming needs only the epoch and the position in it.
A *global* micro-batch is `micro_batch_size * world_size` consecutive examples of the epoch's
permutation; rank r takes its r-th slice. Two processes with micro-batch 2 therefore see exactly the
examples one process with micro-batch 4 sees, which is what makes the runs comparable.
"""

from __future__ import annotations

import torch

from llmtrain.data import IGNORE


def rank_micro_batches(
    num_examples: int, *, seed: int, epoch: int, micro_batch_size: int, rank: int, world_size: int, shuffle: bool = True
) -> list[list[int]]:
    """Example indices of every micro-batch this rank runs in one epoch.

    Every example appears exactly once across ranks. Every rank gets the same number of micro-batches
    (collectives would hang otherwise); a rank whose slice of the last global micro-batch is empty gets
    an empty list, which the collator turns into a row with no trained token.
    """
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(num_examples, generator=g).tolist()
    else:
        order = list(range(num_examples))
    per_global = micro_batch_size * world_size
    batches = []
    for start in range(0, num_examples, per_global):
        chunk = order[start : start + per_global]
        # Spread a short last chunk evenly so no rank idles while another has two examples too many.
        per_rank = -(-len(chunk) // world_size)
        batches.append(chunk[rank * per_rank : (rank + 1) * per_rank])
    return batches


def collate(examples: list[dict], *, pad_id: int, packing: bool) -> dict[str, torch.Tensor]:
    """Turn examples into model inputs plus `targets`, the labels already shifted by one per example.

    Shifting per example (the last position of each example gets -100) keeps a boundary token from being
    trained to predict the next example's first token, with or without packing.
    - padded: one row per example, right-padded, with an attention mask.
    - packed: one row holding every example back to back, no padding and no attention mask; the
      position ids restart at 0 for each example and transformers turns those restarts into a
      block-diagonal causal mask, so no example attends to another.
    """
    if not examples:  # an idle rank at the end of an epoch: one token, nothing trained
        examples = [{"input_ids": [pad_id], "labels": [IGNORE]}]
    ids = [list(e["input_ids"]) for e in examples]
    targets = [list(e["labels"][1:]) + [IGNORE] for e in examples]
    if packing:
        return {
            "input_ids": torch.tensor([sum(ids, [])]),
            "position_ids": torch.tensor([[p for x in ids for p in range(len(x))]]),
            "targets": torch.tensor([sum(targets, [])]),
        }
    width = max(len(x) for x in ids)
    pad = [width - len(x) for x in ids]
    return {
        "input_ids": torch.tensor([x + [pad_id] * n for x, n in zip(ids, pad)]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * n for x, n in zip(ids, pad)]),
        "position_ids": torch.tensor([list(range(len(x))) + [0] * n for x, n in zip(ids, pad)]),
        "targets": torch.tensor([t + [IGNORE] * n for t, n in zip(targets, pad)]),
    }
