"""A pipeline stage of a Llama-layout causal LM (Llama, Mistral, Qwen, Gemma 3 and 4, Phi, the mixtures of experts),
cut by hand: the modules a stage runs, and the storage-less placeholders of the ones other stages hold; what crosses a
boundary beside the hidden states (Gemma 4's per-layer inputs and shared keys and values: kv_handoffs). Where the
stages run and how they are split: schedule.py and group.py beside it.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

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

    def __init__(self, lm, layers: range, *, first: bool, last: bool, precision=nullcontext,
                 balanced: bool = False):
        """`balanced` (model.router_aux_loss_coef): a mixture of experts' load-balancing loss needs every layer's
        router logits; each stage adds its layers' sums (loss.balance_parts over the row's real tokens) to those it
        receives and hands them on beside the hidden states, the last stage's loss reads the whole row's (its
        routing probabilities' gradient flows back through the stages as the hidden states' does)."""
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
        # Gemma 4: its per-layer inputs, made on the first stage from the token ids and the embeddings (the modules
        # that make them live there) and handed on with the hidden states, each stage reading its layers' and passing
        # the later layers' on; and the keys and values a layer stores for later layers of its kind (KV sharing),
        # handed on while a later stage reads them
        self.per_layer = bool(getattr(lm.config, "hidden_size_per_layer_input", None))
        # (the decoder's own methods, bound: not a submodule, which would bring every layer)
        self.make_per_layer = (decoder.get_per_layer_inputs, decoder.project_per_layer_inputs) \
            if first and self.per_layer else None
        if self.make_per_layer is not None:
            self.per_layer_modules = nn.ModuleList(getattr(decoder, n) for n in PER_LAYER_MODULES)
        self.kv_in, self.kv_out = kv_handoffs(lm.config, layers.start), kv_handoffs(lm.config, layers.stop)
        self.start = layers.start
        shared = int(getattr(lm.config, "num_kv_shared_layers", 0) or 0)
        self.first_shared = lm.config.num_hidden_layers - shared if shared else None  # Gemma 4's first sharing layer
        # (every Gemma 4 layer takes the dict: transformers 5.17's store layers write into it whether or not a later
        # layer reads it)
        self.shares_kv = "shared_kv_states" in inspect.signature(type(decoder.layers[0]).forward).parameters
        self.balanced = Balance(lm, self.layers) if balanced else None

    def forward(self, x, *handed, position_ids, cu_seq_lens=None, real=None, cache=None, masks=None, held=None):
        """Training and evaluation: a packed row (`cu_seq_lens`: its examples' boundaries) under the run's autocast.
        Sampling (`cache`: a transformers Cache, `masks`: each layer's attention mask, `held`: the decoding's shared
        keys and values received so far, _decode): the new positions of a batch of left-padded rows with the KV cache
        of this stage's layers, as the unwrapped model generates (no autocast: one process's sampling runs the model
        as it is), through this forward so FSDP's hooks gather the stage. A head that is an FSDP unit of its own (an
        fp32 head's: schedule.Pipeline) is gathered here too, as the stage is, on every replica alike: the loss calls it
        outside this forward, and not on a row that holds nothing to score (a forward-only pass's idle rows), where
        its gather would wait for the other replicas' (a hang, seen on 2 x 2 processes)."""
        if isinstance(self.head, FSDPModule):
            self.head.unshard()
        if cache is not None:
            return self._decode(x, handed, position_ids, cache, masks, {} if held is None else held)
        with self.precision():
            if self.balanced is None:
                return self._forward(x, handed, position_ids, cu_seq_lens, real)
            # the sums received last among the handed tensors (none on the first stage); the hidden states (and
            # Gemma 4's handed tensors) first, the sums with this stage's layers' added last
            handed, received = (handed, None) if self.embed is not None else (handed[:-1], handed[-1])
            with self.balanced.recording() as routed:
                out = self._forward(x, handed, position_ids, cu_seq_lens, real)
            return (*(out if isinstance(out, tuple) else (out,)), self.balanced.add(routed, received, real, x.device))

    def _decode(self, x, handed, position_ids, cache, masks, held: dict):
        """One decoding step's new positions through the stage's layers. Gemma 4 hands on what it does in training
        (_forward): the per-layer inputs of the later layers (made on the first stage from the new tokens), and the
        keys and values its store layers made for sharing layers on later stages, as the new positions' alone: each
        receiving stage appends them to what it holds of them (`held`, by its first layer and kind, for the whole
        decoding), so that its sharing layers read the whole length, as the store layer's own cache has it. The
        sharing layers (the last ones) run on each row's last position alone, as transformers' Gemma 4 runs them when
        only the last logits are read (_maybe_slice_kv_shared_inputs): they add nothing to a cache."""
        new = position_ids.shape[1]  # the step's positions (the store layers' new keys and values)
        h = self.embed(x) if self.embed is not None else x
        if h.shape[1] < new:  # an earlier stage's sharing layers kept the last position alone
            position_ids, masks = position_ids[:, -1:], _last_query(masks)
        per_layer, handed = (handed[0], handed[1:]) if self.per_layer and self.embed is None else (None, handed)
        if self.make_per_layer is not None:  # as transformers' Gemma4TextModel makes them
            lookup, project = self.make_per_layer
            per_layer = project(h, lookup(x, h))
        shared = {}
        for i, kind in enumerate(self.kv_in):
            step, before = handed[2 * i: 2 * i + 2], held.get((self.start, kind))
            shared[kind] = held[(self.start, kind)] = tuple(step) if before is None else tuple(
                torch.cat([b, n], dim=2) for b, n in zip(before, step))
        extra = {"shared_kv_states": shared} if self.shares_kv else {}
        pe = rotary_by_kind(self.rotary, h, position_ids, self.kinds)
        for i, (layer, kind) in enumerate(zip(self.layers, self.kinds)):
            if self.start + i == self.first_shared and h.shape[1] > 1:
                h, masks, position_ids = h[:, -1:], _last_query(masks), position_ids[:, -1:]
                per_layer = per_layer[:, -1:] if per_layer is not None else None
                pe = {k: tuple(t[:, -1:] for t in pair) for k, pair in pe.items()}
            if per_layer is not None:
                extra["per_layer_input"] = per_layer[:, :, i]
            h = layer(h, attention_mask=masks(layer), position_ids=position_ids, use_cache=True,
                      position_embeddings=pe[kind], **{_cache_name(type(layer)): cache}, **extra)
        if self.norm is not None:
            return self.norm(h)
        out = [per_layer[:, :, len(self.layers):].contiguous()] if per_layer is not None else []
        out += [t[:, :, -new:].contiguous() for kind in self.kv_out for t in shared[kind]]
        return (h, *out) if out else h

    def _forward(self, x, handed, position_ids, cu_seq_lens, real=None):
        cu = cut_points(cu_seq_lens)
        if (noise := getattr(self.embed, "neftune", None)) is not None:  # train.neftune_alpha: the row's examples,
            # and its tokens before the slots' padding (`real`: the schedule's, one a row)
            noise.read(x.shape[:2], {"cu_seq_lens_q": cu, "row_tokens": None if real is None else int(real.sum())})
        h = self.embed(x) if self.embed is not None else x
        longest = int((cu[1:] - cu[:-1]).max())
        pe = rotary_by_kind(self.rotary, h, position_ids, self.kinds)
        handed = [_ContiguousGrad.apply(t) for t in handed]
        per_layer, handed = (handed[0], handed[1:]) if self.per_layer and self.embed is None else (None, handed)
        if self.make_per_layer is not None:  # as transformers' Gemma4TextModel makes them
            lookup, project = self.make_per_layer
            per_layer = project(h, lookup(x, h))
        shared = {kind: (handed[2 * i], handed[2 * i + 1]) for i, kind in enumerate(self.kv_in)}
        extra = {"shared_kv_states": shared} if self.shares_kv else {}
        for i, (layer, kind) in enumerate(zip(self.layers, self.kinds)):
            if per_layer is not None:  # this stage's layers first, in order
                extra["per_layer_input"] = per_layer[:, :, i]
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe[kind],
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, **extra)
        if self.norm is not None:
            return self.norm(h)
        out = [per_layer[:, :, len(self.layers):].contiguous()] if per_layer is not None else []
        out += [t.contiguous() for kind in self.kv_out for t in shared[kind]]
        return (h, *out) if out else h


def _last_query(masks):
    """Each layer's decoding mask (a function of the layer) for the step's last position alone."""
    return lambda layer: masks(layer)[:, :, -1:]


# Gemma 4's modules that make the per-layer inputs (Gemma4TextModel.get_per_layer_inputs, project_per_layer_inputs):
# the first stage's
PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def kv_sharing(config) -> list:
    """Each layer's part in Gemma 4's KV sharing (config.kv_sharing_modes: "store" for the last layer of each kind
    before the sharing ones, "reuse" for those, None); [] for a model without it. transformers 5.17 (the GPU
    machine's) has no kv_sharing_modes: its layers decide alike from num_kv_shared_layers and layer_types."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not shared:
        return []
    if (modes := getattr(config, "kv_sharing_modes", None)) is not None:
        return list(modes)
    kinds = list(config.layer_types)
    first = len(kinds) - shared
    last = {kind: i for i, kind in enumerate(kinds[:first])}  # each kind's last layer before the sharing ones
    return ["reuse" if i >= first else "store" if last[kind] == i else None for i, kind in enumerate(kinds)]


def kv_handoffs(config, boundary: int) -> list[str]:
    """The layer kinds whose shared keys and values cross the stage boundary before layer `boundary`: stored by a layer
    before it, read by one at or after it (sorted: the order they travel in, keys then values)."""
    modes, kinds = kv_sharing(config), layer_kinds(config, config.num_hidden_layers)
    stored = {kinds[i] for i, m in enumerate(modes[:boundary]) if m == "store"}
    return sorted(stored & {kinds[i] for i, m in enumerate(modes[boundary:], boundary) if m == "reuse"})


@functools.cache
def _cache_name(layer_class) -> str:
    """What a decoder layer calls the KV cache: `cache` from transformers 5.2x on (which warns on past_key_values),
    past_key_values before (5.17's)."""
    return "cache" if "cache" in inspect.signature(layer_class.forward).parameters else "past_key_values"


class Balance:
    """A stage's part in a mixture of experts' load-balancing loss (model.router_aux_loss_coef): its layers' router
    logits, recorded by a hook on each router (the module transformers records them from: its model's
    _can_record_outputs["router_logits"]) while the stage's forward runs (not in a checkpointed layer's recompute in
    backward), and their sums (loss.balance_parts) added to the earlier stages': one fp32 row [1, 2 x experts + 1] of
    the routed tokens, the routing probabilities (with their gradient) and the rows."""

    def __init__(self, lm, layers):
        from llmtrain.capabilities import experts, experts_per_token

        self.experts, self.top_k = experts(lm.config), experts_per_token(lm.config)
        recorder = lm.model._can_record_outputs["router_logits"]
        self.index, self.routed = recorder.index, None
        for layer in layers:
            for m in layer.modules():
                if isinstance(m, recorder.target_class):
                    m.register_forward_hook(self._record)

    def _record(self, module, args, output):
        if self.routed is not None:
            self.routed.append(output[self.index] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self):
        self.routed = []
        try:
            yield self.routed
        finally:
            self.routed = None

    def add(self, routed: list, received, real, device) -> torch.Tensor:
        """This stage's sums over the row's first `real` tokens (a [1] tensor: the row's real tokens, the padding left
        out) added to `received` (the earlier stages'; None on the first)."""
        from llmtrain.model.loss import balance_parts

        n = int(real.reshape(-1)[0])
        counts, probs, rows = (balance_parts(routed, self.experts, self.top_k, real=n) if routed else
                               (torch.zeros(self.experts, device=device),) * 2 + (0,))
        mine = torch.cat([counts, probs, counts.new_tensor([rows])])[None]
        return mine if received is None else received + mine

    @staticmethod
    def whole(sums: torch.Tensor, experts: int) -> torch.Tensor:
        """The row's load-balancing loss from the last stage's sums (loss.balance)."""
        from llmtrain.model.loss import balance

        sums = sums.reshape(-1).float()
        return balance(sums[:experts], sums[experts:2 * experts], sums[-1], experts)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch's PipelineStage receives a gradient into a
    buffer of the layout the sender's autograd made it in (a key's gradient is a transposed view), and gloo's receive
    takes contiguous buffers only."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


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
