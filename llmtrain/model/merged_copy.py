"""The generation copy of a LoRA policy's weights (rl.merged_copy): while the fast sampler runs, each adapted linear
forwards through one weight, its base plus its scaled adapter product (W + s B A), instead of the base beside two
small adapter matmuls; a DoRA adapter's (lora.dora) with its magnitudes folded in, (m / n) (W + s B A), where the
unmerged DoRA forward computes the row norms n of W + s B A again in every decode step.

The copy is built beside the trained weights, never in place: a bf16 merge then unmerge does not give the base back
(TRL #6688), and the update trains the adapters on the base as it was. It is made from the weights of the moment (the
policy after the last optimizer step; under FSDP from the units the rollout has gathered), in fp32 and then cast to
the dtype the layer computes in (the base's dtype; a 4-bit base's compute dtype, dequantized), and it is

- `rollout`: built for each rollout and freed after it (its memory is the sampler's only);
- `kept`: built once and rewritten in place at each rollout (no allocation per rollout; held through the update too);
- `off`: not built: the adapters run unmerged beside the base.

Where the copy would not fit on the GPU beside the KV cache (`fits`: a 4-bit base's dequantized copy is 4x its
weights), the rollout samples unmerged, with a warning. The tokens are the unmerged path's up to rounding: x W + s
(x A) B and x (W + s B A) round differently (tests/test_fast_sample.py measures the agreement). The copy is peft's
merge_and_unload weight to 1e-6 in fp32; in bf16 it is the fp32 sum rounded once, where peft rounds the delta to bf16
before adding it (on the tiny model 73-79% of a layer's entries the same, the rest a bf16 step apart).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from llmtrain.model.split import local, row_norms_summed

KEPT = "_llmtrain_generation_copy"  # the attribute of the policy that holds a kept copy {module: weight}


def adapted_linears(lm) -> list:
    """The LoRA linears a merged copy can stand in for: peft's LoRA layers over a Linear (or a 4-bit Linear) with
    their adapters on (DoRA's with one adapter active; no adapter bias), not merged into the base already."""
    from peft.tuners.lora import LoraLayer

    out = []
    for module in lm.modules():
        if not isinstance(module, LoraLayer) or module.disable_adapters or module.merged:
            continue
        names = [a for a in module.active_adapters if a in module.lora_A]
        if not names or getattr(module, "fan_in_fan_out", False):
            continue
        if any(getattr(module, "lora_bias", {}).get(a) for a in names) or (
                len(names) > 1 and any(module.use_dora.get(a) for a in names)):
            continue
        if not hasattr(module.get_base_layer(), "weight") or module.get_base_layer().weight.dim() != 2:
            continue
        if hasattr(module, "parameter_name"):  # peft's ParamWrapper (a router's weight): not a linear's forward
            continue
        out.append(module)
    return out


def _four_bit(base) -> bool:
    return type(base.weight).__name__ == "Params4bit"


def _compute_dtype(base) -> torch.dtype:
    """The dtype the base layer's matmul runs in: a 4-bit layer's compute dtype, else its weight's."""
    if _four_bit(base):
        return getattr(base, "compute_dtype", None) or torch.float32
    return base.weight.dtype


def _split(weight):
    """A tensor-parallel base weight (a DTensor: this process holds rows or columns of it), else None."""
    from torch.distributed.tensor import DTensor

    return weight if isinstance(weight, DTensor) else None


def copy_bytes(modules: list) -> int:
    """The copy's size: each adapted linear's [out, in] weight (this process's part of a tensor-parallel one) in the
    dtype its layer computes in."""
    total = 0
    for m in modules:
        base = m.get_base_layer()
        split = _split(base.weight)
        elements = split.to_local().numel() if split is not None else base.out_features * base.in_features
        total += elements * torch.empty((), dtype=_compute_dtype(base)).element_size()
    return total


@torch.no_grad()
def merged_weight(module, out: torch.Tensor | None = None) -> torch.Tensor:
    """W + sum over the active adapters of scaling x B A, computed in fp32 and cast to the layer's compute dtype
    (written into `out` where given). A DoRA adapter's: (m / n) (W + s B A), n the row norms of W + s B A, which is
    what peft's DoRA forward computes, base + (m / n - 1) base + (m / n) s B A x, in one matmul.

    Under tensor parallelism (the base weight a DTensor), this process's part of it: its rows of a column-wise split
    layer (W's, B's, A whole) or its columns of a row-wise one (W's, A's, B whole), each the same part of the whole
    merge; a DoRA row's norm is then summed over the processes' columns (_whole_rows)."""
    base = module.get_base_layer()
    if _four_bit(base):
        import bitsandbytes as bnb

        w = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
    else:  # a copy even where the base is fp32: never merged in place
        w = local(base.weight).to(torch.float32, copy=True)
    for a in module.active_adapters:
        if a in module.lora_A:
            w.addmm_(local(module.lora_B[a].weight).float(), local(module.lora_A[a].weight).float(),
                     alpha=module.scaling[a])
            if module.use_dora.get(a):
                magnitude = local(module.lora_magnitude_vector[a].weight).float()
                norm = torch.linalg.norm(w, dim=1)
                if (split := _split(base.weight)) is not None:
                    norm, magnitude = _whole_rows(split, norm, magnitude)
                w.mul_((magnitude / norm).unsqueeze(1))
    if out is None:
        return w.to(_compute_dtype(base))
    return out.copy_(w)


def _whole_rows(weight, norm: torch.Tensor, magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor-parallel DoRA layer's row norms and magnitudes for this process's part of the weight: split by columns
    (Shard(1), a row-wise layer), each row's norm is the root of the processes' parts' squares summed, the magnitudes
    whole; split by rows (Shard(0)), the norms are this process's rows' already, and whole magnitudes (a gathered
    layer's: parallel/tensor._split_dora) are cut to those rows."""
    from torch.distributed.tensor import Shard

    ((dim, placement),) = [(d, p) for d, p in enumerate(weight.placements) if isinstance(p, Shard)]
    mesh = weight.device_mesh
    if placement.dim == 1:
        return row_norms_summed(norm, mesh.get_group(dim)), magnitude
    if magnitude.shape[0] != norm.shape[0]:
        magnitude = magnitude.chunk(mesh.size(dim))[mesh.get_local_rank(dim)]
    return norm, magnitude


def _split_forward(x: torch.Tensor, *args, base, weight: torch.Tensor, **kwargs):
    """A tensor-parallel adapted linear on its merged part: the split base layer run with the merged part in its
    weight's place (its parallel style's hooks lay its input and output out as they do for W), W put back after."""
    from torch.distributed.tensor import DTensor

    held = base.weight
    base._parameters["weight"] = DTensor.from_local(weight, held.device_mesh, held.placements, run_check=False,
                                                    shape=held.shape, stride=held.stride())
    try:
        return base(x, *args, **kwargs)
    finally:
        base._parameters["weight"] = held


def _merged_forward(x: torch.Tensor, *args, weight: torch.Tensor, bias: torch.Tensor | None, cast: bool, **kwargs):
    """The adapted linear on its merged weight, as its base layer computes (a 4-bit layer casts the input to its
    compute dtype and the output back, as bitsandbytes' Linear4bit does)."""
    if cast:
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def fits(lm, modules: list, *, spare_bytes: int) -> bool:
    """Whether the copy and `spare_bytes` more (the sampler's KV cache) fit in the device's free memory (the
    allocator's cached blocks included); off CUDA there is no such limit to check."""
    device = next(lm.parameters()).device
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    held = getattr(lm, KEPT, None)
    need = 0 if held else copy_bytes(modules)
    return need + spare_bytes <= 0.95 * free


@contextmanager
def merged_for_sampling(lm, policy: str, *, spare_bytes: int = 0):
    """Inside the block, each adapted linear of `lm` forwards through its merged weight (policy `rollout` or `kept`;
    `off`, or no adapted linear, or a copy that does not fit: unchanged). Yields the number of linears merged."""
    modules = adapted_linears(lm) if policy != "off" else []
    if modules and not fits(lm, modules, spare_bytes=spare_bytes):
        import warnings

        warnings.warn(f"rl.merged_copy={policy}: the merged generation copy ({copy_bytes(modules) / 2**30:,.2f} GiB) "
                      "does not fit beside the KV cache in the GPU's free memory; this rollout samples with the "
                      "adapters unmerged (the same tokens up to rounding, slower). rl.merged_copy=off says so "
                      "up front", stacklevel=3)
        modules = []
    held = getattr(lm, KEPT, None) if policy == "kept" else None
    if policy == "kept" and held is None:
        held = {}
        object.__setattr__(lm, KEPT, held)  # not a submodule or buffer: never saved, never sharded
    swapped = []  # (module, the forward its instance held before: a hook's, or None)
    try:
        for m in modules:
            base = m.get_base_layer()
            if held is not None:
                weight = merged_weight(m, held.get(m))
                held[m] = weight
            else:
                weight = merged_weight(m)
            swapped.append((m, m.__dict__.get("forward")))
            if _split(base.weight) is not None:
                m.__dict__["forward"] = functools.partial(_split_forward, base=base, weight=weight)
                continue
            cast = _four_bit(base)
            bias = base.bias if base.bias is None or not cast else base.bias.to(weight.dtype)
            m.__dict__["forward"] = functools.partial(_merged_forward, weight=weight, bias=bias, cast=cast)
        yield len(swapped)
    finally:
        for m, before in swapped:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = before
