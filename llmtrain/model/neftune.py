"""NEFTune (Jain et al. 2023, train.neftune_alpha): uniform noise on the input embeddings of training forward passes.

Each token's embedding gains noise drawn from U(-1, 1) x alpha / sqrt(L d), d the hidden size and L the number of
tokens of the example it belongs to: each example of a packed row its own (from the row's boundaries, cu_seq_lens),
a padded row its real tokens (its attention mask), an unpadded batch its length. Hugging Face's hook
(transformers.integrations.neftune, which TRL's SFTTrainer uses) takes L from the padded batch's width: the same
where no row is padded, and in a padding-free row its whole width, which scales every example's noise down by the
square root of the number it shares the row with. Evaluation, generation and every forward in eval mode see no noise.

Two hooks: a forward pre-hook on the decoder reads the row's layout from its keyword arguments, and a forward hook on
the embedding adds the noise. The decoder and its embedding are the model's own modules, so the hooks hold under
LoRA and under DDP and FSDP's wrapping; the layouts that split a row or its embedding (sequence, pipeline and tensor
parallelism) refuse the setting (capabilities.RULES).
"""

from __future__ import annotations

import torch


def _lengths(kwargs: dict, shape: torch.Size, device) -> torch.Tensor:
    """[rows, tokens, 1] float: each token's example length, from the decoder's keyword arguments; on the device,
    without a host synchronisation (a searchsorted, not repeat_interleave's data-dependent size)."""
    rows, tokens = shape[0], shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # a packed row: each example's own; tokens past the last boundary (none here) their count
        ends = torch.cat([cu[1:], cu.new_tensor([tokens])])  # each example's end, then the row's
        per = (ends - cu)[torch.searchsorted(ends, torch.arange(tokens, device=cu.device), right=True)]
        return per.reshape(1, tokens, 1).expand(rows, tokens, 1).float()
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:  # padded rows: each row's real tokens
        return mask.sum(dim=1).clamp(min=1).reshape(rows, 1, 1).expand(rows, tokens, 1).float()
    return torch.full((rows, tokens, 1), float(tokens), device=device)


def attach_neftune(model, alpha: float) -> None:
    """Add NEFTune's noise to `model`'s input embeddings in training mode (a peft model's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, embedding = base.get_decoder(), base.get_input_embeddings()
    # the decoder's forward's ids shape and row layout, read by the embedding's hook only when it trains (a cache,
    # a generation's, is never held here)
    seen: dict = {"shape": None}

    def read_layout(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.update(shape=None if ids is None else ids.shape[:2],
                    layout={k: kwargs.get(k) for k in ("cu_seq_lens_q", "attention_mask")})

    def add_noise(module, args, output):
        if not module.training:
            return output
        inside = seen["shape"] == output.shape[:2]  # else called outside the decoder: the batch's width
        lengths = _lengths(seen["layout"] if inside else {}, output.shape, output.device)
        scale = alpha / torch.sqrt(lengths.to(output.device) * output.shape[2])
        return output + torch.zeros_like(output).uniform_(-1, 1) * scale.to(output.dtype)

    decoder.register_forward_pre_hook(read_layout, with_kwargs=True)
    embedding.register_forward_hook(add_noise)
