"""Pipeline parallelism (parallel.pipeline_parallel P): each stage's memory, and the step's time with its bubble and
the stage boundaries' sends beside the collectives inside a stage (docs/scaling.md gives the formulas).

The GPUs form P stage groups of D = world / P consecutive GPUs (with P = nodes a stage is a node); every GPU of group
r runs the decoder layers parallel.pipeline.split.stage_layers gives rank r (interleaved: V chunks, virtual stages r,
r + P, ...), rank 0 also the embeddings, rank P - 1 the final norm, LM head and loss; inside a group the strategy
(FSDP over D, or DDP) shards or replicates the group's parameters, each GPU training its own micro-batches (D
data-parallel ranks, each a pipeline of M = grad_accum_steps micro-batches a step). A GPU's peak is its stage's
one-micro-batch peak (estimate.py's phases on the stage's layers) plus the activations of the other micro-batches its
schedule holds (split.in_flight) and torch's receive buffers; the worst GPU decides the fit. FSDP inside a stage:
stage_estimate follows train.fsdp_accumulate (sharded as without a pipeline, unsharded as torch's PipelineStage runs
an FSDP2 stage); a run is estimated as llmtrain trains it, unsharded (as_trained).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain import capabilities
from llmtrain.errors import LLMTrainError
from llmtrain.memory import activations as act
from llmtrain.memory.comms import (
    Collective,
    Network,
    PipelineTraffic,
    Traffic,
    forward_flops,
    gathered_bytes,
    no_grad_forwards,
    no_grad_rate,
    parts_of,
    recompute_flops,
    step_flops,
    step_traffic,
    traffic,
)
from llmtrain.memory.estimate import (_backward_layers, _cache_width, _finish, _generation_phases, _loss_phases,
                                      _notes, _phase, _rollout_rows, estimate, fp32_head_extra, make_pass,
                                      param_counts, sampling_rows)
from llmtrain.memory.params import LoraPlan, ModelShape, run_lora_plan
from llmtrain.memory.reward_models import add_reward_models
from llmtrain.memory.spec import DTYPE_BYTES, GIB, Estimate, TrainSpec
from llmtrain.memory.states import States, accumulated_grads, embedding_state_bytes, optimizer_bytes, states
from llmtrain.memory.teacher import add_stage_teacher
from llmtrain.parallel.pipeline.split import bubble_fraction, in_flight, rank_stages, stage_layers


@dataclass(frozen=True)
class Stage:
    """What one GPU of pipeline rank `rank` runs: its chunks' decoder layers (one chunk unless interleaved), whether
    it holds the embeddings (rank 0) and the head and loss (rank P - 1), and the micro-batches in flight per chunk."""

    rank: int
    virtual: tuple[int, ...]  # its virtual stages, first to last
    chunks: tuple[range, ...]  # their decoder layers
    first: bool
    last: bool
    held: tuple[int, ...]  # micro-batches whose activations each chunk holds at the worst moment
    total: int  # virtual stages in the pipeline (P x V)

    @property
    def layers(self) -> int:
        return sum(len(c) for c in self.chunks)


def pipeline_problems(spec: TrainSpec, shape: ModelShape) -> list[str]:
    """What the estimate refuses with a pipeline (spec.validate has checked the rest, the schedule and chunks too)."""
    p, v, m, problems = spec.pipeline_parallel, spec.chunks, spec.grad_accum_steps, []
    stage_gpus = spec.world // p
    if why := capabilities.family_cell(shape.model_type, "pp"):  # a family the stages do not train
        problems.append(f"pipeline parallelism is refused for {capabilities.FAMILIES[shape.model_type].name}: {why}")
    if p * v > shape.layers:
        problems.append(f"{p} pipeline stages x {v} chunks need a decoder layer each and the model has {shape.layers} "
                        f"({shape.source}): use at most {shape.layers // v} stages (--pipeline-parallel, "
                        "parallel.pipeline_parallel)")
    if spec.world % p:
        problems.append(f"pipeline parallelism {p} must divide the GPUs: {spec.world} ({spec.num_gpus} a node x "
                        f"{spec.num_nodes}) do not split into {p} stages")
    elif stage_gpus % spec.num_gpus and spec.num_gpus % stage_gpus:
        problems.append(f"a pipeline stage of {stage_gpus} GPUs must be whole nodes of {spec.num_gpus} or divide a "
                        f"node: {spec.world} GPUs in {p} stages straddle nodes unevenly")
    if spec.strategy not in ("single", "ddp", "fsdp") or (spec.strategy == "ddp" and stage_gpus == 1):
        problems.append(f"inside a pipeline stage the GPUs run fsdp or ddp (single: one GPU a stage), not "
                        f"{spec.strategy} on {stage_gpus} GPU(s) a stage: the stages already split the model")
    if spec.cpu_offload or spec.tp > 1 or spec.sequence_parallel > 1:
        problems.append("pipeline parallelism is modelled without FSDP's cpu offload, tensor or sequence parallelism "
                        "(llmtrain's stages run none of them)")
    if spec.activation_offload:  # the stages run it; its estimate on stages is not built
        problems.append("pipeline stages with model.activation_offload train, but the estimate does not model the "
                        "offload on stages yet: estimate without it (what it saves not counted) or with "
                        "--pipeline-parallel 1")
    if spec.num_generations and spec.teacher is None and not spec.rl_micro_batch_tokens:
        problems.append("online RL on pipeline stages trains its passes in rows of rl.micro_batch_tokens slots: set it "
                        "in the recipe, or as an override after it (rl.micro_batch_tokens=4096)")
    if spec.quantize and spec.sharded:
        problems.append("a QLoRA stage under FSDP (which llmtrain trains) is not modelled: estimate it with "
                        "--strategy ddp (each stage's replicas holding its whole 4-bit base), or single with one GPU a "
                        "stage")
    if capabilities.too_few_micro_batches(spec.pipeline_schedule, m, p):  # the table's rule (capabilities._pp_accum)
        problems.append(f"the {spec.pipeline_schedule} schedule needs at least as many micro-batches a step as stages: "
                        f"train.grad_accum_steps {m} < {p} (GPipe takes fewer: --pipeline-schedule gpipe)")
    if capabilities.uneven_rounds(spec.pipeline_schedule, m, p):
        rounds = capabilities.interleaved_rounds(p, m)
        problems.append(f"the interleaved schedule runs {rounds} rounds of micro-batches here and needs "
                        f"train.grad_accum_steps ({m}) to be a multiple of them (torch's ScheduleInterleaved1F1B)")
    return problems


def stages_of(shape: ModelShape, spec: TrainSpec) -> list[Stage]:
    """The P ranks of spec's pipeline on this model (what pipeline_problems finds refused, in one paragraph)."""
    spec.validate()
    if problems := pipeline_problems(spec, shape):
        raise LLMTrainError("cannot estimate this run: " + "; ".join(problems) + ".")
    p, v = spec.pipeline_parallel, spec.chunks
    split = stage_layers(shape.layers, p * v)
    out = []
    for r in range(p):
        virtual = tuple(rank_stages(r, p, v))
        out.append(Stage(r, virtual, tuple(split[s] for s in virtual), r == 0, r == p - 1,
                         tuple(in_flight(spec.pipeline_schedule, p, spec.grad_accum_steps, r, v)), p * v))
    return out


def stage_shape(shape: ModelShape, stage: Stage, chunk: int | None = None) -> ModelShape:
    """The model as one GPU of `stage` holds it: its decoder layers (those of chunk `chunk` alone, if given; each
    layer its own shape where the layers differ: Gemma 4's) and the embeddings, final norm and head only where the
    stage has them, so that params_total counts the stage's parameters. A tied embedding is two copies, the first
    stage's embedding and the last stage's head (parallel/pipeline/schedule.py); Gemma 4's per-layer embeddings and
    the projection of the embeddings (params_other) are the first stage's."""
    ranges = stage.chunks if chunk is None else (stage.chunks[chunk],)
    head = shape.params_embed if shape.tied else shape.params_head
    own = replace(shape, layers=sum(len(r) for r in ranges), tied=False,
                  params_embed=shape.params_embed if stage.first else 0,
                  params_head=head if stage.last else 0,
                  params_final_norm=shape.params_final_norm if stage.last else 0,
                  params_other=shape.params_other if stage.first else 0)
    if shape.layer_shapes:
        own = replace(own, layer_shapes=tuple(shape.layer_shapes[i] for r in ranges for i in r))
    return own


def as_trained(spec: TrainSpec) -> TrainSpec:
    """A pipeline run as llmtrain trains it (parallel/pipeline/schedule.py): an FSDP stage is an FSDP2 module inside
    torch's PipelineStage, which accumulates its gradients unsharded through the step's micro-batches whatever
    train.fsdp_accumulate says (it turns gradient sync off in each micro-batch's backward and reduce-scatters once
    after the last). A DDP launch of as many GPUs as stages (ddp.yaml with parallel.pipeline_parallel = its processes)
    is one GPU a stage: no replica, nothing for DDP to hold (it had been refused: 'not ddp on 1 GPU(s) a stage'); so is
    an FSDP launch of as many GPUs as stages, whose stages have no replica to shard over (it had been priced as FSDP:
    its gathered copies and fp32 master weights, 78.24 GiB for Llama-2-7B on 2 GPUs where the stages hold 64.43)."""
    if spec.pipeline_parallel > 1 and spec.strategy in ("ddp", "fsdp") and spec.world == spec.pipeline_parallel:
        return spec.but(strategy="single")
    return spec.but(fsdp_accumulate="unsharded") if spec.pipeline_parallel > 1 and spec.sharded else spec


def pipeline_estimate(shape: ModelShape, spec: TrainSpec) -> Estimate:
    """The estimate of the pipeline's worst GPU (the largest peak), with every stage's summary in `pipeline`."""
    estimates = [stage_estimate(shape, spec, s) for s in stages_of(shape, spec)]
    worst = max(estimates, key=lambda e: e.per_gpu_peak_bytes)
    summary = {"stages": [e.pipeline["stage"] for e in estimates], "schedule": spec.pipeline_schedule,
               "pipeline_parallel": spec.pipeline_parallel, "chunks": spec.chunks,
               "micro_batches": spec.grad_accum_steps,
               "stage_gpus": spec.world // spec.pipeline_parallel,
               "bubble": bubble_fraction(spec.pipeline_parallel, spec.grad_accum_steps, spec.chunks),
               "worst_stage": worst.pipeline["stage"]["rank"]}
    # The model's counts, not the worst stage's (its own are in the stage table), and the host RAM of loading it:
    # every stage process reads the whole model before it keeps its own layers (loop/phases.build_model), FSDP or
    # not (they had been one stage's: "3,624,009,728 total" for Mistral-7B, 13.5 GiB a node for 8 processes' 216)
    total, trainable = param_counts(shape, run_lora_plan(shape, spec))
    loading = 0 if spec.random_init else spec.num_gpus * shape.params_total * DTYPE_BYTES[spec.dtype]
    return replace(worst, pipeline=summary, params_total=total, params_trainable=trainable,
                   host_ram_bytes=max(worst.host_ram_bytes, loading))


def stage_master(spec: TrainSpec) -> int:
    """Bytes of a trained parameter, its gradient's too: fp32 master weights under FSDP's mixed precision (as
    states.states), else the storage dtype."""
    return 4 if (spec.sharded and spec.mixed_precision != "no") else DTYPE_BYTES[spec.dtype]


def stage_plan(shape: ModelShape, spec: TrainSpec, stage: Stage) -> LoraPlan | None:
    """A LoRA run's adapters on the stage's GPU (None: a full fine-tune): its layers' (in the order of its chunks),
    an adapted LM head and modules_to_save's copies only where it holds the head or the embeddings."""
    if (plan := run_lora_plan(shape, spec)) is None:
        return None
    saved = tuple(m for m in plan.saved_copies
                  if (m == "lm_head" and stage.last) or (m == "embed_tokens" and stage.first))
    return replace(plan, adapted=tuple(plan.adapted[i] for c in stage.chunks for i in c),
                   adapted_head=plan.adapted_head and stage.last, saved_copies=saved,
                   adapted_other=plan.adapted_other if stage.first else {})


def stage_states(shape: ModelShape, spec: TrainSpec, stage: Stage) -> States:
    """The weights, gradients and AdamW state of the stage's parameters (its layers, and the embeddings or the head
    where it has them), sharded over the FSDP group inside the stage (spec.shards: world / P): a full fine-tune's in
    their master dtype (and its frozen reference's copy of them); LoRA's as states.states has them (the frozen base,
    4-bit under QLoRA, and the adapters);
    grads_layer: each of the stage's layers', its chunks' in order."""
    own = stage_shape(shape, stage)
    spec = spec if stage.last else spec.but(fp32_head=False)  # rl.cast_lm_head_to_fp32: the last stage's head
    # LoRA's moving reference keeps no whole snapshot on stages (their rollout holds no unit gathered)
    spec = spec.but(adapter_reference_whole=False)
    # No DDP buckets: the stages are not wrapped in DDP; a stage's replicas all-reduce each gradient in place
    # (group.sum_replicas). They had been counted under DDP: 12.55 GiB more for Llama-2-7B on 2 replicas a stage.
    if (plan := stage_plan(shape, spec, stage)) is not None:
        return replace(states(own, spec, plan), ddp_buckets=0)
    master = stage_master(spec)
    # (a head held in fp32 by rl.cast_lm_head_to_fp32: its weight, gradient and AdamW state at 4 bytes a parameter)
    head_bytes = 4 if spec.fp32_head else master
    fp32 = own.params_head * 4 if spec.fp32_head else 0  # (AdamW's state of fp32 parameters, below)
    head = own.params_head * head_bytes + own.params_final_norm * master
    total = (own.params_total - own.params_head) * master + own.params_head * head_bytes
    shard = spec.shards
    # a full fine-tune's frozen reference (spec.frozen_reference): the stage's copy of its own weights, sharded as
    # they are (model/reference.StageCopy; its exchange's temporary, one weight at a time, is not at the peak)
    copy = total // shard if spec.frozen_reference else 0
    return States(weights=total // shard + copy, grads=total // shard, grads_head=head // shard,
                  grads_layer=tuple(own.layer(i).params_per_layer * master // shard for i in range(own.layers)),
                  optimizer=(optimizer_bytes(total - fp32, spec.optimizer, param_bytes=master)
                             + optimizer_bytes(fp32, spec.optimizer, param_bytes=4)
                             # a tied head: the last stage's copy of the embedding, its moments as the first's
                             + embedding_state_bytes(replace(own, params_embed=own.params_embed + (
                                 own.params_head if shape.tied else 0)), spec, None)) // shard,
                  ddp_buckets=0, host_offload=0)


def stage_estimate(shape: ModelShape, spec: TrainSpec, stage: Stage) -> Estimate:
    """One GPU of `stage` at its worst moment: estimate.py's phases for one micro-batch through each of its chunks
    (interleaved: its virtual stages), the worst of them (the forward of the chunk's last layer, the loss's chunks on
    the last virtual stage, each layer's backward, the embeddings' backward on the first, the optimizer step), plus,
    in every phase but the optimizer's, what the other micro-batches in flight keep (each chunk's layers' saved
    tensors and RoPE; the first chunk the token ids, the last the final norm's and the loss's inputs, every other its
    outputs) and the receive buffers. LoRA (and QLoRA) as estimate.py counts it: the adapters' saved tensors and
    casts, a frozen embedding's first layer saving less (on the first stage only: every other stage's input is
    received with its gradient wanted)."""
    return max((chunk_estimate(shape, spec, stage, c) for c in range(len(stage.chunks))),
               key=lambda e: e.per_gpu_peak_bytes)


def chunk_estimate(shape: ModelShape, spec: TrainSpec, stage: Stage, c: int) -> Estimate:
    """stage_estimate with the one micro-batch going through chunk `c` (every chunk's other micro-batches in flight). An
    interleaved stage's worst moment may be in the chunk without the head: on 2 GPUs of 2 chunks, the last GPU's first
    chunk holds twice the micro-batches of its second (measured: 0.962 of the peak when only the head's chunk was
    modelled, 0.983 with both)."""
    sub = stage_shape(shape, stage, c)
    p = make_pass(sub, spec)
    L, V, H, ckpt, fsdp = sub.layers, shape.vocab, shape.hidden, spec.gradient_checkpointing, spec.sharded
    O = shape.head_outputs  # the last stage's head: the vocabulary, or a reward model's one score
    amp = p.autocast
    plan = stage_plan(shape, spec, stage)
    full = plan is None
    offset = sum(len(x) for x in stage.chunks[:c])  # the modelled chunk's first layer among the stage's
    adapted = [plan.adapted[offset + i] if plan else {} for i in range(L)]
    chunk_plan = replace(plan, adapted=tuple(adapted)) if plan else None
    first, last = stage.first and c == 0, stage.last and c == len(stage.chunks) - 1  # the modelled chunk's ends
    embed_trains = full or "embed_tokens" in plan.saved_copies  # (a stage's plan: the first stage's only)
    head_trains = full or "lm_head" in plan.saved_copies
    frozen_input = first and not embed_trains  # the first layer's input needs no gradient
    saved = [act.layer_bytes(p, sub.layer(i), adapted[i], spec.lora_r) for i in range(L)]
    if frozen_input:
        saved[0] -= act.frozen_input_discount(p, sub.layer(0), adapted[0])
    if ckpt and p.mlp_shard:  # the tiled input norm keeps the layer's input: the checkpoint's own tensor, once
        saved = [x - (act.checkpoint_bytes(p, sub) if (i or not frozen_input) else 0) for i, x in enumerate(saved)]
    kept = [act.checkpoint_bytes(p, sub)] * L if ckpt else saved
    rope_ids = act.stream_inputs_bytes(p, sub, embed_trainable=embed_trains) if first else act.rope_bytes(p, sub)
    # Gemma 4's per-layer inputs, every layer's, made on the first stage and saved until its first layer's backward
    # (as estimate.py counts them: in the loss's phases, part of outside_layers_bytes; the other micro-batches' in
    # `held`, chunk_bytes)
    made = act.per_layer_inputs_bytes(p, shape, plan.adapted_other if plan else {}, spec.lora_r) if first else 0
    ends = act.norm_bytes(p, H, trainable=full, gemma=shape.gemma_norms) + act.loss_input_bytes(p, sub) if last else 0
    out = boundary_bytes(p, shape, stage.chunks[c].stop) if not last else 0  # its outputs, kept for its backward
    held = in_flight_bytes(p, shape, stage, spec) - (sum(kept) + rope_ids + made + ends + out)  # the others'
    buffers = receive_buffer_bytes(p, shape, stage, spec)
    mask = act.mask_bytes(p, shape.masks)
    mask_bwd = mask if ckpt else 0
    # autocast's casts of fp32 weights (not under FSDP's mixed precision): its cache holds every trainable layer's until
    # the forward returns, checkpointed or not; after it, only what the matmuls saved (none under checkpointing)
    # a mixture of experts' router weight, its one cast (Gemma 4's router is one of the layer's linears)
    router = shape.experts.count * H if shape.experts and not shape.experts.beside else 0
    adapter_params = [chunk_plan.layer_params(i) if chunk_plan else 0 for i in range(L)]
    magnitudes = [chunk_plan.magnitudes(i) if chunk_plan else 0 for i in range(L)]
    base_copies = [(sub.layer(i).linear_params_per_layer + router) * p.cd if p.separate_casts else 0
                   for i in range(L)]
    adapter_cast = amp and not fsdp  # fp32 adapters under autocast
    factors = sum(n for name, n in plan.moe_params.items() if shape.experts and name in (
        shape.experts.gate_up, shape.experts.down)) if plan else 0
    copies = [base_copies[i] + ((n - factors - magnitudes[i]) * p.cd if adapter_cast else 0)
              for i, n in enumerate(adapter_params)]
    cached = [(base_copies[i] if full else 0) + ((n - factors - magnitudes[i]) * p.cd if adapter_cast else 0)
              for i, n in enumerate(adapter_params)]
    if first:  # the linears outside the layers (Gemma 4's projection of the embeddings): their casts, as estimate.py's
        other = (sum(x.numel for x in shape.other_linears) * p.cd if full and p.separate_casts else 0) + (
            (plan.other_params - plan.magnitudes()) * p.cd if plan and adapter_cast else 0)
        copies[0] += other
        cached[0] += other
    if frozen_input:  # nor are its q/k/v weights' casts kept (saved for the input's gradient)
        qkv = [x for x in sub.layer(0).layer_linears if x.name in sub.layer(0).input_linears[0]]
        copies[0] -= sum(x.numel for x in qkv) * p.cd if p.separate_casts else 0
        copies[0] -= sum(spec.lora_r * x.fan_in for x in qkv if x.name in adapted[0]) * p.cd if adapter_cast else 0
    head_copies = (O * H * p.cd if p.separate_casts else 0) + (
        spec.lora_r * (H + V) * p.cd if (plan and plan.adapted_head and adapter_cast) else 0)
    copies_fwd = sum(copies) if not ckpt else sum(cached) + copies[-1] - cached[-1]
    pd = p.cd if amp else DTYPE_BYTES[spec.dtype]
    every = stage_states(shape, spec, stage)
    st = replace(every, grads_layer=every.grads_layer[offset:offset + L])  # the modelled chunk's layers
    # FSDP inside a stage, by train.fsdp_accumulate. sharded (the default): as without a pipeline, each layer gathered
    # for its forward and again for its backward (two in flight) and its gradients reduce-scattered every micro-batch.
    # unsharded: as torch's PipelineStage runs a stage that is an FSDP2 module: every micro-batch's backward with
    # set_requires_gradient_sync(False) and set_reshard_after_backward(False), one reduce-scatter after the last
    # (perform_reduce_grad); so from the first backward a GPU holds its stage's whole gradient in fp32 (FSDP2
    # accumulates unsharded in the reduce dtype) and all its parameters gathered in the compute dtype (torchtitan also
    # keeps them gathered after forward under a pipeline, reshard_after_forward=False: one all-gather a step).
    whole_grad = fsdp and spec.fsdp_accumulate == "unsharded"
    whole = stage_shape(shape, stage)
    largest = max(sub.layer(i).params_per_layer for i in range(L))
    unit = (largest + max(adapter_params)) * pd if fsdp else 0
    gathered = (whole.params_total + (plan.trainable(whole) if plan else 0)) * pd if whole_grad else 2 * unit
    # a layer's gradients being made
    unit_grads = (largest if full else max(adapter_params)) * (pd + 4 * amp) if fsdp else 0
    # The gradients the rank's other chunks (interleaved) made before this one's backward are held beside it even when
    # no accumulation holds them (grad_accum_steps 1); the embeddings' come after.
    others = sum(every.grads_layer) - sum(st.grads_layer)
    g_acc = st.grads * spec.shards if whole_grad else max(accumulated_grads(spec, st), others)
    base = dict(weights=st.weights, optimizer=st.optimizer, ddp_buckets=st.ddp_buckets, pipeline_buffers=buffers)
    acts = sum(kept) + rope_ids + made + ends + out + held
    phases = {"forward": _phase(**base, gradients=g_acc, autocast_copies=copies_fwd,
                                activations=sum(kept) + rope_ids + held + mask, fsdp_buffers=gathered,
                                temporaries=act.layer_forward_temp(p, sub.layer(L - 1), adapted[-1]))}
    if last:
        phases.update(_loss_phases(
            p, sub, spec, st, head_copies=head_copies,
            tail=(gathered if whole_grad else (O * H + shape.params_final_norm) * pd) + fp32_head_extra(shape, spec, pd)
            if fsdp else 0,
            fsdp_head=O * H * pd + fp32_head_extra(shape, spec, pd) if fsdp and head_trains else 0,
            forward=dict(**base, gradients=g_acc, autocast_copies=copies_fwd, activations=acts + mask),
            backward=dict(**base, gradients=g_acc, autocast_copies=0 if ckpt else sum(copies),
                          activations=acts + mask_bwd),
            head_adapter_r=spec.lora_r if plan and plan.adapted_head else 0))
    every = [x for i in range(L) for x in sub.layer(i).layer_linears]  # the chunk's layers' linears
    mlp = [x.numel for x in every if x.name.startswith("mlp.")] + [router]
    attn = [x.numel for x in every if not x.name.startswith("mlp.")]
    # a 16-bit weight gradient before its cast (a full fine-tune's)
    temps = (max(mlp) * p.cd, max(attn) * p.cd) if p.separate_casts and full else (0, 0)
    # the tiled MLP returns its weights' gradients summed over the shards: one more copy where .grad is held (as
    # estimate.py counts it; a stage under FSDP accumulates unsharded, as_trained)
    if p.mlp_shard and full and (not fsdp or (spec.fsdp_accumulate == "unsharded" and spec.grad_accum_steps > 1)):
        temps = (temps[0] + max(sum(x.numel for x in sub.layer(i).layer_linears if x.name.startswith("mlp."))
                                for i in range(L)) * DTYPE_BYTES[spec.dtype], temps[1])
    phases["backward_layers"] = _backward_layers(
        p, sub, spec, st, chunk_plan, base, adapted=adapted, saved=saved, kept=kept, on_gpu=kept, copies=copies,
        below_all=rope_ids + out + mask_bwd + held, g_acc=g_acc, temps=temps,
        fsdp_buffers=gathered + 2 * unit_grads, embed_trains=not frozen_input)
    if first:
        phases["backward_embedding"] = _phase(**base, gradients=max(g_acc, st.grads),
                                              temporaries=p.tokens * H * p.resid,
                                              fsdp_buffers=(gathered if whole_grad else V * H * pd)
                                              + (V * H * pd if full else 0) if fsdp else 0)
    if whole_grad:  # the step's one reduce-scatter, unit by unit: the whole gradient, its shards, a unit's flat copy
        phases["reduce_gradients"] = _phase(**base, gradients=g_acc + st.grads, fsdp_buffers=gathered,
                                            temporaries=unit_grads)
    phases["optimizer_step"] = _phase(**base, gradients=st.grads)
    if spec.num_generations:  # online RL: its rollout through the stages (parallel/pipeline/sampling.py)
        phases.update(staged_generation_phases(shape, spec, stage, base, cached=sum(cached), pd=pd))
        if spec.reward_models:  # learned rewards: whole on every GPU, scoring after sampling (reward_models.py)
            add_reward_models(phases, spec, rows=max(_rollout_rows(spec, drawn=False), spec.eval_rows))
    if spec.teacher is not None and stage.last:  # distillation: the teacher on the last stage alone
        add_stage_teacher(phases, shape, spec, p, base)
    est = _finish(whole, spec, plan, st, phases, notes=_notes(sub, spec, p) + stage_notes(shape, spec))
    state = st.weights + st.grads + st.optimizer + st.ddp_buckets
    summary = {"rank": stage.rank, "virtual_stages": list(stage.virtual),
               "layers": [[r.start, r.stop] for r in stage.chunks], "embedding": stage.first, "head": stage.last,
               "in_flight": list(stage.held), "params": whole.params_total, "state_bytes": state,
               "in_flight_activation_bytes": in_flight_bytes(p, shape, stage, spec), "receive_buffer_bytes": buffers,
               "per_gpu_peak_bytes": est.per_gpu_peak_bytes, "peak_phase": est.peak_phase}
    return replace(est, pipeline={"stage": summary})


def chunk_bytes(p: act.Pass, shape: ModelShape, stage: Stage, k: int, ckpt: bool, plan: LoraPlan | None = None) -> int:
    """What one micro-batch leaves saved in chunk k of `stage` after its forward: each layer's saved tensors (with
    checkpointing its input; a later virtual stage's first input is its receive buffer, counted there), RoPE (each
    stage makes its own), the token ids on the first virtual stage, the final norm's and loss's inputs on the last,
    on every other what it sent on (boundary_bytes: torch's PipelineStage keeps a micro-batch's outputs until its
    backward, which starts from them; the hidden states were missing, 2 to 5% of a tiny stage's measured peak).
    `plan`: the stage's LoRA adapters (stage_plan; None: a full fine-tune), whose saved tensors the layers add, and
    whose frozen embedding the first virtual stage's first layer saves less for."""
    sub = stage_shape(shape, stage, k)
    s = stage.virtual[k]
    full = plan is None
    embed_trains = full or "embed_tokens" in plan.saved_copies
    if ckpt:
        own = act.checkpoint_bytes(p, sub) * sub.layers - (act.checkpoint_bytes(p, sub) if s > 0 else 0)
    else:
        offset = sum(len(x) for x in stage.chunks[:k])
        adapted = [plan.adapted[offset + i] if plan else {} for i in range(sub.layers)]
        own = sum(act.layer_bytes(p, sub.layer(i), a, plan.r if plan else 0) for i, a in enumerate(adapted))
        own -= act.frozen_input_discount(p, sub.layer(0), adapted[0]) if s == 0 and not embed_trains else 0
    ends = act.norm_bytes(p, shape.hidden, trainable=full, gemma=shape.gemma_norms) + act.loss_input_bytes(p, shape) \
        if s == stage.total - 1 else boundary_bytes(p, shape, stage.chunks[k].stop)
    if s == 0:  # the token ids, RoPE, and Gemma 4's per-layer inputs of every layer
        return own + act.stream_inputs_bytes(p, sub, embed_trainable=embed_trains) + ends + \
            act.per_layer_inputs_bytes(p, shape, plan.adapted_other if plan else {}, plan.r if plan else 0)
    return own + act.rope_bytes(p, sub) + ends


def staged_generation_phases(shape: ModelShape, spec: TrainSpec, stage: Stage, base: dict, *, cached: int,
                             pd: int) -> dict:
    """Online RL's sampling on one GPU of `stage` (parallel/pipeline/sampling.py), estimate.py's generation phases of
    the model as the stage holds it: the KV cache of its own layers (every chunk's) and their prefill transients, and,
    on every stage, the last position's logits (the last stage's head makes them, the others receive them: fp32,
    broadcast) and the sampler's state over them (every process of a pipeline draws the tokens). A stage sharded by
    FSDP is gathered whole for the rollout (Pipeline.sampling). Gemma 4: a stage whose layers share keys and values
    stored on an earlier stage holds them whole through the decoding (stage.Stage._decode), as that layer's cache."""
    own = stage_shape(shape, stage)
    plan = stage_plan(shape, spec, stage)
    gathered = (own.params_total + (plan.trainable(own) if plan else 0)) * pd if spec.sharded else 0
    if spec.sharded and stage.last:  # (an fp32 head: a unit of its own, gathered in fp32)
        gathered += fp32_head_extra(shape, spec, pd)
    phases = _generation_phases(own, spec, base, cached=cached, fsdp_unit=gathered)
    # the prompts' pass (the stages sample with the reference loop: every row's whole prompt at once)
    prompt, rows = spec.prompt_longest or spec.prompt_tokens or spec.seq_len, sampling_rows(spec)
    p = make_pass(own, spec.but(seq_len=max(2, prompt), attn_implementation="sdpa", packing=False,
                                micro_batch_tokens=None), examples=rows)
    prefill = phases["generation_prefill"]
    if stage.first and len(stage.chunks) == 1:  # the whole model's forward keeps the embeddings beside each layer's
        # input, output and normalised input (eval_layer_bytes' 4 x T x H); the first stage's embeddings are its first
        # layer's input, dropped after it (a later stage keeps what it received beside them: 4)
        prefill["temporaries"] = max(0, prefill.get("temporaries", 0) - p.tokens * own.hidden * p.resid)
    if own.per_layer_input:  # Gemma 4: the per-layer inputs of the layers from the stage's first on, made there (the
        # first stage) or received, alive through the pass
        prefill["temporaries"] = prefill.get("temporaries", 0) + p.tokens * act.ple_width(p) * own.per_layer_input * (
            shape.layers - stage.chunks[0].start)
    if shape.kv_handed and (held := sum(shape.kv_handed[c.start] for c in stage.chunks)):
        # (in the compute dtype, as kv_cache_bytes; the prompts' alone while they are prefilled)
        per_row = held * spec.compute_bytes * rows
        for name, positions in (("generation_prefill", prompt), ("generation", _cache_width(spec))):
            phases[name]["kv_cache"] = phases[name].get("kv_cache", 0) + per_row * positions
    return phases


def in_flight_bytes(p: act.Pass, shape: ModelShape, stage: Stage, spec: TrainSpec) -> int:
    """The activations the stage's schedule holds at once: chunk_bytes x the micro-batches in flight, every chunk."""
    plan = stage_plan(shape, spec, stage)
    return sum(n * chunk_bytes(p, shape, stage, k, spec.gradient_checkpointing, plan)
               for k, n in enumerate(stage.held))


def boundary_bytes(p: act.Pass, shape: ModelShape, layer: int, *, gradient: bool = False) -> int:
    """What one micro-batch sends across the stage boundary before decoder layer `layer` (its gradient coming back:
    `gradient`): the hidden states (tokens x hidden, the stream dtype), and Gemma 4's per-layer inputs of the layers
    from there on (where they train, their gradient too) and the keys and values its store layers made for sharing
    layers from there on (ModelShape.kv_handed, the compute dtype). `shape`: the whole model."""
    per_layer = (shape.layers - layer) * shape.per_layer_input * act.ple_width(p) \
        if not gradient or p.per_layer_inputs_train else 0
    kv = shape.kv_handed[layer] * p.cd if shape.kv_handed else 0
    return p.tokens * (shape.hidden * p.resid + per_layer + kv)


def receive_buffer_bytes(p: act.Pass, shape: ModelShape, stage: Stage, spec: TrainSpec) -> int:
    """torch's PipelineStage allocates, before the first step, one receive buffer per micro-batch for the activations
    (every virtual stage but the first) and one for the gradients (every one but the last): 2 M buffers a middle
    stage, each what crosses its boundary (boundary_bytes: tokens x hidden in the stream dtype, and Gemma 4's
    per-layer inputs and shared keys and values)."""
    return spec.grad_accum_steps * sum(
        (boundary_bytes(p, shape, c.start) if s > 0 else 0) +
        (boundary_bytes(p, shape, c.stop, gradient=True) if s < stage.total - 1 else 0)
        for s, c in zip(stage.virtual, stage.chunks))


def stage_notes(shape: ModelShape, spec: TrainSpec) -> tuple[str, ...]:
    b = bubble_fraction(spec.pipeline_parallel, spec.grad_accum_steps, spec.chunks)
    return ((f"pipeline of {spec.pipeline_parallel} stages ({spec.pipeline_schedule}, {spec.chunks} chunk(s) a GPU, "
             f"{spec.grad_accum_steps} micro-batches a step: bubble {b:.1%}), each stage "
             f"{spec.world // spec.pipeline_parallel} GPU(s) running {spec.strategy}; the worst stage's GPU is shown"),)


# --------------------------------------------------------------------------- time


def crosses_nodes(spec: TrainSpec, a: int, b: int) -> bool:
    """Whether pipeline ranks a and b (their GPUs of the same place in the stage group) are on different nodes."""
    d = spec.world // spec.pipeline_parallel
    return (a * d) // spec.num_gpus != (b * d) // spec.num_gpus


def stage_traffic(shape: ModelShape, spec: TrainSpec, stage: Stage, network: Network) -> Traffic:
    """One GPU of `stage`: the collectives of the strategy inside its group of D GPUs over the stage's parameters
    (comms.traffic on the stage's model), its compute (the stage's layers, and the head on the last, for M
    micro-batches), and its boundary sends: per micro-batch and virtual stage, its output to the next stage (forward)
    and its input's gradient to the previous one (backward), each tokens x hidden in the stream dtype."""
    d, g = spec.world // spec.pipeline_parallel, spec.num_gpus
    group = spec.but(pipeline_parallel=1, num_gpus=min(d, g), num_nodes=max(1, d // g),
                     strategy=spec.strategy if d > 1 else "single")
    whole = stage_shape(shape, stage)
    plan = stage_plan(shape, spec, stage)
    trained = whole.params_total if plan is None else plan.trainable(whole)  # LoRA: the adapters (and copies)
    # their gradients as they are reduced: the master dtype's, LoRA's fp32 adapters
    trainable = (trained * stage_master(spec) if plan is None
                 else stage_states(shape, spec, stage).grads * spec.shards)
    if spec.sharded and spec.fsdp_accumulate == "unsharded":  # once a step each (stage_estimate: torch's PipelineStage)
        g = gathered_bytes(whole, group, trained_params=trained)
        inside = parts_of(group, (
            Collective("all-gather of the stage's parameters, once a step (kept gathered through its micro-batches)",
                       "all_gather", g.resharded + g.tail, d, "job"),
            Collective("reduce-scatter of the stage's gradients, once a step (after its last micro-batch)",
                       "reduce_scatter", trainable, d, "job")))
    else:
        inside = traffic(whole, group, trained_params=trained, trainable_bytes=trainable, network=network).parts
    full = plan is None  # LoRA: no weight gradients of the base (4 FLOPs a frozen parameter a token, 6 a trained one)
    flops = sum(step_flops(replace(shape, layers=len(c)), spec, 1.0 if full else 0.0) for c in stage.chunks)
    flops -= (len(stage.chunks) - stage.last) * spec.tokens * spec.grad_accum_steps * shape.vocab * shape.hidden * (
        6 if full else 4)
    # the no-grad passes run through the stages too (a preference.reference adapter's, KTO's): the chunks' layers,
    # at the rate the step's recompute implies (comms.no_grad_rate), the head's recompute on the last stage alone
    heads = 2.0 * (len(stage.chunks) - stage.last) * spec.tokens * spec.grad_accum_steps * shape.head_outputs * (
        shape.hidden)
    forwards = spec.extra_forwards * (sum(forward_flops(replace(shape, layers=len(c)), spec) for c in stage.chunks)
                                      - heads)
    recompute = sum(recompute_flops(replace(shape, layers=len(c)), spec) for c in stage.chunks) - heads
    p = make_pass(shape, spec)
    send = float(p.tokens * shape.hidden * p.resid)
    intra = inter = 0.0
    for s, c in zip(stage.virtual, stage.chunks):
        for other in (s - 1, s + 1):  # backward's gradient to the previous stage, forward's output to the next
            if 0 <= other < stage.total:
                sent = boundary_bytes(p, shape, c.start, gradient=True) if other < s else boundary_bytes(
                    p, shape, c.stop)
                send = max(send, float(sent))
                nbytes = spec.grad_accum_steps * sent
                if crosses_nodes(spec, stage.rank, other % spec.pipeline_parallel):
                    inter += nbytes
                else:
                    intra += nbytes
    links = "across nodes" if inter and not intra else "within the node" if intra and not inter else "both"
    part = ((f"point-to-point sends at the stage boundaries ({links}): forward activations and backward gradients, "
             f"{spec.grad_accum_steps} micro-batches"), intra, inter)
    info = PipelineTraffic(spec.pipeline_parallel, spec.chunks, spec.grad_accum_steps, stage.rank, send, intra, inter,
                           bubble_fraction(spec.pipeline_parallel, spec.grad_accum_steps, spec.chunks))
    forwards_s = forwards / no_grad_rate(network, flops, recompute)
    return Traffic(inside + (part,), flops / (network.peak_tflops * 1e12 * network.mfu) + forwards_s, network,
                   forwards_s=forwards_s,
                   forwards_what=no_grad_forwards(spec), pipeline=info)


def pipeline_traffic(shape: ModelShape, spec: TrainSpec, network: Network = Network()) -> Traffic:
    """The traffic of the stage that paces the pipeline: the longest slot, its compute or its collectives
    (overlapped) and then its sends (torch's schedules wait for them before the next micro-batch)."""
    each = [stage_traffic(shape, spec, s, network) for s in stages_of(shape, spec)]
    return max(each, key=lambda t: max(t.compute_s, t.collectives_s) + t.pipeline.p2p_s(network))


def same_batch(spec: TrainSpec, strategy: str) -> TrainSpec | None:
    """The pipeline's run as a data-parallel one on the same GPUs, at the same global batch: P times the data ranks,
    so grad_accum_steps / P micro-batches each (None where P does not divide it)."""
    p = spec.pipeline_parallel
    if spec.grad_accum_steps % p:
        return None
    return spec.but(pipeline_parallel=1, pipeline_schedule="1f1b", pipeline_chunks=None, strategy=strategy,
                    grad_accum_steps=spec.grad_accum_steps // p)


def compared(shape: ModelShape, spec: TrainSpec, network: Network) -> list[tuple[str, Estimate, Traffic]]:
    """The pipeline beside DDP, FSDP and HSDP (HSDP where there are nodes to replicate over) on the same GPUs at the
    same global batch: (label, estimate, traffic) each, the pipeline first (each estimate says whether it fits). FSDP
    and HSDP only where the capability table lets the recipe shard without stages (spec.unshardable_unstaged)."""
    stage_gpus = spec.world // spec.pipeline_parallel
    label = (f"pipeline {spec.pipeline_parallel} x {spec.strategy} {stage_gpus}" if stage_gpus > 1 else
             f"pipeline {spec.pipeline_parallel} (a GPU a stage)")  # not "x single 1", nor "x ddp 1"
    rows = [(label, pipeline_estimate(shape, as_trained(spec)), pipeline_traffic(shape, as_trained(spec), network))]
    for strategy in ("ddp", "fsdp", "hsdp") if spec.num_nodes > 1 and spec.num_gpus > 1 else ("ddp", "fsdp"):
        if strategy != "ddp" and spec.unshardable_unstaged is not None:
            continue
        other = same_batch(spec, strategy)
        if other is not None:
            rows.append((f"{strategy} {spec.world}", estimate(shape, other), step_traffic(shape, other, network)))
    return rows


def gib(n: int) -> str:
    return f"{n / GIB:,.2f}"
