"""NEFTune (Jain et al. 2023, train.neftune_alpha): uniform noise on the input embeddings of training forward passes.

Each token's embedding gains noise drawn from U(-1, 1) x alpha / sqrt(L d), d the hidden size and L the number of
tokens of the example it belongs to: each example of a packed row its own (from the row's boundaries, cu_seq_lens),
a padded row its real tokens (its attention mask), an unpadded batch its length. Hugging Face's hook
(transformers.integrations.neftune, which TRL's SFTTrainer uses) takes L from the padded batch's width: the same
where no row is padded, and in a padding-free row its whole width, which scales every example's noise down by the
square root of the number it shares the row with. Evaluation, generation and every forward in eval mode see no noise.

Two hooks: a forward pre-hook on the decoder reads the row's layout from its keyword arguments, and a forward hook on
the embedding adds the noise. The decoder and its embedding are the model's own modules, so the hooks hold under
LoRA and under DDP and FSDP's wrapping, and under tensor parallelism, which keeps the embedding whole on every
process of a pair (each draws the same noise from the same seed). The layouts that embed a row apart:
- sequence parallelism (`sequence`: this process's place in its group): each process embeds its slice of the group's
  row; it draws the noise of the whole row, as one process would, and keeps its slice's (every process of the group
  holds the same random state), so the slices' noise is one draw, each example scaled by its whole length;
- pipeline stages: the first stage runs the embedding outside the decoder's forward and hands it the row's layout
  (`Noise.read`, the embedding's `neftune` attribute) before it embeds.
Noise is drawn for a row's real tokens only (a packed row's up to its last example's end, padded rows' up to the
longest's), the padding's 0: a row padded to a layout's shape (a sequence group's multiple, a stage's fixed slots)
had drawn noise for its padding too, moving the random stream on, so every later row's noise was another than one
process's (audit 28: step 1's loss 4.6906 under sequence parallelism against 4.6739). Those layouts pad a packed row
with one more segment, which its boundaries cannot tell from an example: each says the row's real tokens itself
(`row_tokens`: a sequence slice's batch through the loss's forward, a pipeline's first stage through `read`); they had
not, so a row not filling the group's multiple or the slots still drew for its padding (audit 38: step 4's loss
4.6535 under sequence parallelism against one process's 4.6180).
"""

from __future__ import annotations

import torch


def _lengths(layout: dict, shape: torch.Size, device) -> torch.Tensor:
    """[rows, tokens, 1] float: each token's example length, from the decoder's keyword arguments; on the device,
    without a host synchronisation (a searchsorted, not repeat_interleave's data-dependent size)."""
    rows, tokens = shape[0], shape[1]
    cu = layout.get("cu_seq_lens_q")
    if cu is not None:  # a packed row: each example's own; tokens past the last boundary (none here) their count
        ends = torch.cat([cu[1:], cu.new_tensor([tokens])])  # each example's end, then the row's
        per = (ends - cu)[torch.searchsorted(ends, torch.arange(tokens, device=cu.device), right=True)]
        return per.reshape(1, tokens, 1).expand(rows, tokens, 1).float()
    mask = layout.get("attention_mask")
    if mask is not None and mask.dim() == 2:  # padded rows: each row's real tokens
        return mask.sum(dim=1).clamp(min=1).reshape(rows, 1, 1).expand(rows, tokens, 1).float()
    return torch.full((rows, tokens, 1), float(tokens), device=device)


def _real_width(layout: dict, tokens: int) -> int:
    """The row's tokens before its padding: where a layout padded a packed row (a sequence group to its multiple, a
    pipeline to its slots: one more segment), the count it says (`row_tokens`); else a packed row's last example's
    end, padded rows' longest; `tokens` where the layout says nothing (one host synchronisation a micro-batch, where
    it does)."""
    if (row := layout.get("row_tokens")) is not None:
        return min(int(row), tokens)
    cu = layout.get("cu_seq_lens_q")
    if cu is not None:
        return min(int(cu[-1]), tokens)
    mask = layout.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return min(int(mask.sum(dim=1).max()), tokens)
    return tokens


class Noise:
    """The embedding's forward hook: the noise of a training forward, scaled by the layout the last forward of the
    decoder (or a pipeline's first stage) said its rows have. `sequence`: (rank, size) of this process in its
    sequence-parallel group, whose row it holds the rank-th slice of."""

    def __init__(self, alpha: float, sequence: tuple[int, int] = (0, 1)):
        self.alpha, (self.rank, self.size) = alpha, sequence
        # the ids' shape of the forward and its row layout, read by the hook only when it trains (a cache, a
        # generation's, is never held here)
        self.shape, self.layout = None, {}
        # a sequence slice's group row's tokens before the group's padding, set by the loss's forward (model/loss.py)
        # before it runs the decoder; read once, by the decoder's pre-hook
        self.row_tokens = None

    def read(self, shape, layout: dict) -> None:
        """The rows about to be embedded: the ids' [rows, tokens] and their layout (cu_seq_lens_q, attention_mask)."""
        self.shape, self.layout = shape, layout

    def read_decoder(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.read(None if ids is None else ids.shape[:2],
                  {**{k: kwargs.get(k) for k in ("cu_seq_lens_q", "attention_mask")}, "row_tokens": self.row_tokens})
        self.row_tokens = None

    def __call__(self, module, args, output):
        if not module.training:
            return output
        inside = self.shape == output.shape[:2]  # else called outside the decoder: the batch's width
        rows, width, d = output.shape
        whole = (rows, width * self.size, d) if inside else output.shape  # a sequence slice's group row
        layout = self.layout if inside else {}
        lengths = _lengths(layout, whole, output.device)
        # drawn for the row's real tokens only, the padding's left 0: a layout's padding (a sequence group's multiple,
        # a stage's slots) had moved the random stream on, every later row's noise another than one process's
        real = _real_width(layout, whole[1])
        noise = torch.zeros((rows, real, d), dtype=output.dtype, device=output.device).uniform_(-1, 1)
        if real < whole[1]:
            noise = torch.cat([noise, noise.new_zeros((rows, whole[1] - real, d))], dim=1)
        scale = self.alpha / torch.sqrt(lengths.to(output.device) * d)
        part = slice(self.rank * width, (self.rank + 1) * width) if inside else slice(None)
        return output + noise[:, part] * scale[:, part].to(output.dtype)


def attach_neftune(model, alpha: float, *, sequence: tuple[int, int] = (0, 1)) -> Noise:
    """Add NEFTune's noise to `model`'s input embeddings in training mode (a peft model's base model's). `sequence`:
    this process's (rank, size) in its sequence-parallel group."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, embedding = base.get_decoder(), base.get_input_embeddings()
    noise = Noise(alpha, sequence)
    decoder.register_forward_pre_hook(noise.read_decoder, with_kwargs=True)
    embedding.register_forward_hook(noise)
    embedding.neftune = noise  # for a pipeline's first stage, which embeds outside the decoder
    return noise
