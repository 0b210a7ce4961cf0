"""Building the Accelerator: the one place a process joins the job.

`build_accelerator` refuses a launch llmtrain does not train (launch.py; the recipe on its layout: capabilities.py)
before any process group exists, builds Accelerate's FSDP plugin from the launch's variables, and does what
Accelerate leaves undone: FSDP on CPU workers (`_fsdp_on_cpu`) and the mesh attached once they are FSDP, or with
tensor parallelism (`_attach_mesh`).

Code elsewhere asks the Accelerator (`num_processes`, `process_index`, `is_main_process`) and never
reads RANK or WORLD_SIZE itself.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from llmtrain import capabilities
from llmtrain.config import Recipe
from llmtrain.errors import LLMTrainError
from llmtrain.layout import Layout
from llmtrain.parallel.fsdp import fsdp_precision
from llmtrain.parallel.groups import make_groups
from llmtrain.parallel.launch import check_parent_launch
from llmtrain.parallel.mesh import requested_mesh


def fsdp_requested() -> bool:
    """The launch asks for FSDP: `accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP=true."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def build_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # set by `accelerate launch`
    if launched is not None:  # its settings that accelerate ignores or llmtrain does not follow, refused first
        check_parent_launch()
    # The recipe on this launch's layout (capabilities.py's table), before any process group exists: every process
    # says the same paragraph (`llmtrain launch` says it once, before starting them)
    capabilities.check(recipe, Layout.from_environment(recipe))
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
        _fsdp_on_cpu(accelerator, fsdp_plugin, stages=recipe.parallel.pipeline_parallel)
    # the sequence groups and the pipelines with their stages' replicas (1: none), kept with this run's Accelerator
    accelerator.llmtrain_groups = make_groups(sequence_parallel=recipe.parallel.sequence_parallel,
                                              pipeline_parallel=recipe.parallel.pipeline_parallel)
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
    if recipe.train.mixed_precision == "fp16" and accelerator.scaler is None and accelerator.is_main_process:
        accelerator.print(  # (Accelerate turns fp16's autocast and loss scale on for GPUs only)
            f"warning: train.mixed_precision=fp16 on a CPU computes in the model's dtype ({recipe.model.dtype}): "
            "Accelerate runs neither fp16 autocast nor a loss scale on a CPU. Set train.mixed_precision=bf16 (CPU "
            "autocast) or no; fp16 trains on a GPU.")
    return accelerator


def _fsdp_on_cpu(accelerator, fsdp_plugin, *, stages: int = 1) -> None:
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
    n = accelerator.num_processes
    # pipeline stages shard themselves (over a stage's replicas) and save each stage's own files
    saved = (f"{fsdp_plugin.state_dict_type.name} checkpoints" if stages == 1 else
             f"{stages} pipeline stages, each sharded over its {n // stages} replicas" if n > stages else
             f"{stages} pipeline stages of one process each, whole (no replica to shard over)")
    accelerator.print(f"FSDP2 on CPU: {n} process{'es' * (n != 1)} over gloo, {saved}")


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


def use_fused_adamw(accelerator) -> bool:
    return accelerator.device.type == "cuda"
