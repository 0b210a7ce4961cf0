"""Sampling on pipeline stages: the stages of one pipeline as the model that model/generate.sample decodes with.

Each decoding step (the prompts' pass, then one token a row) runs through the stages in order with the KV cache of
each stage's own layers kept where they run: the first stage embeds the tokens, each stage hands its hidden states to
the next (point to point, in the pipeline's process group; Gemma 4's per-layer inputs and its store layers' new keys
and values with them, as in training: stage.Stage._decode), and the last applies the final norm and the head to the
last position; its logits (fp32, [rows, 1, vocab]) are broadcast to every stage of the pipeline, so every process of
it picks the same tokens with generate.sample's own code (its uniforms, filters and stops). A step costs one hop a
stage boundary and the logits' broadcast; the stages run one after another (no micro-batches in flight: the
bubble is P - 1 of P stages idle), which is the price of a model that does not fit on one process.

The attention is transformers' SDPA (or eager where the model has no SDPA: generate.cached_attention) with the
cache, each layer's mask made here: causal over the left-padded rows, the padding left out, a sliding layer's
window (its self_attn.sliding_window, Mistral's config.sliding_window). The pipeline's replicas each sample their own
prompts; sharded stages (FSDP over the replicas) are gathered once for the whole block (`Pipeline.sampling`).
"""

from __future__ import annotations

import torch

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Out(dict):
    """What generate.sample reads of a forward: .logits and ["cache"]."""

    @property
    def logits(self) -> torch.Tensor:
        return self["logits"]


class _State:
    """A decoding's KV cache (this process's layers'), and the shared keys and values its stages received (Gemma 4's:
    Stage._decode)."""

    def __init__(self):
        from transformers import DynamicCache

        self.kv = DynamicCache()  # lazily a layer of its own for each layer index it is given (none sliding: whole)
        self.held: dict = {}


# What crosses a stage boundary at each decoding step: the hidden states, and Gemma 4's per-layer inputs and new keys
# and values (Stage._decode), led by a header of their dtypes and shapes (they change with the step's positions)
_MOST, _DIMS = 8, 4


def _send(tensors: tuple, dst: int, group, device) -> None:
    import torch.distributed as dist

    header = torch.zeros(1 + _MOST * (2 + _DIMS), dtype=torch.long)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        at = 1 + i * (2 + _DIMS)
        header[at], header[at + 1] = _WIRE_DTYPES.index(t.dtype), t.dim()
        header[at + 2: at + 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(device), dst=dst, group=group)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=group)


def _receive(src: int, group, device) -> tuple:
    import torch.distributed as dist

    header = torch.empty(1 + _MOST * (2 + _DIMS), dtype=torch.long, device=device)
    dist.recv(header, src=src, group=group)
    header, out = header.tolist(), []
    for i in range(header[0]):
        at = 1 + i * (2 + _DIMS)
        t = torch.empty(header[at + 2: at + 2 + header[at + 1]], dtype=_WIRE_DTYPES[header[at]], device=device)
        dist.recv(t, src=src, group=group)
        out.append(t)
    return tuple(out)


def window_of(layer) -> int | None:
    """A decoder layer's sliding window, as its attention applies it: its own (Gemma 3's, Qwen's, GPT-OSS's local
    layers; None on a global one), else its config's (Mistral's); None: none."""
    attn = getattr(layer, "self_attn", None)
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def decode_mask(attention_mask: torch.Tensor, queries: int, window: int | None, *, boolean: bool) -> torch.Tensor:
    """The attention mask [rows, 1, queries, keys] of the last `queries` positions of left-padded rows
    (`attention_mask` [rows, keys]: 0 on the padding): each attends to the real positions up to itself (within the
    last `window`, itself among them), and a padding position to itself alone (softmax over nothing is NaN). Boolean
    (True: attend) for SDPA; additive fp32 (0 or the most negative) for eager attention."""
    keys = attention_mask.shape[1]
    device = attention_mask.device
    key = torch.arange(keys, device=device)
    query = torch.arange(keys - queries, keys, device=device)[:, None]
    allowed = (key <= query) & attention_mask[:, None, None, :].bool()
    if window is not None:
        allowed = allowed & (query - key < window)
    allowed = allowed | (key == query)
    if boolean:
        return allowed
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)


class StagesLM:
    """The stages of one pipeline as a causal LM for generate.sample: called on every process of the pipeline with
    the same rows, it returns the last position's logits on every one of them. `pipeline`: parallel/pipeline
    schedule.Pipeline (this process's stage modules, its group, the head's logit transform)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.config = pipeline.config
        self.device = pipeline.device
        self._supports_sdpa = pipeline.supports_sdpa  # read by generate.cached_attention

    def __call__(self, *, input_ids, attention_mask, position_ids, use_cache: bool = True, logits_to_keep: int = 1,
                 cache: _State | None = None, past_key_values: _State | None = None) -> _Out:
        p = self.pipeline
        g = p.group
        state = cache or past_key_values or _State()
        rows, queries = input_ids.shape
        boolean = self.config._attn_implementation != "eager"
        made: dict = {}

        def masks(layer):
            window = window_of(layer)
            if window not in made:
                made[window] = decode_mask(attention_mask, queries, window, boolean=boolean)
            return made[window]

        total = len(p.stage_ranks)
        handed, logits = (input_ids,), None
        for s in range(total):
            module = p.by_stage.get(s)
            if module is None:
                continue
            if s > 0 and s - 1 not in p.by_stage:  # the previous stage is another process's
                handed = _receive(p.stage_ranks[s - 1], g.group, self.device)
            out = module(*handed, position_ids=position_ids, cache=state.kv, masks=masks, held=state.held)
            handed = out if isinstance(out, tuple) else (out,)
            if s == total - 1:
                logits = p.logits(module.head(handed[0][:, -1:])).float()
            elif s + 1 not in p.by_stage:  # the next stage is another process's
                _send(handed, p.stage_ranks[s + 1], g.group, self.device)
        if len(p.by_stage) < total:  # the last stage's logits to every stage of the pipeline
            if logits is None:
                logits = torch.empty(rows, 1, p.vocab, dtype=torch.float32, device=self.device)
            logits = p.from_last(logits)
        return _Out(logits=logits, cache=state)
