"""Everything distributed lives here: building the Accelerator and reducing across processes.

Code elsewhere asks the Accelerator (`num_processes`, `process_index`, `is_main_process`) and never
reads RANK or WORLD_SIZE itself.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch

from llmtrain.config import Recipe
from llmtrain.errors import LLMTrainError
from llmtrain.parallel import sequence
from llmtrain.parallel.launch import check_parent_launch


def fsdp_requested() -> bool:
    """The launch asks for FSDP: `accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP=true."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def build_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # set by `accelerate launch`
    if launched is not None:  # its settings that accelerate ignores or llmtrain does not follow, refused first
        check_parent_launch()
    # Built here (from the launch's FSDP_* variables, as Accelerate itself would) to keep a handle on it.
    fsdp_plugin = FullyShardedDataParallelPlugin() if fsdp_requested() else None
    if fsdp_plugin is not None and fsdp_plugin.state_dict_type.name != "SHARDED_STATE_DICT":
        raise LLMTrainError(
            f"the launch config sets fsdp_state_dict_type: {fsdp_plugin.state_dict_type.name}; llmtrain's FSDP "
            "checkpoints are sharded (every rank writes its own shard, nothing is gathered), so set "
            "fsdp_state_dict_type: SHARDED_STATE_DICT. final/ is still exported as one full model."
        )
    # The recipe is the source of truth for precision; passing it explicitly overrides the launch config. A second
    # train() in one process (a notebook, the tests) may ask for another precision than the first: Accelerate keeps
    # its state per process and refuses a change, so the old precision is forgotten (the process group is kept).
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", recipe.train.mixed_precision) != recipe.train.mixed_precision:
        AcceleratorState._reset_state()
    cpu = not torch.accelerator.is_available()
    # A launch with parallelism_config (hsdp_multinode.yaml, cpu_hsdp.yaml) sets ACCELERATE_USE_PARALLELISM_CONFIG
    # and the mesh sizes. Accelerate validates the mesh against the distributed type in its constructor, which on
    # CPU workers is MULTI_CPU until _fsdp_on_cpu makes it FSDP: there the mesh is attached afterwards.
    mesh = requested_mesh()
    sequence.check(recipe, world=int(os.environ.get("WORLD_SIZE", "1")), mesh=mesh)
    if mesh is not None:  # refused before any process group exists, with the launch's own sizes
        check_mesh(mesh, world=int(os.environ.get("WORLD_SIZE", "1")), fsdp=fsdp_plugin is not None)
        check_tensor_parallel(mesh, recipe)
    # Tensor parallelism is applied by llmtrain (apply_tensor_parallel), not by Accelerate: its mesh is attached
    # afterwards on GPUs too (see _attach_mesh).
    mesh_later = mesh is not None and (cpu or mesh.tp_size > 1)
    if mesh_later:
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    try:
        accelerator = Accelerator(
            # Without an accelerator, processes started by torchrun (`accelerate launch` with a multi-process
            # config) must be told they are CPU workers, or each one silently trains alone; with cpu=True
            # Accelerate joins them into one gloo process group (MULTI_CPU).
            cpu=cpu,
            mixed_precision=recipe.train.mixed_precision,
            fsdp_plugin=fsdp_plugin,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.train.timeout_s))],
        )
    finally:
        if mesh_later:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    if fsdp_plugin is not None and accelerator.distributed_type.name == "MULTI_CPU":
        _fsdp_on_cpu(accelerator, fsdp_plugin)
    sequence.setup(recipe.parallel.sequence_parallel)  # its process groups (1: none, and any earlier one forgotten)
    if mesh_later:
        _attach_mesh(accelerator, mesh)
    if mesh is not None and mesh.tp_size > 1:
        # Every process loads the model and keeps its tensor-parallel slice: the rank-0 broadcast of Accelerate's
        # cpu_ram_efficient_loading sends whole tensors into an unsharded model, which a TP model is not.
        fsdp_plugin.cpu_ram_efficient_loading = False
    if fsdp_plugin is not None and recipe.train.mixed_precision != "no":
        fsdp_plugin.mixed_precision_policy = fsdp_precision(recipe.train.mixed_precision)
    if launched and launched != recipe.train.mixed_precision and accelerator.is_main_process:
        accelerator.print(
            f"warning: the launch config asks for mixed_precision={launched} but the recipe sets "
            f"train.mixed_precision={recipe.train.mixed_precision}; using the recipe's."
        )
    return accelerator


def _fsdp_on_cpu(accelerator, fsdp_plugin) -> None:
    """Run Accelerate's own FSDP code path on CPU workers joined over gloo.

    Accelerate switches to DistributedType.FSDP only for accelerator devices (AcceleratorState turns
    MULTI_GPU/NPU/XPU... into FSDP, never MULTI_CPU), so a CPU launch with an FSDP config would silently
    fall back to DDP. PyTorch's `fully_shard`, DTensor, DCP checkpoints and the gloo collectives they use
    all work on CPU, so this does what AcceleratorState does for a GPU group, on the CPU group: attach
    the plugin and set the distributed type. From there `prepare` (fsdp2_prepare_model), `no_sync`,
    `clip_grad_norm_`, `save_state`/`load_state` (save_fsdp_model/optimizer) and `get_state_dict` are
    the very functions a GPU run calls. It is how the FSDP path is tested on machines without a GPU.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin.fsdp_version != 2:
        raise LLMTrainError("FSDP on CPU is supported with FSDP2 only: set fsdp_version: 2 in the launch config.")
    state = accelerator.state
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)  # as AcceleratorState does for FSDP
    state.fsdp_plugin = fsdp_plugin
    state.distributed_type = DistributedType.FSDP
    # AcceleratorState and PartialState keep separate shared dicts; both must agree (wait_for_everyone,
    # RNG sync and the like read PartialState's).
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.print(f"FSDP2 on CPU: {accelerator.num_processes} processes over gloo, "
                      f"{fsdp_plugin.state_dict_type.name} checkpoints")


def requested_mesh():
    """The device mesh the launch asks for (its parallelism_config section: HSDP), as accelerate's ParallelismConfig
    reads it from the PARALLELISM_CONFIG_* variables `accelerate launch` sets; None without one."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


def _attach_mesh(accelerator, config) -> None:
    """What Accelerator.__init__ does with a launch's parallelism_config, done once the workers are FSDP (CPU) and,
    with tensor parallelism, on GPUs too.

    With tp_size > 1 Accelerate is handed the data-parallel part of the mesh only (tp_size 1 in its config; the device
    mesh keeps its `tp` dimension): llmtrain applies the tensor-parallel plan itself (apply_tensor_parallel), because
    Accelerate 1.15's own TP preparation imports a class transformers 5.24 no longer has (ReplicateParallel), and
    transformers' TP loading builds its own mesh of tp x fsdp. FSDP2 then shards over the mesh's dp dimensions and
    finds the TP'd weights already DTensors on the `tp` dimension of the same mesh: the 2-D layout.
    """
    import dataclasses

    mesh = config.get_device_mesh(accelerator.device.type)
    config._validate_accelerator(accelerator)  # the whole mesh against the processes
    if config.tp_size > 1:
        config = dataclasses.replace(config, tp_size=1, tp_handler=None)
        config.device_mesh = mesh
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = mesh


def check_mesh(config, *, world: int, fsdp: bool, nodes: int | None = None) -> None:
    """Refuse the meshes llmtrain does not train, naming what to use instead (`nodes`: the launch's machines, for
    an example that fits it; by default the mesh's replicas where they divide the processes, else 1)."""
    where = "in the launch config's parallelism_config"
    if config.cp_size > 1 or config.sp_size > 1:
        kind, key = ("context", "cp") if config.cp_size > 1 else ("sequence", "sp")
        raise LLMTrainError(
            f"{kind} parallelism (parallelism_config_{key}_size > 1 {where}) is not supported by llmtrain: it packs "
            f"whole sequences per process with varlen attention instead. Set parallelism_config_{key}_size: 1, and "
            "for long sequences use model.gradient_checkpointing=true or a smaller train.micro_batch_tokens.")
    if not fsdp:
        raise LLMTrainError(
            "a parallelism_config mesh needs FSDP: set distributed_type: FSDP with fsdp_version: 2 in the launch "
            "config (accelerate_configs/hsdp_multinode.yaml), or drop parallelism_config for plain data "
            "parallelism (accelerate_configs/ddp.yaml).")
    if config.tp_size > 1 and config.dp_shard_size < 2:
        raise LLMTrainError(
            f"tensor parallelism (parallelism_config_tp_size: {config.tp_size} {where}) runs under FSDP2 as FSDP x TP "
            "(or HSDP x TP), which needs at least 2 shards: set parallelism_config_dp_shard_size to the processes "
            f"(of a node, with replicas) divided by {config.tp_size} (accelerate_configs/fsdp_tp.yaml), or lower "
            "parallelism_config_tp_size, or shard with plain FSDP over the same GPUs (accelerate_configs/fsdp.yaml).")
    sizes = [(config.dp_replicate_size, "replicas", "dp_replicate"), (config.dp_shard_size, "shards", "dp_shard"),
             (config.tp_size, "tensor-parallel ranks", "tp")]
    sizes = [x for x in sizes if x[0] > 1 or x[2] == "dp_shard"]
    size = config.dp_replicate_size * config.dp_shard_size * config.tp_size
    if size != world:
        raise LLMTrainError(
            f"the launch config's mesh is {' x '.join(str(n) for n, _, _ in sizes)} = {size} processes "
            f"({' x '.join(f'parallelism_config_{key}_size' for _, _, key in sizes)}) but the job has {world} "
            f"processes. Make {' x '.join(name for _, name, _ in sizes)} equal the processes: replicas = nodes and "
            f"shards x tp = GPUs per node ({_mesh_example(config, world, nodes)}).")


def _mesh_example(config, world: int, nodes: int | None) -> str:
    """accelerate launch flags whose mesh fits `world` processes on `nodes` machines, keeping the config's TP."""
    tp = config.tp_size
    if nodes is None:
        nodes = config.dp_replicate_size if world % (config.dp_replicate_size * tp) == 0 else 1
    shards = world // (nodes * tp) if world % (nodes * tp) == 0 else 0
    if shards < 2:
        return ("e.g. --parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 8 for 2 nodes of 8, "
                "or --parallelism_config_dp_shard_size 4 --parallelism_config_tp_size 2 for 8 GPUs")
    flags = ([f"--parallelism_config_dp_replicate_size {nodes}"] if nodes > 1 else []) + [
        f"--parallelism_config_dp_shard_size {shards}"] + ([f"--parallelism_config_tp_size {tp}"] if tp > 1 else [])
    return f"for these {world} processes on {nodes} node{'s' if nodes > 1 else ''}: {' '.join(flags)}"


def check_tensor_parallel(config, recipe: Recipe) -> None:
    """Refuse what tensor parallelism does not train, before any process group exists."""
    if config.tp_size < 2:
        return
    where = f"parallelism_config_tp_size: {config.tp_size} in the launch config"
    if recipe.lora is not None or recipe.model.quantize:
        what = "a 4-bit base (model.quantize)" if recipe.model.quantize else "LoRA (the recipe's lora: section)"
        raise LLMTrainError(
            f"tensor parallelism ({where}) does not train {what}: peft's adapters are whole matrices beside "
            "the sharded base weights. A LoRA run of a 7B model fits one GPU: launch it with "
            "accelerate_configs/ddp.yaml or accelerate_configs/fsdp.yaml (tp_size 1).")
    if recipe.model.compile:
        raise LLMTrainError(f"tensor parallelism ({where}) is not tested with model.compile: set model.compile=false.")


def mesh_line(config, tp: int = 1) -> str | None:
    """How the processes are laid out, for the start-up line: '2 replicas x 2 shards' (HSDP), '2 shards x 2
    tensor-parallel' (FSDP x TP); None without a mesh."""
    if config is None:
        return None
    parts = [(config.dp_replicate_size, "replica"), (config.dp_shard_size, "shard")]
    line = " x ".join(f"{n} {name}{'s' if n > 1 else ''}" for n, name in parts if n > 1)
    tp = max(tp, config.tp_size)
    return " x ".join(p for p in (line, f"{tp} tensor-parallel" if tp > 1 else "") if p) or None


def tensor_parallel_size(accelerator) -> int:
    """Processes that share each batch and split each layer's matrices between them (the mesh's `tp` dimension)."""
    mesh = accelerator.torch_device_mesh
    return mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else 1


def data_ranks(accelerator) -> tuple[int, int]:
    """(data-parallel ranks, this process's data rank): who reads which batch. Without tensor parallelism every
    process is a data rank; with it, the processes of a TP group (consecutive ranks: `tp` is the mesh's innermost
    dimension in Accelerate's order) read the same batch, and so do those of a sequence group (each keeps its slice)."""
    from llmtrain.parallel.sequence import sequence_parallel_size

    group = tensor_parallel_size(accelerator) * sequence_parallel_size()  # one of the two is 1 (sequence.check)
    return accelerator.num_processes // group, accelerator.process_index // group


def apply_tensor_parallel(model, mesh) -> int:
    """Shard the decoder's linear layers over `mesh` (1-D, the `tp` dimension) by the model's own tensor-parallel
    plan (transformers' `base_model_tp_plan`: q/k/v and gate/up column-wise, o and down row-wise), with PyTorch's
    parallelize_module. Each attention layer then holds heads / tp query and KV heads, each MLP intermediate / tp
    columns; a row-wise layer all-reduces its output, so every process of the group holds the same hidden states
    and the same loss. Embeddings, norms and the LM head stay whole on every TP rank (FSDP still shards them over
    the data-parallel dimension). Returns the number of layers sharded."""
    from fnmatch import fnmatchcase

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    config, tp = model.config, mesh.size()
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan or set(plan.values()) - set(styles):
        raise LLMTrainError(
            f"tensor parallelism needs a model whose tensor-parallel plan (config.base_model_tp_plan) is column- and "
            f"row-wise linear layers, as Llama's and Mistral's are; {type(model).__name__} has "
            f"{sorted(set(plan.values())) or 'none'}. Set parallelism_config_tp_size: 1.")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, n in (("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", kv),
                    ("intermediate_size", config.intermediate_size)):
        if n % tp:
            raise LLMTrainError(f"tensor parallelism over {tp} processes splits the model's {name} ({n}) evenly, and "
                                f"{n} is not a multiple of {tp}: set parallelism_config_tp_size to a divisor of {n}.")
    base = getattr(model, model.base_model_prefix)
    layers = {name: styles[style]() for name, _ in base.named_modules()
              for pattern, style in plan.items() if fnmatchcase(name, pattern)}
    parallelize_module(base, mesh, layers)
    for block in {name.rpartition(".")[0] for name, style in layers.items() if isinstance(style, ColwiseParallel)}:
        base.get_submodule(block).register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
    return len(layers)


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


def fsdp_param_groups(state) -> list:
    """An FSDP2 unit's parameter groups (`FSDPModule._get_fsdp_state()`), which torch reads through no public API
    and spells two ways: a list `_fsdp_param_groups` in torch 2.13 (one group per mesh), one `_fsdp_param_group`
    or None in torch 2.11 (the GPU machine's; pyproject allows >= 2.6)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def replicas(accelerator) -> int:
    """HSDP's replicas (the mesh's dp_replicate dimension: the nodes); 1 without HSDP."""
    mesh = accelerator.torch_device_mesh
    return mesh["dp_replicate"].size() if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()) else 1


def uses_fsdp(accelerator) -> bool:
    """The run is sharded by FSDP (on GPUs, or on CPU through `_fsdp_on_cpu`)."""
    return accelerator.distributed_type.name == "FSDP"


def receives_weights(accelerator) -> bool:
    """This process builds an empty model and receives its weights from the main process.

    FSDP with cpu_ram_efficient_loading (fsdp.yaml): only the main process reads the checkpoint; in
    `prepare`, Accelerate's fsdp2_load_full_state_dict broadcasts it tensor by tensor and every process
    keeps only its own shard. Host RAM then holds one copy of the model per job, not one per process.
    """
    plugin = accelerator.state.fsdp_plugin if uses_fsdp(accelerator) else None
    return bool(plugin is not None and plugin.cpu_ram_efficient_loading and not accelerator.is_main_process)


def global_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers over all processes in one collective."""
    return _summed(accelerator, values).tolist()


def gathered(accelerator, items: list) -> list:
    """Every process's list, concatenated in rank order, on every process (picklable items: online RL's rollout
    records)."""
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    return gather_object(list(items))


def data_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers of the batches (losses, token counts) over the data-parallel ranks, in one collective over all
    processes: the processes of a tensor-parallel group hold the same batch and the same loss (the row-wise layers
    all-reduce their outputs), so the sum over all processes counts each batch tp times. Exact for counts; for
    losses the float64 sum of tp equal values divided by tp is the value."""
    tp = tensor_parallel_size(accelerator)
    return (_summed(accelerator, values) / tp).tolist()


def _summed(accelerator, values) -> torch.Tensor:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t


def use_fused_adamw(accelerator) -> bool:
    return accelerator.device.type == "cuda"
