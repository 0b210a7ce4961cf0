"""Tensor parallelism: the decoder's linear layers sharded over the mesh's `tp` dimension by the model's own plan
(what it does not train is refused with the rest of the layout: capabilities.py).

llmtrain applies the plan itself, not Accelerate (accelerator.py's `_attach_mesh` says why); FSDP2 then shards
the tensor-parallel weights over the mesh's data-parallel dimensions.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from llmtrain.capabilities import paragraph, tensor_plan, tensor_plan_problems
from llmtrain.errors import LLMTrainError
from llmtrain.model.loss import causal_lm
from llmtrain.model.split import local, row_norms_summed


def apply_tensor_parallel(model, mesh) -> tuple[int, int]:
    """Shard the decoder's linear layers over `mesh` (1-D, the `tp` dimension) by the model's tensor-parallel plan
    (capabilities.tensor_plan: transformers' `base_model_tp_plan`, or the family's own where that splits nothing, as
    GPT-OSS's; q/k/v and gate/up column-wise, o and down row-wise), with PyTorch's parallelize_module. Each attention
    layer then holds heads / tp query and KV heads, each MLP intermediate / tp columns; a row-wise layer all-reduces
    its output, so every process of the group holds the same hidden states and the same loss. Embeddings, norms and
    the LM head stay whole on every TP rank (FSDP still shards them over the data-parallel dimension). A mixture of
    experts' experts are split by expert (_split_experts). Returns the number of linear layers split and of experts
    modules split.

    Phi-3/Phi-4's plan is the gathered one: its fused qkv_proj and gate_up_proj hold q, k, v (gate, up)
    one after another, which a column-wise split would cut across, so each keeps its 1/tp of the output rows and
    all-gathers its output; attention and the MLP's product then run whole on every rank, and o_proj and down_proj
    take their 1/tp of the input columns (a slice, no communication) and all-reduce their output. The weights are
    split as for Llama; the activations are not.

    LoRA (peft's layers): the base layer inside each is split as the plan says and its adapters beside it as
    ADAPTER_SPLIT says, so an adapter's output is laid out as its base layer's; the 4-bit base of QLoRA cannot be
    split (refused: capabilities.RULES). With lora.dropout, a column-wise adapter draws its mask on the whole input
    on every rank of the pair (the same seed, the same draws: the same mask). DoRA's magnitudes and row norms are
    laid out as the base layer's output (_split_dora)."""
    from fnmatch import fnmatchcase

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}
    if problems := tensor_plan_problems(model.config, mesh.size()):  # refused before any process starts, too
        raise LLMTrainError(paragraph(problems))
    lm = causal_lm(model)  # through a peft model to the transformers one
    plan = tensor_plan(lm.config)
    base = getattr(lm, lm.base_model_prefix)
    matched = {name: style for name, _ in base.named_modules()
               for pattern, style in plan.items() if style in styles and fnmatchcase(name, pattern)}
    layers, dora = {}, []
    for name, style in matched.items():
        module = base.get_submodule(name)
        if not isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):
            layers[name] = styles[style]()
            continue
        # peft's LoRA layer: its base layer split as the plan says, and the adapter's matrix on the split side with
        # the same style (ADAPTER_SPLIT); eager whole under compile (its input a replicated DTensor: eager_in_compile)
        layers[f"{name}.base_layer"] = styles[style]()
        module._llmtrain_eager = True
        for adapter in module.lora_A:
            layers[f"{name}.{ADAPTER_SPLIT[style]}.{adapter}"] = styles[style]()
            # a column-wise layer's input is one replicated DTensor (below): its adapter takes the local (whole) tensor
            module.lora_dropout[adapter].register_forward_pre_hook(_local_input)
            if module.use_dora.get(adapter):
                dora.append((module.lora_magnitude_vector[adapter], style))
    parallelize_module(base, mesh, layers)
    for magnitude, style in dora:
        _split_dora(magnitude, style, mesh)
    experts = [name for name, _ in base.named_modules()
               for pattern, style in plan.items() if style == EXPERTS and fnmatchcase(name, pattern)]
    for name in experts:
        _split_experts(base.get_submodule(name), mesh)
    for name, _ in base.named_modules():  # GPT-OSS's attention sinks
        if any(fnmatchcase(name, pattern) for pattern, style in plan.items() if style == HEADS):
            _split_heads(base.get_submodule(name), mesh)
    for block in {name.rpartition(".")[0] for name, style in matched.items() if style.startswith("colwise")}:
        base.get_submodule(block).register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
    for name, _ in base.named_modules():  # QK-norm (Qwen3, Gemma 3): whole on every rank, applied to its own heads
        if any(fnmatchcase(name, pattern) for pattern, style in plan.items() if style == SUMMED):
            base.get_submodule(name).register_forward_pre_hook(_gradients_summed(mesh))
            base.get_submodule(name)._llmtrain_eager = True  # (under compile: its hook hooks the gradient)
    return len(matched), len(experts)


def _split_dora(layer, style: str, mesh) -> None:
    """DoRA beside a split layer (peft's DoraLinearLayer): its output is (m / n) (W + s B A) x with m a trained
    magnitude per output row and n the norm of that row of W + s B A, which tensor parallelism splits: a column-wise
    layer (q, k, v, gate, up) holds whole rows of 1/tp of the outputs, so its magnitudes are split with them (Shard(0))
    and each rank's norms are its rows'; a row-wise one (o, down) holds 1/tp of every row's columns, so its magnitudes
    stay whole on every rank and each row's squared norm is the sum of the ranks' parts (an all-reduce of `out`
    numbers, without gradient: peft detaches n); a gathered column-wise one (Phi's fused qkv_proj, gate_up_proj)
    holds whole rows of 1/tp of the outputs and gathers its output, so its magnitudes stay whole and its norms are
    gathered. The layer then runs on the local tensors (_dora_forward), as peft's forward does on whole ones."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if style == "colwise":
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(0)]),
                                          requires_grad=layer.weight.requires_grad)
    layer.__dict__["forward"] = functools.partial(_dora_forward, layer, style, mesh.get_group())
    layer._llmtrain_eager = True  # (under compile: its norms' all-reduce or all-gather)


def _dora_forward(layer, style, group, x, *, lora_A, lora_B, scaling, base_layer, base_result=None,
                  adapter_name="default"):
    """peft's DoraLinearLayer.forward on this rank's part of a split layer: what DoRA adds to the base layer's output,
    (m / n - 1) W x + (m / n) s B A x, laid out as that output (this rank's rows under a column-wise split, whole
    under a row-wise or gathered one). `base_result` is the base layer's output where peft has it (no dropout, or
    eval); with dropout, the base layer is run again on the dropped input (peft's F.linear(x, W), through the split
    layer so that its output is laid out the same)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    x = local(x)  # (a column-wise block's replicated input where no dropout made it local)
    with torch.no_grad():  # n: detached in peft too (the DoRA paper's section 4.3)
        dtype = x.dtype  # (peft's: the adapters' dtype, which the input was cast to)
        # W + s B A, B A made directly (peft runs an in x in identity through A and B) and added to in place: two
        # [out, in] tensors of this rank's part at most (memory/activations.dora_forward_temp)
        direction = local(lora_B.weight).to(dtype) @ local(lora_A.weight).to(dtype)
        direction.mul_(scaling).add_(local(base_layer.weight).to(dtype))
        norm = torch.linalg.norm(direction, dim=1)  # (in the input's dtype, as peft's; summed below in fp32 at least)
        norm = norm.to(torch.promote_types(norm.dtype, torch.float32))
        del direction
        if style.startswith("rowwise"):  # each rank holds a part of every row: the parts' squares summed
            norm = row_norms_summed(norm, group)
        elif style == "colwise_gather_output":  # each rank's rows, gathered into the whole output's
            parts = [torch.empty_like(norm) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, norm, group=group)
            norm = torch.cat(parts)
        norm = norm.to(dtype)
    scale = (local(layer.weight) / norm).view(1, -1)
    lora_result = lora_B(lora_A(x))
    if base_result is None:
        base_result = base_layer(x)
    if (bias := base_layer.bias) is not None:  # (a gathered layer's output is whole: so is the bias it takes off)
        base_result = base_result - (bias.full_tensor() if style == "colwise_gather_output" and
                                     isinstance(bias, DTensor) else local(bias))
    return (scale - 1) * base_result + scale * lora_result * scaling


def eager_in_compile(model) -> int:
    """What tensor parallelism split runs eagerly inside a compiled decoder layer (model.compile's regional compile):
    each module holding a split weight of its own (the split linears, the adapter matrices beside them, DoRA's split
    magnitudes, split experts, GPT-OSS's sinks) with its hooks (the layouts of its input and output), peft's LoRA
    layers around split ones (their adapters' input is the block's replicated DTensor: traced, Dynamo warned of
    DTensor builtins it cannot trace), DoRA's magnitudes beside a row-wise or gathered layer (their norms'
    collectives) and the whole norms whose gradient is summed over the group (QK-norm's hook on its weight's
    gradient). Inductor's compile of the split layers' DTensor code had recursed without end at the first backward
    (torch 2.13, FSDP x TP on gloo); what compile fuses (the norms, rotary embeddings, attention's softmax,
    activations, residual adds) lies between them and stays compiled, each split module a graph break. Returns how
    many are left eager, the outermost (a LoRA layer once)."""
    from torch.distributed.tensor import DTensor

    eager = [m for m in model.modules() if getattr(m, "_llmtrain_eager", False)
             or any(isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    for module in eager:  # (an instance's _call_impl: nn.Module.__call__ runs it, hooks and forward, as Dynamo does)
        module._call_impl = torch.compiler.disable(functools.partial(_waited, module._call_impl))
    inside = {id(sub) for m in eager for sub in m.modules() if sub is not m}
    return sum(id(m) not in inside for m in eager)  # the outermost: a LoRA layer, not also its base and adapters


def _waited(call, *args, **kwargs):
    """A split module's output as a plain tensor: a row-wise layer's all-reduce is asynchronous (torch's
    RowwiseParallel), its output an AsyncCollectiveTensor, which the compiled graph it enters cannot take back a
    gradient for (a plain one reaches DTensor's redistribute in backward); an op on it waits and unwraps it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    out = call(*args, **kwargs)
    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out


EXPERTS = "moe_tp_experts"  # the plan's word for a mixture of experts' module (llmtrain splits it by expert)


def _split_experts(module, mesh) -> None:
    """A mixture of experts' experts split by expert: each rank of the group holds tp-th of them whole (every expert's
    gate_up_proj and down_proj, [E, ., .] placed Shard(0): rank t holds experts tE/tp..(t+1)E/tp - 1) and runs the
    routed tokens through its own; the layer's output is the sum of the ranks' (one all-reduce, as a row-wise layer's),
    and the tokens' gradient too. The router stays whole: every rank routes each token alike. This is expert
    parallelism within the tensor-parallel group, with a dense layer's communication; transformers' own plan for these
    models (packed_colwise) splits each expert's columns instead, in an interleaved layout (_StridedShard) that torch's
    distributed checkpoint cannot write beside FSDP's shards ("overlapping chunks").

    The module (transformers' experts, or the outermost of peft's ParamWrappers around them) runs on its experts as
    plain tensors (_split_experts_forward), a token's pair with an expert of another rank routed to none (transformers'
    expert-parallel sentinel, its weight 0 here). Under LoRA each adapter's factors stay whole on every rank (A is
    [E r, in], B [out, E r] with the experts innermost: no contiguous split), each rank runs its experts' rows of them
    (lora_experts slices them by `first_expert`), and their gradients, each rank's experts' rows, are summed over the
    group as they are made."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from llmtrain.model.lora_experts import wrappers

    chain, experts = wrappers(module)
    count, rank = experts.num_experts // mesh.size(), mesh.get_local_rank()
    for name, param in list(experts.named_parameters(recurse=False)):  # gate_up_proj, down_proj (and any biases)
        if param.shape[0] != experts.num_experts:  # not one row an expert: whole on every rank
            continue
        experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                                            requires_grad=param.requires_grad))
    experts.num_experts, experts.first_expert, experts._is_expert_parallel = count, rank * count, True
    whole = [(factor, _gradients_summed(mesh)) for wrapper in chain for adapter in wrapper.lora_A
             for factor in (wrapper.lora_A[adapter], wrapper.lora_B[adapter])]
    forward = module.forward  # lora_experts' unmerged forward where it installed one, else the module's own
    module.__dict__["forward"] = functools.partial(_split_experts_forward, module, forward, experts, mesh.get_group(),
                                                   whole)


def _split_experts_forward(module, forward, experts, group, whole, hidden_states, top_k_index, top_k_weights):
    """`forward` on this rank's experts (and their adapters' rows): the tokens and their routing weights come in whole
    (the same on every rank; their gradients are each rank's part, summed in backward), each pair with another
    rank's expert goes to the sentinel (expert num_experts: no expert, weight 0), and the output is this rank's part,
    summed over the group."""
    for factor, summed in whole:  # (each factor's own hook: it keeps the parameter it hooked by name)
        summed(factor, ())
    hidden_states, top_k_weights = _SumBackward.apply(hidden_states, group), _SumBackward.apply(top_k_weights, group)
    local = top_k_index - experts.first_expert
    elsewhere = (local < 0) | (local >= experts.num_experts)
    local = local.masked_fill(elsewhere, experts.num_experts)
    top_k_weights = top_k_weights.masked_fill(elsewhere, 0.0)
    with _local_parameters(experts):
        out = forward(hidden_states, local, top_k_weights)
    return _SumForward.apply(out, group)


HEADS = "heads"  # llmtrain's style: a module's own parameters of one value a query head, split with the heads


def _split_heads(module, mesh) -> None:
    """The module's own 1-D parameters of one value a query head (GPT-OSS's attention sinks: a learned logit a head in
    each softmax) split with its heads (Shard(0): rank t holds those of its heads, as q_proj's column-wise split gives
    it), and the module run on them as plain tensors, as its heads' queries are."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        if param.ndim == 1:
            module.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                                               requires_grad=param.requires_grad))
    local = {}

    def enter(module, args):
        local[id(module)] = _local_parameters(module)
        local[id(module)].__enter__()

    def leave(module, args, output):
        local.pop(id(module)).__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


@contextlib.contextmanager
def _local_parameters(module):
    """Each DTensor parameter of `module` as its local tensor (differentiable: its gradient comes back as the
    DTensor's) for the time of a forward, then the DTensor again."""
    from torch.distributed.tensor import DTensor

    swapped = [(module, name, param) for name, param in module._parameters.items() if isinstance(param, DTensor)]
    for owner, name, param in swapped:
        owner._parameters[name] = param.to_local()
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._buffers.pop(name, None)  # (where peft's merged forward re-registered the local tensor as a buffer)
            owner._parameters[name] = param


class _SumForward(torch.autograd.Function):
    """The group's parts summed in forward (every rank's output is its experts' share); the gradient, the same on
    every rank, passes back as it is."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBackward(torch.autograd.Function):
    """A whole input (the same on every rank) passed as it is; its gradient, each rank's part, summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


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
