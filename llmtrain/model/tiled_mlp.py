"""model.tiled_mlp: each decoder layer's MLP run over shards of the tokens, as ALST's TiledMLP and unsloth_zoo's
tiled_mlp, and its two RMSNorms the same way (their fp32 tensors are the next largest: TILED_NORMS).

A SwiGLU MLP keeps gate, up, silu(gate) and their product for its backward, four (tokens x intermediate) tensors:
3.5 times the layer's hidden width each on a 7B, more than the rest of the layer. Tiled, the forward runs the MLP
shard by shard under no_grad and keeps only its input (which the layer keeps anyway); the backward recomputes one
shard at a time and backpropagates through it, so the wide intermediates exist for one shard, never for the
sequence. The MLP is token-wise, so a shard of any length gives the same numbers, up to the order of float sums.

Parameters. ALST and unsloth run the shard's backward with torch.autograd.backward and let it accumulate into each
weight's .grad, which fires the weight's gradient hooks once per shard (DDP would reduce it once per shard, or
refuse). Here the MLP's trainable parameters are inputs of the autograd Function and their gradients, summed over the
shards, are its outputs: autograd accumulates each once per step, as for the untiled MLP, so gradient accumulation
and DDP see an ordinary gradient. The cost is one gradient-sized buffer per MLP during its backward (nothing for
LoRA; the MLP's three weights for a full fine-tune). LoRA adapters on gate/up/down and 4-bit bitsandbytes layers
(QLoRA) need nothing else: the shard runs the module's own forward. Dropout (LoRA's) draws the same masks in the
recompute: the random state at the start of the forward is restored for the backward, and the shards run in the
same order; they are not the masks the untiled MLP would draw.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in dict.fromkeys(("cpu", device_type))]


def _run_shards(run, x: torch.Tensor, shard: int) -> torch.Tensor:
    """run(x) shard by shard, written into one output (a list of shards and their concatenation would hold the
    output twice)."""
    out = None
    for start in range(0, x.shape[0], shard):
        part = run(x[start:start + shard])
        if out is None:
            out = part.new_empty((x.shape[0], part.shape[-1]))
        out[start:start + shard] = part
    return out


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, shard: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.shard, ctx.autocast = run, shard, _autocast_state(x.device.type)
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x, *params)
        return _run_shards(run, x, shard)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        dx = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.enable_grad(), \
                contextlib.ExitStack() as stack:
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            for device_type, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.amp.autocast(device_type, enabled=enabled, dtype=dtype))
            for start in range(0, x.shape[0], ctx.shard):
                part = x[start:start + ctx.shard].detach().requires_grad_(dx is not None)
                # Run on a view of it, not on the leaf: autocast caches its casts of leaves that need a gradient
                # (meant for weights) until the autocast above ends, so an fp32 input's bf16 casts would pile up
                # shard by shard into a full-length copy.
                out = ctx.run(part.view_as(part))
                wrt = ([part] if dx is not None else []) + list(params)
                got = list(torch.autograd.grad(out, wrt, grad_out[start:start + ctx.shard], allow_unused=True))
                if dx is not None:
                    dx[start:start + ctx.shard] = got.pop(0)
                grads = [g if s is None else s if g is None else s.add_(g) for s, g in zip(grads, got)]
                # Not through the next shard: its gradients of the weights (a second copy of them in a full
                # fine-tune, beside the sum and the next shard's) and its output.
                del out, got
        return None, None, dx, *grads


def tiled_forward(run, module: torch.nn.Module, shard: int, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward over shards of `shard` tokens (x: ... x hidden)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= shard:
        return run(x)
    params = [p for p in module.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        out = _TiledMLP.apply(run, shard, flat, *params)
    else:  # evaluation, or nothing to differentiate: the shards alone, nothing kept
        out = _run_shards(run, flat, shard)
    return out.view(*x.shape[:-1], out.shape[-1])


# The decoder layer's token-wise norms, tiled with the MLP: an RMSNorm computes in fp32 (transformers' LlamaRMSNorm and
# its copies), so its backward holds five fp32 (tokens x hidden) temporaries and its forward keeps an fp32 copy of its
# input: 100 KB a token at a hidden size of 4,096, the largest moment of a layer once its MLP is tiled (docs/
# long-context.md). Tiled, each keeps only its input, and a shard's fp32 tensors exist in its backward only.
TILED_NORMS = ("input_layernorm", "post_attention_layernorm")


def tile_mlps(model, setting: bool | int) -> int:
    """Give every decoder layer's `mlp`, and its norms before attention and before the MLP (TILED_NORMS, where the
    layer has them), the tiled forward (before LoRA: peft then replaces the projections inside the MLP, which the
    tiled forward calls). Each norm and the MLP are tiled on their own, so a layer that orders them otherwise
    (Gemma's norm of the attention output before the residual add) runs as it did. Returns the shard size."""
    from llmtrain.config import tiled_mlp_shard
    from llmtrain.model.loss import causal_lm, decoder_layers

    lm = causal_lm(model)
    shard = tiled_mlp_shard(setting, lm.config.hidden_size)
    for layer in decoder_layers(lm):
        # The module's forward as it is now (liger's, where liger patched it), called shard by shard.
        for module in [getattr(layer, name, None) for name in TILED_NORMS] + [layer.mlp]:
            if module is not None:
                module.forward = functools.partial(tiled_forward, module.forward, module, shard)
    return shard
