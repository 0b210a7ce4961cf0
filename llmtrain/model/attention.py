"""Varlen attention: each example of a padding-free packed row attends only to itself, at a cost of
sum(l_i^2) instead of (sum l_i)^2.

Registered with transformers' AttentionInterface as "llmtrain_varlen". transformers builds no mask for a
name it does not know (masking_utils returns None), so no L x L mask is ever materialised; the example
boundaries arrive as `cu_seq_lens_q` / `max_length_q`, the keyword arguments transformers forwards to
every attention call (the names its own flash-attention path uses), computed by the collator on the CPU.
- CUDA: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (flash kernels, no extra package).
- elsewhere: SDPA per example, which is what the CPU tests use to prove the path equal to the unpacked
  model.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from llmtrain.errors import LLMTrainError

PREFIX = "llmtrain_"  # every attention llmtrain registers with transformers (generation swaps them for SDPA)
NAME = PREFIX + "varlen"


def varlen_available() -> bool:
    """PyTorch's flash varlen kernel can run here (CUDA and a torch that has it)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def layer_kinds(config, layers: int) -> list[str]:
    """Each decoder layer's kind (config.layer_types: Gemma 3's sliding_attention and full_attention); a model
    without them: every layer full_attention."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * layers)


def rotary_by_kind(rotary_emb, hidden, position_ids, kinds) -> dict:
    """The rotary embeddings (cos, sin) of `position_ids` for each kind of layer in `kinds`, as the decoder's
    `rotary_emb` makes them: Gemma 3's takes a layer_type (a base and scaling of its own for local and global
    layers); elsewhere one pair serves every layer."""
    if _per_kind(type(rotary_emb)):
        return {t: rotary_emb(hidden, position_ids, t) for t in dict.fromkeys(kinds)}
    return dict.fromkeys(kinds, rotary_emb(hidden, position_ids=position_ids))


@functools.cache
def _per_kind(rotary_class) -> bool:
    """Whether a rotary embedding class takes a layer_type (read once a class: rotary_by_kind runs every step)."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    return NAME


def _segments(cu_seq_lens, position_ids, total: int) -> torch.Tensor:
    if cu_seq_lens is not None:
        return cu_seq_lens
    if position_ids is None:  # one sequence (generation, or a caller that passed nothing)
        return torch.tensor([0, total], dtype=torch.int32)
    # Fallback for callers that did not pass the boundaries: every position id 0 starts an example.
    # This reads the GPU (a host sync); the trainer always passes cu_seq_lens.
    starts = (position_ids.flatten() == 0).nonzero().flatten().to(torch.int32).cpu()
    return torch.cat([starts, torch.tensor([total], dtype=torch.int32)])


# What a model may hand its attention that changes the scores or the softmax and llmtrain's varlen attention does not
# compute: refused at the first call (capabilities.attention_problems refuses the models known to, before the run).
UNCOMPUTED = {"softcap": "a cap on the attention scores"}
SINKS = ("s_aux", "sinks")  # a learned logit per query head in each softmax (GPT-OSS's s_aux): computed here


# Left out of torch.compile (model.compile): the example boundaries change every step, and the per-example
# loop and the kernel's max length would make every new batch a recompile. The layers compile around it.
@torch.compiler.disable
def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, cu_seq_lens_q=None, max_length_q=None,
                             position_ids=None, **kwargs):
    """transformers' attention signature: query (B, Hq, L, D), key/value (B, Hkv, L, D) -> (B, L, Hq, D).

    The batch is flattened to one sequence of B*L tokens and attended per example. A padded batch (one
    example per row, right padding) works too when position ids restart on the pads: each pad is then
    its own one-token example and no real token ever sees one.
    """
    if uncomputed := [f"{k} ({what})" for k, what in UNCOMPUTED.items() if kwargs.get(k) is not None]:
        raise LLMTrainError(
            f"{type(module).__name__} passes {', '.join(uncomputed)} to its attention, which llmtrain's varlen "
            "attention does not compute: the model would train on other attention than its own. Set "
            "model.attn_implementation=eager")
    if kwargs.get("past_key_values") is not None or query.shape[2] != key.shape[2]:
        raise NotImplementedError("llmtrain's varlen attention is for training (no KV cache); generate with "
                                  "attn_implementation='sdpa'")
    b, hq, length, d = query.shape
    hkv = key.shape[1]
    # Mistral-style models pass their window (a token sees itself and the window - 1 before it) as a kwarg.
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    sinks = next((kwargs[name] for name in SINKS if kwargs.get(name) is not None), None)
    if sinks is not None and sinks.numel() != hq:
        raise LLMTrainError(f"{type(module).__name__} hands its attention {sinks.numel()} sinks for {hq} query heads "
                            "(its heads split over processes): llmtrain does not split the sinks with them")
    q, k, v = (t.transpose(1, 2).reshape(b * length, t.shape[1], d) for t in (query, key, value))  # (T, H, D)
    cu = _segments(cu_seq_lens_q, position_ids, b * length)
    scale = scaling if scaling is not None else d ** -0.5
    # Under autocast, RoPE leaves q and k in fp32 beside a bf16 v, and the varlen kernel is a custom op that
    # autocast does not cast: cast them to the autocast dtype here. fp32 without autocast has no flash kernel.
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        low = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(low), k.to(low), v.to(low)
    # (a model whose config has attention dropout trains through SDPA per example, which takes it: the flash varlen
    # kernel has none, and had raised NotImplementedError at the first step, on every process; audit 34)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and varlen_available() and not dropout:
        max_len = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        out = _flash_varlen(q, k, v, cu.to(q.device, non_blocking=True), max_len, scale=scale, window=window,
                            sinks=sinks)
    else:
        out = _sdpa_per_example(q, k, v, cu.tolist(), scale=scale, dropout=dropout, window=window, gqa=hq // hkv,
                                sinks=sinks)
    return out.view(b, length, hq, d), None


def _sdpa_per_example(q, k, v, cu: list[int], *, scale: float, dropout: float, window: int | None, gqa: int,
                      sinks: torch.Tensor | None = None):
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        # (H, l, D): SDPA's math kernel, exact and simple; this path is the CPU reference (and the fallback where
        # there is no flash varlen kernel), and estimate-memory models what it saves.
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))
        if gqa > 1:
            ki, vi = ki.repeat_interleave(gqa, dim=0), vi.repeat_interleave(gqa, dim=0)
        mask, causal = None, True
        if window is not None and e - s > window:  # Mistral-style sliding window: see only the last `window`
            i = torch.arange(e - s, device=q.device)
            mask, causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window), False
        if sinks is not None:
            outs.append(_with_sinks(qi, ki, vi, mask, scale=scale, sinks=sinks, dropout=dropout).transpose(0, 1))
            continue
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale,
                                                   dropout_p=dropout).transpose(0, 1))
    return torch.cat(outs)


def _with_sinks(qi, ki, vi, mask, *, scale: float, sinks: torch.Tensor, dropout: float) -> torch.Tensor:
    """One example's causal attention (H, l, D) whose softmax over each row also holds the head's sink logit, which
    takes probability and gives nothing (GPT-OSS's eager attention, as transformers writes it)."""
    h, length = qi.shape[0], qi.shape[1]
    scores = (qi @ ki.transpose(1, 2)) * scale
    allowed = mask if mask is not None else torch.ones(length, length, dtype=torch.bool, device=qi.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    combined = torch.cat([scores, sinks.to(scores.dtype).view(h, 1, 1).expand(h, length, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return F.dropout(probs, p=dropout, training=dropout > 0).to(vi.dtype) @ vi


@functools.cache
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)  # read once, not in every layer of every step


def _flash_varlen(q, k, v, cu, max_len: int, *, scale: float, window: int | None, sinks=None):
    """torch.nn.attention.varlen.varlen_attn across releases, as read in their sources:
    - torch 2.10: `is_causal`, no window, maybe no scale; K/V heads must equal Q heads (repeated here);
    - torch 2.11: `window_size=(left, right)` ((-1, 0) is causal) and `scale`; K/V go straight to aten's flash
      kernel, which takes fewer K/V heads than Q heads (GQA) itself, so they are not repeated (repeating would
      keep 4x the K/V of a Mistral layer for backward);
    - torch 2.12+: the same plus `enable_gqa`, which must be set for fewer K/V heads.
    `sinks` (a logit per query head, GPT-OSS's): the kernel's output is rescaled by each row's share of the softmax
    that the sink leaves, sigmoid(lse - sink), from the kernel's log-sum-exp (_SinkShare)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _parameters(varlen_attn)
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (window - 1 if window is not None and max_len > window else -1, 0)
        if q.shape[1] != k.shape[1] and "enable_gqa" in params:
            kwargs["enable_gqa"] = True
    else:
        if window is not None and max_len > window:
            raise NotImplementedError(f"this torch's varlen_attn has no sliding window and an example is longer "
                                      f"than the model's {window}; upgrade torch or use attn_implementation=sdpa")
        kwargs["is_causal"] = True
        if q.shape[1] != k.shape[1]:  # repeat each KV head for its group of query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel applies 1/sqrt(D); fold the model's own scale into q
    if sinks is None:
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    from torch.nn.attention.varlen import AuxRequest

    def attend(q, k, v, **aux):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs, **aux)

    out, lse = attend(q, k, v, return_aux=AuxRequest(lse=True))
    # the kernel's log-sum-exp (heads, tokens), which its backward takes no gradient of: _SinkShare gives it one
    lse = _SinkShare.apply(q, k, lse.transpose(0, 1) if lse.shape[0] == q.shape[1] else lse, attend,
                           kwargs.get("scale", q.shape[-1] ** -0.5))  # the kernel's scale of the q it is given
    return out * torch.sigmoid(lse - sinks.float()).unsqueeze(-1).to(out.dtype)


class _SinkShare(torch.autograd.Function):
    """The flash kernel's log-sum-exp of each row's scores, lse_i = log sum_j exp(scale q_i . k_j) (tokens, heads),
    with the gradient the kernel's backward leaves out (it takes none for lse): d lse_i / d q_i = scale sum_j P_ij k_j,
    the kernel's output with the keys as values, and d lse_i / d k_j = scale P_ij q_i, summed over i: the values'
    gradient of that same attention given g_i q_i as its output's gradient. One more pass forward and back through the
    kernel, in backward only."""

    @staticmethod
    def forward(ctx, q, k, lse, attend, scale):
        ctx.save_for_backward(q, k)
        ctx.attend, ctx.scale = attend, scale
        return lse.clone()

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        with torch.enable_grad():
            keys = k.detach().requires_grad_()
            mean_key = ctx.attend(q.detach(), k.detach(), keys)  # sum_j P_ij k_j, (tokens, query heads, D)
            g = grad.unsqueeze(-1)
            (dk,) = torch.autograd.grad(mean_key, keys, grad_outputs=(g * q.float()).to(q.dtype))
        return (g * mean_key.detach().float() * ctx.scale).to(q.dtype), dk * ctx.scale, None, None, None
