"""LoRA on a mixture of experts' experts without merging them: the adapters beside the base experts, token-expert pair
by pair, in grouped matmuls, in training as in sampling.

peft adapts an expert parameter (gate_up_proj, down_proj: every expert in one 3-D tensor) as a parameter
(lora.ParamWrapper): each forward it merges the whole tensor, W + s B A for every expert, and the grouped matmul runs
on the merged copy. Training saves that copy for backward and its backward makes a gradient of the same size: for
Qwen3-30B-A3B, 1.12 GiB a layer, 54 GiB over 48 layers at any context length. In sampling it is work every decode step
repeats for every layer: reading all the experts and writing their merged copy for the few rows a step decodes (on the
CPU, a Qwen3-MoE of 64 experts decoded 24x slower with LoRA on its experts than without the merge). Here each pair's
rows go through the base expert and its adapter: x W^T + s (x A^T) B^T, with A and B grouped by expert as W is, so a
step reads the experts once and the adapters (rank r a expert) beside them, and backward saves the rank-r rows x A^T.
The same function and the same gradients up to rounding (tests/test_lora_experts.py: to 1e-5 in fp32 against peft's
merged forward, the adapters' gradients to 1e-6).

`install(model)` gives each LoRA-adapted experts module of `model` this forward, where the module is transformers'
grouped experts (its default `grouped_mm` implementation, a gate, with or without biases: GPT-OSS's have them) under
one or two of peft's ParamWrappers (all-linear or gate_up_proj/down_proj in lora.target_modules, or GPT-OSS's
lora.target_parameters). Whenever its adapters are disabled (a preference run's reference pass), merged or more than
one is active, the module runs peft's own forward; other experts stay peft's throughout.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def wrappers(module) -> tuple[list, object]:
    """peft's ParamWrappers nested from `module` down, and the experts module they wrap."""
    chain = []
    while hasattr(module, "parameter_name"):
        chain.append(module)
        module = module.base_layer
    return chain, module


def _supported(module) -> bool:
    """Whether `module` (the outermost of its ParamWrappers) wraps experts this forward runs."""
    chain, experts = wrappers(module)
    if not chain or getattr(getattr(experts, "config", None), "_experts_implementation", None) != "grouped_mm":
        return False
    if not getattr(experts, "has_gate", False):
        return False
    if getattr(experts, "has_post_expert_norm", False):
        return False
    return all(w.parameter_name in ("gate_up_proj", "down_proj") for w in chain)


def _factors(chain, experts) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None:
    """{parameter name: (lhs, rhs, scaling)}, the adapter's delta = scaling x lhs @ rhs in the parameter's layout
    (each [experts, ., .]: the rows of the experts this module holds, where tensor parallelism split them by expert,
    parallel/tensor._split_experts); None where an adapter is disabled or merged, or other than one is active (peft's
    forward then)."""
    out, first = {}, getattr(experts, "first_expert", 0)
    held = slice(first, first + experts.num_experts)
    for w in chain:
        active = [a for a in w.active_adapters if a in w.lora_A]
        if w.disable_adapters or w.merged or len(active) != 1:
            return None
        lhs, rhs, s = w.get_delta_factors(active[0])
        out[w.parameter_name] = lhs[held], rhs[held], s
    return out


def _rank_padding(first) -> int:
    """Zero ranks to add so that a row of rank values is a multiple of 16 bytes, which torch's grouped matmul takes
    (on the CPU as on CUDA: rank 4 in bf16, rank 6 in fp32 are refused)."""
    return -first.size(-1) % (16 // first.element_size())


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
    lhs, rhs, s = factors
    first, second = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))  # [E,in,r], [E,r,out]
    pad = _rank_padding(first)
    if pad:  # zero ranks added: the same product
        first, second = F.pad(first, (0, pad)), F.pad(second, (0, 0, 0, pad))
    low = _grouped_mm(x, first, offs=offsets) * s  # A^T: a view of peft's A (or of its cast), a layout it takes
    # B^T is a view of peft's B with the experts innermost (stride 1), which the matmul does not take: one copy, rank r
    # a expert. The sum in place: the base's output is saved by nothing, and a pair's rows are not held three times.
    return out.add_(_grouped_mm(low, second.contiguous(), offs=offsets))


def _forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm_experts_forward (integrations/moe.py), each adapted parameter's adapter beside it;
    peft's own forward where _factors says so."""
    chain, experts = wrappers(module)
    factors = _factors(chain, experts)
    if factors is None:
        return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids)
    x = hidden_states[perm // k]
    histc = ids_sorted.float() if hidden_states.device.type in ("cpu", "mps") else ids_sorted.int()
    offsets = torch.cumsum(torch.histc(histc, bins=experts.num_experts, min=0, max=experts.num_experts - 1), dim=0,
                           dtype=torch.int32)
    # Experts split by expert (parallel/tensor._split_experts): a pair with another rank's expert has the sentinel id
    # num_experts, sorted last, past the offsets, so no matmul computes its rows; they are left as the kernel leaves
    # them and zeroed after each (transformers' grouped_mm_experts_forward does the same), its input rows before
    # (so the rows' gradient, which backward leaves alike, reaches no token)
    # (transformers 5.17, the GPU machine's, has no _is_expert_parallel: only parallel/tensor._split_experts sets it)
    split = getattr(experts, "_is_expert_parallel", False)
    elsewhere = (ids_sorted >= experts.num_experts).unsqueeze(-1) if split else None
    if elsewhere is not None:
        ids_sorted = ids_sorted.clamp(max=experts.num_experts - 1)
        x = x.masked_fill(elsewhere, 0.0)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    h = _linear(x.to(gate_up.dtype), gate_up, offsets, factors.get("gate_up_proj"), experts.is_transposed)
    if experts.has_bias:  # each pair's expert's bias (GPT-OSS), added in place as transformers does
        h.add_(experts.gate_up_proj_bias[ids_sorted])
    if elsewhere is not None:
        h = h.masked_fill(elsewhere, 0.0)
    h = experts._apply_gate(h)
    out = _linear(h.to(down.dtype), down, offsets, factors.get("down_proj"), experts.is_transposed)
    if experts.has_bias:
        out.add_(experts.down_proj_bias[ids_sorted])
    if elsewhere is not None:
        out = out.masked_fill(elsewhere, 0.0)
    out = out * weights[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def install(model) -> int:
    """From now on, each LoRA-adapted experts module of `model` that `_supported` runs its adapters beside the base
    experts (no merge); returns how many (of nested ParamWrappers, the outermost is the one its layer calls). Calling
    it again changes nothing."""
    wrapped = [m for m in model.modules() if hasattr(m, "parameter_name")]
    inner = {id(m.base_layer) for m in wrapped}
    outermost = [m for m in wrapped if id(m) not in inner and _supported(m)]
    for module in outermost:
        module.__dict__["forward"] = functools.partial(_forward, module)
    return len(outermost)
