"""The teacher of on-policy distillation (distill: section) in the estimate: what it adds to each phase of the step.

The teacher is a second, frozen model, stored in its own dtype (model.dtype, or the autocast dtype under mixed
precision): whole on every GPU (one GPU, DDP), or under FSDP/HSDP sharded as the student is (fsdp.shard_frozen), its
LM head whole on every GPU (a tied head a copy of the embeddings). Beside its weights:
- its forward, under no_grad, before the student's: one decoder layer's transients at a time over the micro-batch
  (as evaluation's), which ends by keeping the final hidden states of the trained positions only (N x its hidden);
  sharded, the decoder's root unit (embeddings, final norm) and about two layers gathered meanwhile, as the
  student's forward gathers them;
- those hidden states stay until the student's loss has run backward (each chunk's recompute projects them again);
- each loss chunk holds, beside the student's logits the cross-entropy's chunk counts, the teacher's logits in fp32,
  both log-softmaxes and one product of the divergence: 4 x C x V in fp32.
"""

from __future__ import annotations

from llmtrain.memory import activations as act
from llmtrain.memory.params import ModelShape
from llmtrain.memory.spec import DTYPE_BYTES, TrainSpec

LOSS_PHASES = ("loss", "backward_loss", "backward_lm_head", "eval_loss")
HELD_PHASES = ("forward", "backward_layers", "backward_embedding")  # the teacher's hidden states are alive


def sharded_frozen_bytes(shape: ModelShape, spec: TrainSpec, b: int) -> int:
    """A frozen model's weights on each GPU as fsdp.shard_frozen holds them under FSDP/HSDP (distillation's teacher,
    KTO's full fine-tune's reference): the decoder in shards, the LM head whole (a tied head a copy of the
    embeddings); `b` bytes a weight. `shape`: the whole model (not a TP slice): under FSDP x TP its shards spread
    over the TP ranks too (fsdp._frozen_mesh), 1 / (shards x tp) of the decoder a GPU."""
    return -(-(shape.params_total - shape.params_head) // (spec.shards * spec.tp)) * b + shape.vocab * shape.hidden * b


def add_teacher(phases: dict[str, dict[str, int]], shape: ModelShape, spec: TrainSpec, p: act.Pass, base: dict,
                *, gradients: int) -> None:
    """Each phase with the teacher's bytes (its weights, and in the loss's phases its hidden states and a chunk's
    logits), and the teacher's own forward as a phase: `base` and `gradients` are what is alive then."""
    t, b = spec.teacher, DTYPE_BYTES[spec.teacher_dtype]
    weights, gathered = t.params_total * b, 0
    if spec.sharded:  # the decoder in shards, the head whole; in its forward the root and ~2 layers gathered
        weights = sharded_frozen_bytes(t, spec, b)
        gathered = (t.params_embed + t.params_final_norm + 2 * t.params_per_layer) * b
    hidden, chunk = p.loss_tokens * t.hidden * b, _chunk_logits(shape, spec, p)
    for name, parts in phases.items():
        extra = hidden + chunk if name in LOSS_PHASES else hidden if name in HELD_PHASES else 0
        parts["teacher"] = weights + extra
    phases["teacher_forward"] = {**{k: v for k, v in base.items() if v}, "gradients": gradients,
                                 "teacher": weights + gathered + _forward_bytes(spec, p) + hidden}


def _chunk_logits(shape: ModelShape, spec: TrainSpec, p: act.Pass) -> int:
    """A loss chunk's teacher logits beside the student's: the teacher's logits in fp32, both log-softmaxes and one
    product of the divergence, 4 x C x V in fp32."""
    return 4 * act.loss_chunk(p, spec.loss_chunk_tokens) * shape.vocab * act.FP32


def _forward_bytes(spec: TrainSpec, p: act.Pass) -> int:
    """The teacher's forward over the micro-batch `p`, under no_grad: one decoder layer's transients at a time."""
    frozen = act.Pass(**{**vars(p), "trainable_base": False, "lora_dropout": 0.0, "dora": False})
    return act.eval_layer_bytes(frozen, spec.teacher, {})


def add_stage_teacher(phases: dict[str, dict[str, int]], shape: ModelShape, spec: TrainSpec, p: act.Pass,
                      base: dict) -> None:
    """Distillation on pipeline stages (objectives/distill.StageDistill), on a GPU of the last stage, which alone
    holds the teacher, whole (under an FSDP launch too: phases.build_teacher): before the window's schedule runs,
    the teacher's forward over each of its M micro-batches (no gradient alive: the step's first backward has not
    run), whose trained positions' hidden states, all M, stay through the step's phases and the next window's
    sampling (the next window's teacher forward frees them first); in the loss's phases a chunk's logits as
    add_teacher counts them."""
    t, b = spec.teacher, DTYPE_BYTES[spec.teacher_dtype]
    weights, held = t.params_total * b, spec.grad_accum_steps * p.loss_tokens * t.hidden * b
    chunk = _chunk_logits(shape, spec, p)
    for name, parts in phases.items():
        parts["teacher"] = weights + held + (chunk if name in LOSS_PHASES else 0)
    phases["teacher_forward"] = {**{k: v for k, v in base.items() if v},
                                 "teacher": weights + held + _forward_bytes(spec, p)}
