"""The set-up of a run, in the order train() calls it: each phase a plain function that returns a small frozen
object.

1. read_only_checks: a finished run, the output folder, whether the checkpoint can be resumed by this recipe;
2. seed_run: the seed (and train.deterministic);
3. prepare_data: tokenise (or read the cache), the shared data checks, the plan, the number of steps;
4. build_model: the model and its loss, laid out over the processes (parallel/parallelize.py), the optimizer and
   the schedule;
5. claim_run_dir: the FIRST write. Every check above only read, so a refused run leaves the folder byte for
   byte as it was;
6. restore: the TrainState, from the checkpoint when resuming.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from llmtrain import capabilities
from llmtrain.config import Recipe, tiled_mlp_shard, updates_per_window
from llmtrain.data.batching import DataPlan, packs_rows
from llmtrain.data.chat import data_tokenizer
from llmtrain.data.checks import check_context, check_data, check_epochs, check_warmup, data_plan, trained_text
from llmtrain.data.checks import total_steps as count_steps
from llmtrain.data.prepare import prepare_recipe
from llmtrain.errors import Everywhere, LLMTrainError, Stopped
from llmtrain.layout import Layout
from llmtrain.loop.determinism import deterministic_algorithms
from llmtrain.loop.rounds import round_problem
from llmtrain.loop.signals import StopRequests
from llmtrain.model.loss import attach_loss, causal_lm
from llmtrain.model.modeling import (
    build_optimizer,
    build_scheduler,
    compute_dtype,
    context_reach,
    count_parameters,
    describe_attention,
    dropout_off,
    embedding_rows,
    fused_linear_cross_entropy,
    load_model,
    load_model_config,
    load_tokenizer,
    pad_id,
    reapply_hyperparameters,
    recipe_hyperparameters,
    unadapted_experts,
    unquantized_experts,
)
from llmtrain.model.reference import (AdapterReference, Reference, StageCopy, adapter_off, copy_into, frozen_copy,
                                      saved_problem)
from llmtrain.model.score import attach_score
from llmtrain.model.teacher import load_teacher, teacher_problem
from llmtrain.objectives.objective import head_loss_for
from llmtrain.parallel.accelerator import use_fused_adamw
from llmtrain.parallel.collectives import agreed, any_process, device_sum, global_sum, main_first, on_main
from llmtrain.parallel.fsdp import receives_weights, shard_frozen, uses_fsdp
from llmtrain.parallel.groups import groups
from llmtrain.parallel.mesh import data_ranks, mesh_line, tensor_parallel_size
from llmtrain.parallel.parallelize import parallelize
from llmtrain.parallel.pipeline.checkpoint import read_stages
from llmtrain.parallel.sequence.shards import balance_sums
from llmtrain.run.checkpoint import later_than, load_checkpoint, lora_only_hooks, write_failure
from llmtrain.run.metrics import MetricsLog, flop_model, peak_flops
from llmtrain.run.preflight import check_resume, finished_run, input_files, inputs_changed
from llmtrain.run.rundir import RunDir, check_output_dir, claim_output_dir, has_checkpoints, inputs_inside
from llmtrain.run.state import TrainState
from llmtrain.run.trackers import open_trackers


def quiet_libraries() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()  # the run's own progress bar is the one to watch
    transformers.utils.logging.disable_progress_bar()


# --------------------------------------------------------------------------- 1. checks that only read


@dataclass(frozen=True)
class Checked:
    checkpoint: Path | None  # the checkpoint to resume from (None: start at step 0)
    notes: tuple[str, ...]  # allowed recipe changes at resume (--allow-recipe-change)
    finished: dict | None  # the summary of a run that is already complete with this recipe: nothing to do
    config: object = None  # the model's config (no weights), None where it cannot be read: said where it is loaded


def read_only_checks(recipe: Recipe, accelerator, *, resume: str | None, overwrite: bool,
                     allow_recipe_change: bool, say) -> Checked:
    out = Path(recipe.output_dir)
    if problem := inputs_inside(out, recipe.model_dump(mode="json"), resume=resume, overwrite=overwrite):
        raise Everywhere(problem)  # (every process reads the same folder and recipe)
    done = finished_run(out, recipe, allow_recipe_change=allow_recipe_change) if resume == "auto" else None
    if done is not None:
        further = ("Raise train.max_steps with --allow-recipe-change to train it further." if has_checkpoints(out)
                   else "It kept no checkpoint to continue from: to train it further, start a new run from its "
                   f"final weights (model.name_or_path={out}/final, another output_dir; a LoRA run's after "
                   f"`llmtrain export {out} --merge`).")
        say(f"the run in {out} is already complete ({done['steps']} steps, final/ written); nothing was changed. "
            + further)
        return Checked(checkpoint=None, notes=(), finished=done)
    # The recipe on this launch's layout was checked before the process group existed (build_accelerator); what the
    # layout and the recipe ask of the model itself (heads, layers, a tied embedding, a mixture of experts, what the
    # varlen attention computes) is checked now, from its config alone
    try:
        config = load_model_config(recipe.model)
    except LLMTrainError:  # a model that cannot be read is said where it is loaded (the tokenizer first)
        config = None
    if config is not None:
        capabilities.check_model(recipe, Layout.from_environment(recipe), config)
    if recipe.eval is not None:  # the benchmark at the end: its tasks and their data, before anything is written
        from llmtrain.run.benchmarks import check_recipe

        try:
            check_recipe(recipe)
        except LLMTrainError as e:  # the same recipe and tasks on every process: said once a node (audit 34)
            raise Everywhere(str(e)) from None
    ckpt = check_output_dir(accelerator, out, resume=resume, overwrite=overwrite)
    try:
        # the input files as the main process's disk has them: read once, its answer given to the others
        files = on_main(accelerator, partial(inputs_changed, ckpt, recipe), share=True) if ckpt else None
        notes = check_resume(ckpt, recipe, world=data_ranks(accelerator)[0], fsdp=uses_fsdp(accelerator),
                             allow_recipe_change=allow_recipe_change, files=files) if ckpt else []
        if ckpt and (problem := round_problem(ckpt, every=updates_per_window(recipe),
                                              processes=accelerator.num_processes)):
            raise LLMTrainError(problem)
        sync = capabilities.reference_sync(recipe)
        if ckpt and (problem := saved_problem(ckpt, every=sync.every_steps if sync else None)):
            raise LLMTrainError(problem)
    except LLMTrainError as e:  # the same checkpoint against the same recipe on every process: said once a node
        raise Everywhere(str(e)) from None
    if resume and ckpt is None:
        say(f"--resume {resume}: no complete checkpoint in {out}; starting from step 0.")
    return Checked(checkpoint=ckpt, notes=tuple(notes), finished=None, config=config)


# --------------------------------------------------------------------------- 2. seeding


def seed_run(tc, cleanup) -> None:
    """The same seed on every rank (identical init, which DDP checks anyway); torch's deterministic kernels (strict)
    and cuBLAS's fixed workspace for the run when train.deterministic (loop/determinism.py), before the model is
    built; the previous setting restored when `cleanup` closes."""
    from accelerate.utils import set_seed

    set_seed(tc.seed)
    if tc.deterministic:
        cleanup.enter_context(deterministic_algorithms())


def separate_draws(recipe: Recipe, accelerator, trainable, *, say) -> None:
    """After the model is built (its weights drawn alike everywhere): a sequence group's later processes and a
    pipeline's later stages each on a random stream of their own, so that dropout (LoRA's) draws other masks there
    (audit 31: every process of a group had dropped a row's halves alike, token j of each together, and stage 1 had
    reused stage 0's masks layer for layer). Under NEFTune a sequence group keeps its one stream: each process draws
    the whole row's noise from it and keeps its slice (model/neftune.py), and its dropout masks repeat across the
    slices (said at start-up). Tensor-parallel pairs keep theirs (they hold one computation). A checkpoint's resume
    restores each process's own stream."""
    sequence = groups(accelerator).sequence
    stage = min(trainable.pipeline.by_stage) if trainable.pipeline is not None else 0
    shared = recipe.train.neftune_alpha is not None
    k = (0 if shared else sequence.rank) + sequence.size * stage
    if k:
        torch.manual_seed(recipe.train.seed + 1_000_003 * k)
    if shared and sequence.size > 1 and recipe.lora and recipe.lora.dropout > 0 and not recipe.train.disable_dropout:
        say(f"warning (dropout): under NEFTune the {sequence.size} processes of a sequence group share one random "
            f"stream, so lora.dropout={recipe.lora.dropout:g} drops each process's slice of a row alike (token j of "
            "each together). Set lora.dropout: 0, or leave NEFTune out, for masks of their own.")


# --------------------------------------------------------------------------- 3. data


@dataclass(frozen=True)
class Data:
    tokenizer: object
    train: object  # the tokenised train set (datasets.Dataset: input_ids, labels, length)
    eval: object | None
    stats: dict  # split -> data.DataStats
    cache_reads: int  # processes that read the tokenised cache instead of tokenising
    pad_id: int
    plan: DataPlan  # every global micro-batch of each epoch
    total_steps: int
    packing_efficiency: float | None  # real tokens / token budget (token budgets only)
    reference_s: float = 0.0  # seconds spent computing a preference run's reference log-probabilities: run time


def prepare_data(recipe: Recipe, accelerator, *, say, config=None) -> Data:
    """Tokenised once on the main process, then read from the cache by the others; checked (`config`: the model's,
    read_only_checks', for its embedding's rows; None: unknown); planned."""
    tc = recipe.train
    # with data.chat_template's file: final/'s tokenizer renders as training did
    tokenizer = data_tokenizer(load_tokenizer(recipe.model), recipe.data)
    # the others read the main process's cache; its error (a bad row) is theirs too
    train_ds, eval_ds, stats, cache_hit = main_first(accelerator, lambda: prepare_recipe(recipe, tokenizer))
    (cache_reads,) = global_sum(accelerator, cache_hit)
    (world, _), accum, s = data_ranks(accelerator), tc.grad_accum_steps, stats["train"]  # world: data ranks
    tp = tensor_parallel_size(accelerator)
    mesh = mesh_line(accelerator.parallelism_config, tp)
    ranks = f"{world} data-parallel rank{'s' * (world != 1)}"
    if tp > 1:  # a tensor-parallel group reads one batch: the batch multiplies by the data-parallel ranks
        procs = f"{ranks} ({accelerator.num_processes} processes: {mesh})"
    elif (sp := recipe.parallel.sequence_parallel) > 1:  # so does a sequence group
        procs = f"{ranks} ({accelerator.num_processes} processes, each sequence over {sp})"
    elif (pp := recipe.parallel.pipeline_parallel) > 1:  # and a pipeline's stages
        procs = f"{ranks} ({accelerator.num_processes} processes: {pp} pipeline stages a data-parallel rank)"
    else:
        n = accelerator.num_processes
        procs = f"{n} process{'es' * (n != 1)}" + (f" ({mesh})" if mesh else "")
    unit = capabilities.unit_of(recipe)  # what a row and train.micro_batch_size count
    evals = f"eval: {stats['eval'].examples if 'eval' in stats else 0} {unit}"
    if "eval" in stats and (cut := stats["eval"]).dropped:  # the eval metrics leave these out: said (data.md)
        evals += (f" ({cut.dropped:,} dropped with no trained token within data.max_seq_len="
                  f"{recipe.data.max_seq_len}" + (f", {cut.truncated:,} truncated)" if cut.truncated else ")"))
    sampling = recipe.rl or recipe.distill  # what samples completions: rl.sampler / distill.sampler
    if sampling is not None:
        sixteen = copy_in_16_bits(recipe, fsdp=uses_fsdp(accelerator))
        sampler = sampler_text(sampling.sampler, accelerator.device, copy=sampling.merged_copy,
                               lora=recipe.lora is not None, four_bit=recipe.model.quantize is not None,
                               sixteen_bit=sixteen, split=tp > 1)
    if recipe.rl is not None:
        say(f"data: {s.examples} train {unit} ({cache_line(int(cache_reads), accelerator.num_processes)}), "
            f"{recipe.rl.num_generations} completions each a step, {recipe.rl.algorithm.upper()} "
            f"(rl.sampler={sampler}); {evals}")
    else:
        trained = trained_text(s, scored=recipe.reward_model is not None)
        say(f"data: {s.examples} train {unit} ({cache_line(int(cache_reads), accelerator.num_processes)}), "
            f"{s.truncated} truncated, {s.dropped} dropped, {trained}; {evals}")
    if recipe.data.sources is not None:
        from llmtrain.data.mixture import describe, source_sizes

        for line in describe(recipe.data, stats, source_sizes(train_ds["source"])):
            say(f"data source: {line}")
    rows = embedding_rows(recipe, tokenizer, config)
    for name, status, detail in check_data(recipe, s, train_ds, eval_ds, tokenizer, rows=rows):  # as `llmtrain doctor`
        if status == "fail":  # every process checks the same data: said once a node
            raise Everywhere(f"{name}: {detail}")
        if status == "warn":
            say(f"warning ({name}): {detail}")
    if (d := recipe.distill) is not None:  # the teacher's vocabulary and files, before either model's weights are read
        if problem := teacher_problem(recipe, tokenizer):  # the same files on every process: said once a node
            raise Everywhere(problem)
        say(f"distillation: teacher {d.teacher}, beta={d.beta:g} (0 forward KL, 1 reverse KL), temperature="
            f"{d.temperature:g}; the student samples the completions of {d.lmbda:.0%} of the steps (distill.lmbda; "
            f"distill.sampler={sampler}), the others train on the data's")
    plan = data_plan(recipe, train_ds["length"], world=world,
                     sources=train_ds["source"] if recipe.data.sources is not None else None)
    per_epoch = plan.steps_per_epoch(0, accum) * updates_per_window(recipe)  # the first epoch's, as said below
    total_steps = count_steps(recipe, train_ds["length"], world=world, plan=plan)  # as doctor counts them
    for name, status, detail in (check_warmup(tc.warmup_steps, total_steps)  # as `llmtrain doctor`
                                 + check_epochs(recipe, steps_per_epoch=per_epoch, examples=s.examples,
                                                sources=train_ds["source"] if recipe.data.sources is not None
                                                else None)):
        if status == "warn":
            say(f"warning ({name}): {detail}")
    efficiency = plan.packing_efficiency()
    if tc.micro_batch_tokens:
        say(f"global batch: bins of <= {tc.micro_batch_tokens} tokens x {accum} accumulation x {procs}; "
            f"{plan.bins()} bins/epoch, packing efficiency {efficiency:.1%} (real tokens / "
            f"budget); {total_steps} step{'s' if total_steps != 1 else ''} ({per_epoch}/epoch)")
    else:
        mb = tc.micro_batch_size
        say(f"global batch: {mb} micro-batch x {accum} accumulation x {procs} = "
            f"{mb * accum * world} {unit}/step"
            + (f" ({mb * accum * world * recipe.rl.num_generations} completions)" if recipe.rl else "")
            + (f", sampled every {recipe.rl.num_iterations} steps (rl.num_iterations: each round's completions "
               f"trained {recipe.rl.num_iterations} times)" if recipe.rl and recipe.rl.num_iterations > 1 else "")
            + f"; {total_steps} step{'s' if total_steps != 1 else ''} ({per_epoch}/epoch)")
    return Data(tokenizer=tokenizer, train=train_ds, eval=eval_ds, stats=stats, cache_reads=int(cache_reads),
                pad_id=pad_id(tokenizer), plan=plan, total_steps=total_steps, packing_efficiency=efficiency)


COPY_TEXT = {"rollout": "LoRA on a merged copy built each rollout", "kept": "LoRA on a merged copy kept between "
             "rollouts", "off": "LoRA unmerged"}


def copy_in_16_bits(recipe: Recipe, *, fsdp: bool) -> bool:
    """Whether the merged generation copy is made in 16 bits: it takes the dtype its base layer computes in
    (merged_copy._compute_dtype), the model's dtype, a 4-bit base's compute dtype (the mixed precision's, else the
    model's) and under FSDP the gathered units' (its mixed precision's param_dtype). An fp32 model with
    train.mixed_precision on one process or DDP keeps an fp32 copy (exact to rounding), whatever autocast does."""
    mixed = recipe.train.mixed_precision != "no"
    return "float16" in recipe.model.dtype or (mixed and (recipe.model.quantize is not None or fsdp))


def sampler_text(sampler: str, device, *, copy: str = "off", lora: bool = False, four_bit: bool = False,
                 sixteen_bit: bool = False, split: bool = False) -> str:
    """The sampler the run uses, for its header: graph replays static's step on CUDA only, and not of a model split
    by tensor parallelism (`split`: its layers' collectives run eagerly); with LoRA, what the fast sampler forwards
    the adapted linears through (rl.merged_copy), and what a 16-bit copy loses."""
    text = sampler
    if sampler == "graph" and split:
        text = "graph: static under tensor parallelism"
    elif sampler == "graph" and device.type != "cuda":
        text = "graph: static off CUDA"
    if lora and sampler != "reference":
        text += ", " + COPY_TEXT[copy]
        if copy != "off":
            text += " (4-bit dequantized where it fits)" if four_bit else ""
            text += (" in 16 bits: adapter changes under half a 16-bit step of a weight do not reach the samples; "
                     "rl.merged_copy=off samples the exact adapters" if sixteen_bit else "")
    return text


def cache_line(reads: int, world: int) -> str:
    """Where the tokenised data came from: the cache, or tokenised now (by the main process, the others reading)."""
    if reads == world:
        return "read from the tokenised cache"
    if world == 1:
        return "tokenised and cached"
    return f"tokenised by the main process and cached; read from the cache by the other {reads}"


# --------------------------------------------------------------------------- 4. model and optimizer


@dataclass(frozen=True)
class Trainable:
    model: object  # as prepared by Accelerate (DDP- or FSDP-wrapped)
    optimizer: object
    scheduler: object
    unwrapped: object  # the model Accelerate saves and loads: names carry no "module."
    trainable_names: frozenset[str] | None  # LoRA: the adapter's parameters (all a checkpoint saves)
    model_keys: frozenset[str]
    params_total: int
    params_trainable: int
    flops: object  # metrics.FlopModel
    peak_flops: float | None  # of one device, for MFU
    pipeline: object = None  # parallel.pipeline_parallel > 1: this process's stages and the schedule (Pipeline)


def check_memory(recipe: Recipe, accelerator, data: Data, *, say):
    """On a GPU: the estimate for this run on this card (online RL at its data's prompt lengths), said before the
    model loads when it does not fit, with what shrinks it; the run goes on (the estimate is a model, not a
    measurement). None on a CPU or where the model cannot be estimated."""
    if accelerator.device.type != "cuda":
        return None
    from llmtrain.memory import estimate_for_run
    from llmtrain.memory.fit import overflow_advice

    est = estimate_for_run(recipe, accelerator,
                           prompt_lengths=list(data.train["length"]) if recipe.rl is not None else None)
    if est is not None and not est.fits:
        say(f"warning (memory): llmtrain's estimate for this run is {est.per_gpu_peak_bytes / 2**30:.1f} GiB per "
            f"GPU, over this GPU's {est.spec.gpu_memory_gib:.1f} GiB, so it will likely run out of memory: "
            f"{overflow_advice(est)} (llmtrain estimate-memory RECIPE --fit names a configuration that fits)")
    return est


def memory_line(cfg, config, device: str = "cuda") -> str:
    """What the model does to save memory, for the start-up line: checkpointing, the offload, the tiled MLP, RoPE
    scaling (cfg: the recipe's model section; config: the model's; device: the run's device type: the offload
    saves GPU memory, none on a CPU)."""
    offload = (" (layer inputs offloaded to the host)" if device == "cuda" else
               " (model.activation_offload: copies layer inputs, but on a CPU the host is the device: nothing saved)")
    parts = ["gradient checkpointing" + (offload if cfg.activation_offload else "")
             ] if cfg.gradient_checkpointing else []
    if cfg.tiled_mlp:
        parts.append(f"MLP tiled in shards of {tiled_mlp_shard(cfg.tiled_mlp, config.hidden_size):,} tokens")
    if cfg.rope_scaling is not None:
        parts.append(f"RoPE {cfg.rope_scaling.rope_type} x{cfg.rope_scaling.factor:g} (a context of "
                     f"{context_reach(config):,})")
    return "; " + ", ".join(parts) if parts else ""


def build_model(recipe: Recipe, accelerator, *, total_steps: int, say, pad: int = 0) -> Trainable:
    tc = recipe.train
    # A quantised base is loaded (and quantised) by every process itself: 4-bit weights cannot be broadcast into an
    # empty model.
    # (agreed: a model one process cannot read, the main one under FSDP, is its paragraph on every process, not the
    # others' traceback of the broken connection at the broadcast it never reaches)
    model = agreed(accelerator, lambda: load_model(
        recipe.model, recipe.lora, device=accelerator.device,
        empty=(receives_weights(accelerator) and not recipe.model.quantize
               and recipe.parallel.pipeline_parallel == 1),  # stages: each loads, keeps its own
        compute_dtype=compute_dtype(tc.mixed_precision, accelerator.device),
        reward_head=recipe.reward_model is not None))
    if found := capabilities.loaded_model_problems(recipe, model):  # what its config does not say (sinks)
        raise LLMTrainError(capabilities.paragraph(found))
    if tc.disable_dropout:  # TRL's disable_dropout_in_model: lora.dropout's too
        dropout_off(model)
    # None unless liger is in use (and DFT's weighted loss is chunked llmtrain's)
    fused_ce = fused_linear_cross_entropy(recipe.model, accelerator.device) if tc.sft_loss == "nll" else None
    if recipe.reward_model is not None:  # a score head: one hidden state per sequence, no LM head, no logits
        fused_ce = None
        attach_score(model)
    else:
        sequence = groups(accelerator).sequence  # a sequence group's slices add the load-balancing loss's sums
        attach_loss(model, chunk=tc.loss_chunk_tokens, fused_linear_ce=fused_ce,
                    router_aux=recipe.model.router_aux_loss_coef,
                    balance_sums=partial(balance_sums, group=sequence.group) if sequence.size > 1 else None,
                    dft=tc.sft_loss == "dft", fp32_head=capabilities.fp32_head(recipe))
    if tc.neftune_alpha is not None:
        from llmtrain.model.neftune import attach_neftune

        sequence = groups(accelerator).sequence  # its slice of the group's row: the whole row's noise drawn
        attach_neftune(model, tc.neftune_alpha, sequence=(sequence.rank, sequence.size))
    for name, status, detail in check_context(recipe.data.max_seq_len, context_reach(model.config)):
        if status == "warn":  # as `llmtrain doctor`
            say(f"warning ({name}): {detail}")
    n_total, n_trainable = count_parameters(model)
    flops = flop_model(model)
    method = ("full" if recipe.lora is None else
              f"QLoRA: LoRA on a 4-bit {recipe.model.quantize} base" if recipe.model.quantize else "LoRA")
    if (whole := unquantized_experts(model))[0]:
        say(f"warning (model.quantize={recipe.model.quantize}): bitsandbytes quantizes linear layers, and this "
            f"{model.config.model_type} model's experts are 3-D parameters (every expert of a layer in one tensor), "
            f"so they stay {str(whole[2]).removeprefix('torch.')}: {whole[0]:,} of the base's "
            f"{n_total - n_trainable:,} weights, {whole[1] / 2**30:,.2f} GiB"
            f"{Layout.from_environment(recipe).each_holds()}. The base takes that "
            "much more memory than a 4-bit one would; LoRA trains as asked")
    if recipe.lora is not None and (unadapted := unadapted_experts(model))[0]:
        say(f"note (lora): this {model.config.model_type} model's experts ({unadapted[0]:,} of the base's "
            f"{n_total - n_trainable:,} weights) are 3-D parameters that lora.target_modules does not reach, so LoRA "
            f"adapts its other layers only; lora.target_parameters: [{', '.join(unadapted[1])}] adapts them too "
            "(with lora.dropout: 0)")
    attention = describe_attention(recipe.model, packed=packs_rows(recipe), sinks=capabilities.has_sinks(model))
    say(f"model: {n_total:,} parameters, {n_trainable:,} trainable ({method}); "
        f"attention: {attention}{'; liger kernels' if fused_ce else ''}"
        + memory_line(recipe.model, model.config, accelerator.device.type)
        + (f"; NEFTune noise on the input embeddings in training (alpha {tc.neftune_alpha:g})"
           if tc.neftune_alpha is not None else "")
        + ("; train.deterministic: strict deterministic kernels (flash attention's deterministic backward, "
           "cuBLAS workspace " + os.environ.get("CUBLAS_WORKSPACE_CONFIG", "?") + ")" if tc.deterministic else ""))
    lora = recipe.lora
    lora_plus = {} if lora is None else {"lora_lr_ratio": lora.lr_ratio, "lora_lr_embedding": lora.lr_embedding}
    whole = None
    if recipe.parallel.pipeline_parallel > 1:
        whole = stage_names(model, lora=recipe.lora is not None)
    laid = parallelize(model, recipe, accelerator, pad_id=pad, say=say,
                       head_loss=head_loss_for(recipe, model=model, reduce=partial(device_sum, accelerator)),
                       make_optimizer=partial(build_optimizer, lr=tc.lr, weight_decay=tc.weight_decay,
                                              betas=tc.betas, eps=tc.eps, fused=use_fused_adamw(accelerator),
                                              kind=tc.optimizer, **lora_plus))
    model, optimizer, stages = laid.model, laid.optimizer, laid.pipeline
    # on the torch optimizer itself, not Accelerate's wrapper of it
    scheduler = build_scheduler(getattr(optimizer, "optimizer", optimizer), tc, total_steps=total_steps)
    unwrapped = accelerator.unwrap_model(model)
    trainable_names = (frozenset(n for n, p in unwrapped.named_parameters() if p.requires_grad)
                       if recipe.lora else None)
    if trainable_names:
        lora_only_hooks(accelerator, set(trainable_names))
    model_keys = frozenset(unwrapped.state_dict())
    if whole is not None:
        model_keys, trainable_names = whole
    return Trainable(model=model, optimizer=optimizer, scheduler=scheduler, unwrapped=unwrapped,
                     trainable_names=trainable_names, model_keys=model_keys,
                     params_total=n_total, params_trainable=n_trainable, flops=flops,
                     peak_flops=peak_flops(accelerator.device, recipe.logging.peak_tflops), pipeline=stages)


def stage_names(model, *, lora: bool) -> tuple[frozenset[str], frozenset[str] | None]:
    """The whole model's parameter names, before this process drops the stages it does not hold: what a pipeline
    checkpoint's stage files hold between them (the adapter's alone for LoRA). A head tied to the embeddings is named
    twice: the first stage saves the embedding and the last its copy as the head (listed once, a tied model's
    checkpoint had failed its verification with one weight more than the model: audit 45)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return (frozenset(n for n, _ in named),
            frozenset(n for n, p in named if p.requires_grad) if lora else None)


def build_teacher(recipe: Recipe, accelerator, trainable: Trainable, tokenizer, *, say):
    """Distillation's teacher (None for other modes): whole on this process's device, or under FSDP sharded as the
    student is (fsdp.shard_frozen), the main process reading the weights and the others receiving their shards; on
    pipeline stages whole on the last stage's processes alone, each reading it, an FSDP launch's too (its loss runs
    it there, no collective: distill.StageDistill), None on the others."""
    if recipe.distill is None:
        return None
    if trainable.pipeline is not None and trainable.pipeline.last is None:  # the last stage's processes hold it
        return None
    if not uses_fsdp(accelerator) or trainable.pipeline is not None:
        return _teacher_attention(recipe, load_teacher(recipe, tokenizer, device=accelerator.device), trainable)
    # the main process reads it, the others receive their shards: its refusal reaches them (agreed)
    teacher = agreed(accelerator, lambda: load_teacher(recipe, tokenizer, device=None,
                                                       empty=not accelerator.is_main_process))
    _teacher_attention(recipe, teacher, trainable)
    say(f"teacher: sharded like the student, {_sharded(teacher, trainable, accelerator)}")
    return teacher


def _sharded(frozen, trainable: Trainable, accelerator, *, weights: bool = True) -> str:
    """A frozen model (the teacher, a full fine-tune's reference) sharded as the policy is (fsdp.shard_frozen; its
    weights=False: left for the caller to fill), and what the main process holds of it, in words."""
    held = shard_frozen(frozen, trainable.unwrapped, accelerator, weights=weights)
    total = sum(p.numel() for p in frozen.parameters())  # DTensors count their whole shape
    return f"{held:,} of its {total:,} parameters on the main process (the LM head whole)"


def _teacher_attention(recipe: Recipe, teacher, trainable: Trainable):
    """Under sequence parallelism the teacher reads the student's slices of each row, so it attends as the student
    does (the group's all-to-all around the varlen attention), its heads split the same way (refused, naming the
    teacher, where they cannot be)."""
    if (n := recipe.parallel.sequence_parallel) > 1:
        config = causal_lm(teacher).config
        if problem := capabilities.sequence_config_problem(n, config, whose="its"):
            raise LLMTrainError(f"the teacher {recipe.distill.teacher}: {problem}")
        config._attn_implementation = causal_lm(trainable.unwrapped).config._attn_implementation
    return teacher


def build_reference(recipe: Recipe, accelerator, trainable: Trainable, *, say):
    """A full fine-tune's frozen reference (capabilities.reference_copy: KTO, preference.reference copy, online RL
    with rl.beta > 0), as a model/reference.Reference with the mode's sync_reference; with LoRA and sync_reference
    the adapter's snapshots (AdapterReference); None for other runs (LoRA's reference is its own model with the
    adapter disabled). Pipeline stages: each process copies its own stages' weights (reference.StageCopy). One
    process and DDP copy the policy before it trains (reference.frozen_copy); under FSDP every process builds the
    model empty, shards it as the policy is (fsdp.shard_frozen: every decoder layer a unit gathered for its forward,
    the LM head whole) and takes the policy's starting weights into its shards (reference.copy_into: its own shards
    where the two are sharded alike, each weight gathered once where not, nothing read again), frozen, in eval mode,
    with the policy's loss forward (its trained positions through the head chunk by chunk) and its attention (a
    sequence group's, if any). A whole copy on every process is what FSDP is there to avoid. Made before a resume
    loads its checkpoint: a resume's reference is the starting weights, or the checkpoint's where sync_reference has
    moved it (Reference.restore)."""
    sync = capabilities.reference_sync(recipe)
    if recipe.lora is not None and sync is not None:  # (capabilities: alpha 1)
        say(f"reference: the model with its adapter disabled, then every {sync.every_steps} steps the adapter as it "
            "was then (TR-DPO's hard update)")
        # RLOO's KL runs it in the rollout, where FSDP holds the policy gathered: the snapshot whole too
        stages = trainable.pipeline.modules if trainable.pipeline is not None else ()
        moving = AdapterReference(trainable.unwrapped, sync, stages=stages,
                                  whole=uses_fsdp(accelerator) and capabilities.rollout_adapter(recipe) and not stages)
        if trainable.pipeline is not None:  # each stage's snapshot of its own part, run by the stages' reference passes
            trainable.pipeline.head_loss.follow(moving, trainable.unwrapped)
        return moving
    if not capabilities.reference_copy(recipe):
        return None
    mixed = f"; every {sync.every_steps} steps it takes alpha={sync.alpha:g} of the policy (TR-DPO)" if sync else ""
    if trainable.pipeline is not None:  # each process a copy of its stages' part, run by the stages' reference passes
        say(f"reference: each stage's copy of its own starting weights, exchanged into them for its passes{mixed}")
        copied = StageCopy(trainable.unwrapped, sync, stages=trainable.pipeline.modules)
        trainable.pipeline.head_loss.follow(copied, trainable.unwrapped)
        return copied
    if not uses_fsdp(accelerator):
        say(f"reference: a frozen copy of the starting weights{mixed}")
        return Reference(frozen_copy(trainable.unwrapped, whose=capabilities.MODES[capabilities.mode_of(recipe)].name),
                         sync)
    reference = load_model(recipe.model, None, device=None, empty=True)  # nothing read: the policy's weights next
    attach_loss(reference, chunk=recipe.train.loss_chunk_tokens)
    causal_lm(reference).config._attn_implementation = causal_lm(trainable.unwrapped).config._attn_implementation
    held = _sharded(reference, trainable, accelerator, weights=False)
    copy_into(reference, trainable.unwrapped)
    say(f"reference: the starting weights, sharded like the policy (copied from its shards), {held}{mixed}")
    return Reference(reference.eval(), sync)


def reference_logps(recipe: Recipe, accelerator, data: Data, trainable: Trainable, objective, *, console) -> Data:
    """Preference runs with a precomputed reference (a full fine-tune's dpo or ipo; any on pipeline stages): the
    reference log-probabilities from the initial weights (LoRA: the adapter disabled) of the pairs the run will train
    on (all of them, unless max_steps ends it before the epoch does) and of every eval pair, added to the data as
    columns ref_chosen, ref_rejected. Cached next to the tokenised data, keyed by the model, so a resume or a later
    run computes only what is missing. Shown with a progress bar and its eta (lines every tenth where there is no
    bar); its time counts in the run's. On pipeline stages, M micro-batches a pass through them. Any other run:
    the data as it is."""
    if getattr(objective, "reference", None) != "precomputed":
        return data
    import time

    from llmtrain.objectives.preference import precompute_reference

    tc, say, start = recipe.train, console.say, time.perf_counter()
    # LoRA (on pipeline stages, or asked for): the reference is the model with its adapter disabled, as it is for
    # preference.reference=adapter, whatever the adapter's weights are now
    off = partial(adapter_off, trainable.unwrapped) if recipe.lora is not None else nullcontext
    needed = {"train": data.plan.examples_in(data.total_steps, tc.grad_accum_steps), "eval": None}
    splits = {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}
    key = model_key(recipe)
    for name, ds in splits.items():
        cache = Path(ds.cache_files[0]["filename"]).parent.parent / f"reference-{name}-{key}.pt"
        pairs = len(ds) if needed[name] is None else len(needed[name])
        progress, task = console.progress(total=0, completed=0)
        progress.update(task, description=f"reference ({name})", info=f"{pairs} pairs")
        tenths = [0]  # tenths of the pass said so far

        def on_batch(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
            if not console.show_bar and done * 10 // total > tenths[0]:  # a log, not a terminal: a line a tenth
                tenths[0] = done * 10 // total
                spent = time.perf_counter() - begun
                say(f"reference log-probabilities ({name}): {done}/{total} micro-batches, {spent:.0f} s, eta "
                    f"{spent / done * (total - done):.0f} s")

        begun = time.perf_counter()
        with progress, StopRequests(doing="finishing this batch of the reference pass, then keeping what it "
                                    "computed") as asked:
            # pipeline stages: the token budget's rows, their one fixed shape (train.eval_batch_size is read only
            # with an eval there, and refused with one)
            staged = trainable.pipeline is not None
            values = precompute_reference(trainable.model, ds, accelerator, objective, batch_size=tc.eval_rows,
                                          batch_tokens=tc.micro_batch_tokens if staged else tc.eval_tokens,
                                          cache=cache, needed=needed[name], on_batch=on_batch,
                                          pipeline=trainable.pipeline, adapter_off=off,
                                          stop_signal=lambda: asked.signum)
            if any_process(accelerator, bool(asked.signum)):  # after its last vote, or with every pair cached
                signum = asked.signum or signal.SIGTERM
                raise Stopped(f"{signal.Signals(signum).name} during the reference log-probabilities: every pair "
                              f"the run uses is cached in {cache}; the same command trains without computing them "
                              "again", signum)
        say(f"reference log-probabilities of the {pairs} {name} pairs the run uses (of {len(ds)}): "
            f"{time.perf_counter() - begun:.1f} s, cached in {cache}")
        splits[name] = ds.add_column("ref_chosen", values[:, 0].tolist()).add_column("ref_rejected",
                                                                                    values[:, 1].tolist())
    return dataclasses.replace(data, train=splits["train"], eval=splits.get("eval"),
                               reference_s=time.perf_counter() - start)


def model_key(recipe: Recipe) -> str:
    """What fixes the reference's numbers: the model's files (or hub id), its dtype, precision and attention, and
    preference.ld_alpha where set (the tokens' weights in each sum); where set, the weights made from the seed instead
    of the files (model.random_init), the rotary embedding's scaling, the tokens added to the vocabulary and the
    kernels. (Those four joined the key 2026-12-06: a DPO run after a random_init check of its recipe had read the
    random model's reference.)"""
    import hashlib

    m, h = recipe.model, hashlib.sha256()
    h.update(json.dumps([m.name_or_path, m.dtype, m.attn_implementation, recipe.train.mixed_precision,
                         recipe.train.loss_chunk_tokens]).encode())
    if recipe.preference is not None and recipe.preference.ld_alpha is not None:
        h.update(f"ld_alpha={recipe.preference.ld_alpha}".encode())
    if m.quantize is not None:  # a QLoRA run's reference: the 4-bit base
        h.update(f"quantize={m.quantize}".encode())
    if m.random_init:  # (each only where set: a recipe without them keeps the key its cache was written with)
        h.update(f"random_init seed={recipe.train.seed}".encode())
    if m.rope_scaling is not None:
        h.update(f"rope_scaling={json.dumps(m.rope_scaling.model_dump(mode='json'), sort_keys=True)}".encode())
    if m.new_tokens:
        h.update(f"new_tokens={json.dumps(m.new_tokens)}".encode())
    if m.kernels != "auto":
        h.update(f"kernels={m.kernels}".encode())
    folder = Path(m.name_or_path)
    for f in sorted(q for q in folder.rglob("*") if q.is_file()) if folder.is_dir() else []:
        st = f.stat()
        h.update(f"{f.relative_to(folder)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- 5. the first write


def claim_run_dir(recipe: Recipe, accelerator, console, *, checkpoint: Path | None, resume: str | None,
                  overwrite: bool) -> RunDir:
    """Take the run folder (its lock; --overwrite empties it) and write the resolved recipe and train.log.
    Refused if the checkpoint found under the lock is not the one the checks above judged."""
    out = Path(recipe.output_dir)
    run_dir = claim_output_dir(accelerator, out, resume=resume, overwrite=overwrite, expected=checkpoint)
    if accelerator.is_main_process:
        # written whole or not at all: a full disk had cut a resumed run's recipe.yaml short, which generate, export
        # and eval of the run then could not read (audit 46)
        tmp = out / "recipe.yaml.tmp"
        try:
            tmp.write_text(recipe.to_yaml(working_dir=os.getcwd()))
            tmp.replace(out / "recipe.yaml")
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise LLMTrainError(f"cannot write {out / 'recipe.yaml'}: {write_failure(e, out)}. The run's files are "
                                "as they were; free space there and start it again.") from None
        console.keep_log(out / "train.log")
    return run_dir


def set_aside_summary(out: Path, *, resumed: bool) -> None:
    """A finished run trained on (more steps with --allow-recipe-change, or from an older checkpoint): its
    summary.json, which no longer describes the run, renamed summary-step_N.json (N its steps). A stop had left it
    beside the new recipe.yaml, and `--resume auto`, the command the stop prints, called the run complete with its old
    final/ (audit 27); the run's end writes summary.json and final/ again. Called once the checkpoint is restored
    (a resume refused while it loads leaves the run as it was)."""
    summary = out / "summary.json"
    if not (resumed and summary.is_file()):
        return
    try:
        steps = int(json.loads(summary.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        steps = 0
    summary.replace(out / f"summary-step_{steps:06d}.json")


# --------------------------------------------------------------------------- 6. the state to start from


def restore(recipe: Recipe, accelerator, trainable: Trainable, *, checkpoint: Path | None, say,
            objective=None) -> TrainState:
    """The TrainState, and with it (registered for Accelerate's checkpoints) the scheduler's and whatever state the
    objective keeps between steps (`checkpointed`: GRPO's adaptive entropy coefficient), from `checkpoint`."""
    tc, (world, _) = recipe.train, data_ranks(accelerator)  # data ranks: a tensor-parallel group reads one batch
    state = TrainState(examples_per_micro=0 if tc.micro_batch_tokens else tc.micro_batch_size * world,
                       processes=world, micro_batch_tokens=tc.micro_batch_tokens or 0)
    accelerator.register_for_checkpointing(trainable.scheduler, state, *getattr(objective, "checkpointed", ()))
    if checkpoint is not None:
        _restore_from(recipe, accelerator, trainable, state, checkpoint, say=say)
    # what this run trains from now, saved with its checkpoints (train_state.json: the main process's), and on
    state.inputs = input_files(recipe) if accelerator.is_main_process else {}
    state.tensor_parallel = tensor_parallel_size(accelerator)
    return state


def _restore_from(recipe: Recipe, accelerator, trainable: Trainable, state: TrainState, checkpoint: Path, *,
                  say) -> None:
    """restore's resume: the checkpoint read into the model, the optimizer and `state`."""
    tc, (world, _) = recipe.train, data_ranks(accelerator)
    names = set(trainable.trainable_names) if trainable.trainable_names else None
    built = recipe_hyperparameters(trainable.scheduler)  # the checkpoint's groups replace them: put back after
    load_checkpoint(accelerator, checkpoint, trainable_names=names)
    if trainable.pipeline is not None:  # this process's stages, by name, from every stage's file; a refusal of one
        # stage's (8-bit moments on other shards: its head's, where the first stage's embedding has 32-bit ones) is
        # every process's paragraph, not the others' broken connection at the first step
        agreed(accelerator, lambda: read_stages(checkpoint, trainable.unwrapped, trainable.optimizer,
                                                trainable_only=recipe.lora is not None))
    reapply_hyperparameters(trainable.scheduler, built)
    state.check_layout(accum=tc.grad_accum_steps, micro_batch_tokens=tc.micro_batch_tokens or 0, processes=world)
    say(f"resumed from {checkpoint} at step {state.step}")
    if later := later_than(checkpoint.parent, state.step):  # on the main process's disk; the same on each node's
        say(f"note: {', '.join(p.name for p in later)} {'are' if len(later) > 1 else 'is'} of the run this resume "
            f"goes back on (or damaged), and {'are' if len(later) > 1 else 'is'} removed at this run's first "
            "checkpoint (or at its end), so that --resume auto continues this run")
    if state.processes != world:
        say(ranks_note(recipe, state.processes, world))
        state.processes = world


def ranks_note(recipe: Recipe, was: int, world: int) -> str:
    """A resume on another number of data-parallel ranks: each rank restores its own RNG file (with more ranks than
    saved, the new ones start from the seed); KTO's KL term pairs each rank's completions with another prompt of the
    same rank's micro-batch, so its value depends on how the global batch is split, in an uninterrupted run too (the
    note had said only dropout differs; audit 57)."""
    return (f"note: written by {was} data-parallel rank{'s' * (was != 1)}, resumed on {world} (a tensor-parallel "
            "group is one rank): the same examples per step, but per-rank random streams (dropout) do not replay the "
            "original run's" + (", and KTO's KL estimate, taken over each rank's micro-batch, is another one (as on "
                                 f"{world} rank{'s' * (world != 1)} from the start)" if recipe.kto is not None else "")
            + ".")


def open_log(recipe: Recipe, accelerator, state: TrainState, *, resumed: bool, notes: tuple[str, ...],
             say) -> MetricsLog:
    """metrics.jsonl (lines after the checkpoint dropped on resume) and the trackers of logging.report_to."""
    out = Path(recipe.output_dir)
    resume_step = state.step if resumed else None
    trackers = (open_trackers(recipe.logging.report_to, output_dir=out, config=recipe.model_dump(mode="json"),
                              project=recipe.logging.project, run_name=recipe.logging.run_name,
                              resume_step=resume_step)
                if accelerator.is_main_process else [])
    log = MetricsLog(out, enabled=accelerator.is_main_process, trackers=trackers, resume_step=resume_step)
    for note in notes:  # allowed recipe changes at resume (--allow-recipe-change): said, and on record
        say(f"note: {note}")
        log.write({"type": "note", "step": state.step, "note": note})
    return log
