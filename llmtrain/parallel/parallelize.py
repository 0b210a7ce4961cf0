"""The one place a loaded model is laid out over the run's processes: each parallelism applied from its own room, in
this written order (torchtitan's):

1. tensor (tensor.py): the decoder's linear layers split over the mesh's `tp` dimension;
2. sequence (sequence/): the model's attention made the Ulysses all-to-all over this process's sequence group;
3. compile: each decoder layer compiled (regional torch.compile), once the layers hold their final modules;
4. pipeline (pipeline/): this process keeps its stages, and drops the others' layers;
5. the optimizer over what this process holds, then DDP or FSDP (Accelerate's prepare, with the launch's plugin), except
   for pipeline stages, whose replicas sum their gradients themselves (pipeline/group.py).

The layout was checked before any process group existed (capabilities.py, on layout.Layout); each step here only
applies what it was given, and says so in the start-up line.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain import capabilities
from llmtrain.capabilities import experts_held, tensor_plan_source
from llmtrain.config import Recipe
from llmtrain.model.modeling import compile_layers
from llmtrain.parallel.fsdp import head_in_fp32, prepared_for_fsdp, uses_fsdp
from llmtrain.parallel.groups import groups
from llmtrain.parallel.mesh import tensor_parallel_size
from llmtrain.parallel.pipeline.schedule import Pipeline, row_slots
from llmtrain.parallel.sequence import attention as sequence_attention
from llmtrain.parallel.sequence.group import describe as describe_sequence
from llmtrain.parallel.tensor import apply_tensor_parallel, eager_in_compile


@dataclass(frozen=True)
class Parallelized:
    model: object  # as Accelerate prepared it (DDP- or FSDP-wrapped), or this process's stages' model
    optimizer: object
    pipeline: Pipeline | None = None  # parallel.pipeline_parallel > 1: this process's stages and their schedule


def parallelize(model, recipe: Recipe, accelerator, *, make_optimizer, pad_id: int, say,
                head_loss=None) -> Parallelized:
    """Apply the run's layout to `model` (loaded, adapters and loss attached) in the order above; `make_optimizer`
    builds the optimizer over a model's trainable parameters once this process holds only its own; `head_loss`: an
    objective's own last-stage loss for pipeline stages (a reward model's, preference pairs': objectives/
    reward_model.StageScores, objectives/preference.StagePairs, objectives/kto.StageKTO; None: the LM head's
    cross-entropy)."""
    if (tp := tensor_parallel_size(accelerator)) > 1:
        layers, experts = apply_tensor_parallel(model, accelerator.torch_device_mesh["tp"])
        held = f", and {experts} layers' experts split by expert ({experts_held(model.config, tp)})" if experts else ""
        say(f"tensor parallelism: {layers} linear layers split over {tp} processes{held} "
            f"(PyTorch parallelize_module, {tensor_plan_source(model.config)}"
            f"{'; the experts by llmtrain' if experts else ''})")
    if (sp := recipe.parallel.sequence_parallel) > 1:
        sequence_attention.attach(model, size=sp, group=groups(accelerator).sequence.group)
        say(describe_sequence(sp, accelerator.num_processes))
    if recipe.model.compile:
        eager = f", the {eager_in_compile(model)} modules tensor parallelism split run eagerly" if tp > 1 else ""
        say(f"compile: {compile_layers(model)} decoder layers (regional torch.compile){eager}")
    fp32_head = capabilities.fp32_head(recipe)
    if recipe.parallel.pipeline_parallel > 1:
        # this process's stages (the optimizer sees only theirs), sharded over their replicas by an FSDP launch
        plugin = accelerator.state.fsdp_plugin if uses_fsdp(accelerator) else None
        slots, key = row_slots(recipe)
        stages = Pipeline(model, parallel=recipe.parallel, micro_batches=recipe.train.grad_accum_steps,
                          slots=slots, slots_key=key, pad_id=pad_id, device=accelerator.device,
                          group=groups(accelerator).pipeline,
                          fsdp=None if plugin is None else plugin.mixed_precision_policy or True,
                          precision=accelerator.autocast, head_loss=head_loss,
                          router_aux=recipe.model.router_aux_loss_coef, fp32_head=fp32_head,
                          loss_scaler=accelerator.scaler)
        say(stages.describe())
        # not wrapped: no DDP over all processes (the replicas sum their gradients in Pipeline.run), and the optimizer
        # stays a plain torch one, saved per process by the checkpoint (run/checkpoint.py)
        return Parallelized(model=model, optimizer=make_optimizer(model), pipeline=stages)
    # its wrap's classes, the main process's buffers, the fp32 head's unit of its own (fsdp.py)
    with prepared_for_fsdp(model, accelerator), head_in_fp32(model, accelerator, on=fp32_head):
        model, optimizer = accelerator.prepare(model, make_optimizer(model))
    return Parallelized(model=model, optimizer=optimizer)
