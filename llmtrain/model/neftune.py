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


def _lengths(kwargs: dict, shape: torch.Size) -> torch.Tensor:
    """[rows, tokens, 1] float: each token's example length, from the decoder's keyword arguments."""
    rows, tokens = shape[0], shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # a packed row: each example's own; tokens past the last boundary (none here) their count
        sizes = cu.diff()
        per = torch.repeat_interleave(sizes, sizes)
        rest = tokens - per.numel()
        per = torch.cat([per, per.new_full((rest,), rest)]) if rest > 0 else per[:tokens]
        return per.reshape(1, tokens, 1).expand(rows, tokens, 1).float()
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:  # padded rows: each row's real tokens
        return mask.sum(dim=1).clamp(min=1).reshape(rows, 1, 1).expand(rows, tokens, 1).float()
    return torch.full((rows, tokens, 1), float(tokens))


def attach_neftune(model, alpha: float) -> None:
    """Add NEFTune's noise to `model`'s input embeddings in training mode (a peft model's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, embedding = base.get_decoder(), base.get_input_embeddings()
    seen: dict[str, torch.Tensor | None] = {"lengths": None}

    def read_layout(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["lengths"] = None if ids is None else _lengths(kwargs, ids.shape)

    def add_noise(module, args, output):
        if not module.training:
            return output
        lengths = seen["lengths"]
        if lengths is None or lengths.shape[:2] != output.shape[:2]:  # called outside the decoder: the batch's width
            lengths = torch.full((*output.shape[:2], 1), float(output.shape[1]))
        scale = alpha / torch.sqrt(lengths.to(output.device) * output.shape[2])
        return output + torch.zeros_like(output).uniform_(-1, 1) * scale.to(output.dtype)

    decoder.register_forward_pre_hook(read_layout, with_kwargs=True)
    embedding.register_forward_hook(add_noise)
