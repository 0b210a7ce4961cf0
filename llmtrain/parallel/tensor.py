"""Tensor parallelism: the decoder's linear layers sharded over the mesh's `tp` dimension by the model's own plan
(what it does not train is refused with the rest of the layout: capabilities.py).

llmtrain applies the plan itself, not Accelerate (accelerator.py's `_attach_mesh` says why); FSDP2 then shards
the tensor-parallel weights over the mesh's data-parallel dimensions.
"""

from __future__ import annotations

import torch

from llmtrain.capabilities import paragraph, tensor_plan_problems
from llmtrain.errors import LLMTrainError
from llmtrain.model.loss import causal_lm


def apply_tensor_parallel(model, mesh) -> int:
    """Shard the decoder's linear layers over `mesh` (1-D, the `tp` dimension) by the model's own tensor-parallel
    plan (transformers' `base_model_tp_plan`: q/k/v and gate/up column-wise, o and down row-wise), with PyTorch's
    parallelize_module. Each attention layer then holds heads / tp query and KV heads, each MLP intermediate / tp
    columns; a row-wise layer all-reduces its output, so every process of the group holds the same hidden states
    and the same loss. Embeddings, norms and the LM head stay whole on every TP rank (FSDP still shards them over
    the data-parallel dimension). Returns the number of layers sharded.

    Phi-3/Phi-4's plan is the gathered one: its fused qkv_proj and gate_up_proj hold q, k, v (gate, up)
    one after another, which a column-wise split would cut across, so each keeps its 1/tp of the output rows and
    all-gathers its output; attention and the MLP's product then run whole on every rank, and o_proj and down_proj
    take their 1/tp of the input columns (a slice, no communication) and all-reduce their output. The weights are
    split as for Llama; the activations are not.

    LoRA (peft's layers): the base layer inside each is split as the plan says and its adapters beside it as
    ADAPTER_SPLIT says, so an adapter's output is laid out as its base layer's; the 4-bit base of QLoRA cannot be
    split (refused: capabilities.RULES). With lora.dropout, a column-wise adapter draws its mask on the whole input
    on every rank of the pair (the same seed, the same draws: the same mask)."""
    from fnmatch import fnmatchcase

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}
    if problems := tensor_plan_problems(model.config, mesh.size()):  # refused before any process starts, too
        raise LLMTrainError(paragraph(problems))
    lm = causal_lm(model)  # through a peft model to the transformers one
    plan = lm.config.base_model_tp_plan
    base = getattr(lm, lm.base_model_prefix)
    matched = {name: style for name, _ in base.named_modules()
               for pattern, style in plan.items() if style in styles and fnmatchcase(name, pattern)}
    layers = {}
    for name, style in matched.items():
        module = base.get_submodule(name)
        if not isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):
            layers[name] = styles[style]()
            continue
        # peft's LoRA layer: its base layer split as the plan says, and the adapter's matrix on the split side with
        # the same style (ADAPTER_SPLIT)
        layers[f"{name}.base_layer"] = styles[style]()
        for adapter in module.lora_A:
            layers[f"{name}.{ADAPTER_SPLIT[style]}.{adapter}"] = styles[style]()
            # a column-wise layer's input is one replicated DTensor (below): its adapter takes the local (whole) tensor
            module.lora_dropout[adapter].register_forward_pre_hook(_local_input)
    parallelize_module(base, mesh, layers)
    for block in {name.rpartition(".")[0] for name, style in matched.items() if style.startswith("colwise")}:
        base.get_submodule(block).register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
    for name, _ in base.named_modules():  # QK-norm (Qwen3, Gemma 3): whole on every rank, applied to its own heads
        if any(fnmatchcase(name, pattern) for pattern, style in plan.items() if style == SUMMED):
            base.get_submodule(name).register_forward_pre_hook(_gradients_summed(mesh))
    return len(matched)


# LoRA beside a split layer: which of its matrices is split, with the base layer's own style (the other runs whole on
# every rank). Column-wise (q, k, v, gate, up): the base layer keeps 1/tp of its output rows, so B does too, and A
# (r x in) runs whole on the replicated input, its gradient made whole on every rank from B's all-reduced input
# gradient. Row-wise (o, down): the base layer takes 1/tp of its input columns, so A does too and its r outputs are
# all-reduced (r numbers a token, not the layer's width), and B (out x r) runs whole on them. Each adapter's output is
# then laid out as its base layer's.
ADAPTER_SPLIT = {"colwise": "lora_B", "colwise_gather_output": "lora_B", "rowwise": "lora_A",
                 "rowwise_split_input": "lora_A"}


def _local_input(module, args):
    """An adapter's input as this rank's local tensor (the whole of a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    if args and isinstance(args[0], DTensor):
        return (args[0].to_local(), *args[1:])
    return None


SUMMED = "replicated_with_grad_allreduce"  # the plan's word for a whole module whose gradient each rank has in part


def _gradients_summed(mesh):
    """A module kept whole on every rank of the group but run on that rank's heads only (Qwen3's and Gemma 3's q_norm
    and k_norm: one weight over head_dim, shared by the heads): each rank's weight gradient is its heads' part, so the
    parts are summed over the group as each is made (a hook on the gradient before it is accumulated: with gradients
    held across micro-batches, each micro-batch's part is summed once). Transformers' ReplicatedWithGradAllReduce sums
    param.grad after accumulation instead, right where FSDP2 frees the gradient after each micro-batch, twice-counting
    where it does not. The hook goes on the parameter the module runs with at its first forward with gradients (FSDP2
    runs it with its own unsharded parameter, made once)."""
    import torch
    import torch.distributed as dist

    group, hooked = mesh.get_group(), {}

    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def hook(module, args):
        if torch.is_grad_enabled():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_hook(summed)
                    hooked[name] = param

    return hook


def _replicated_input(mesh):
    """A block's (attention's, the MLP's) input as one replicated DTensor, before its column-wise layers see it.

    Each column-wise layer given a plain tensor wraps it itself, so in backward each would all-reduce its own partial
    input gradient: q, k and v three times, gate and up twice. Wrapped once here, their partial gradients are summed
    as one DTensor and all-reduced once, where the block's input is made: 2 all-reduces per layer in backward, as in
    forward (tests/test_comms_measured.py counts them)."""
    from torch.distributed.tensor import DTensor, Replicate

    def wrap(x):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x

    def hook(module, args, kwargs):
        if args:  # the MLP: mlp(hidden_states)
            return (wrap(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:  # attention: self_attn(hidden_states=..., ...)
            return args, {**kwargs, "hidden_states": wrap(kwargs["hidden_states"])}
        return None

    return hook
