"""The device mesh: the one a launch asks for (its parallelism_config section: HSDP, FSDP x TP; its sizes are
checked with the rest of the layout, layout.py), and what a process reads from it: the size of each dimension and
which batch it reads.

Each parallelism's own work lives in its own file (fsdp.py, tensor.py); the sizes of the mesh's dimensions are read
here, for all of them: `tensor_parallel_size`, `replicas` (HSDP's dp_replicate) and `data_ranks`, the processes
divided by those that share a batch.
"""

from __future__ import annotations

import os


def requested_mesh():
    """The device mesh the launch asks for (its parallelism_config section: HSDP), as accelerate's ParallelismConfig
    reads it from the PARALLELISM_CONFIG_* variables `accelerate launch` sets; None without one."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


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
    and the stages of a pipeline (parallel/pipeline/group.py)."""
    from llmtrain.parallel.groups import groups

    run = groups(accelerator)
    if (pipe := run.pipeline).size > 1:  # a pipeline's stages read one batch: a data rank is a pipeline
        return pipe.replicas, pipe.replica
    group = tensor_parallel_size(accelerator) * run.sequence.size  # one of the two is 1 (layout.py)
    return accelerator.num_processes // group, accelerator.process_index // group


def replicas(accelerator) -> int:
    """HSDP's replicas (the mesh's dp_replicate dimension: the nodes); 1 without HSDP."""
    mesh = accelerator.torch_device_mesh
    return mesh["dp_replicate"].size() if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()) else 1
