"""Accelerate launch configs: read the layout one describes, and name the shipped one for a layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.layout import fsdp_flag, mesh_sizes
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


@dataclass(frozen=True)
class Layout:
    strategy: Strategy
    num_gpus: int  # per node
    num_nodes: int
    cpu_offload: bool
    mixed_precision: str | None  # the launch config's; llmtrain runs with the recipe's
    tp: int = 1  # tensor-parallel GPUs per group (parallelism_config_tp_size)
    reshard_after_forward: bool = True  # fsdp_config's fsdp_reshard_after_forward


def read_accelerate_config(path: Path) -> Layout:
    """Strategy and GPU layout from an `accelerate launch --config_file` YAML."""
    from llmtrain.parallel.launch import read_launch_file

    cfg = read_launch_file(path, name=f"--accelerate-config {path}")  # as doctor and launch read it
    kind = str(cfg.get("distributed_type", "NO"))
    if kind not in STRATEGIES:
        raise LLMTrainError(f"accelerate config '{path}': distributed_type {kind} is not modelled; "
                            f"estimate-memory knows {', '.join(STRATEGIES)}.")
    if cfg.get("use_cpu"):
        raise LLMTrainError(f"accelerate config '{path}' runs on the CPU (use_cpu: true): there is no GPU memory "
                            "to estimate.")
    procs, machines = int(cfg.get("num_processes", 1) or 1), int(cfg.get("num_machines", 1) or 1)
    if procs % machines:
        raise LLMTrainError(f"accelerate config '{path}': num_processes {procs} is not a multiple of "
                            f"num_machines {machines}.")
    strategy, tp = STRATEGIES[kind] if procs > 1 or kind == "FSDP" else "single", 1
    if kind == "FSDP" and (sizes := mesh_sizes(cfg)) is not None:
        strategy, tp = _mesh_strategy(path, sizes, gpus=procs // machines, nodes=machines)
    mp = cfg.get("mixed_precision")
    sharded = strategy in ("fsdp", "hsdp")  # the offload and the resharding are FSDP's (over a node's shards: HSDP)
    return Layout(strategy, procs // machines, machines, sharded and fsdp_flag(cfg, "fsdp_offload_params", False),
                  None if mp is None else str(mp), tp,
                  not sharded or fsdp_flag(cfg, "fsdp_reshard_after_forward", True))


def _mesh_strategy(path: Path, sizes: dict[str, int], *, gpus: int, nodes: int) -> tuple[Strategy, int]:
    """(fsdp or hsdp, tp) from a parallelism_config section's sizes (mesh_sizes); the estimate models HSDP as
    replicas = nodes, and FSDP x TP as tp consecutive GPUs of a node per group."""
    if sizes["cp"] > 1:
        raise LLMTrainError(f"accelerate config '{path}': context parallelism is not modelled (llmtrain does not "
                            "train with it); estimate-memory knows DDP, FSDP, HSDP and their x TP.")
    tp = sizes["tp"]
    if sizes["dp_replicate"] <= 1:
        return "fsdp", tp
    if (sizes["dp_replicate"], sizes["dp_shard"] * tp) != (nodes, gpus):
        raise LLMTrainError(f"accelerate config '{path}': HSDP of {sizes['dp_replicate']} replicas x "
                            f"{sizes['dp_shard']} shards{f' x {tp} TP' if tp > 1 else ''} on {nodes} node(s) of "
                            f"{gpus} GPUs; estimate-memory models replicas = nodes and shards = GPUs per node "
                            "(shards x tp with TP), as examples/slurm/llmtrain.sbatch launches it. Give --strategy "
                            "and the counts to estimate another layout.")
    return "hsdp", tp


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
