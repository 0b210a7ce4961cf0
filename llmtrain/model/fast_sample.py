"""The fast sampler for online RL: a static KV cache, one prefill per distinct prompt, and a decode step of fixed
shape that reads nothing back to the host, replayed as a CUDA graph where asked (rl.sampler).

It samples by the reference loop's rule (`generate.sample`, the oracle in the tests): the same completion seeds,
the same pre-drawn uniforms, the same `next_tokens`. Its attention path (SDPA over the static cache) gives logits
that differ from the reference's in the last bits (~1e-6 in fp32), so a uniform within that distance of a CDF
boundary draws the neighbouring token: the same completions up to rounding (tests/test_fast_sample.py measures the
agreement rate); its batch moves a row's logits in their last bits too (a matmul rounds a row differently with other
rows beside it), so a completion is its batch's own up to the same rounding. What changes is the cost of a token:

- The KV cache is preallocated once for the call: [rows, kv heads, L, head dim] per layer, L = the longest prompt +
  max_new_tokens, zeroed (a masked slot must hold a finite value: softmax gives it weight 0, and 0 x NaN is NaN).
  Prompts are left-padded to the longest, so every row writes the same slot at a step; each row has its own
  positions (rotary) and its own first valid slot. The attention mask is computed from the slot counter inside the
  step (no growing mask): row r attends to the slots from its first real token to the current one. A step reads
  the cache's slots up to the next multiple of SPAN only, so early tokens do not pay for the whole cache (one
  captured graph per span).
- The `num_generations` completions of a prompt share its prefix: each distinct prompt is prefilled once and its
  KV rows are copied to its completions.
- A decode step forwards one token per row through the model's own decoder layers (transformers' modules, so LoRA,
  QLoRA's 4-bit layers and the model's attention stay as they train), writes its K/V at the slot, draws the next
  token from the row's pre-drawn uniform (`next_tokens`: inverse CDF after repetition_penalty, top_k, top_p and
  min_p, no torch.multinomial; the penalty's seen tokens a [rows, vocab] flag per row in the state), writes it to a
  device buffer and advances its counters in place. Its inputs and outputs are
  tensors allocated before the loop, so the step can be captured once and replayed (`capture=True`, CUDA only).
  End-of-turn flags stay on the device: the host looks at them every CHECK_EVERY tokens, and copies the tokens back
  once.
- LoRA: each adapted linear forwards through a merged generation copy of its weight (W + s B A, built beside the
  trained weights for the rollout: model/merged_copy.py, rl.merged_copy), or unmerged beside the base (off, or
  where the copy does not fit). Never an in-place merge/unmerge: in bf16 it does not restore the base (TRL #6688).
- Finished rows leave the batch: at a look at the end-of-turn flags, once no more than COMPACT_AT of the rows are
  still going, the live rows (their state, uniforms and KV cache) move to the front and the step runs on them only
  (a captured graph per batch size), so the cost follows the rows still running. A completion is the same either
  way up to rounding: no row reads another's, and its uniforms go with it.
- The prefill forwards at most PREFILL_CHUNK prompt positions at once (config.py), each chunk attending to
  the ones before it through the cache: a long prompt group needs a chunk's activations, not the whole width's.

Models: the Llama layout (`model.layers`, `embed_tokens`, `rotary_emb`, `norm`, `lm_head`, attention that updates a
cache object): llama, mistral, qwen2, qwen3, phi3 (fused projections, a window on every layer as Mistral's),
gemma3_text (scaled embeddings in embed_tokens, a RoPE per kind of layer, local layers' windows) and the mixtures of
experts qwen3_moe, mixtral and gpt_oss (their router and experts run inside transformers' layer; LoRA-adapted experts
run their adapters beside the base experts, unmerged: model/lora_experts.py; GPT-OSS's attention sinks in
`_with_sinks`), and gemma4_text (its per-layer inputs and shared keys and values: `_Forward`). Others sample with the
reference loop (`supports`).
"""

from __future__ import annotations

import inspect

import torch

from llmtrain.capabilities import FAMILIES
from llmtrain.config import PREFILL_CHUNK  # noqa: F401  (read as fast_sample.PREFILL_CHUNK: the tests set it)
from llmtrain.model.attention import SINKS, layer_kinds, rotary_by_kind
from llmtrain.model.generate import Drawn, Stops, attention_as, next_tokens, seen_tokens
from llmtrain.model.loss import causal_lm

CHECK_EVERY = 16  # tokens between two looks at the end-of-turn flags (the only host syncs while decoding)
SPAN = 256  # a decode step attends to the cache's slots up to the next multiple of this (one graph per span)
COMPACT_AT = 0.5  # the decode batch drops its finished rows once no more than this share of its rows is still going
# models whose forward is embed -> layers -> norm -> head
# the capability table's families whose layer llmtrain models, each with the Llama layout's modules
LAYOUTS = tuple(key for key, family in FAMILIES.items() if family.fast_sampler)
WINDOWED = ("mistral", "phi3")  # no layer_types: config.sliding_window applies to every layer


def supports(lm) -> bool:
    """Whether the fast sampler can run this model: the Llama layout, its parameters whole or split by tensor
    parallelism (FSDP's shards are gathered for sampling first: fsdp.gathered_for_generation)."""
    model = causal_lm(lm)
    if getattr(model.config, "model_type", None) not in LAYOUTS:
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("layers", "embed_tokens", "rotary_emb", "norm"))


def tensor_parallel(lm) -> bool:
    """Whether the model's layers are split by tensor parallelism (its parameters DTensors): each process of a group
    runs its heads and columns (the layers' own collectives sum them), so the step runs eagerly (no CUDA graph of
    collectives) on the split weights (no merged copy of them)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in causal_lm(lm).parameters())


class _SlotCache:
    """The static KV cache as a decoder layer's attention sees it: `update` writes the new keys and values at the
    step's slots and returns the layer's whole cache (its first `length` slots)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, length: int):
        self.keys, self.values, self.slots, self.length = keys, values, slots, length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, : self.length], v[:, :, : self.length]


class _Forward:
    """The model's forward over the cache: embed, each decoder layer with a boolean mask [rows, 1, q, kv] and the
    rotary embeddings of the rows' positions, the final norm and the head on the last position only, its logits as the
    model's own forward makes them (loss.logit_transform: a cap, a scale). Gemma 4's layers also take their per-layer
    inputs (its per-layer embeddings of the ids, projected with the embeddings, as its model computes them) and the
    keys and values its later layers share (`shared_kv_states`: a storing layer puts there what the cache gives it,
    the sharing layers read them: they write no cache of their own). As those layers are the last ones and write no
    cache, only the last position's output of theirs is ever read: a prefill runs them on that position alone, as
    transformers' own generate does (Gemma4TextModel._maybe_slice_kv_shared_inputs)."""

    def __init__(self, lm):
        from llmtrain.model.loss import logit_transform

        self.model = causal_lm(lm)
        inner = self.model.model
        self.inner, self.layers = inner, list(inner.layers)
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x renamed it
        self.shares_kv = "shared_kv_states" in params
        self.per_layer = bool(getattr(inner, "hidden_size_per_layer_input", None))
        cfg = self.model.config
        self.types = layer_kinds(cfg, len(self.layers))
        window = getattr(cfg, "sliding_window", None)
        self.windows = [window if t == "sliding_attention" or (window and cfg.model_type in WINDOWED) else None
                        for t in self.types]
        self.head = self.model.get_output_embeddings()
        self.logits = logit_transform(self.model)
        shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0) if self.shares_kv else 0
        self.first_shared = len(self.layers) - shared if shared else None  # Gemma 4's first kv-sharing layer

    def __call__(self, ids, positions, masks: dict, cache: _SlotCache) -> torch.Tensor:
        hidden = self.inner.embed_tokens(ids)
        rotary = rotary_by_kind(self.inner.rotary_emb, hidden, positions, self.types)  # Gemma 3: one per kind of layer
        extra = {self.cache_arg: cache}
        if self.shares_kv:
            extra["shared_kv_states"] = {}
        per_layer = self.inner.project_per_layer_inputs(hidden, self.inner.get_per_layer_inputs(ids, None)) \
            if self.per_layer else None
        for i, (layer, window, kind) in enumerate(zip(self.layers, self.windows, self.types)):
            if i == self.first_shared and hidden.size(1) > 1:  # the rest write no cache: the last position alone
                hidden, positions = hidden[:, -1:], positions[:, -1:]
                rotary = {k: (cos[:, -1:], sin[:, -1:]) for k, (cos, sin) in rotary.items()}
                masks = {w: m[:, :, -1:] for w, m in masks.items()}
                per_layer = per_layer[:, -1:] if per_layer is not None else None
            if per_layer is not None:
                extra["per_layer_input"] = per_layer[:, :, i, :]
            hidden = layer(hidden, attention_mask=masks[window], position_ids=positions,
                           position_embeddings=rotary[kind], **extra)
        logits = self.head(self.inner.norm(hidden[:, -1:]))[:, -1]  # [rows, vocab]: logits_to_keep=1
        return logits if self.logits.plain else self.logits(logits)


ATTENTION = "llmtrain_sample"


def sample_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA over the static cache with the step's boolean mask [rows, 1, q, slots], whatever the run trains with.
    A decode step (one query a row) with grouped K/V runs each K/V head's query heads as its queries, so the cache
    is read once, never repeated to every query head (transformers' SDPA path repeats it under a mask: a copy of
    4x the cache a layer a token for Mistral's 32 query / 8 K/V heads). The prefill repeats it (once a rollout).
    Attention sinks (GPT-OSS's, handed as s_aux): _with_sinks."""
    sinks = next((kwargs[name] for name in SINKS if kwargs.get(name) is not None), None)
    if sinks is not None:
        return _with_sinks(query, key, value, attention_mask, scaling, sinks)
    rows, heads, q, dim = query.shape
    groups = heads // key.shape[1]
    if q == 1 and groups > 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.view(rows, key.shape[1], groups, dim), key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(rows, heads, 1, dim)  # CUDA SDPA under a mask returns it non-contiguous
    else:
        if groups > 1:
            key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _with_sinks(query, key, value, mask, scaling, sinks):
    """Attention over the cache whose softmax over each row also holds its head's sink logit (which takes probability
    and gives nothing), as GPT-OSS's eager attention computes it (SDPA has no such column): each K/V head's query heads
    as its queries, so the cache is read as it is, not repeated; the softmax in fp32, in place on one tensor of the
    scores (the sink enters its max and its sum: no column is concatenated). A query whose slots are all masked
    gives zeros, its weight all on the sink."""
    rows, heads, q, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    scores = (query.reshape(rows, kv_heads, groups * q, dim) @ key.transpose(-1, -2)).float().mul_(scale)
    scores = scores.view(rows, kv_heads, groups, q, slots).masked_fill_(~mask.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, kv_heads, groups, 1, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    scores = scores.sub_(top).exp_()
    probs = scores.div_(scores.sum(-1, keepdim=True) + (sink - top).exp_()).to(value.dtype)
    out = probs.view(rows, kv_heads, groups * q, slots) @ value  # [rows, kv heads, groups x q, dim]
    return out.view(rows, heads, q, dim).transpose(1, 2).contiguous(), None


def _sample_attention(lm):
    """`sample_attention` while sampling, the run's own attention put back after."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, sample_attention)
    return attention_as(causal_lm(lm).config, ATTENTION)


def _window_mask(allowed: torch.Tensor, query_slots: torch.Tensor, key_slots: torch.Tensor, window: int | None):
    """`allowed` cut to the `window` slots before each query's (sliding-window attention), as transformers cuts it."""
    return allowed if window is None else allowed & (key_slots > query_slots - window)


@torch.no_grad()
def sample_fast(lm, prompts: list[list[int]], *, seeds: list[int], max_new_tokens: int, temperature: float,
                top_p: float, stop_ids: set[int], pad_id: int, top_k: int = 0, min_p: float = 0.0,
                repetition_penalty: float = 1.0, capture: bool = False, copy: str = "off",
                compact: bool = True, logps: bool = False) -> list[list[int]] | list[Drawn]:
    """Each prompt's completion, as `generate.sample` returns it: at most max_new_tokens ids, ending with a stop id
    where one was drawn. capture: replay the decode step as a CUDA graph (CUDA only); copy: rl.merged_copy (the
    adapted linears on a merged generation copy, model/merged_copy.py; LoRA-adapted experts run their adapters beside
    the base experts whatever it says, as they train: model/lora_experts.py); compact: drop finished rows from the
    decode batch (the same tokens either way); logps: each completion a generate.Drawn, with the sampler's
    log-probability of each token."""
    from llmtrain.model.merged_copy import merged_for_sampling

    device = lm.device
    forward = _Forward(lm)
    uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(s),
                                       dtype=torch.float64) for s in seeds]).to(device=device, dtype=torch.float32)
    cache = _cache_bytes(forward, len(prompts), max(map(len, prompts)) + max_new_tokens)
    with _sample_attention(lm), torch.compiler.set_stance("force_eager"), \
            merged_for_sampling(lm, copy, spare_bytes=cache):
        logits, keys, values = _prefill(forward, prompts, steps=max_new_tokens, pad_id=pad_id, device=device)
        decode = _Decode(forward, prompts, keys, values, uniforms=uniforms, stop_ids=stop_ids, pad_id=pad_id,
                         sampling=dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                       repetition_penalty=repetition_penalty), logps=logps)
        decode.first(logits)
        decode.run(capture=capture, compact=compact)
    completions = _trim(decode.result.tolist(), Stops.of(stop_ids))  # the one copy back to the host
    if not logps:
        return completions
    return [Drawn(ids, row[:len(ids)]) for ids, row in zip(completions, decode.result_logps.tolist())]


def _cache_bytes(forward: _Forward, rows: int, length: int) -> int:
    """The static KV cache's size for `rows` x `length` slots, in the dtype the layers compute in: each layer's K/V
    heads x head size (Gemma 4's global layers have a head size of their own; its layers that share an earlier one's
    keys and values hold none)."""
    cfg, weight = forward.model.config, forward.inner.embed_tokens.weight
    heads = cfg.num_attention_heads
    element = 2 if torch.is_autocast_enabled(weight.device.type) else weight.element_size()
    total = 0
    for layer in forward.layers:
        attn = layer.self_attn
        if getattr(attn, "is_kv_shared_layer", False):
            continue
        dim = getattr(attn, "head_dim", None) or cfg.hidden_size // heads
        total += heads // getattr(attn, "num_key_value_groups", 1) * dim
    return 2 * rows * length * total * element


def _prefill(forward: _Forward, prompts: list[list[int]], *, steps: int, pad_id: int, device: torch.device):
    """Each distinct prompt forwarded once, left-padded to the common width, in chunks of PREFILL_CHUNK positions (a
    chunk attends to the slots before it through the prefill's cache): (each row's last logits [rows, vocab], the
    static cache's keys and values per layer [rows, kv heads, width + steps, head dim], each row's prompt prefix
    copied into its first width slots, the rest zero)."""
    rows, width = len(prompts), max(map(len, prompts))
    length = width + steps  # the cache's slots: the longest prompt, then one slot per decoded token
    distinct = list(dict.fromkeys(map(tuple, prompts)))
    which = torch.tensor([distinct.index(tuple(p)) for p in prompts], device=device)  # each row's distinct prompt
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in distinct], device=device)
    real = ids.new_tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct])
    positions = (real.cumsum(-1) - 1).clamp(min=0)
    slots = torch.arange(width, device=device)
    small = _PrefillCache(len(forward.layers), width)  # the distinct prompts' keys and values, chunk after chunk
    for a in range(0, width, PREFILL_CHUNK):
        b = min(width, a + PREFILL_CHUNK)
        q, k = slots[a:b, None], slots[None, :b]
        causal = (k <= q)[None] & (real[:, None, :b] == 1)
        causal |= (k == q)[None]  # a pad attends to itself: no all-masked row
        masks = {w: _window_mask(causal, q, k, w)[:, None] for w in set(forward.windows)}
        small.start, small.stop = a, b
        logits = forward(ids[:, a:b], positions[:, a:b], masks, small)
    keys, values = [], []  # the static cache: each row gets its prompt's prefix
    for k, v in zip(small.keys, small.values):
        if k is None:  # a layer that reads an earlier one's keys and values (Gemma 4's shared ones) holds none
            keys.append(None), values.append(None)
            continue
        keys.append(k.new_zeros(rows, k.size(1), length, k.size(3)))
        values.append(v.new_zeros(rows, v.size(1), length, v.size(3)))
        keys[-1][:, :, :width] = k[which]
        values[-1][:, :, :width] = v[which]
    return logits[which], keys, values


class _Decode:
    """The decode state, every tensor the step reads or writes allocated once (`state`), and the step: one token
    per row, in place, no host sync, fixed shapes, so it can be captured and replayed. Its rows are the rows still
    going: `compact` drops the finished ones (`rows`: each one's place in the rollout; `result` keeps what every row
    drew)."""

    def __init__(self, forward: _Forward, prompts: list[list[int]], keys: list, values: list, *,
                 uniforms: torch.Tensor, stop_ids: set[int], pad_id: int, sampling: dict, logps: bool = False):
        device, rows, steps = uniforms.device, len(prompts), uniforms.size(1)
        self.forward, self.uniforms, self.pad_id, self.sampling = forward, uniforms, pad_id, sampling
        self.prompts = prompts  # their tokens: repetition_penalty's first seen ones (`first`)
        self.width = width = max(map(len, prompts))
        self.length = width + steps
        stop_ids = Stops.of(stop_ids)
        self.stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
        # an end of turn of several tokens (Stops.sequences): each, and the columns back from a row's last token
        self.sequences = [(torch.tensor(seq, device=device), torch.arange(1 - len(seq), 1, device=device))
                          for seq in stop_ids.sequences]
        self.key_slots = torch.arange(self.length, device=device)
        self.start = torch.tensor([width - len(p) for p in prompts], device=device)  # each row's first real slot
        self.windows = set(forward.windows)
        self.rows = torch.arange(rows, device=device)
        self.result = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        # logps: each drawn token's log-probability under the sampler's distribution (next_tokens'), as `out`
        self.result_logps = torch.zeros(rows, steps, device=device) if logps else None
        self.state = dict(
            ids=torch.zeros(rows, 1, dtype=torch.long, device=device),  # the token each row forwards next
            positions=torch.tensor([[len(p)] for p in prompts], device=device),  # its position (rotary)
            slot=torch.tensor([width], device=device),  # the cache slot it is written to (every row alike)
            column=torch.ones(rows, 1, dtype=torch.long, device=device),  # the token drawn next: out's column
            done=torch.zeros(rows, dtype=torch.bool, device=device),
            out=torch.full((rows, steps), pad_id, dtype=torch.long, device=device))
        if logps:
            self.state["logps"] = torch.zeros(rows, steps, device=device)
        self.cache = _SlotCache(keys, values, self.state["slot"], self.length)

    def first(self, logits: torch.Tensor) -> None:
        """The first token of each row, from the prefill's logits; with a repetition_penalty, each row's seen tokens
        [rows, vocab] join the state (its prompt's, then each drawn one)."""
        if self.sampling["repetition_penalty"] != 1.0:
            self.state["seen"] = seen_tokens(self.prompts, logits.shape[-1], logits.device)
        logps = self.state["logps"][:, 0] if "logps" in self.state else None
        token = next_tokens(logits, self.uniforms[:, 0], **self.sampling, seen=self.state.get("seen"), logps=logps)
        if "seen" in self.state:
            self.state["seen"].scatter_(1, token[:, None], True)
        self.state["out"][:, 0] = token
        self.state["done"].copy_((token[:, None] == self.stops).any(-1))
        self.state["ids"].copy_(token[:, None])

    def step(self) -> None:
        """One token per row, all in place on `state` (the cache's first `cache.length` slots: set before a call,
        or before a capture)."""
        s, slots = self.state, self.key_slots[None, : self.cache.length]
        allowed = (slots >= self.start[:, None]) & (slots <= s["slot"])
        masks = {w: _window_mask(allowed, s["slot"], slots, w)[:, None, None] for w in self.windows}
        logits = self.forward(s["ids"], s["positions"], masks, self.cache)
        logps = s["done"].new_zeros(s["done"].shape, dtype=torch.float32) if "logps" in s else None
        drawn = next_tokens(logits, self.uniforms.gather(1, s["column"]).squeeze(1), **self.sampling,
                            seen=s.get("seen"), logps=logps)
        drawn = torch.where(s["done"], torch.full_like(drawn, self.pad_id), drawn)
        if "seen" in s:
            s["seen"].scatter_(1, drawn[:, None], True)  # a finished row's pad: it draws no more
        s["out"].scatter_(1, s["column"], drawn[:, None])
        if logps is not None:  # a finished row's: never read (its tokens end at its stop)
            s["logps"].scatter_(1, s["column"], logps[:, None])
        s["done"] |= (drawn[:, None] == self.stops).any(-1)
        for seq, back in self.sequences:  # its last len(seq) tokens are the sequence (a finished row's are pads)
            window = s["out"].gather(1, (s["column"] + back).clamp(min=0))
            s["done"] |= (window == seq).all(-1) & (s["column"].squeeze(1) >= seq.numel() - 1)
        s["ids"].copy_(drawn[:, None])
        s["positions"].add_(1)
        s["slot"].add_(1)
        s["column"].add_(1)

    def compact(self, live: torch.Tensor, filled: int) -> None:
        """Keep the rows at `live` only (the ones still going), in order: what the finished rows drew goes to
        `result`, and every per-row buffer is cut to the live rows, the KV cache in place (its first `filled` slots
        moved to the front rows, layer by layer: no second cache). A row's tokens do not change: its uniforms,
        positions and cache go with it, and no row reads another's."""
        s, n = self.state, live.numel()
        self._keep_results()
        self.rows, self.start, self.uniforms = self.rows[live], self.start[live], self.uniforms[live]
        for key in ("ids", "positions", "column", "done", "out", "seen", "logps"):
            if key in s:
                s[key] = s[key][live]
        for cache in (self.cache.keys, self.cache.values):
            for i, x in enumerate(cache):
                if x is not None:  # (a layer that shares another's keys and values holds none)
                    x[:n, :, :filled] = x[live, :, :filled]
                    cache[i] = x[:n]

    def run(self, *, capture: bool, compact: bool = True) -> None:
        """The tokens after the first, until every row is done (looked at every CHECK_EVERY tokens) or the last;
        capture: each span's step captured once as a CUDA graph and replayed (eager where capture fails); compact:
        once no more than COMPACT_AT of the rows are going, the finished ones leave the batch (at a look), so the
        step's cost follows the rows still running (a few batch sizes: each at most COMPACT_AT of the last)."""
        state, cache, width, length = self.state, self.cache, self.width, self.length
        # one captured step per span and batch size, in one pool (they never run at once: the memory a capture
        # frees is the next one's)
        graphs = {} if capture and _can_capture(self.uniforms.device) else None
        for t in range(1, self.uniforms.size(1)):
            if t % CHECK_EVERY == 0:  # host sync, every CHECK_EVERY tokens only
                going = ~state["done"]
                live = int(going.sum())
                if live == 0:
                    break
                if compact and live <= COMPACT_AT * going.numel():
                    self.compact(going.nonzero().squeeze(1), filled=width + t - 1)
                    state = self.state
            # Attention reads the slots up to the next multiple of SPAN only (the host knows the step's slot,
            # width + t - 1, without asking the device): early tokens do not pay for the whole cache.
            cache.length = min(length, (width + t - 1) // SPAN * SPAN + SPAN)
            key = (cache.length, len(self.rows))
            if graphs is not None and key not in graphs:
                try:
                    graphs[key] = _captured(self.step, state, warmup=min(2, length - (width + t - 1)),
                                            pool=next(iter(graphs.values())).pool() if graphs else None)
                except RuntimeError as e:  # an op that cannot be captured (a kernel library's): eager from here
                    import warnings

                    warnings.warn(f"rl.sampler=graph: the decode step could not be captured as a CUDA graph ({e}); "
                                  "this rollout samples eagerly (rl.sampler=static), with the same tokens")
                    graphs = None
            if graphs is None:
                self.step()
            else:
                graphs[key].replay()
        self._keep_results()

    def _keep_results(self) -> None:
        """What the rows in the batch drew so far (and its log-probabilities) to their places in the rollout."""
        self.result.index_copy_(0, self.rows, self.state["out"])
        if self.result_logps is not None:
            self.result_logps.index_copy_(0, self.rows, self.state["logps"])


class _PrefillCache:
    """The prefill's cache: each layer's keys and values of the distinct prompts [prompts, kv heads, width, head dim],
    the chunk's written at its slots [start, stop), and the slots up to stop given back to its attention."""

    def __init__(self, layers: int, width: int):
        self.width, self.start, self.stop = width, 0, width
        self.keys: list = [None] * layers
        self.values: list = [None] * layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            shape = (*key_states.shape[:2], self.width, key_states.size(3))
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + (value_states.size(3),))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, self.start:self.stop] = key_states
        v[:, :, self.start:self.stop] = value_states
        return k[:, :, : self.stop], v[:, :, : self.stop]


def _can_capture(device: torch.device) -> bool:
    return device.type == "cuda"


def _captured(step, state: dict, *, warmup: int, pool=None) -> torch.cuda.CUDAGraph:
    """`step` captured as a CUDA graph, to be replayed: run `warmup` times on a side stream first (cuBLAS and the
    allocator set themselves up outside the capture; never past the cache's last slot), the state put back as it
    was, then captured once, in `pool` (the call's graphs share their memory: they never run at once)."""
    saved = {k: v.clone() for k, v in state.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for k, v in saved.items():  # the warm-up's writes to the cache are at slots the real steps write before reading
        state[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA call during the capture (the data prefetch pinning a batch) is neither
    # refused nor taken into the graph
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        step()
    return graph


def _trim(tokens: list[list[int]], stops: Stops) -> list[list[int]]:
    """Each row's tokens up to and including its first stop (all of them where none was drawn)."""
    return [row[:stops.end(row) or len(row)] for row in tokens]


def sampler_for(lm, kind: str, *, copy: str = "off"):
    """The sampling function rl.sampler names for this model (generate.sample's signature): the reference loop where
    asked, or where the fast sampler cannot run the model (`supports`); copy: rl.merged_copy, for the fast sampler."""
    from functools import partial

    from llmtrain.model.generate import sample

    if kind == "reference":
        return sample
    if not supports(lm):
        import warnings

        warnings.warn(f"rl.sampler={kind}: the fast sampler runs the Llama layout ({', '.join(LAYOUTS)}) with whole "
                      f"parameters; this {causal_lm(lm).config.model_type} model samples with the reference loop "
                      "(slower; the same tokens up to rounding)", stacklevel=2)
        return sample
    # a model split by tensor parallelism steps eagerly (its layers' collectives), on its merged part where asked
    return partial(sample_fast, capture=kind == "graph" and not tensor_parallel(lm), copy=copy)
