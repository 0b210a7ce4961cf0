"""Accelerate launch configs: read the layout one describes, and name the shipped one for a layout."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.layout import Layout
from llmtrain.memory.spec import Strategy

STRATEGIES = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp"}  # FSDP with a replicated mesh: "hsdp"
# The shipped configs in accelerate_configs/ and the (num_processes, num_machines) each sets.
SHIPPED = {
    "single": ("accelerate_configs/single_gpu.yaml", 1, 1),
    "ddp": ("accelerate_configs/ddp.yaml", 8, 1),
    "fsdp": ("accelerate_configs/fsdp.yaml", 8, 1),
    "fsdp_multinode": ("accelerate_configs/fsdp_multinode.yaml", 16, 2),
    "hsdp": ("accelerate_configs/hsdp_multinode.yaml", 16, 2),
}


def read_accelerate_config(path: Path) -> Layout:
    """The layout an `accelerate launch --config_file` YAML describes (layout.Layout, as doctor and launch read it),
    refused where the estimate does not model it."""
    from llmtrain.parallel.launch import read_launch_file

    cfg = read_launch_file(path, name=f"--accelerate-config {path}")  # as doctor and launch read it
    kind = str(cfg.get("distributed_type", "NO"))
    if kind not in STRATEGIES:
        raise LLMTrainError(f"accelerate config '{path}': distributed_type {kind} is not modelled; "
                            f"estimate-memory knows {', '.join(STRATEGIES)}.")
    if cfg.get("use_cpu"):
        raise LLMTrainError(f"accelerate config '{path}' runs on the CPU (use_cpu: true): there is no GPU memory "
                            "to estimate.")
    layout = Layout.from_launch(cfg, where=f"accelerate config '{path}'")
    procs, machines = max(1, layout.processes), layout.nodes
    if procs % machines:
        raise LLMTrainError(f"accelerate config '{path}': num_processes {procs} is not a multiple of "
                            f"num_machines {machines}.")
    if kind != "FSDP":  # a mesh is FSDP's (the run refuses one without it: Layout.problems)
        return replace(layout, processes=procs if kind == "MULTI_GPU" else machines, mesh=False, tp=1, replicate=1)
    if layout.mesh:
        _check_mesh(path, layout)
    return replace(layout, processes=procs)


def _check_mesh(path: Path, layout: Layout) -> None:
    """The parallelism_config meshes the estimate models: HSDP as replicas = nodes, and FSDP x TP as tp consecutive
    GPUs of a node per group."""
    if layout.cp > 1:
        raise LLMTrainError(f"accelerate config '{path}': context parallelism is not modelled (llmtrain does not "
                            "train with it); estimate-memory knows DDP, FSDP, HSDP and their x TP.")
    tp, gpus, nodes = layout.tp, layout.gpus_per_node, layout.nodes
    if layout.replicate > 1 and (layout.replicate, layout.shard * tp) != (nodes, gpus):
        raise LLMTrainError(f"accelerate config '{path}': HSDP of {layout.replicate} replicas x "
                            f"{layout.shard} shards{f' x {tp} TP' if tp > 1 else ''} on {nodes} node(s) of "
                            f"{gpus} GPUs; estimate-memory models replicas = nodes and shards = GPUs per node "
                            "(shards x tp with TP), as examples/slurm/llmtrain.sbatch launches it. Give --strategy "
                            "and the counts to estimate another layout.")


def shipped_config(strategy: Strategy, *, num_gpus: int, num_nodes: int) -> tuple[str, tuple[str, ...]]:
    """The shipped config for a layout, and the `accelerate launch` flags that adapt its process counts."""
    key = "fsdp_multinode" if (strategy == "fsdp" and num_nodes > 1) else strategy
    path, procs, machines = SHIPPED[key]
    flags: list[str] = []
    if strategy == "hsdp" and (num_nodes, num_gpus) != (2, 8):
        flags += ["--parallelism_config_dp_replicate_size", str(num_nodes),
                  "--parallelism_config_dp_shard_size", str(num_gpus)]
    if num_gpus * num_nodes != procs:
        flags += ["--num_processes", str(num_gpus * num_nodes)]
    if num_nodes != machines:
        flags += ["--num_machines", str(num_nodes)]
    return path, tuple(flags)
