"""The device mesh: the one a launch asks for (its parallelism_config section: HSDP, FSDP x TP), the meshes
llmtrain refuses, and what a process reads from it: the size of each dimension and which batch it reads.

Each parallelism's own work lives in its own file (fsdp.py, tensor.py); the sizes of the mesh's dimensions are read
here, for all of them: `tensor_parallel_size`, `replicas` (HSDP's dp_replicate) and `data_ranks`, the processes
divided by those that share a batch.
"""

from __future__ import annotations

import os

from llmtrain.errors import LLMTrainError


def requested_mesh():
    """The device mesh the launch asks for (its parallelism_config section: HSDP), as accelerate's ParallelismConfig
    reads it from the PARALLELISM_CONFIG_* variables `accelerate launch` sets; None without one."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


def check_mesh(config, *, world: int, fsdp: bool, nodes: int | None = None) -> None:
    """Refuse the meshes llmtrain does not train, naming what to use instead (`nodes`: the launch's machines, for
    an example that fits it; by default the mesh's replicas where they divide the processes, else 1)."""
    where = "in the launch config's parallelism_config"
    if config.cp_size > 1 or config.sp_size > 1:
        kind, key = ("context", "cp") if config.cp_size > 1 else ("sequence", "sp")
        raise LLMTrainError(
            f"{kind} parallelism through accelerate (parallelism_config_{key}_size > 1 {where}) is not what llmtrain "
            f"runs: accelerate's needs DeepSpeed (sp) or turns packed rows into one causal sequence (cp). Set "
            f"parallelism_config_{key}_size: 1 and split each sequence with the recipe's parallel.sequence_parallel: "
            "N (Ulysses, on a plain DDP or FSDP launch: docs/sequence-parallel.md).")
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
    dimension in Accelerate's order) read the same batch, and so do those of a sequence group (each keeps its slice)
    and the stages of a pipeline (parallel/pipeline.py)."""
    from llmtrain.parallel.pipeline import pipeline_group
    from llmtrain.parallel.sequence import sequence_parallel_size

    if (pipe := pipeline_group()).size > 1:  # a pipeline's stages read one batch: a data rank is a pipeline
        return pipe.replicas, pipe.replica
    group = tensor_parallel_size(accelerator) * sequence_parallel_size()  # one of the two is 1 (sequence.check)
    return accelerator.num_processes // group, accelerator.process_index // group


def replicas(accelerator) -> int:
    """HSDP's replicas (the mesh's dp_replicate dimension: the nodes); 1 without HSDP."""
    mesh = accelerator.torch_device_mesh
    return mesh["dp_replicate"].size() if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()) else 1
