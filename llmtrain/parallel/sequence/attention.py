"""The Ulysses attention of sequence parallelism: each process of a sequence group holds a
slice of the packed row's tokens; an all-to-all turns the slices of every head into every token of 1/N of the heads,
llmtrain's varlen attention runs on the whole row with its real example boundaries (sliding window included), and a
second all-to-all turns the output back into slices. Registered with transformers' AttentionInterface as NAME by
`attach`, with the group to exchange over."""

from __future__ import annotations

from functools import partial

import torch

from llmtrain.model.attention import PREFIX, SINKS, varlen_attention_forward

NAME = PREFIX + "ulysses"


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group`, of equal chunks along dim 0; its backward is the same exchange of the gradient
    (chunk j of process i goes to process j as its chunk i, and back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # of a contiguous x: empty_like keeps a view's strides, which the exchange ignores
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def to_heads(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """(1, H, T/n, D) slices of every head -> (1, H/n, T, D): every token of this process's heads."""
    _, h, s, d = x.shape
    out = _AllToAll.apply(x[0].reshape(n, h // n, s, d), group)  # sent: chunk j, process j's heads; got: slice i
    return out.transpose(0, 1).reshape(1, h // n, n * s, d)


def to_sequence(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """(1, T, H/n, D) every token of this process's heads -> (1, T/n, H, D): its slice of every head."""
    _, t, h, d = x.shape
    out = _AllToAll.apply(x[0].reshape(n, t // n, h, d), group)  # sent: slice j; got: the heads of process i
    return out.transpose(0, 1).reshape(1, t // n, n * h, d)


# Left out of torch.compile (model.compile), as the varlen attention inside it is: torch 2.11's dynamo traced the
# all-to-alls' autograd Function into the compiled layers and trained other gradients than one process (step 2's loss
# 2.6e-3 off; tests/test_sequence_parallel.py's compiled launch). The layers compile around it.
@torch.compiler.disable
def ulysses_attention(module, query, key, value, attention_mask, *, size: int, group, **kwargs):
    """transformers' attention signature around llmtrain's varlen attention: query (1, Hq, T/n, D), key/value
    (1, Hkv, T/n, D) -> (1, T/n, Hq, D), attending over the whole packed row (`cu_seq_lens_q` is the row's)."""
    if key.shape[1] < size:  # fewer K/V heads than processes: each goes to the processes of its query heads
        key, value = (t.repeat_interleave(size // t.shape[1], dim=1) for t in (key, value))
    for name in SINKS:  # a sink a query head (GPT-OSS): this process's heads' (to_heads sends process j chunk j)
        if (sinks := kwargs.get(name)) is not None:
            import torch.distributed as dist

            share = query.shape[1] // size
            rank = dist.get_rank(group)
            kwargs[name] = sinks[rank * share:(rank + 1) * share]  # its gradient: these heads', summed over the group
    out, weights = varlen_attention_forward(module, *(to_heads(t, size, group) for t in (query, key, value)),
                                            attention_mask, **kwargs)
    return to_sequence(out, size, group), weights


def attach(model, *, size: int, group) -> None:
    """Make `model`'s attention the Ulysses one over `group` of `size` processes; generation switches to SDPA as it
    does from the varlen attention (model.generate.cached_attention)."""
    from transformers import AttentionInterface

    from llmtrain.model.loss import causal_lm

    AttentionInterface.register(NAME, partial(ulysses_attention, size=size, group=group))
    causal_lm(model).config._attn_implementation = NAME
