"""Per-GPU peak memory of a training step: the largest of the step's phases, never a sum of everything.

A step is walked phase by phase (the last layer's forward, a loss chunk's forward, its backward and
the LM head's, each layer's backward, the embedding's, the optimizer step, evaluation) and at each phase
the tensors alive then are added up by component. The peak phase's components are the breakdown.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

from llmtrain.capabilities import FAMILIES, experts_problems, family_cell, sequence_heads_problem
from llmtrain.config import PREFILL_CHUNK, tiled_mlp_shard
from llmtrain.errors import LLMTrainError
from llmtrain.memory import activations as act
from llmtrain.memory.params import LoraPlan, ModelShape, run_lora_plan, tensor_parallel_shape, tensor_problems
from llmtrain.memory.spec import (
    DTYPE_BYTES,
    GIB,
    MIB,
    Estimate,
    TrainSpec,
    sequence_kv_heads,
)
from llmtrain.memory.states import (  # noqa: F401  (optimizer_bytes, quantized_base_bytes: imported from here too)
    States,
    accumulated_grads,
    host_ram_bytes,
    optimizer_bytes,
    quantized_base_bytes,
    states,
)
from llmtrain.memory.reward_models import add_reward_models, reward_model_notes
from llmtrain.memory.teacher import add_teacher

# Outside PyTorch's allocator; constants to be calibrated on GPUs (see docs/memory.md).
CUDA_CONTEXT_BYTES = 500 * MIB  # CUDA context, cuBLAS/cuDNN handles and kernels
NCCL_BYTES = 512 * MIB  # NCCL communicator buffers, multi-process runs only
ALLOCATOR_SLACK = 0.10  # reserved / allocated - 1: the caching allocator's rounding and fragmentation
# online RL's reserved and allocated peaks on the H200 (GiB; 2026-12-04, 92.66 reserved on 2026-11-27)
RL_RESERVED_MEASURED = (91.90, 68.96)
DROPOUT_MASK_BYTES = act.CUDA_DROPOUT_MASK_BYTES  # per element saved by dropout (4 on the CPU, for tests)


@functools.cache
def varlen_repeats_kv() -> bool:
    """llmtrain.model.attention repeats K/V to every query head only for torch 2.10's varlen_attn (`is_causal`, no
    `window_size`); from 2.11 the flash kernel takes the K/V heads as they are. Read off the torch installed
    here, as training decides it (without varlen_attn at all: assume the repeat, the larger)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return True
    return "window_size" not in inspect.signature(varlen_attn).parameters


def update_examples(spec: TrainSpec) -> int:
    """The sequences of one training pass: the micro-batch, or online RL's update in passes of whole sequences within
    its budget (rl.micro_batch_tokens)."""
    if spec.rl_micro_batch_tokens:
        return min(spec.micro_batch, max(1, spec.rl_micro_batch_tokens // spec.seq_len))
    return spec.micro_batch


def make_pass(shape: ModelShape, spec: TrainSpec, *, examples: int | None = None,
              budget: int | None = None) -> act.Pass:
    """Shapes and dtypes of one micro-batch: the training one, or `examples` (or a token `budget`) for eval.

    Packed (spec.packed: varlen attention, packing, or a token budget): one row of every token, each example
    attending only to itself. varlen and flash_attention_2 read the boundaries and build no mask; sdpa and
    eager get transformers' block-diagonal 4-D mask over the whole row. Padded: one row per example, all
    seq_len long and assumed to differ in length, so sdpa and eager get a 4-D mask there too. Sequence parallelism
    (spec.sequence_parallel N, varlen only): one row of this GPU's ceil(T / N) tokens of the group's row."""
    training = examples is None
    if training:  # (online RL's passes on pipeline stages: rows of rl.micro_batch_tokens slots, padded to them)
        staged = spec.rl_micro_batch_tokens if spec.pipeline_parallel > 1 and spec.num_generations else None
        examples, budget = update_examples(spec), spec.micro_batch_tokens or staged
    tokens = budget or examples * spec.seq_len
    n = spec.sequence_parallel
    if n > 1:  # this GPU's share of the group's packed row (the estimate at ceil(T / N) tokens)
        tokens, budget = -(-tokens // n), -(-tokens // n)
    b, s = (1, tokens) if spec.packed else (examples, spec.seq_len)
    shard = tiled_mlp_shard(spec.tiled_mlp, shape.hidden)
    amp = spec.mixed_precision != "no"
    compute = spec.compute_dtype
    # FSDP's mixed-precision policy gathers parameters in the compute dtype, so the stream is too.
    stream = compute if (spec.sharded and amp) else spec.dtype
    window = shape.sliding_window  # varlen applies it per example, inside the kernel
    mask = spec.kernel in ("sdpa", "eager") and (spec.packed or b > 1 or (window is not None and s > window))
    return act.Pass(rows=b, row_len=s, resid=DTYPE_BYTES[stream], cd=DTYPE_BYTES[compute], autocast=amp,
                    attn=spec.kernel, mask=mask, trainable_base=spec.method == "full",
                    separate_casts=amp and stream != compute,
                    lora_dropout=spec.lora_dropout if spec.method == "lora" else 0.0,
                    dropout_mask_bytes=DROPOUT_MASK_BYTES,
                    varlen_repeats_kv=spec.kernel == "varlen" and varlen_repeats_kv(),
                    examples=1 if budget else examples,
                    # online RL's update trains each sequence's completion only; a reward model's score head reads
                    # one position a sequence (a budget's row: at least a pair)
                    # (under sequence parallelism, this GPU's share of them)
                    loss_positions=(2 if budget else examples) if shape.score_head else
                    -(-examples * spec.max_completion_tokens // n) if training and spec.max_completion_tokens else
                    None,
                    # FSDP gathers the adapters in cd; peft's 4-bit layers do not cast their input under autocast;
                    # without autocast on fp32 weights the fp32 adapters' cast of their fp32 input is no copy
                    adapters_in_cd=spec.method == "lora" and (
                        (amp and (spec.sharded or bool(spec.quantize))) or (not amp and stream == "float32")),
                    # the tiled MLP runs untiled on a micro-batch of at most one shard (model/tiled_mlp.py)
                    mlp_shard=shard if shard and tokens > shard else None, sequence_parallel=n,
                    per_layer_inputs_train=bool(shape.per_layer_input) and (spec.method == "full" or (
                        "per_layer_model_projection" in run_lora_plan(shape, spec).adapted_other)),
                    dora=spec.method == "lora" and spec.lora_dora, dora_split=spec.tp > 1,
                    dora_weight_copy=_dora_weight_copy(spec, DTYPE_BYTES[stream], DTYPE_BYTES[compute], amp),
                    **_expert_adapters(shape, spec, DTYPE_BYTES[stream]))


def _dora_note(shape: ModelShape, spec: TrainSpec, p: act.Pass) -> str:
    """What DoRA adds to a layer's saved tensors (act.dora_bytes), and the part lora.dropout=0 would save."""
    adapted = run_lora_plan(shape, spec).adapted[0]
    saved = sum(act.dora_bytes(p, i, o) for i, o in adapted.values())
    copies = sum(i * o * p.dora_weight_copy for i, o in adapted.values()) if spec.lora_dropout > 0 else 0
    text = (f"lora.dora: each adapted linear keeps its base and adapter outputs for the magnitude's gradient, "
            f"{saved / MIB:,.1f} MiB a layer")
    if copies:
        text += (f", of which {copies / MIB:,.1f} MiB are the weight copies of the base matmuls peft runs again on "
                 f"the dropped-out input (lora.dropout={spec.lora_dropout:g}; 0 saves the matmuls and the copies)")
    return text


def _dora_weight_copy(spec: TrainSpec, stream: int, cd: int, amp: bool) -> int:
    """Pass.dora_weight_copy: with LoRA dropout, DoRA's second base matmul (peft's F.linear of the dropped input and
    the weight cast to its dtype) saves a copy of the weight for the input's gradient: a 4-bit base's dequantized
    weight; under autocast the cast to cd (none where FSDP gathers it and the adapters in cd already); without, the
    cast of a 16-bit weight to the adapters' fp32."""
    if spec.method != "lora" or not spec.lora_dora or spec.lora_dropout == 0:
        return 0
    if spec.quantize or (amp and not spec.sharded):
        return cd
    return 0 if amp or stream == 4 else 4


def _expert_adapters(shape: ModelShape, spec: TrainSpec, stream: int) -> dict:
    """Pass.expert_ranks (peft's, read off its plan) and expert_factors_cast for LoRA on a mixture of experts."""
    if spec.method != "lora" or shape.experts is None:
        return {}
    plan = run_lora_plan(shape, spec)
    fans = act.expert_fans(shape)
    ranks = tuple((name, n // (shape.experts.count * sum(fans[name]))) for name, n in plan.moe_params.items()
                  if name in fans)
    return dict(expert_ranks=ranks, expert_factors_cast=stream == 2 and not (spec.sharded and
                                                                             spec.mixed_precision != "no"))


def _experts_note(shape: ModelShape, spec: TrainSpec, p: act.Pass) -> str:
    """What a mixture of experts' layer holds: its experts (tp-th of them under tensor parallelism), top_k a token;
    under LoRA, what the experts' adapters save; a 4-bit base leaves the experts in the storage dtype."""
    e = shape.experts
    moe = e.params(shape.hidden)
    experts = moe[e.gate_up] + moe[e.down]
    text = (f"a mixture of {e.count} experts a layer, {e.top_k} a token ({e.pairs(p.tokens):,} token-expert pairs "
            f"a micro-batch, run by transformers' grouped_mm in the weights' dtype)")
    if e.held:
        text += (f"; tensor parallelism splits them by expert: each GPU holds {e.held} of each layer's {e.count} "
                 "and every pair's rows (zeros where another GPU's expert runs them)")
    if spec.method == "lora":
        plan = run_lora_plan(shape, spec)
        if saved := act.expert_adapter_bytes(p, shape, plan.adapted[0]):
            text += (f"; LoRA on the experts ({sum(plan.moe_params.values()):,} adapter weights a layer) runs each "
                     f"expert's adapter beside it, unmerged ({saved / MIB:,.1f} MiB a layer saved for backward)")
    if e.clamped_gate:  # GPT-OSS: the hub's checkpoints hold the experts in MXFP4, which does not train
        text += (f"; the experts counted in {spec.dtype}: a checkpoint's MXFP4 experts (openai/gpt-oss-*) are "
                 "read dequantized to it, as llmtrain loads them to train (modeling.dequantized)")
    if spec.quantize:
        text += (f"; {spec.quantize} quantizes the linear layers only: the experts' {experts * shape.layers:,} "
                 f"weights stay in {spec.dtype}")
    return text


def _share(shape: ModelShape, plan: LoraPlan | None, k: int, prefix: str) -> float:
    """The fraction of decoder layer k's trainable parameters in the linears named `prefix`... (or in their adapters):
    "mlp.down_proj", or "mlp." for the whole MLP."""
    if plan is None:
        layer = shape.layer(k)
        sizes = {x.name: x.numel for x in layer.layer_linears}
        sizes.update(shape.experts.params(shape.hidden) if shape.experts else {})
        return sum(n for name, n in sizes.items() if name.startswith(prefix)) / layer.params_per_layer
    sizes = plan.layer_sizes(k)
    return sum(n for name, n in sizes.items() if name.startswith(prefix)) / max(1, sum(sizes.values()))


def _phase(**parts: int) -> dict[str, int]:
    return {k: int(v) for k, v in parts.items() if v}


def estimate(shape: ModelShape, spec: TrainSpec) -> Estimate:
    """The per-GPU peak of the run `spec` describes on the model `shape`. Under FSDP x TP every GPU runs its tensor-
    parallel slice of the model (params.tensor_parallel_shape), sharded by FSDP over the data-parallel ranks."""
    if spec.pipeline_parallel > 1:  # each stage holds other layers: memory.estimate_run walks them
        raise ValueError("a pipeline's stages are estimated by llmtrain.memory.estimate_run")
    spec.validate()
    for kv in dict.fromkeys(shape.layer(i).kv_heads for i in range(shape.layers)):  # each layer's (Gemma 4's)
        if problem := sequence_heads_problem(spec.sequence_parallel, shape.heads, kv):
            raise LLMTrainError(f"cannot estimate this run: {problem} ({shape.source}).")
    if spec.tp > 1 and (why := family_cell(shape.model_type, "tp")):
        raise LLMTrainError(f"cannot estimate this run: tensor parallelism is refused for "
                            f"{FAMILIES[shape.model_type].name}: {why}.")
    if spec.tp > 1 and shape.config_json and (problems := tensor_problems(shape.config_json, shape.model_type,
                                                                           spec.tp)):
        raise LLMTrainError(f"cannot estimate this run: {'; '.join(problems)} ({shape.source}).")
    dropout = spec.lora_dropout if spec.method == "lora" else 0.0
    if shape.experts and (problems := experts_problems(
            shape.model_type, shape.experts.count, tiled_mlp=bool(spec.tiled_mlp), lora_dropout=dropout,
            parameters_adapted=(dropout > 0 or spec.lora_dora) and bool(run_lora_plan(shape, spec).moe_params),
            dora=spec.method == "lora" and spec.lora_dora,
            flags={"tiled_mlp": " (--tiled-mlp)", "lora_dropout": " (--lora-dropout)", "dora": " (--dora)"})):
        raise LLMTrainError(f"cannot estimate this run: {problems[0]} ({shape.source}).")
    whole, shape = shape, tensor_parallel_shape(shape, spec.tp)
    plan = run_lora_plan(shape, spec)
    st = states(shape, spec, plan, whole=whole)
    p = make_pass(shape, spec)
    L, V, H = shape.layers, shape.vocab, shape.hidden
    full, fsdp, ckpt = plan is None, spec.sharded, spec.gradient_checkpointing
    amp = p.autocast
    adapted = [plan.adapted[i] if plan else {} for i in range(L)]
    head_trains = full or (plan is not None and "lm_head" in plan.saved_copies)
    embed_trains = full or (plan is not None and "embed_tokens" in plan.saved_copies)

    # -- activations
    saved = [act.layer_bytes(p, shape.layer(i), adapted[i], spec.lora_r) for i in range(L)]
    if not embed_trains:  # the first layer's input needs no gradient
        saved[0] -= act.frozen_input_discount(p, shape.layer(0), adapted[0])
    if ckpt and p.mlp_shard:  # the tiled input norm keeps the layer's input: the checkpoint's own tensor, once
        saved = [s - (act.checkpoint_bytes(p, shape) if (i or embed_trains) else 0) for i, s in enumerate(saved)]
    kept = [act.checkpoint_bytes(p, shape)] * L if ckpt else saved  # what each layer keeps after forward
    # model.activation_offload: the checkpointed inputs go to host memory as the forward moves on, all but the last
    # layer's; one is in flight at a time (copied out in forward; in backward the next one is fetched while a layer
    # is recomputed), so the GPU holds two layers' inputs at most (model/offload.py)
    offload = ckpt and spec.activation_offload
    on_gpu = [0] * (L - 1) + [kept[-1]] if offload else kept
    in_flight = kept[0] if offload and L > 1 else 0
    rope_ids = act.stream_inputs_bytes(p, shape, embed_trainable=embed_trains)
    outside = act.outside_layers_bytes(p, shape, embed_trainable=embed_trains, norm_trainable=full,
                                       other_adapted=plan.adapted_other if plan else {}, r=spec.lora_r)
    mask = act.mask_bytes(p, shape.masks)
    mask_bwd = mask if ckpt else 0  # checkpointed layers hold the mask for their recompute

    # -- autocast copies of weights (non-FSDP mixed precision; FSDP gathers in the compute dtype)
    adapter_params = [plan.layer_params(i) if plan else 0 for i in range(L)]
    magnitudes = [plan.magnitudes(i) if plan else 0 for i in range(L)]
    # a mixture of experts' router weight (E x H; Gemma 4's is one of the layer's linears)
    router = shape.experts.count * H if shape.experts and not shape.experts.beside else 0
    # fp32 base linears, each layer's
    base_copies = [(shape.layer(i).linear_params_per_layer + router) * p.cd if p.separate_casts else 0
                   for i in range(L)]
    adapter_cast = amp and not fsdp  # fp32 adapters under autocast
    # (an expert parameter's A and B are not autocast's: peft casts them itself, act.expert_adapter_bytes)
    factors = sum(n for name, n in plan.moe_params.items() if shape.experts and name in (
        shape.experts.gate_up, shape.experts.down)) if plan else 0
    copies = [base_copies[i] + ((n - factors - magnitudes[i]) * p.cd if adapter_cast else 0)
              for i, n in enumerate(adapter_params)]
    # The autocast cache holds casts of trainable fp32 leaves until the forward returns.
    cached = [(base_copies[i] if full else 0) + ((n - factors - magnitudes[i]) * p.cd if adapter_cast else 0)
              for i, n in enumerate(adapter_params)]
    # the linears outside the layers (Gemma 4's projection of the embeddings): the casts of those that train, their
    # adapters', held from before the first layer
    other = (sum(x.numel for x in shape.other_linears) * p.cd if full and p.separate_casts else 0) + (
        (plan.other_params - plan.magnitudes()) * p.cd if plan and adapter_cast else 0)
    copies[0] += other
    cached[0] += other
    if not embed_trains:  # nor does it keep casts of its q/k/v weights (saved for the input's gradient)
        qkv = [x for x in shape.layer(0).layer_linears if x.name in shape.layer(0).input_linears[0]]
        copies[0] -= sum(x.numel for x in qkv) * p.cd if p.separate_casts else 0
        copies[0] -= sum(spec.lora_r * x.fan_in for x in qkv if x.name in adapted[0]) * p.cd if adapter_cast else 0
    head_copies = (shape.head_outputs * H * p.cd if p.separate_casts else 0) + (
        spec.lora_r * (H + V) * p.cd if (plan and plan.adapted_head and adapter_cast) else 0)
    copies_fwd = sum(copies) if not ckpt else sum(cached) + copies[-1] - cached[-1]
    # The loss runs inside the forward, so the autocast cache still holds its casts then; after it, only the
    # casts the layers' matmuls saved are left (the head's is made again in each chunk's recompute).
    copies_kept = sum(copies) if not ckpt else 0

    # -- FSDP: gathered (unsharded) units in the compute dtype, about two decoder layers in flight
    pd = p.cd if amp else DTYPE_BYTES[spec.dtype]
    largest = max(shape.layer(i).params_per_layer for i in range(L))
    unit = (largest + max(adapter_params)) * pd if fsdp else 0
    # A unit's unsharded gradients, in the compute dtype and, under mixed precision, also as the fp32 copy that
    # is reduce-scattered (fsdp.fsdp_precision reduces in fp32).
    unit_grads = (largest if full else max(adapter_params)) * (pd + 4 * amp) if fsdp else 0
    # final norm + head (+ tied embedding); rl.cast_lm_head_to_fp32's head a unit of its own gathered in fp32
    tail = (shape.head_outputs * H + shape.params_final_norm) * pd + fp32_head_extra(shape, spec, pd) if fsdp else 0
    embed_unit = V * H * pd if (fsdp and not shape.tied) else 0
    always = tail if shape.tied else 0
    # fsdp_reshard_after_forward: false: every layer stays gathered from its forward to its backward (the layers
    # beyond the two in flight, from the last layer's forward through the loss to the first backward)
    unresharded = L * unit if (fsdp and not spec.reshard_after_forward) else 0
    g_acc = accumulated_grads(spec, st)

    base = dict(weights=st.weights, optimizer=st.optimizer, ddp_buckets=st.ddp_buckets)
    acts_all = sum(on_gpu) + in_flight + outside
    phases = {"forward": _phase(**base, gradients=g_acc, autocast_copies=copies_fwd,
                                activations=sum(on_gpu) + in_flight + rope_ids + mask,
                                fsdp_buffers=max(2 * unit, unresharded) + always,
                                temporaries=act.layer_forward_temp(p, shape.layer(L - 1), adapted[-1]))}

    phases.update(_loss_phases(
        p, shape, spec, st, head_copies=head_copies, tail=tail + unresharded,
        fsdp_head=shape.head_outputs * H * pd + fp32_head_extra(shape, spec, pd) if fsdp and head_trains else 0,
        forward=dict(**base, gradients=g_acc, autocast_copies=copies_fwd, activations=acts_all + mask),
        backward=dict(**base, gradients=g_acc, autocast_copies=copies_kept, activations=acts_all + mask_bwd),
        head_adapter_r=spec.lora_r if plan and plan.adapted_head else 0))
    cast_temp = p.separate_casts and full  # a 16-bit weight gradient before it is cast to the fp32 .grad
    every = [x for i in range(L) for x in shape.layer(i).layer_linears]  # every layer's linears
    mlp_names = [x for x in every if x.name.startswith("mlp.")]
    # (a mixture of experts' run in their weights' dtype: its router's is the one cast)
    down_temp = max([x.numel for x in mlp_names] + [router]) * p.cd if cast_temp else 0
    # the tiled MLP returns its weights' gradients summed over the shards: one more copy where .grad is already held
    # (one GPU, DDP, FSDP keeping unsharded gradients over the window); under FSDP's default it becomes the unit's
    # unsharded gradient, counted in its buffers
    held = not fsdp or (spec.fsdp_accumulate == "unsharded" and spec.grad_accum_steps > 1)
    if p.mlp_shard and full and held:
        down_temp += max(sum(x.numel for x in shape.layer(i).layer_linears if x.name.startswith("mlp."))
                         for i in range(L)) * DTYPE_BYTES[spec.dtype]
    attn_temp = max(x.numel for x in every if x not in mlp_names) * p.cd if cast_temp else 0
    phases["backward_layers"] = _backward_layers(
        p, shape, spec, st, plan, base, adapted=adapted, saved=saved, kept=kept, on_gpu=on_gpu, copies=copies,
        below_all=rope_ids + mask_bwd, g_acc=g_acc, temps=(down_temp, attn_temp),
        fsdp_buffers=max(2 * unit, unresharded) + 2 * unit_grads + always, embed_trains=embed_trains)
    phases["backward_embedding"] = _phase(**base, gradients=st.grads, temporaries=p.tokens * H * p.resid,
                                          fsdp_buffers=embed_unit * (2 if full else 1) + always)
    phases["optimizer_step"] = _phase(**base, gradients=st.grads)
    if spec.num_generations:
        # FSDP: the rollout gathers every unit at once and keeps them so while it samples
        # (fsdp.gathered_for_generation): the whole model, unsharded, in FSDP's param dtype
        gathered = shape.layers * unit + tail + embed_unit if fsdp else 0
        if fsdp and spec.rollout_reference:  # the frozen copy the rollout runs (RLOO's KL, GRPO's once a round),
            # its decoder gathered too (rollouts.held_whole): whole, under tensor parallelism too (not split by TP)
            gathered += (whole.params_total - whole.params_head) * DTYPE_BYTES[spec.dtype]
        phases.update(_generation_phases(shape, spec, base, cached=sum(cached), fsdp_unit=gathered))
        if spec.rollout_forwards:  # the rollout's no-grad forwards of the update's passes (the old log-probabilities
            # of rl.num_iterations > 1, RLOO's KL), the model still gathered; under sequence parallelism on the group's
            # first GPU over whole rows
            phases.update(_eval_phases(shape, spec.but(sequence_parallel=1), base, adapted=adapted,
                                       cached=sum(cached), head_copies=head_copies, fsdp_unit=gathered, tail=gathered,
                                       examples=update_examples(spec), budget=None, name="rollout_logps"))
    if spec.no_grad_forwards:  # KTO: the micro-batch's KL and reference passes, the window's gradients so far held
        phases.update(_eval_phases(shape, spec, {**base, "gradients": g_acc}, adapted=adapted, cached=sum(cached),
                                   head_copies=head_copies, fsdp_unit=2 * unit + always, tail=tail,
                                   examples=spec.micro_batch, budget=spec.micro_batch_tokens, name="no_grad"))
    if spec.eval_micro_batch:
        phases.update(_eval_phases(shape, spec, base, adapted=adapted, cached=sum(cached), head_copies=head_copies,
                                   fsdp_unit=2 * unit + always, tail=tail, examples=spec.eval_micro_batch,
                                   budget=spec.eval_micro_batch_tokens, name="eval"))
    if spec.teacher is not None:  # distillation: a second, frozen model and its forward (memory/teacher.py)
        add_teacher(phases, shape, spec, p, base, gradients=g_acc)
    if spec.reward_models:  # online RL's learned rewards: frozen models, scoring after sampling (reward_models.py)
        add_reward_models(phases, spec, rows=max(_rollout_rows(spec, drawn=False), spec.eval_rows))  # a micro-batch's
    if copy := generation_copy_bytes(shape, spec, plan):  # while the sampler runs, or throughout where it is kept
        for name, parts in phases.items():
            if spec.merged_copy == "kept" or name.startswith("generation"):
                parts["generation_copy"] = copy
    # the model's parameters as a whole, under tensor parallelism too (`plan` adapts a GPU's slice of each layer)
    counted = run_lora_plan(whole, spec) if whole is not shape else plan
    est = _finish(whole, spec, counted, st, phases, notes=_notes(shape, spec, p))
    est = replace(est, long_context=_long_context(whole, spec, est, p, kept if offload else None))
    if spec.max_completion_tokens and spec.prompt_tokens < spec.prompt_cap:  # at the data's lengths: the worst case too
        cap = spec.prompt_cap
        worst = estimate(whole, spec.but(prompt_tokens=cap, prompt_longest=cap,
                                         seq_len=cap + spec.max_completion_tokens, prompt_basis=""))
        est = replace(est, worst_case_bytes=worst.per_gpu_peak_bytes, notes=est.notes + (
            f"worst case, every prompt at its longest ({cap} tokens) + {spec.max_completion_tokens} completion tokens, "
            f"sequences of data.max_seq_len: {worst.per_gpu_peak_bytes / GIB:,.2f} GiB per GPU (allocated "
            f"{worst.per_gpu_peak_allocated_bytes / GIB:,.2f}, at the {worst.peak_phase.replace('_', ' ')} phase)",))
    return est


def _long_context(shape: ModelShape, spec: TrainSpec, est: Estimate, p: act.Pass, kept: list[int] | None
                  ) -> dict[str, int]:
    """What activation offload puts in host memory and keeps off the GPU, and what tiling the MLP saves at the peak
    (the same run untiled, estimated again)."""
    out = {}
    if kept is not None:
        # pinned, per process; torch's caching host allocator rounds each pinned block up to a power of two
        out["offload_host_bytes"] = sum(1 << (n - 1).bit_length() for n in kept[:-1])
        out["offload_gpu_saved_bytes"] = sum(kept[1:-1])  # all but the last layer's and the one in flight
    if p.mlp_shard:
        untiled = estimate(shape, spec.but(tiled_mlp=None))
        out["mlp_shard_tokens"] = min(p.mlp_shard, p.tokens)
        out["tiled_mlp_saved_bytes"] = untiled.per_gpu_peak_bytes - est.per_gpu_peak_bytes
    return out


def _backward_layers(p, shape: ModelShape, spec: TrainSpec, st, plan, base: dict, *, adapted, saved, kept, on_gpu,
                     copies, below_all: int, g_acc: int, temps: tuple[int, int], fsdp_buffers: int,
                     embed_trains: bool) -> dict[str, int]:
    """The worst moment of the decoder layers' backward, last layer to first, each in its four moments: the
    recompute of its forward (under checkpointing), the MLP's backward (down_proj's input freed, its weight
    gradient made), the post-attention norm's (the MLP's tensors freed, the norm's fp32 temporaries: the largest
    once the MLP is tiled) and attention's (the MLP half freed, its gradients made). The layers below are still saved,
    the layers above have their gradients, and the residual stream's gradient flows through. `below_all`: what
    every moment keeps besides the layers (rope ids, the mask); `temps`: the MLP's and attention's 16-bit weight
    gradients before their cast. `on_gpu`: what each layer keeps on the GPU (with activation offload, the last
    layer's input only: layer k's comes back for its backward, and layer k-1's is fetched meanwhile)."""
    ckpt = spec.gradient_checkpointing
    offload = ckpt and spec.activation_offload
    resid_grad = act.residual_grad_bytes(p, shape)
    worst: dict[str, int] = {}
    for k in range(shape.layers - 1, -1, -1):
        a, layer = adapted[k], shape.layer(k)
        above = st.grads_head + sum(st.grads_layer[k + 1:])
        g_down = st.grads_layer[k] * _share(shape, plan, k, "mlp.down_proj")
        fetched = kept[k - 1] if (offload and k > 0) else 0  # offload: the next layer's, prefetched
        below = sum(on_gpu[:k]) + (kept[k] if ckpt else 0) + fetched + below_all
        live_copies = sum(copies[: k + 1]) if not ckpt else copies[k]
        half_attn = act.attn_half_bytes(p, layer, a, spec.lora_r) - (
            act.frozen_input_discount(p, layer, a) if (k == 0 and not embed_trains) else 0)
        # Gemma 4's per-layer input block, the first to run its backward (its tensors then freed), and the per-layer
        # inputs' gradient, summed over the layers so far (a whole one more while a layer's slice is summed in)
        ple, ple_grad = act.per_layer_input_bytes(p, layer, a, spec.lora_r), act.per_layer_inputs_grad_bytes(p, shape)
        grad = resid_grad + ple_grad
        held = grad if k < shape.layers - 1 else resid_grad  # before this layer's per-layer input's backward
        moments = [
            dict(gradients=max(g_acc, above + g_down), activations=below + saved[k] - ple - act.down_input_bytes(
                p, layer, a, spec.lora_r), temporaries=grad + act.mlp_backward_temp(p, layer, a) + temps[0]
                + act.tiled_shard_bytes(p, layer, a, spec.lora_r)),
            # the post-attention norm's backward: the MLP's gradients made, its input freed, the norm's fp32 input
            dict(gradients=max(g_acc, above + st.grads_layer[k] * _share(shape, plan, k, "mlp.")),
                 activations=below + half_attn + act.layer_norm_bytes(p, shape.hidden, trainable=False,
                                                                      gemma=shape.gemma_norms),
                 temporaries=grad + act.norm_backward_temp(p, shape.hidden)),
            dict(gradients=max(g_acc, above + st.grads_layer[k]), activations=below + half_attn,
                 temporaries=grad + act.attn_backward_temp(p, layer, a) + temps[1]),
        ]
        if ple:
            moments.append(dict(gradients=max(g_acc, above), activations=below + saved[k],
                                temporaries=held + ple_grad + act.norm_backward_temp(p, shape.hidden)))
        if shape.gemma_norms:  # Gemma's norm of the MLP's output runs its backward first, with the layer all saved
            moments.append(dict(gradients=max(g_acc, above), activations=below + saved[k] - ple,
                                temporaries=grad + act.norm_backward_temp(p, shape.hidden)))
        if ckpt:
            moments.append(dict(gradients=max(g_acc, above), activations=below + saved[k],
                                temporaries=held + act.layer_forward_temp(p, layer, a)))
        for m in moments:
            ph = _phase(**base, autocast_copies=live_copies, fsdp_buffers=fsdp_buffers, **m)
            if sum(ph.values()) > sum(worst.values()):
                worst = ph
    return worst


def _eval_phases(shape: ModelShape, spec: TrainSpec, base: dict, *, adapted, cached: int, head_copies: int,
                 fsdp_unit: int, tail: int, examples: int, budget: int | None, name: str) -> dict[str, dict[str, int]]:
    """A forward with no graph (evaluation; KTO's no-grad passes, `name` no_grad) of `examples` sequences (or a
    token `budget`): a layer's transients; then the hidden states, gathered, and a loss chunk."""
    e = make_pass(shape, spec, examples=examples, budget=budget)
    ce = act.loss_chunk(e, spec.loss_chunk_tokens)
    layer = max(act.eval_layer_bytes(e, shape.layer(i), adapted[i]) + act.all_to_all_temp(e, shape.layer(i))
                for i in range(shape.layers)) if shape.layer_shapes else \
        act.eval_layer_bytes(e, shape, adapted[-1]) + act.all_to_all_temp(e, shape)
    return {
        f"{name}_forward": _phase(**base, autocast_copies=cached, activations=act.mask_bytes(e, shape.masks),
                                  temporaries=layer, fsdp_buffers=fsdp_unit),
        f"{name}_loss": _phase(**base, autocast_copies=cached + head_copies,
                               temporaries=(e.tokens + e.loss_tokens) * shape.hidden * e.resid,
                               logits=act.chunk_eval_bytes(e, shape.head_outputs, ce, -(-e.loss_tokens // ce)),
                               fsdp_buffers=tail),
    }


def sampling_rows(spec: TrainSpec) -> int:
    """Completions the sampler decodes at once (model/fast_sample.py): the micro-batch's prompts x
    rl.num_generations, exactly (its cache and graphs are made for each rollout: no bucket of rows), or the eval's
    where it samples more (its batch of prompts x rl.num_generations_eval: on the group's first GPU alone); under
    sequence parallelism each GPU of the group draws its share of the rollout's (parallel/sequence/shards.
    shared_sampling; with rl.tools the first GPU draws them all: audit 35, 27% low where it was left out)."""
    every = spec.micro_batch * spec.sampled_batches if spec.tool_rounds else _rollout_rows(spec)
    return max(every, spec.eval_rows)


def _rollout_rows(spec: TrainSpec, *, drawn: bool = True) -> int:
    """The rollout's rows on one GPU: the micro-batch's sequences (drawn: the sampler's, the step's with
    rl.generation_batch=step; else those scored together), a sequence group's share of them."""
    return -(-spec.micro_batch * (spec.sampled_batches if drawn else 1) // spec.sequence_parallel)


def kv_cache_bytes(shape: ModelShape, spec: TrainSpec) -> int:
    """The sampler's static KV cache, allocated once a round: K and V of kv_heads x head_dim per layer in the compute
    dtype, for sampling_rows x (the longest prompt + rl.max_completion_tokens) positions (the sampler left-pads every
    prompt to the micro-batch's longest). Each layer's own heads (Gemma 4's); a layer sharing an earlier layer's keys
    and values holds none."""
    cd = spec.compute_bytes
    per_token = shape.summed(lambda layer: 0 if layer.kv_shared else 2 * layer.kv_heads * layer.head_dim)
    return sampling_rows(spec) * _cache_width(spec) * per_token * cd


def _cache_width(spec: TrainSpec) -> int:
    """The KV cache's positions a row: the longest prompt and rl.max_completion_tokens (the data's sequence length
    where the prompts are not known); with tool rounds (TrainSpec.tool_rounds) the longest prompt + completion so far
    and the most room left beside it, up to another max_completion_tokens."""
    extra = spec.max_completion_tokens if spec.tool_rounds else 0
    return (spec.prompt_longest + spec.max_completion_tokens if spec.prompt_longest else spec.seq_len) + extra


def generation_copy_bytes(shape: ModelShape, spec: TrainSpec, plan) -> int:
    """The fast sampler's merged generation copy (model/merged_copy.py; rl.merged_copy not off): each adapted
    linear's [out, in] weight in the compute dtype, whole on every GPU (under FSDP it is made from the gathered
    units; a 4-bit base's is dequantized; DoRA's too, its magnitudes folded in); under tensor parallelism a GPU's
    part of each split linear (the plan's shapes are a TP rank's: tensor_parallel_shape)."""
    if spec.merged_copy == "off" or plan is None or not spec.num_generations or not FAMILIES[
            shape.model_type].fast_sampler:  # the reference sampler runs the training model as it is
        return 0
    cd = spec.compute_bytes
    # (a mixture of experts' adapted router and experts are peft's parameter adapters: the router's merged by peft at
    # each forward, the experts' run beside them, model/lora_experts.py)
    per_layers = sum(i * o for layer in plan.adapted for name, (i, o) in layer.items() if name not in plan.moe_params)
    other = sum(i * o for i, o in plan.adapted_other.values())  # Gemma 4's projection of the embeddings
    return (per_layers + other + (shape.hidden * shape.vocab if plan.adapted_head else 0)) * cd


def _generation_phases(shape: ModelShape, spec: TrainSpec, base: dict, *, cached: int, fsdp_unit: int) -> dict:
    """Online RL's sampling, no graph and no gradients (freed by the previous step), beside the static KV cache
    (kv_cache_bytes; the merged generation copy, generation_copy_bytes, is added by the caller). The prefill runs
    once per distinct prompt (the micro-batch's prompts, not x num_generations), PREFILL_CHUNK positions at a time:
    a layer's transients over a chunk (Gemma 4's kv-sharing layers over each row's last position alone).
    Then each decode step: the logits of one token per row, and what the sampler makes of them over the vocabulary
    with the run's filters (act.sampler_bytes: its softmax, cumulative sum, nucleus sort, repetition penalty). (A
    mixture of experts' LoRA-adapted experts run unmerged, their adapters beside them: model/lora_experts.py;
    GPT-OSS's attention holds its scores over the cache: act.sink_sampling_bytes.)"""
    rows = sampling_rows(spec)
    # (tool rounds: a row's prompt and completion so far, each row prefilled: TrainSpec.tool_rounds; audit 35, the
    # sampling phases had been 42% low)
    width = (spec.prompt_longest or spec.prompt_tokens or spec.seq_len) + (
        spec.max_completion_tokens if spec.tool_rounds else 0)
    # the reference loop (rl.sampler reference, a model the fast sampler cannot run; pipeline stages): every row's
    # whole prompt at once, and a dynamic cache that grows by a copy (a layer's old and new keys and values at once)
    family = FAMILIES.get(shape.model_type)
    reference = spec.reference_sampler or family is None or not family.fast_sampler
    prompts = rows if reference or spec.tool_rounds else \
        max(1, spec.micro_batch // max(1, spec.num_generations)) * spec.sampled_batches
    chunk = max(2, width if reference else min(width, PREFILL_CHUNK))
    # the sampler's own attention, whatever the run trains with: SDPA over padded rows (GPT-OSS's: its scores, below)
    prefill = make_pass(shape, spec.but(seq_len=chunk, attn_implementation="sdpa", packing=False,
                                        micro_batch_tokens=None), examples=prompts)
    # Gemma 4's kv-sharing layers (its last ones, no cache of their own) run on the last position of a row alone
    last = make_pass(shape, spec.but(seq_len=1, attn_implementation="sdpa", packing=False, micro_batch_tokens=None),
                     examples=prompts) if any(shape.layer(i).kv_shared for i in range(shape.layers)) else prefill
    common = dict(**base, autocast_copies=cached, kv_cache=kv_cache_bytes(shape, spec), fsdp_buffers=fsdp_unit)
    # the reference loop's cache holds the prompts alone while it prefills them (the fast sampler's is allocated whole)
    early = ({**common, "kv_cache": common["kv_cache"] * width // max(width, _cache_width(spec))} if reference
             else common)
    # GPT-OSS's sinks: its scores over the cache (the prefill's last chunk reads the whole width; a decode step, the
    # cache), in attention, beside the layer's stream (its input, the embeddings, the residual, the normalised input)
    slots = width + spec.max_completion_tokens
    scores = act.sink_sampling_bytes(shape, prompts, chunk, width, prefill.cd)
    stream = 4 * prefill.tokens * shape.hidden * prefill.resid
    # DoRA's adapters unmerged (no generation copy) make their row norms at each forward, every decode step too
    plan = run_lora_plan(shape, spec)
    norms = max((act.dora_norms_temp(prefill, a) for a in plan.adapted), default=0) if (
        plan and spec.merged_copy == "off") else 0
    peft = plan.adapted if plan and reference else None  # the reference loop runs peft's layers, adapters beside
    return {"generation_prefill": _phase(**early, logits=prompts * shape.vocab * (prefill.cd + act.FP32),
                                         temporaries=max(*(act.eval_layer_bytes(
                                             last if shape.layer(i).kv_shared else prefill, shape.layer(i),
                                             peft[i] if peft else {}) for i in range(shape.layers)),
                                                         stream + scores if scores else 0, norms)),
            "generation": _phase(**common, logits=act.sampler_bytes(rows, shape.vocab, prefill.cd,
                                                                    **dict(spec.sampling)),
                                 temporaries=max(act.sink_sampling_bytes(shape, rows, 1, slots, prefill.cd), norms,
                                                 _cache_growth(shape, rows, slots, prefill.cd) if reference else 0))}


def _cache_growth(shape: ModelShape, rows: int, slots: int, cd: int) -> int:
    """The reference loop's dynamic cache at its last token: the largest layer's keys and values copied into tensors
    one position longer (torch.cat) while the old ones are alive."""
    return rows * slots * max(2 * shape.layer(i).kv_heads * shape.layer(i).head_dim for i in range(shape.layers)) * cd


def _plus(parts: dict[str, int], **more: int) -> dict[str, int]:
    """`parts` with `more` added, component by component."""
    return _phase(**{k: parts.get(k, 0) + more.get(k, 0) for k in [*parts, *(k for k in more if k not in parts)]})


def fp32_head_extra(shape: ModelShape, spec: TrainSpec, pd: int) -> int:
    """What rl.cast_lm_head_to_fp32 adds to FSDP's gathered head (and its unsharded gradient) over FSDP's param dtype
    `pd`: the head is a unit of its own gathered in fp32 (parallel/fsdp.head_in_fp32, pipeline stages' too)."""
    return shape.head_outputs * shape.hidden * (4 - pd) if spec.fp32_head else 0


def _loss_phases(p: act.Pass, shape: ModelShape, spec: TrainSpec, st: States, *, head_copies: int,
                 tail: int, fsdp_head: int, forward: dict[str, int], backward: dict[str, int],
                 head_adapter_r: int) -> dict[str, dict[str, int]]:
    """The loss's phases, chunk by chunk (llmtrain.model.loss), on top of what is alive around it: `forward`
    (inside the model's forward, whose autocast cache still holds its casts) and `backward` (after it).

    Backward runs the chunks last to first; the phases are those of a chunk run after another, when the
    head's weight gradient and the gathered hidden states' gradient, summed over the chunks so far, exist.
    A chunk's recompute holds the head's weight cast (head_copies) and the chunk's input cast until the
    head's backward has run. The head's weight gradient is made by each chunk in cd under autocast casts
    (all chunks share the forward's one cast, so their gradients meet before it), else in the weight's
    dtype; the engine sums the chunks' gradients out of place (the sum so far, the new one, the result),
    then the sum is cast to the fp32 gradient. FSDP does this on the unsharded tail unit (fsdp_head each).
    An adapter on the head (head_adapter_r) saves its chunk's tensors in the recompute."""
    V, H = shape.head_outputs, shape.hidden
    c = act.loss_chunk(p, spec.loss_chunk_tokens)
    head_adapter = act.lora_bytes(replace(p, rows=1, row_len=c), H, head_adapter_r) if head_adapter_r else 0
    several = p.loss_tokens > c
    h_grad = p.loss_tokens * H * p.resid if several else 0
    in_cast = c * H * p.cd if p.separate_casts else 0  # autocast's copy of the chunk's fp32 input
    if spec.fp32_head:  # rl.cast_lm_head_to_fp32: autocast off, the chunk's input cast to fp32 instead
        in_cast = c * H * act.FP32
    in_grad = c * H * p.resid  # the chunk's input gradient, from the head's backward to the gather's
    G = st.grads_head if not spec.sharded else 0
    Gw = G * p.cd // DTYPE_BYTES[spec.dtype] if p.separate_casts else G
    cast = G if p.separate_casts else 0  # the fp32 gradient cast from the cd one
    so_far, made = (Gw, 2 * Gw) if several else (0, Gw)  # at the head's backward of a chunk
    summed = max(3 * Gw, Gw + cast) if several else Gw + cast  # while the gradients are added and cast
    mm, add = (2, 3) if several else (1, 1)  # FSDP's unsharded head gradients at those two moments
    return {
        "loss": _plus(forward, autocast_copies=head_copies, logits=act.chunk_forward_bytes(p, V, c),
                      temporaries=in_cast, fsdp_buffers=tail),
        "backward_loss": _plus(backward, gradients=so_far, autocast_copies=head_copies,
                               logits=act.chunk_backward_bytes(V, c, p.cd if shape.logit_cap else 0),
                               temporaries=in_cast + h_grad + head_adapter,
                               fsdp_buffers=tail + (fsdp_head if several else 0)),
        "backward_lm_head": max(
            (_plus(backward, gradients=made, autocast_copies=head_copies,
                   logits=act.chunk_logits_grad_bytes(p, V, c, fp32_head=spec.fp32_head),
                   temporaries=in_cast + in_grad + h_grad, fsdp_buffers=tail + mm * fsdp_head),
             _plus(backward, gradients=summed, temporaries=in_grad + h_grad,
                   fsdp_buffers=tail + add * fsdp_head)), key=lambda ph: sum(ph.values())),
    }


def param_counts(shape: ModelShape, plan: LoraPlan | None) -> tuple[int, int]:
    """(total, trainable) parameters of the run: the model's, and with LoRA its adapters and copies, which peft adds."""
    trainable = shape.params_total if plan is None else plan.trainable(shape)
    return shape.params_total + (0 if plan is None else trainable), trainable


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
    total, trainable = param_counts(shape, plan)
    return Estimate(
        model=shape.source, spec=spec, params_total=total, params_trainable=trainable,
        per_gpu_peak_allocated_bytes=allocated, per_gpu_peak_reserved_bytes=reserved,
        per_gpu_peak_bytes=allocated + overhead, peak_phase=peak_phase, breakdown=breakdown, phases=totals,
        host_ram_bytes=host_ram_bytes(shape, spec, st), phase_parts=phases, notes=notes,
    )


def _notes(shape: ModelShape, spec: TrainSpec, p: act.Pass) -> tuple[str, ...]:
    notes = []
    if spec.max_completion_tokens:
        kind = "distillation (the student samples)" if spec.teacher is not None else "online RL"
        eval_more = spec.eval_rows > _rollout_rows(spec)  # rl.num_generations_eval's
        notes.append(f"{kind}: {spec.micro_batch} sequences a micro-batch ({spec.micro_batch // spec.per_example} "
                     f"prompts x {spec.num_generations}), each a prompt of {spec.prompt_tokens} tokens "
                     f"({spec.prompt_basis}) "
                     f"and up to {spec.max_completion_tokens} completion tokens (the loss trains the completions); "
                     f"sampled {sampling_rows(spec)} rows at once"
                     f"{' (the eval: its prompts x rl.num_generations_eval, more than a rollout)' if eval_more else ''}"
                     + (f" by the reference loop (every row's prompt prefilled at once), into transformers' cache "
                        f"growing to {kv_cache_bytes(shape, spec) / GIB:,.2f} GiB" if spec.reference_sampler else
                        f" into a static KV cache of {kv_cache_bytes(shape, spec) / GIB:,.2f} GiB")
                     + (" (this GPU's layers' share: each stage caches its own)" if spec.pipeline_parallel > 1 else ""))
    if spec.max_completion_tokens and spec.teacher is None:  # issue 53, item 14: measured, not yet modelled
        reserved, allocated = RL_RESERVED_MEASURED
        notes.append(f"online RL's reserved memory was measured at {reserved / allocated:.2f}x its allocated peak on "
                     "one H200 (Mistral-7B LoRA GRPO and RLOO, 8 prompts x 8 x 256 tokens, rl.micro_batch_tokens "
                     f"8192: {reserved:.2f} GiB reserved for {allocated:.2f} allocated), where this estimate's "
                     "reserved figure adds "
                     f"{ALLOCATOR_SLACK:.0%}: leave about a third of the allocated peak free beside it "
                     "(docs/memory.md, the sixth GPU run)")
    if spec.teacher is not None:
        where = ("whole on each GPU of the last stage, its hidden states of the window's "
                 f"{spec.grad_accum_steps} micro-batches kept there through the step" if spec.pipeline_parallel > 1
                 else f"sharded by FSDP over {spec.shards} GPUs like the student (its LM head whole on every GPU)"
                 if spec.sharded else "whole on every GPU")
        notes.append(f"the teacher ({spec.teacher.source}): {spec.teacher.params_total / 1e9:,.2f}B parameters in "
                     f"{spec.teacher_dtype}, {where}")
    notes += reward_model_notes(spec)
    if p.varlen_repeats_kv and shape.kv_heads < shape.heads:
        extra = 2 * p.tokens * (shape.heads - shape.kv_heads) * shape.head_dim * p.cd
        notes.append(f"this torch's varlen_attn is torch 2.10's (no window_size): K/V are repeated to all "
                     f"{shape.heads} heads, {extra / MIB:,.0f} MiB more saved per layer than with torch >= 2.11")
    if p.mask and spec.kernel == "sdpa":
        why = "a packed row" if spec.packed else ("padded rows" if p.rows > 1 else "the sliding window")
        notes.append(f"{why}: SDPA gets a 4-D mask, so it uses the memory-efficient kernel with K/V repeated "
                     "to all heads and a b*s*s bias saved per layer")
    if spec.packed and spec.kernel in ("sdpa", "eager"):
        notes.append(f"{spec.kernel} on a packed row of {p.tokens} tokens: transformers builds a {p.tokens} x "
                     f"{p.tokens} block-diagonal mask and attention scales with its square; "
                     "model.attn_implementation=varlen (the default, auto) attends per example instead")
    if spec.sequence_parallel > 1:
        n, kv = spec.sequence_parallel, sequence_kv_heads(spec.sequence_parallel, shape.kv_heads)
        split = f"{shape.kv_heads // n} K/V head(s) a GPU" if kv == shape.kv_heads else \
            f"each of the {shape.kv_heads} K/V heads repeated {n // shape.kv_heads} times, 1 a GPU"
        notes.append(f"sequence parallelism over {n} GPUs: each holds {p.tokens:,} of the micro-batch's "
                     f"{spec.tokens:,} tokens, and everything the micro-batch makes is counted at those; attention "
                     f"runs on the whole row with {shape.heads // n} query heads and {split}, after an all-to-all "
                     f"(one layer's buffers in flight: {act.all_to_all_temp(p, shape) / MIB:,.0f} MiB); weights, "
                     f"gradients and optimizer state are {spec.strategy}'s over all {spec.world} GPUs, and "
                     f"{spec.data_ranks} data-parallel rank(s) read different batches")
        if spec.num_generations:
            kind = "distillation" if spec.teacher is not None else "online RL"
            notes.append(f"{kind} under sequence parallelism: each GPU of the group samples 1/{n} of the "
                         "micro-batch's completions (its KV cache holds those rows; with rl.tools the first GPU "
                         "samples them all, as priced here), then each trains on its slice of every packed row"
                         + (", the teacher's forward too" if spec.teacher is not None else ""))
    if spec.tp > 1 and any(shape.tp_gathers):
        notes.append(f"tensor parallelism over {spec.tp} GPUs: each holds 1/{spec.tp} of every layer's linear weights "
                     f"(the fused qkv_proj and gate_up_proj by output rows, o_proj and down_proj by input columns), "
                     f"the embeddings, norms and LM head whole, all sharded by FSDP over {spec.shards} data-parallel "
                     f"ranks; the fused layers' outputs are gathered, so attention ({shape.heads} query heads) and "
                     "the MLP run whole on every GPU of a group, with the activations of one process")
    elif spec.tp > 1:
        e = shape.experts  # a mixture of experts has no dense MLP (Gemma 4's has one beside its experts)
        mlp = f" and {shape.intermediate} MLP columns" if e is None or e.beside else ""
        mlp += f" and {e.held} of its {e.count} experts" if e is not None else ""
        notes.append(f"tensor parallelism over {spec.tp} GPUs: each holds {shape.heads} query and {shape.kv_heads} KV "
                     f"heads{mlp} of every layer, the embeddings, norms and LM head "
                     f"whole, all sharded by FSDP over {spec.shards} data-parallel ranks; the residual stream's "
                     "activations are whole on every GPU of a group")
    if shape.experts:
        notes.append(_experts_note(shape, spec, p))
    if spec.strategy == "ddp" and spec.method == "full":
        notes.append("DDP buckets hold a second copy of every gradient (gradient_as_bucket_view=False)")
    if spec.grad_accum_steps > 1 and spec.sharded and spec.fsdp_accumulate == "unsharded":
        notes.append("every GPU holds the whole fp32 gradient between the micro-batches of a step "
                     "(train.fsdp_accumulate=unsharded); sharded, the default, holds only its shard")
    elif spec.grad_accum_steps > 1:
        held = "gradient shards" if spec.sharded else "gradients"
        notes.append(f"{held} stay allocated between the micro-batches of an accumulation window")
    if p.dora:
        notes.append(_dora_note(shape, spec, p))
    if spec.lora_dropout == 0 and spec.method == "lora" and spec.mixed_precision == "no":
        notes.append("lora.dropout=0 without autocast: LoRA inputs counted per adapter (peft shares them), "
                     "an overestimate")
    return tuple(notes)
