"""A pipeline stage of a Llama-layout causal LM (Llama, Mistral, Qwen, Gemma 3, Phi), cut by hand: the modules a stage
runs, and the storage-less placeholders of the ones other stages hold. Where the stages run and how they are split:
schedule.py and group.py beside it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from llmtrain.model.attention import layer_kinds, rotary_by_kind


class Elsewhere(nn.Module):
    """A module another pipeline stage holds: no parameters here, and never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")



class Stage(nn.Module):
    """One pipeline stage of a Llama-layout causal LM: the embedding (first stage), a run of decoder layers, the
    final norm and the head (last stage: the LM head, or a reward model's score head). Every stage computes the
    rotary embeddings from the positions it is given (one pair for each kind of layer it holds: Gemma 3's local and
    global), and the varlen attention takes the row's example boundaries from `cu_seq_lens` (a local layer's window
    from the layer itself). A tied embedding: the first stage's embedding and the last stage's head are two copies of
    the one weight (schedule.py sums their gradients)."""

    def __init__(self, lm, layers: range, *, first: bool, last: bool, precision=nullcontext):
        super().__init__()
        # the run's autocast (train.mixed_precision) around the forward alone, as Accelerate's prepare puts it: a
        # backward under autocast rounds differently (bf16: grad norms 4e-5 apart from a 1-process run)
        self.precision = precision
        decoder = lm.model
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList(decoder.layers[i] for i in layers)
        kinds = layer_kinds(lm.config, len(decoder.layers))
        self.kinds = [kinds[i] for i in layers]
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if last else None
        self.head = getattr(lm, head_name(lm)) if last else None  # the LM head, or a reward model's score head

    def forward(self, x, position_ids, cu_seq_lens):
        with self.precision():
            return self._forward(x, position_ids, cu_seq_lens)

    def _forward(self, x, position_ids, cu_seq_lens):
        h = self.embed(x) if self.embed is not None else x
        cu = cut_points(cu_seq_lens)
        longest = int((cu[1:] - cu[:-1]).max())
        pe = rotary_by_kind(self.rotary, h, position_ids, self.kinds)
        for layer, kind in zip(self.layers, self.kinds):
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe[kind],
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return self.norm(h) if self.norm is not None else h


def head_name(lm) -> str:
    """The last stage's head in `lm`: a causal LM's lm_head, or a reward model's (a *ForSequenceClassification's)
    score."""
    return "lm_head" if hasattr(lm, "lm_head") else "score"


def skeleton(module: nn.Module) -> nn.Module:
    """`module` with every parameter and buffer replaced by a storage-less one of its shape (the meta device), its
    memory freed. By hand, not .to("meta"): a 4-bit base's Params4bit cannot be moved there."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    table[name] = nn.Parameter(empty, requires_grad=False) if table is m._parameters else empty
    return module


def cut_points(cu: torch.Tensor) -> torch.Tensor:
    """A row's boundaries [0, l1, l1+l2, ..., T] from their fixed-length form (padded with T): on the CPU."""
    cu = cu.reshape(-1)
    n = int((cu[1:] > cu[:-1]).sum())
    return cu[: n + 1]
