"""FSDP2, and HSDP (FSDP2 with replicas): the precision policy, what a micro-batch's backward sends, the whole
model gathered for sampling, and which processes receive their weights from the main one.

FSDP2's private parts that torch spells differently between releases are read here only (`fsdp_param_groups`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from llmtrain.parallel.mesh import replicas


def uses_fsdp(accelerator) -> bool:
    """The run is sharded by FSDP (on GPUs, or on CPU through `_fsdp_on_cpu`)."""
    return accelerator.distributed_type.name == "FSDP"


def fsdp_precision(mixed_precision: str):
    """FSDP2's MixedPrecisionPolicy for train.mixed_precision: compute in bf16/fp16 from the fp32 shards, but
    reduce gradients in fp32 and leave the model's outputs as they are.

    Accelerate's own policy (set_mixed_precision) also reduce-scatters the gradients in bf16 (8 bits of
    mantissa summed over every rank) and casts the outputs to bf16, which rounds the fp32 loss sum that
    loss.py returns (measured: sums near 7,000 came out as multiples of 32). tests/test_fsdp.py checks the logged loss
    is not rounded so.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=None)


@contextmanager
def accumulating(accelerator, model, fsdp_accumulate: str):
    """The backward of a micro-batch that is not its window's last: what it sends and what it leaves held.

    DDP, and FSDP with train.fsdp_accumulate=unsharded: nothing is sent and every process accumulates its whole
    gradient (Accelerate's no_sync; for FSDP2 set_requires_gradient_sync(False), which keeps the unsharded fp32
    gradient on every GPU until the last micro-batch). FSDP with sharded (the default): every micro-batch's
    gradients are reduce-scattered, so each GPU holds only its shard between micro-batches, as torchtitan does;
    under HSDP the all-reduce across the replicas (the nodes) waits for the last micro-batch
    (set_requires_all_reduce(False) accumulates the reduce-scattered shards first), so the network still carries
    one all-reduce a step."""
    if not uses_fsdp(accelerator) or fsdp_accumulate == "unsharded":
        with accelerator.no_sync(model):
            yield
        return
    replicated = replicas(accelerator) > 1
    if replicated:
        model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        if replicated:
            model.set_requires_all_reduce(True)


@contextmanager
def gathered_for_generation(model):
    """FSDP2: every unit's parameters all-gathered once and kept whole while the block runs (sampling decodes one
    token at a time: resharding after each layer's forward would gather every layer again at every token), then
    resharded, and each unit's reshard-after-forward put back as it was. Costs the whole model in FSDP's
    param_dtype on every GPU while it runs (the estimate counts it). Anything else: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    states = [u._get_fsdp_state() for u in units]
    # FSDP takes the first unit to run forward as its root; sampling calls the layers and the tail units itself,
    # maybe before any training forward (the eval at step 0): make the outermost unit the root first
    states[0]._lazy_init()
    # What set_reshard_after_forward overwrites, read from the state to be put back: torch has no public getter
    before = [(s._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp_param_groups(s)])
              for s in states]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, state, (auto, infos) in zip(units, states, before):
            unit.reshard()
            state._auto_reshard_after_forward = auto
            for group, info in zip(fsdp_param_groups(state), infos):
                group.post_forward_mesh_info = info


def _wrap_classes_present(lm) -> None:
    """Accelerate's transformer-based wrap (the launch's fsdp_auto_wrap_policy) makes an FSDP unit of each class the
    model's _no_split_modules names and raises where the model holds none of one: a multimodal family's text model
    names its vision and audio blocks too (Gemma 4's: "Could not find the transformer layer class
    Gemma4VisionPatchEmbedder in the model", a traceback on every process). Keep the names of the classes the model
    holds (its decoder layers), on this model only."""
    names = list(getattr(lm, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in lm.modules()}
    if (kept := [n for n in names if n in present]) and kept != names:
        lm._no_split_modules = kept


@contextmanager
def prepared_for_fsdp(model, accelerator):
    """Around Accelerate's prepare under FSDP (nothing otherwise): the units its wrap makes are the classes the model
    holds (_wrap_classes_present), and the model's persistent buffers (Gemma 4's layer_scalar: read from the
    checkpoint, not made from the config) are the main process's on every process. Under cpu_ram_efficient_loading the
    other processes built the model empty, their buffers as the config makes them, and Accelerate's loading
    broadcasts the main process's state dict as sharded parameters, a buffer among them, which it cannot shard
    ("'Tensor' object has no attribute 'device_mesh'"). So each is broadcast here, and marked non-persistent for the
    prepare, which keeps non-persistent buffers as they are; persistent again after (the checkpoint and final/ save
    them)."""
    from llmtrain.model.loss import causal_lm

    if not uses_fsdp(accelerator):
        yield
        return
    _wrap_classes_present(causal_lm(model))
    held = []
    if getattr(accelerator.state.fsdp_plugin, "cpu_ram_efficient_loading", False):
        held = [(module, name) for module in model.modules() for name, b in module._buffers.items()
                if b is not None and name not in module._non_persistent_buffers_set]
    for module, name in held:
        whole = module._buffers[name].to(accelerator.device).contiguous()
        torch.distributed.broadcast(whole, src=0)
        module._buffers[name] = whole
        module._non_persistent_buffers_set.add(name)
    try:
        yield
    finally:
        for module, name in held:
            module._non_persistent_buffers_set.discard(name)


def fp32_policy():
    """The MixedPrecisionPolicy of an fp32 LM head's unit (rl.cast_lm_head_to_fp32): gathered, computed and reduced
    in fp32, its outputs as they are."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=None)


@contextmanager
def head_in_fp32(model, accelerator, *, on: bool):
    """Around Accelerate's prepare under FSDP with rl.cast_lm_head_to_fp32 (`on`; nothing otherwise): the LM head (made
    fp32 by loss.attach_loss) an FSDP unit of its own whose MixedPrecisionPolicy gathers it in fp32 and reduces its
    gradient in fp32, so that its logits are fp32 from the fp32 weight as on one process, where the launch's policy
    (train.mixed_precision bf16) would gather it in bf16. Accelerate shards every unit with that one policy, the head
    with the final norm (its tail unit) or in the root: its calls of torch's fully_shard (imported when it prepares)
    shard the head alone first, with the head's policy, then the rest as asked. The head's unit is kept gathered
    after its forward, as Accelerate keeps its tail. Raises where Accelerate did not shard through that call (another
    Accelerate release), before anything trains."""
    if not on or not uses_fsdp(accelerator):
        yield
        return
    import torch.distributed.fsdp as api

    from llmtrain.errors import LLMTrainError
    from llmtrain.model.loss import causal_lm

    head = causal_lm(model).get_output_embeddings()
    policy = fp32_policy()
    original, done = api.fully_shard, []

    def fully_shard(module, **kwargs):
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        if not done and any(m is head for part in modules for m in part.modules()):
            original(head, **{**kwargs, "mp_policy": policy, "reshard_after_forward": False})
            done.append(head)
            rest = [m for m in modules if m is not head]
            if not rest:
                return module
            module = rest if isinstance(module, (list, tuple)) else module
        return original(module, **kwargs)

    api.fully_shard = fully_shard
    try:
        yield
    finally:
        api.fully_shard = original
    if not done:
        raise LLMTrainError(
            "rl.cast_lm_head_to_fp32 under FSDP: Accelerate's prepare did not shard the model through "
            "torch.distributed.fsdp.fully_shard as llmtrain expects (another Accelerate release?), so the LM head "
            "would be gathered in the compute dtype. Unset rl.cast_lm_head_to_fp32, or launch one GPU or DDP")


def shard_frozen(frozen, trained, accelerator, *, weights: bool = True) -> int:
    """A frozen model (distillation's teacher) sharded as FSDP shards `trained` (the prepared student): over the
    student's mesh (FSDP's ranks, or HSDP's replicas of shards; under FSDP x TP the TP ranks too: _frozen_mesh),
    each decoder layer a unit that all-gathers for its
    forward and frees after it, the decoder (embeddings, final norm) the root unit, in its own dtype (no cast).
    The LM head stays whole on every process, untied from the embeddings: the student's loss reads its weight chunk
    by chunk, outside any forward of the teacher's. The weights are the main process's, broadcast a tensor at a time,
    each process keeping its shard (Accelerate's fsdp2_load_full_state_dict, as it loads the student under
    cpu_ram_efficient_loading); the other processes may have built the model empty (modeling.load_model).
    weights=False: every process built it empty and nothing is broadcast; its shards and head are left unset on the
    device for the caller to fill (a full fine-tune's reference: reference.copy_into from the policy). Returns the
    parameters each process now holds (its shards and the whole head)."""
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from accelerate.utils.modeling import get_non_persistent_buffers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = _frozen_mesh(accelerator) or next(p.device_mesh for p in trained.parameters() if isinstance(p, DTensor))
    device = accelerator.device
    head = frozen.get_output_embeddings()
    # the head whole on every process, as the main process read it (a tied head: a copy of the embeddings)
    for name, p in list(head.named_parameters(recurse=False)):
        whole = p.detach().to(device, copy=True).contiguous() if weights else torch.empty_like(p, device=device)
        if weights:
            torch.distributed.broadcast(whole, src=0)
        setattr(head, name, torch.nn.Parameter(whole, requires_grad=False))
    decoder = frozen.get_decoder()
    state = decoder.state_dict() if weights else None  # the main process's are broadcast; the others' never read
    # computed from the config on every process (weights=False: all of them, the caller's to fill)
    keep = get_non_persistent_buffers(decoder, recurse=True, fqns=True) if weights else dict(decoder.named_buffers())
    buffers = {k: b for k, b in decoder.named_buffers() if k in keep}
    decoder.to(torch.device("meta"))  # sharded on meta, then filled: no process ever holds the decoder whole on GPU
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True)  # the root too: nothing kept gathered after forward
    if weights:
        fsdp2_load_full_state_dict(accelerator, decoder, state)
    else:
        decoder.to_empty(device=device)
    for fqn, b in buffers.items():
        parent, _, leaf = fqn.rpartition(".")
        decoder.get_submodule(parent).register_buffer(leaf, b.to(device), persistent=False)
    frozen.requires_grad_(False)
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in frozen.parameters())


def _frozen_mesh(accelerator):
    """Under FSDP x TP, the mesh a frozen model is sharded over: it is not split by tensor parallelism, so its shards
    spread over each TP group's processes too (the data ranks' shards x the TP ranks, flattened into one dimension;
    HSDP's replicas stay replicas), each GPU holding 1 / (shards x tp) of its decoder as the policy holds of its own.
    The policy's 2-D mesh would have it replicated over the shards and split over the TP pair alone. None without
    tensor parallelism: the policy's mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    root = accelerator.torch_device_mesh
    names = (root.mesh_dim_names or ()) if root is not None else ()
    if "tp" not in names or root["tp"].size() == 1:
        return None
    ranks = root.mesh  # [replicas,] shards, tp: the global ranks; TP groups are its last dimension
    if "dp_replicate" in names:  # every process builds it (its process groups are made collectively)
        return DeviceMesh(root.device_type, ranks.reshape(ranks.shape[0], -1),
                          mesh_dim_names=("dp_replicate", "dp_shard_tp"))
    return DeviceMesh(root.device_type, ranks.reshape(-1), mesh_dim_names=("dp_shard_tp",))


def fsdp_param_groups(state) -> list:
    """An FSDP2 unit's parameter groups (`FSDPModule._get_fsdp_state()`), which torch reads through no public API
    and spells two ways: a list `_fsdp_param_groups` in torch 2.13 (one group per mesh), one `_fsdp_param_group`
    or None in torch 2.11 (the GPU machine's; pyproject allows >= 2.6)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def receives_weights(accelerator) -> bool:
    """This process builds an empty model and receives its weights from the main process.

    FSDP with cpu_ram_efficient_loading (fsdp.yaml): only the main process reads the checkpoint; in
    `prepare`, Accelerate's fsdp2_load_full_state_dict broadcasts it tensor by tensor and every process
    keeps only its own shard. Host RAM then holds one copy of the model per job, not one per process.
    """
    plugin = accelerator.state.fsdp_plugin if uses_fsdp(accelerator) else None
    return bool(plugin is not None and plugin.cpu_ram_efficient_loading and not accelerator.is_main_process)
