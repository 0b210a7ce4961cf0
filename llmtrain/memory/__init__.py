"""Per-GPU peak memory of a fine-tuning run, from a model's config.json alone (no weights, no GPU).

    from llmtrain.memory import estimate_for_recipe
    est = estimate_for_recipe(recipe, num_processes=8, strategy="fsdp")
    est.per_gpu_peak_bytes, est.breakdown

Everything here is arithmetic on a `ModelShape` (exact counts from the model built on the meta
device) and a `TrainSpec`; docs/memory.md gives the formulas.

May import: the schema (`config`, `errors`), `parallel`, this folder, and pure helpers of `data` and `model` (the
batching's packing, the data plan's step count, the text model of a config). Never the run folder or the loop, and
the estimate itself loads no weights and reads no data. The one reader is the command (cli.py), which tokenises
an online-RL recipe's prompts (through the data cache) for their lengths; the trainer passes its own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from llmtrain.config import Recipe
    from llmtrain.memory.comms import Traffic
    from llmtrain.memory.params import ModelShape, load_model_shape, lora_plan
    from llmtrain.memory.spec import Estimate, TrainSpec, spec_from_recipe

# Imported on first use, so that `import llmtrain.memory.cli` (and `llmtrain --help`) stays light.
# (The estimate function itself is llmtrain.memory.estimate.estimate: its module has the same name.)
_LAZY = {"ModelShape": "params", "load_model_shape": "params", "lora_plan": "params",
         "Estimate": "spec", "TrainSpec": "spec", "spec_from_recipe": "spec"}

__all__ = [
    "Estimate",
    "ModelShape",
    "TrainSpec",
    "estimate_for_recipe",
    "estimate_for_run",
    "estimate_run",
    "load_model_shape",
    "lora_plan",
    "predicted_for_run",
    "spec_from_recipe",
    "traffic_run",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"llmtrain.memory.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'llmtrain.memory' has no attribute {name!r}")


def estimate_run(shape: ModelShape, spec: TrainSpec) -> Estimate:
    """The per-GPU estimate of a run on any layout, the one entry every caller asks (the command, --fit, doctor, the
    trainer): one GPU's phases of its strategy (estimate.estimate); with a pipeline, its worst GPU's
    (pipeline.pipeline_estimate, the stages as llmtrain trains them)."""
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.pipeline import as_trained, pipeline_estimate

    return estimate(shape, spec) if spec.pipeline_parallel == 1 else pipeline_estimate(shape, as_trained(spec))


def traffic_run(shape: ModelShape, spec: TrainSpec, network=None) -> Traffic:
    """The step's time and traffic of a run on any layout: comms.step_traffic, or with a pipeline its pacing
    stage's (pipeline.pipeline_traffic)."""
    from llmtrain.memory.comms import Network, step_traffic
    from llmtrain.memory.pipeline import as_trained, pipeline_traffic

    network = network or Network()
    return step_traffic(shape, spec, network) if spec.pipeline_parallel == 1 else \
        pipeline_traffic(shape, as_trained(spec), network)


def estimate_for_recipe(recipe: Recipe, *, num_processes: int = 1,
                        strategy: Literal["single", "ddp", "fsdp", "hsdp"] = "single", cpu_offload: bool = False,
                        num_nodes: int = 1, tp: int = 1, reshard_after_forward: bool = True,
                        prompt_lengths=None) -> Estimate:
    """The per-GPU estimate for the run `recipe` describes on `num_processes` GPUs of each of `num_nodes` nodes
    (`tp`: tensor-parallel GPUs a group, FSDP sharding over the groups).

    Reads the config.json of recipe.model.name_or_path (a local directory, a preset name, or a hub id
    with a built-in config or in the local cache). `prompt_lengths`: an online-RL recipe's prompt lengths in
    tokens (without them, every prompt is taken at data.max_seq_len: the worst case).
    """
    from llmtrain.memory.params import recipe_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    shape = recipe_model_shape(recipe)
    return estimate_run(shape, spec_from_recipe(recipe, strategy=strategy, num_gpus=num_processes, num_nodes=num_nodes,
                                            cpu_offload=cpu_offload, tp=tp, prompt_lengths=prompt_lengths,
                                            reshard_after_forward=reshard_after_forward))


def estimate_for_run(recipe: Recipe, accelerator, *, prompt_lengths=None) -> Estimate | None:
    """The estimate for the run this process is part of (its launch's strategy, processes, FSDP offload and HSDP
    replicas; online RL at its data's `prompt_lengths`), on the GPU it runs on. A model the estimator cannot read
    gives None (and a note), never a failed run."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from llmtrain.errors import LLMTrainError
    from llmtrain.parallel.fsdp import uses_fsdp

    fsdp = uses_fsdp(accelerator)
    strategy = "fsdp" if fsdp else ("ddp" if accelerator.num_processes > 1 else "single")
    offload = fsdp and isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
    mesh = accelerator.parallelism_config
    replicas = mesh.dp_replicate_size if (fsdp and mesh is not None) else 1
    tp = mesh.tp_size if (fsdp and mesh is not None) else 1  # FSDP x TP (it had been priced as plain FSDP)
    reshard = not fsdp or getattr(accelerator.state.fsdp_plugin, "reshard_after_forward", True) is not False
    try:  # HSDP: the memory of FSDP over a replica's shards (modelled as replicas = nodes)
        est = estimate_for_recipe(recipe, num_processes=accelerator.num_processes // replicas,
                                  strategy="hsdp" if replicas > 1 else strategy, cpu_offload=offload,
                                  num_nodes=replicas, tp=tp, reshard_after_forward=reshard,
                                  prompt_lengths=prompt_lengths)
    except LLMTrainError as e:
        accelerator.print(f"memory estimate unavailable: {e}")
        return None
    except Exception as e:  # a model the estimator does not know: the run goes on without an estimate
        accelerator.print(f"memory estimate unavailable: the estimator cannot read this model ({type(e).__name__}: "
                          f"{e})")
        return None
    if accelerator.device.type == "cuda":  # the card it runs on, for est.fits and the advice
        import dataclasses

        import torch

        gib = torch.cuda.get_device_properties(accelerator.device).total_memory / 2**30
        est = dataclasses.replace(est, spec=dataclasses.replace(est.spec, gpu_memory_gib=gib))
    return est


def predicted_for_run(est: Estimate | None) -> dict:
    """The estimate's figures for summary.json ({} without one). allocated/reserved compare with
    torch.cuda.max_memory_*; peak adds the CUDA context and NCCL buffers."""
    if est is None:
        return {}
    return {"predicted_peak_bytes": est.per_gpu_peak_bytes,
            "predicted_peak_allocated_bytes": est.per_gpu_peak_allocated_bytes,
            "predicted_peak_reserved_bytes": est.per_gpu_peak_reserved_bytes, "predicted_breakdown": est.breakdown,
            **({"predicted_worst_case_peak_bytes": est.worst_case_bytes} if est.worst_case_bytes else {})}
