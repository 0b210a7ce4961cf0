"""Per-GPU peak memory of a training step: the largest of the step's phases, never a sum of everything.

A step is walked phase by phase (the last layer's forward, the LM head, the loss, the start of
backward, each layer's backward, the embedding's, the optimizer step, evaluation) and at each phase
the tensors alive then are added up by component. The peak phase's components are the breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.memory import activations as act
from llmtrain.memory.params import LoraPlan, ModelShape, lora_plan
from llmtrain.memory.spec import DTYPE_BYTES, MIB, PRECISION_DTYPE, Estimate, TrainSpec

# Outside PyTorch's allocator; constants to be calibrated on GPUs (see docs/memory.md).
CUDA_CONTEXT_BYTES = 500 * MIB  # CUDA context, cuBLAS/cuDNN handles and kernels
NCCL_BYTES = 512 * MIB  # NCCL communicator buffers, multi-process runs only
ALLOCATOR_SLACK = 0.10  # reserved / allocated - 1: the caching allocator's rounding and fragmentation
ADAM8BIT_BLOCK = 256  # bitsandbytes' blockwise 8-bit states keep one fp32 absmax per 256 values
DROPOUT_MASK_BYTES = act.CUDA_DROPOUT_MASK_BYTES  # per element saved by dropout (4 on the CPU, for tests)


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


def optimizer_bytes(spec: TrainSpec, *, trainable: int, trainable_bytes: int) -> int:
    """AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (8 bytes a parameter in fp32);
    8-bit AdamW one byte each plus an fp32 absmax per block; plain SGD nothing. The fused AdamW
    llmtrain uses on CUDA updates in place, so the step adds no temporaries of parameter size."""
    if spec.optimizer == "adamw":
        return 2 * trainable_bytes
    if spec.optimizer == "adamw-8bit":
        return 2 * trainable + 2 * 4 * -(-trainable // ADAM8BIT_BLOCK)
    return 0


def states(shape: ModelShape, spec: TrainSpec, plan: LoraPlan | None) -> States:
    """Weights in their storage dtype (LoRA adapters in fp32, as peft keeps them on a 16-bit base),
    gradients of trainable parameters only, optimizer state, and DDP's gradient buckets: DDP copies
    every gradient into flat buckets allocated once (gradient_as_bucket_view=False, Accelerate's
    default); the 25 MB bucket_cap_mb only sets how they are grouped for all-reduce.
    FSDP2 under mixed precision keeps trainable parameters as fp32 master shards (Accelerate upcasts
    them); everything is divided by the world size, and cpu offload moves it all to the host."""
    sd = DTYPE_BYTES[spec.dtype]
    fsdp = spec.strategy == "fsdp"
    master = 4 if (fsdp and spec.mixed_precision != "no") else sd  # bytes of a trainable base parameter
    V, H = shape.vocab, shape.hidden
    if plan is None:
        trainable = shape.params_total
        frozen_bytes = 0
        head = (V * H + shape.params_final_norm) * master
        layer = [shape.params_per_layer * master] * shape.layers
    else:
        trainable = plan.trainable(shape)
        frozen_bytes = shape.params_total * sd
        copies = {m: V * H * master for m in plan.saved_copies}
        head = copies.get("lm_head", 0) + (plan.r * (H + V) * 4 if plan.adapted_head else 0)
        layer = [sum(plan.r * (i + o) for i, o in adapted.values()) * 4 for adapted in plan.adapted]
    embed = (V * H * master if plan is None and not shape.tied else 0) + (
        V * H * master if plan is not None and "embed_tokens" in plan.saved_copies else 0)
    trainable_bytes = head + sum(layer) + embed
    shard = spec.world if fsdp else 1
    optim = optimizer_bytes(spec, trainable=trainable, trainable_bytes=trainable_bytes)
    weights = frozen_bytes + trainable_bytes
    if spec.cpu_offload:
        return States(0, 0, 0, (0,) * shape.layers, 0, 0, weights + trainable_bytes + optim)
    return States(
        weights=weights // shard, grads=trainable_bytes // shard, grads_head=head // shard,
        grads_layer=tuple(g // shard for g in layer), optimizer=optim // shard,
        ddp_buckets=trainable_bytes if spec.strategy == "ddp" else 0, host_offload=0,
    )


def make_pass(shape: ModelShape, spec: TrainSpec, *, rows: int | None = None, packing: bool | None = None) -> act.Pass:
    """Shapes and dtypes of one micro-batch. Padded batches of more than one row pass a 4-D mask
    (rows are assumed to differ in length); a packed batch is one row of micro_batch * seq_len
    tokens whose position ids restart, which transformers turns into a block-diagonal mask."""
    mb = rows or spec.micro_batch
    packed = spec.packing if packing is None else packing
    b, s = (1, mb * spec.seq_len) if packed else (mb, spec.seq_len)
    amp = spec.mixed_precision != "no"
    compute = PRECISION_DTYPE.get(spec.mixed_precision, spec.dtype)
    # FSDP's mixed-precision policy gathers parameters in the compute dtype, so the stream is too.
    stream = compute if (spec.strategy == "fsdp" and amp) else spec.dtype
    window = shape.sliding_window
    mask = packed or b > 1 or (window is not None and s > window)
    return act.Pass(rows=b, row_len=s, resid=DTYPE_BYTES[stream], cd=DTYPE_BYTES[compute], autocast=amp,
                    attn=spec.attn, mask=mask, trainable_base=spec.method == "full",
                    separate_casts=amp and stream != compute,
                    lora_dropout=spec.lora_dropout if spec.method == "lora" else 0.0,
                    dropout_mask_bytes=DROPOUT_MASK_BYTES)


def _down_share(shape: ModelShape, plan: LoraPlan | None, k: int) -> float:
    """The fraction of decoder layer k's trainable parameters in down_proj (or in its adapter)."""
    if plan is None:
        return sum(x.numel for x in shape.layer_linears if x.name == "mlp.down_proj") / shape.params_per_layer
    sizes = {name: plan.r * (i + o) for name, (i, o) in plan.adapted[k].items()}
    return sizes.get("mlp.down_proj", 0) / max(1, sum(sizes.values()))


def _phase(**parts: int) -> dict[str, int]:
    return {k: int(v) for k, v in parts.items() if v}


def estimate(shape: ModelShape, spec: TrainSpec) -> Estimate:
    """The per-GPU peak of the run `spec` describes on the model `shape`."""
    spec.validate()
    plan = lora_plan(shape, r=spec.lora_r, targets=spec.lora_targets,
                     modules_to_save=spec.lora_modules_to_save) if spec.method == "lora" else None
    st = states(shape, spec, plan)
    p = make_pass(shape, spec)
    L, V, H = shape.layers, shape.vocab, shape.hidden
    full, fsdp, ckpt = plan is None, spec.strategy == "fsdp", spec.grad_checkpointing
    amp = p.autocast
    adapted = [plan.adapted[i] if plan else {} for i in range(L)]
    head_trains = full or (plan is not None and "lm_head" in plan.saved_copies)
    embed_trains = full or (plan is not None and "embed_tokens" in plan.saved_copies)

    # -- activations
    saved = [act.layer_bytes(p, shape, adapted[i], spec.lora_r) for i in range(L)]
    if not embed_trains:  # the first layer's input needs no gradient
        saved[0] -= act.frozen_input_discount(p, shape, adapted[0])
    kept = [act.checkpoint_bytes(p, shape)] * L if ckpt else saved  # what each layer keeps after forward
    rope_ids = act.rope_bytes(p, shape) + (p.tokens * 8 if embed_trains else 0)
    outside = act.head_side_bytes(p, shape, norm_trainable=full, head_trainable=head_trains,
                                  head_adapter_r=spec.lora_r if plan and plan.adapted_head else 0)
    mask = act.mask_bytes(p)
    mask_bwd = mask if ckpt else 0  # checkpointed layers hold the mask for their recompute

    # -- autocast copies of weights (non-FSDP mixed precision; FSDP gathers in the compute dtype)
    adapter_params = [sum(spec.lora_r * (i + o) for i, o in a.values()) for a in adapted]
    base_copies = shape.linear_params_per_layer * p.cd if p.separate_casts else 0  # fp32 base linears
    adapter_cast = amp and not fsdp  # fp32 adapters under autocast
    copies = [base_copies + (n * p.cd if adapter_cast else 0) for n in adapter_params]
    # The autocast cache holds casts of trainable fp32 leaves until the forward returns.
    cached = [(base_copies if full else 0) + (n * p.cd if adapter_cast else 0) for n in adapter_params]
    if not embed_trains:  # nor does it keep casts of its q/k/v weights (saved for the input's gradient)
        qkv = [x for x in shape.layer_linears if x.name.endswith(("q_proj", "k_proj", "v_proj"))]
        copies[0] -= sum(x.numel for x in qkv) * p.cd if p.separate_casts else 0
        copies[0] -= sum(spec.lora_r * x.fan_in for x in qkv if x.name in adapted[0]) * p.cd if adapter_cast else 0
    head_copies = (V * H * p.cd if p.separate_casts else 0) + (
        spec.lora_r * (H + V) * p.cd if (plan and plan.adapted_head and adapter_cast) else 0)
    copies_fwd = sum(copies) if not ckpt else sum(cached) + copies[-1] - cached[-1]
    copies_kept = (sum(copies) if not ckpt else 0) + head_copies

    # -- FSDP: gathered (unsharded) units in the compute dtype, about two decoder layers in flight
    pd = p.cd if amp else DTYPE_BYTES[spec.dtype]
    unit = (shape.params_per_layer + max(adapter_params)) * pd if fsdp else 0
    unit_grads = (shape.params_per_layer if full else max(adapter_params)) * pd if fsdp else 0
    tail = (V * H + shape.params_final_norm) * pd if fsdp else 0  # final norm + lm_head (+ tied embeddings)
    embed_unit = V * H * pd if (fsdp and not shape.tied) else 0
    always = tail if shape.tied else 0
    g_acc = st.grads if spec.grad_accum > 1 else 0  # gradients kept between micro-batches

    base = dict(weights=st.weights, optimizer=st.optimizer, ddp_buckets=st.ddp_buckets)
    acts_all = sum(kept) + rope_ids + outside
    tv_cd = p.tokens * V * p.cd
    phases = {
        "forward": _phase(**base, gradients=g_acc, autocast_copies=copies_fwd, activations=sum(kept) + rope_ids + mask,
                          temporaries=act.layer_forward_temp(p, shape, adapted[-1]), fsdp_buffers=2 * unit + always),
        "lm_head": _phase(**base, gradients=g_acc, autocast_copies=copies_fwd + head_copies,
                          activations=acts_all + mask, logits=tv_cd, fsdp_buffers=tail),
        "loss": _phase(**base, gradients=g_acc, autocast_copies=copies_kept, activations=acts_all + mask,
                       logits=act.logits_forward_bytes(p, V), fsdp_buffers=tail),
        "backward_loss": _phase(**base, gradients=g_acc, autocast_copies=copies_kept,
                                activations=acts_all + mask_bwd, logits=act.logits_backward_bytes(p, V),
                                fsdp_buffers=tail),
        "backward_lm_head": _phase(**base, gradients=max(g_acc, st.grads_head), autocast_copies=copies_kept,
                                   activations=acts_all + mask_bwd, logits=tv_cd,
                                   temporaries=V * H * p.cd if (p.separate_casts and head_trains) else 0,
                                   fsdp_buffers=tail + (V * H * pd if fsdp and head_trains else 0)),
    }
    # Each decoder layer's backward, last to first, in its three moments: the recompute of its forward
    # (under checkpointing), the MLP's backward (down_proj's input freed, its weight gradient made) and
    # attention's (the MLP half freed, its gradients made). The layers below are still saved, the
    # layers above have their gradients, and the residual stream's gradient flows through.
    cast_temp = p.separate_casts and full  # a 16-bit weight gradient before it is cast to the fp32 .grad
    mlp_names = [x for x in shape.layer_linears if x.name.startswith("mlp.")]
    down_temp = max(x.numel for x in mlp_names) * p.cd if cast_temp else 0
    attn_temp = max(x.numel for x in shape.layer_linears if x not in mlp_names) * p.cd if cast_temp else 0
    resid_grad = act.residual_grad_bytes(p, shape)
    fsdp_bwd = 2 * unit + 2 * unit_grads + always
    worst: dict[str, int] = {}
    for k in range(L - 1, -1, -1):
        a = adapted[k]
        above = st.grads_head + sum(st.grads_layer[k + 1:])
        g_down = st.grads_layer[k] * _down_share(shape, plan, k)
        below = sum(kept[:k]) + (kept[k] if ckpt else 0) + rope_ids + mask_bwd
        live_copies = sum(copies[: k + 1]) if not ckpt else copies[k]
        half_attn = act.attn_half_bytes(p, shape, a, spec.lora_r) - (
            act.frozen_input_discount(p, shape, a) if (k == 0 and not embed_trains) else 0)
        moments = [
            dict(gradients=max(g_acc, above + g_down), activations=below + saved[k] - act.down_input_bytes(
                p, shape, a, spec.lora_r), temporaries=resid_grad + act.mlp_backward_temp(p, shape, a) + down_temp),
            dict(gradients=max(g_acc, above + st.grads_layer[k]), activations=below + half_attn,
                 temporaries=resid_grad + act.attn_backward_temp(p, shape, a) + attn_temp),
        ]
        if ckpt:
            moments.append(dict(gradients=max(g_acc, above), activations=below + saved[k],
                                temporaries=resid_grad + act.layer_forward_temp(p, shape, a)))
        for m in moments:
            ph = _phase(**base, autocast_copies=live_copies, fsdp_buffers=fsdp_bwd, **m)
            if sum(ph.values()) > sum(worst.values()):
                worst = ph
    phases["backward_layers"] = worst
    phases["backward_embedding"] = _phase(**base, gradients=st.grads, temporaries=p.tokens * H * p.resid,
                                          fsdp_buffers=embed_unit * (2 if full else 1) + always)
    phases["optimizer_step"] = _phase(**base, gradients=st.grads)
    if spec.eval_micro_batch:
        e = make_pass(shape, spec, rows=spec.eval_micro_batch, packing=False)
        phases["eval_lm_head"] = _phase(**base, autocast_copies=sum(cached) + head_copies,
                                        activations=act.mask_bytes(e), logits=e.tokens * V * e.cd,
                                        fsdp_buffers=tail + 2 * unit)
        phases["eval_loss"] = _phase(**base, logits=e.tokens * V * 2 * act.FP32, fsdp_buffers=tail)
    return _finish(shape, spec, plan, st, phases, notes=_notes(shape, spec, p))


def _finish(shape: ModelShape, spec: TrainSpec, plan: LoraPlan | None, st: States, phases: dict, *,
            notes: tuple[str, ...]) -> Estimate:
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(totals, key=totals.get)
    allocated = totals[peak_phase]
    reserved = int(allocated * (1 + ALLOCATOR_SLACK))
    overhead = reserved - allocated + CUDA_CONTEXT_BYTES + (NCCL_BYTES if spec.world > 1 else 0)
    breakdown = {c: 0 for c in ("weights", "gradients", "optimizer", "activations", "logits")}
    breakdown.update(phases[peak_phase])
    breakdown["overhead"] = overhead
    trainable = shape.params_total if plan is None else plan.trainable(shape)
    total = shape.params_total + (0 if plan is None else trainable)  # peft adds adapters and copies
    return Estimate(
        model=shape.source, spec=spec, params_total=total, params_trainable=trainable,
        per_gpu_peak_allocated_bytes=allocated, per_gpu_peak_reserved_bytes=reserved,
        per_gpu_peak_bytes=allocated + overhead, peak_phase=peak_phase, breakdown=breakdown, phases=totals,
        host_ram_bytes=host_ram_bytes(shape, spec, st), phase_parts=phases, notes=notes,
    )


def host_ram_bytes(shape: ModelShape, spec: TrainSpec, st: States) -> int:
    """Host RAM per node for loading: every process materialises the model on the host in its storage
    dtype before moving it to its GPU, except under FSDP (cpu_ram_efficient_loading: rank 0 alone, after
    upcasting trainable weights to fp32 under mixed precision) and model.random_init (built on the GPU).
    Offloaded state (sharded weights, gradients, optimizer) adds the node's share. Python, CUDA and
    library memory of each process is not included."""
    sd = DTYPE_BYTES[spec.dtype]
    if spec.random_init:
        loading = 0
    elif spec.strategy == "fsdp":
        widen = spec.mixed_precision != "no" and spec.method == "full"
        loading = shape.params_total * (4 if widen else sd)
    else:
        loading = spec.num_gpus * shape.params_total * sd
    return loading + st.host_offload // spec.num_nodes


def _notes(shape: ModelShape, spec: TrainSpec, p: act.Pass) -> tuple[str, ...]:
    notes = []
    if p.mask and spec.attn == "sdpa":
        why = "packed rows" if spec.packing else ("padded rows" if p.rows > 1 else "the sliding window")
        notes.append(f"{why}: SDPA gets a 4-D mask, so it uses the memory-efficient kernel with K/V repeated "
                     "to all heads and a b*s*s bias saved per layer")
    if spec.packing and spec.attn in ("sdpa", "eager"):
        notes.append(f"packing puts {spec.micro_batch} x {spec.seq_len} tokens in one row: attention scales "
                     f"with ({spec.micro_batch * spec.seq_len})^2; flash_attention_2 avoids the mask")
    if spec.strategy == "ddp" and spec.method == "full":
        notes.append("DDP buckets hold a second copy of every gradient (gradient_as_bucket_view=False)")
    if spec.grad_accum > 1:
        notes.append("gradients stay allocated between the micro-batches of an accumulation window")
    if spec.lora_dropout == 0 and spec.method == "lora" and spec.mixed_precision == "no":
        notes.append("lora.dropout=0 without autocast: LoRA inputs counted per adapter (peft shares them), "
                     "an overestimate")
    return tuple(notes)
