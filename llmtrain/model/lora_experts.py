"""LoRA on a mixture of experts' experts without merging them, for sampling: the adapters beside the base experts,
token-expert pair by pair, in grouped matmuls.

peft adapts an expert parameter (gate_up_proj, down_proj: every expert in one 3-D tensor) as a parameter
(lora.ParamWrapper): each forward it merges the whole tensor, W + s B A for every expert, and the grouped matmul runs
on the merged copy. That is what training saves for backward, and in sampling it is work every decode step repeats
for every layer: reading all the experts and writing their merged copy, for the few rows a step decodes (on the CPU,
a Qwen3-MoE of 64 experts decoded 24x slower with LoRA on its experts than without the merge). Here each pair's
rows go through the base expert and its adapter: x W^T + s (x A^T) B^T, with A and B grouped by expert as W is, so a
step reads the experts once and the adapters (rank r a expert) beside them. The same function up to rounding
(tests/test_lora_experts.py: to 1e-5 in fp32 against peft's merged forward).

`unmerged_experts(lm)` swaps the forward of each LoRA-adapted experts module for this one, inside a `with` block, where
the module is transformers' grouped experts (its default `grouped_mm` implementation, no biases, a gate) under one
or two of peft's ParamWrappers with one active adapter; any other stays peft's.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch


def _wrappers(module) -> tuple[list, object]:
    """peft's ParamWrappers nested from `module` down, and the experts module they wrap."""
    chain = []
    while hasattr(module, "parameter_name"):
        chain.append(module)
        module = module.base_layer
    return chain, module


def _supported(module) -> bool:
    chain, experts = _wrappers(module)
    if not chain or getattr(getattr(experts, "config", None), "_experts_implementation", None) != "grouped_mm":
        return False
    if getattr(experts, "has_bias", True) or not getattr(experts, "has_gate", False):
        return False
    if getattr(experts, "has_post_expert_norm", False) or getattr(experts, "_is_expert_parallel", False):
        return False
    for w in chain:
        active = [a for a in w.active_adapters if a in w.lora_A]
        if w.disable_adapters or w.merged or len(active) != 1 or w.parameter_name not in ("gate_up_proj", "down_proj"):
            return False
    return True


def _factors(chain) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{parameter name: (lhs, rhs, scaling)}, the adapter's delta = scaling x lhs @ rhs in the parameter's layout."""
    out = {}
    for w in chain:
        (name,) = [a for a in w.active_adapters if a in w.lora_A]
        out[w.parameter_name] = w.get_delta_factors(name)
    return out


def _linear(x, weight, offsets, factors, transposed: bool):
    """The grouped linear of transformers' experts, plus the adapter's rows: x W^T + s (x R^T) L^T (weight stored
    [E, out, in]), or x W + s (x L) R (stored [E, in, out])."""
    from transformers.integrations.moe import _grouped_mm

    if transposed:
        out = _grouped_mm(x, weight, offs=offsets)
    else:
        out = _grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if factors is None:
        return out
    lhs, rhs, s = factors  # rank-r matrices a expert: laid out as the grouped matmul takes them (contiguous)
    first, second = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
    low = _grouped_mm(x, first.contiguous(), offs=offsets)
    return out + s * _grouped_mm(low, second.contiguous(), offs=offsets)


def _forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm_experts_forward (integrations/moe.py), each adapted parameter's adapter beside it."""
    chain, experts = _wrappers(module)
    factors = _factors(chain)
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids)
    x = hidden_states[perm // k]
    histc = ids_sorted.float() if hidden_states.device.type in ("cpu", "mps") else ids_sorted.int()
    offsets = torch.cumsum(torch.histc(histc, bins=experts.num_experts, min=0, max=experts.num_experts - 1), dim=0,
                           dtype=torch.int32)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    h = _linear(x.to(gate_up.dtype), gate_up, offsets, factors.get("gate_up_proj"), experts.is_transposed)
    h = experts._apply_gate(h)
    out = _linear(h.to(down.dtype), down, offsets, factors.get("down_proj"), experts.is_transposed)
    out = out * weights[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


@contextmanager
def unmerged_experts(lm):
    """Inside the block, each LoRA-adapted experts module of `lm` that `_supported` runs its adapters beside the base
    experts (no merge); yields how many. (Of nested ParamWrappers, the outermost is the one its layer calls.)"""
    wrappers = [m for m in lm.modules() if hasattr(m, "parameter_name")]
    inner = {id(m.base_layer) for m in wrappers}
    swapped = []
    try:
        for module in wrappers:
            if id(module) not in inner and _supported(module):
                swapped.append(module)
                module.__dict__["forward"] = functools.partial(_forward, module)
        yield len(swapped)
    finally:
        for module in swapped:
            module.__dict__.pop("forward", None)
