"""Per-GPU bytes of what a step holds besides activations: weights, gradients, optimizer state and DDP's buckets,
after FSDP's sharding or CPU offload; the gradients kept between micro-batches; and host RAM for loading.

The estimate (estimate.py) adds these, per phase, to what the micro-batch makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory.params import LoraPlan, ModelShape
from llmtrain.memory.spec import DTYPE_BYTES, QUANT_BYTES_PER_WEIGHT, TrainSpec
from llmtrain.memory.reward_models import weight_bytes
from llmtrain.memory.teacher import sharded_frozen_bytes


@dataclass(frozen=True)
class States:
    """Per-GPU bytes of everything that is not an activation (after FSDP sharding)."""

    weights: int
    grads: int  # all gradients, as after a full backward
    grads_head: int  # gradients made by the LM head's backward (and the final norm's)
    grads_layer: tuple[int, ...]  # per decoder layer
    optimizer: int
    ddp_buckets: int
    host_offload: int  # bytes moved to host RAM by cpu offload (whole node, see host_ram)


# bitsandbytes' 8-bit AdamW: each moment one byte a parameter, and one fp32 absmax per block of 256 of them
ADAMW_8BIT_BYTES_PER_PARAM = 2 * (1 + 4 / 256)


def embedding_state_bytes(shape: ModelShape, spec: TrainSpec, plan: LoraPlan | None) -> int:
    """What adamw_8bit's 32-bit moments of the trained embeddings add to optimizer_bytes' 8-bit count: bitsandbytes
    keeps them in fp32 (8 bytes a parameter, where 8-bit moments take 2.03), as HF Trainer's adamw_bnb_8bit and peft
    register them (modeling.build_optimizer). A full fine-tune's embedding matrix and the per-layer embeddings outside
    the layers (Gemma's; params_other, less their projection), a LoRA run's trained copy of the embeddings."""
    if spec.optimizer != "adamw_8bit":
        return 0
    if plan is None:
        other = shape.params_other - sum(lin.numel for lin in shape.other_linears)
        trained = shape.params_embed + max(other, 0)
    else:
        trained = shape.params_embed if "embed_tokens" in plan.saved_copies else 0
    return round(trained * (8 - ADAMW_8BIT_BYTES_PER_PARAM))


def optimizer_bytes(trainable_bytes: int, optimizer: str = "adamw", *, param_bytes: int = 4) -> int:
    """The state of train.optimizer for trainable parameters of `param_bytes` bytes each, `trainable_bytes` in all.
    adamw keeps exp_avg and exp_avg_sq in the parameter's dtype (8 bytes a parameter in fp32); the fused AdamW
    llmtrain uses on CUDA updates in place, so the step adds no temporaries of parameter size. adamw_8bit keeps both
    moments in 8 bits with their blocks' absmax, whatever the parameter's dtype (bitsandbytes keeps a tensor of fewer
    than 4,096 elements in 32 bits: norms and biases of small models, not counted)."""
    if optimizer == "adamw_8bit":
        return round(trainable_bytes / param_bytes * ADAMW_8BIT_BYTES_PER_PARAM)
    return 2 * trainable_bytes


def quantized_base_bytes(shape: ModelShape, spec: TrainSpec) -> int:
    """The frozen base of a QLoRA run: the decoder layers' linears in 4 bits with their quantisation constants, the
    rest (embeddings, LM head, norms) in the storage dtype, and the largest linear dequantised to the compute dtype
    while its matmul runs (bitsandbytes dequantises a weight per call, forward and backward)."""
    quantized = shape.linear_params_total
    compute = spec.compute_bytes
    in_flight = max(lin.numel for i in range(shape.layers) for lin in shape.layer(i).layer_linears) * compute
    return (round(quantized * QUANT_BYTES_PER_WEIGHT) + (shape.params_total - quantized) * DTYPE_BYTES[spec.dtype]
            + in_flight)


def states(shape: ModelShape, spec: TrainSpec, plan: LoraPlan | None, *, whole: ModelShape | None = None) -> States:
    """Weights in their storage dtype (LoRA adapters in fp32, as peft keeps them on a 16-bit base),
    gradients of trainable parameters only, optimizer state, and DDP's gradient buckets: DDP copies
    every gradient into flat buckets allocated once (gradient_as_bucket_view=False, Accelerate's
    default); the 25 MB bucket_cap_mb only sets how they are grouped for all-reduce.
    FSDP2 under mixed precision keeps trainable parameters as fp32 master shards (Accelerate upcasts
    them); everything is divided by the world size, and cpu offload moves it all to the host. A full fine-tune's
    frozen reference (spec.frozen_reference: KTO's, preference.reference copy's, online RL's with rl.beta > 0) is one
    more copy of the weights in the storage dtype (its head in fp32 with rl.cast_lm_head_to_fp32; LoRA's under
    sync_reference, spec.adapter_reference, the trained weights twice more): whole on one GPU
    and under DDP, sharded like the policy under FSDP with its LM head whole (loop/phases.build_reference); under
    FSDP x TP `shape` is the TP slice and `whole` the model, whose reference is sharded over every GPU of a replica."""
    sd = DTYPE_BYTES[spec.dtype]
    fsdp = spec.sharded
    master = 4 if (fsdp and spec.mixed_precision != "no") else sd  # bytes of a trainable base parameter
    V, H = shape.vocab, shape.hidden
    if plan is None:
        frozen_bytes = 0
        # rl.cast_lm_head_to_fp32: the head's weight (and so its gradient and optimizer state) in fp32
        head = shape.head_outputs * H * (4 if spec.fp32_head else master) + shape.params_final_norm * master
        layer = [shape.layer(k).params_per_layer * master for k in range(shape.layers)]
    else:
        frozen_bytes = shape.params_total * sd if not spec.quantize else quantized_base_bytes(shape, spec)
        if spec.fp32_head:  # the frozen head in fp32 (capabilities refuse an adapted or saved one)
            frozen_bytes += shape.head_outputs * H * (4 - min(sd, 4))
        copies = {m: V * H * master for m in plan.saved_copies}
        head = copies.get("lm_head", 0) + (plan.linear_size(H, V) * 4 if plan.adapted_head else 0)
        layer = [plan.layer_params(k) * 4 for k in range(len(plan.adapted))]
    # LoRA's trained copy of the embeddings (model.new_tokens), counted once where the head's copy is the same tensor
    embed_copy = V * H * master if plan is not None and "embed_tokens" in plan.saved_copies and \
        not plan.tied_copies(shape) else 0
    embed = (V * H * master if plan is None and not shape.tied else 0) + embed_copy
    # the weights outside the layers (Gemma 4's per-layer embeddings, made before the first layer, their gradients
    # last): trained in full, or their adapters
    embed += shape.params_other * master if plan is None else plan.other_params * 4
    trainable_bytes = head + sum(layer) + embed
    shard = spec.shards
    # trained in full at `master` bytes a parameter (a full fine-tune; LoRA's saved copies), the adapters in fp32
    whole_bytes = trainable_bytes if plan is None else copies.get("lm_head", 0) + embed_copy
    # (a full fine-tune's head held in fp32 by rl.cast_lm_head_to_fp32: its state counted at 4 bytes a parameter)
    fp32 = shape.head_outputs * H * 4 if plan is None and spec.fp32_head and master != 4 else 0
    optim = (optimizer_bytes(whole_bytes - fp32, spec.optimizer, param_bytes=master)
             + optimizer_bytes(trainable_bytes - whole_bytes + fp32, spec.optimizer, param_bytes=4)
             + embedding_state_bytes(shape, spec, plan))
    weights = frozen_bytes + trainable_bytes
    reference = 0
    if spec.frozen_reference:  # the frozen copy: whole, or under FSDP its decoder sharded and its head whole
        reference = sharded_frozen_bytes(whole or shape, spec, sd) if fsdp else shape.params_total * sd
        if spec.fp32_head:  # a copy of a model whose head is fp32 (under FSDP the head is a unit of its own, whole)
            reference += shape.head_outputs * H * (4 - min(sd, 4))
    if spec.adapter_reference:  # LoRA's moving reference: a snapshot of the trained weights and a spare (under FSDP
        # of each process's shards; run in RLOO's rollout, where FSDP holds the weights gathered, both whole as well)
        reference += 2 * trainable_bytes // spec.shards
        if spec.adapter_reference_whole and spec.sharded:
            reference += 2 * trainable_bytes
    if spec.cpu_offload:
        return States(0, 0, 0, (0,) * shape.layers, 0, 0, weights + trainable_bytes + optim)
    return States(
        weights=weights // shard + reference, grads=trainable_bytes // shard, grads_head=head // shard,
        grads_layer=tuple(g // shard for g in layer), optimizer=optim // shard,
        ddp_buckets=trainable_bytes if spec.strategy == "ddp" else 0, host_offload=0,
    )


def accumulated_grads(spec: TrainSpec, st: States) -> int:
    """Gradients kept between the micro-batches of a step. DDP and one GPU: the whole gradient. FSDP and HSDP by
    train.fsdp_accumulate: sharded (the default) reduce-scatters each micro-batch, so a GPU keeps its shard;
    unsharded keeps the whole gradient of the GPU's slice (in fp32 under mixed precision: FSDP2 accumulates in
    the reduce dtype) until the last micro-batch: st.grads x shards, on every GPU."""
    if spec.grad_accum_steps == 1:
        return 0
    if spec.sharded and spec.fsdp_accumulate == "unsharded":
        return st.grads * spec.shards
    return st.grads


def host_ram_bytes(shape: ModelShape, spec: TrainSpec, st: States) -> int:
    """Host RAM per node for loading: every process materialises the model on the host in its storage
    dtype before moving it to its GPU, except under FSDP (cpu_ram_efficient_loading: rank 0 alone, after
    upcasting trainable weights to fp32 under mixed precision) and model.random_init (built on the GPU); then a
    distillation teacher, read the same way, and online RL's reward models (every process reads each whole).
    Offloaded state (sharded weights, gradients, optimizer) adds the node's share. Python, CUDA and
    library memory of each process is not included."""
    sd = DTYPE_BYTES[spec.dtype]
    if spec.random_init:
        loading = 0
    elif spec.tp > 1:  # every process reads the model, then keeps its tensor-parallel slice
        loading = spec.num_gpus * shape.params_total * sd
    elif spec.sharded:
        widen = spec.mixed_precision != "no" and spec.method == "full"
        loading = shape.params_total * (4 if widen else sd)
    else:
        loading = spec.num_gpus * shape.params_total * sd
    if spec.teacher is not None:  # read once the student's host copies are freed (loop/phases.build_teacher): the
        # main process alone under FSDP (its shards broadcast), else every process; the larger of the two loads
        teacher = spec.teacher.params_total * DTYPE_BYTES[spec.teacher_dtype]
        loading = max(loading, teacher if spec.sharded else spec.num_gpus * teacher)
    for reward in spec.reward_models:  # read by every process, whole, onto its GPU before the policy loads
        loading = max(loading, spec.num_gpus * weight_bytes(reward))
    return loading + st.host_offload // spec.num_nodes
