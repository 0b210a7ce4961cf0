"""`llmtrain estimate-memory`: the per-GPU peak of a recipe's run (or a model's), and `--fit`.

Only typer and the standard library are imported at module level, so `llmtrain --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from llmtrain.errors import LLMTrainError
from llmtrain.memory.params import PRESETS

# Options that describe the training run, and the recipe key that sets each in a recipe.
RUN_OPTIONS = {
    "method": "a lora section (e.g. lora.r=16)", "lora_r": "lora.r", "lora_dropout": "lora.dropout",
    "dora": "lora.dora", "lora_target_parameters": "lora.target_parameters",
    "micro_batch": "train.micro_batch_size",
    "micro_batch_tokens": "train.micro_batch_tokens", "grad_accum": "train.grad_accum_steps",
    "seq_len": "data.max_seq_len", "packing": "data.packing", "loss_chunk_tokens": "train.loss_chunk_tokens",
    "grad_checkpointing": "model.gradient_checkpointing", "dtype": "model.dtype",
    "mixed_precision": "train.mixed_precision", "attn": "model.attn_implementation", "quantize": "model.quantize",
    "activation_offload": "model.activation_offload", "tiled_mlp": "model.tiled_mlp",
    "sequence_parallel": "parallel.sequence_parallel", "optimizer": "train.optimizer",
}
# The options whose TrainSpec field is named after its recipe key, not after the (shorter) option.
SPEC_FIELDS = {"grad_accum": "grad_accum_steps", "grad_checkpointing": "gradient_checkpointing",
               "attn": "attn_implementation", "dora": "lora_dora"}
# What `--method lora` without --dtype assumes: every shipped LoRA recipe keeps its frozen base in bf16.
LORA_BASE_DTYPE = "bfloat16"
# The exit status when the run does not fit (with --fit: when no configuration fits the GPUs), so that a script can
# tell it from a fit (0), bad input (2, LLMTrainError) and a crash (1); 3 is finetune's divergence (errors.py).
DOES_NOT_FIT = 4


def _method(value: str | None) -> str | None:
    """--method: full or lora; QLoRA is named with its two flags."""
    if value is None or value in ("full", "lora"):
        return value
    hint = ": QLoRA is --method lora --quantize nf4" if value.lower() in ("qlora", "q-lora", "nf4") else ""
    raise typer.BadParameter(f"'{value}' is not one of 'full', 'lora'{hint}")


def estimate_memory(
    recipe: Annotated[Optional[Path], typer.Argument(metavar="RECIPE.yaml",
                                                     help="YAML recipe to estimate (or use --model).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE",
                                                             help="Dotted recipe overrides, as for finetune.")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", metavar="MODEL", help="Estimate from a model's config.json alone: a directory, a config.json, a "
        f"preset ({', '.join(PRESETS)}) or a hub id.")] = None,
    method: Annotated[Optional[str], typer.Option(
        metavar="full|lora", callback=lambda value: _method(value),
        help="Full fine-tune or LoRA (QLoRA: --method lora --quantize nf4).")] = None,
    lora_r: Annotated[Optional[int], typer.Option(help="LoRA rank (all linear layers but the LM head).")] = None,
    lora_dropout: Annotated[Optional[float], typer.Option(
        min=0.0, max=1.0, help="LoRA dropout (lora.dropout; default 0.05): above 0 each adapter keeps its own dropped "
        "copy of its input for backward; long-context recipes set 0.")] = None,
    dora: Annotated[Optional[bool], typer.Option(
        "--dora/--no-dora", help="DoRA beside the LoRA adapters (lora.dora): a magnitude per output row, the base "
        "and adapter outputs kept for backward, each weight's row norms made in every forward.")] = None,
    lora_target_parameters: Annotated[Optional[list[str]], typer.Option(
        metavar="NAME", help="A parameter LoRA adapts beside the linear layers (lora.target_parameters; once "
        "each): GPT-OSS's experts, mlp.experts.gate_up_proj and mlp.experts.down_proj.")] = None,
    strategy: Annotated[Optional[Literal["single", "ddp", "fsdp", "hsdp"]], typer.Option(
        help="single GPU, DDP (whole model per GPU), FSDP (sharded over every GPU) or HSDP (sharded over a "
        "node's GPUs, replicated across nodes).")] = None,
    num_gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs per node.")] = None,
    num_nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes.")] = None,
    micro_batch: Annotated[Optional[int], typer.Option(help="Examples per forward pass on each GPU.")] = None,
    micro_batch_tokens: Annotated[Optional[int], typer.Option(
        help="Token budget of a micro-batch (train.micro_batch_tokens): whole examples packed into one row of at "
        "most this many tokens, instead of --micro-batch examples.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option(help="Micro-batches per optimizer step.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per example (data.max_seq_len).")] = None,
    packing: Annotated[Optional[bool], typer.Option(
        "--packing/--no-packing", help="Pack a micro-batch into one row (always so with varlen attention or "
        "a token budget).")] = None,
    loss_chunk_tokens: Annotated[Optional[int], typer.Option(
        help="Tokens the loss sends through the LM head at a time (train.loss_chunk_tokens).")] = None,
    grad_checkpointing: Annotated[Optional[bool], typer.Option(
        "--grad-checkpointing/--no-grad-checkpointing", help="Recompute layer activations in backward.")] = None,
    activation_offload: Annotated[Optional[bool], typer.Option(
        "--activation-offload/--no-activation-offload", help="Checkpointed layers' inputs in pinned host memory "
        "(model.activation_offload; needs --grad-checkpointing).")] = None,
    tiled_mlp: Annotated[Optional[bool], typer.Option(
        "--tiled-mlp/--no-tiled-mlp", help="The MLP over shards of hidden-size tokens (model.tiled_mlp=true).")] = None,
    optimizer: Annotated[Optional[Literal["adamw", "adamw_8bit"]], typer.Option(
        help="train.optimizer: AdamW's two moments in the parameters' dtype, or 8-bit (bitsandbytes).")] = None,
    dtype: Annotated[Optional[Literal["float32", "bfloat16", "float16"]], typer.Option(
        help="Storage dtype of the weights (default: float32, and bfloat16 for a LoRA base).")] = None,
    mixed_precision: Annotated[Optional[Literal["no", "bf16", "fp16"]], typer.Option(
        help="Autocast precision.")] = None,
    quantize: Annotated[Optional[Literal["nf4", "fp4"]], typer.Option(
        help="QLoRA: the base's decoder linears in 4 bits (with --method lora).")] = None,
    attn: Annotated[Optional[Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"]], typer.Option(
        help="Attention implementation (model.attn_implementation; auto is varlen).")] = None,
    sequence_parallel: Annotated[Optional[int], typer.Option(
        "--sequence-parallel", help="GPUs that share each micro-batch's tokens (parallel.sequence_parallel: Ulysses; "
        "the micro-batch is the group's, 1/N of it on each GPU; must divide the GPUs and the heads).")] = None,
    pipeline_parallel: Annotated[Optional[int], typer.Option(
        "--pipeline-parallel", help="Pipeline stages (parallel.pipeline_parallel P): the GPUs form P groups of "
        "GPUs / P, each running a stage's layers with --strategy inside it; grad_accum micro-batches a step. Each "
        "stage's memory is shown, and the step time beside FSDP and HSDP.")] = None,
    pipeline_schedule: Annotated[Optional[Literal["gpipe", "1f1b", "interleaved_1f1b"]], typer.Option(
        "--pipeline-schedule", help="The pipeline's schedule (parallel.pipeline_schedule; default 1f1b).")] = None,
    pipeline_chunks: Annotated[Optional[int], typer.Option(
        "--pipeline-chunks", help="Stages a GPU runs, interleaved only (parallel.pipeline_chunks; default 2 "
        "there).")] = None,
    cpu_offload: Annotated[bool, typer.Option(
        "--cpu-offload", help="FSDP offload of weights, gradients and optimizer state.")] = False,
    tp: Annotated[Optional[int], typer.Option(
        "--tp", help="Tensor-parallel GPUs per group, with --strategy fsdp (FSDP x TP).")] = None,
    accelerate_config: Annotated[Optional[Path], typer.Option(
        help="Read strategy and GPU counts from an accelerate launch config; explicit options win.")] = None,
    gpu_memory: Annotated[Optional[float], typer.Option(
        help="Memory of one GPU in GiB [default: 80].", show_default=False)] = None,
    intra_gbps: Annotated[Optional[float], typer.Option(help="Per-GPU bandwidth within a node in Gb/s (default "
                                                        "3600: H100 NVLink 4, 450 GB/s each way).")] = None,
    inter_gbps: Annotated[Optional[float], typer.Option(help="Per-GPU bandwidth between nodes in Gb/s (default 400: "
                                                        "one NDR InfiniBand card per GPU).")] = None,
    mfu: Annotated[Optional[float], typer.Option(help="Model FLOPs utilisation for the step's compute time "
                                                 "(default 0.4).")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option(help="Peak dense bf16 TFLOP/s of one GPU (default 989: "
                                                         "H100 SXM).")] = None,
    hbm_tbps: Annotated[Optional[float], typer.Option(help="Memory bandwidth of one GPU in TB/s, for online RL's "
                                                      "decode steps (default 3.35: H100 SXM; H200 4.8).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    fit: Annotated[bool, typer.Option("--fit", help="Search strategy, checkpointing and micro-batch for the "
                                      "fastest configuration that fits; when none does, the fewest GPUs (FSDP) "
                                      "that would.")] = False,
    longest_context: Annotated[bool, typer.Option(
        "--longest-context", help="The longest single sequence this run can train on these GPUs (one example a "
        "micro-batch, within 90% of the card as --fit), shown with its estimate.")] = False,
) -> None:
    """Estimate per-GPU peak memory of a fine-tuning run, without weights or a GPU.

    Exit status: 0 when it fits --gpu-memory, 4 when it does not (with --fit: 0 when a configuration that fits these
    GPUs was found, 4 when none was), 2 on bad input.
    """
    from llmtrain.memory import estimate_run, traffic_run
    from llmtrain.memory import fit as fitting
    from llmtrain.memory.comms import Network
    from llmtrain.memory.pipeline import compared

    given = dict(intra_gbps=intra_gbps, inter_gbps=inter_gbps, peak_tflops=peak_tflops, mfu=mfu, hbm_tbps=hbm_tbps)
    if bad := [f"--{k.replace('_', '-')} {v:g}" for k, v in given.items()
               if v is not None and not (0 < v <= (1 if k == "mfu" else math.inf))]:
        raise LLMTrainError(f"{', '.join(bad)}: the step time's rates must be positive, and --mfu a share of the "
                            "peak (0 < mfu <= 1, e.g. 0.4 for 40%). Give such values, or leave them out for the "
                            "defaults.")
    parameters = tuple(lora_target_parameters) if lora_target_parameters else None
    run = {k: v for k, v in dict(method=method, lora_r=lora_r, lora_dropout=lora_dropout, dora=dora,
                                 lora_target_parameters=parameters, micro_batch=micro_batch,
                                 micro_batch_tokens=micro_batch_tokens, grad_accum=grad_accum, seq_len=seq_len,
                                 packing=packing, loss_chunk_tokens=loss_chunk_tokens,
                                 grad_checkpointing=grad_checkpointing, dtype=dtype, mixed_precision=mixed_precision,
                                 attn=attn, quantize=quantize, activation_offload=activation_offload,
                                 tiled_mlp=tiled_mlp, sequence_parallel=sequence_parallel,
                                 optimizer=optimizer).items() if v is not None}
    if recipe is not None and accelerate_config is None and not strategy and _header_agrees(recipe, num_gpus,
                                                                                            num_nodes):
        accelerate_config = launch_from_header(recipe, say=not as_json)
    layout, launch_mp = _layout(accelerate_config, strategy=strategy, num_gpus=num_gpus, num_nodes=num_nodes,
                                cpu_offload=cpu_offload, tp=tp, fit=fit,
                                stages=pipeline_parallel or _recipe_stages(recipe, overrides))
    pipe = dict(pipeline_parallel=pipeline_parallel, pipeline_schedule=pipeline_schedule,
                pipeline_chunks=pipeline_chunks)
    # (unset: TrainSpec's default, the one home of the 80)
    launch = dict(**layout, **{k: v for k, v in {**pipe, "gpu_memory_gib": gpu_memory}.items() if v is not None})
    if model is not None and recipe is not None and "=" in recipe.name and not recipe.exists():
        overrides = [str(recipe), *(overrides or [])]  # KEY=VALUE after --model: typer read the first as RECIPE
        recipe = None
    if (recipe is None) == (model is None):
        raise LLMTrainError("give either a RECIPE.yaml or --model PATH_OR_ID (not both, not neither).")
    shape, spec, global_batch, target, assumed = (_from_recipe(recipe, overrides, run, launch) if recipe is not None
                                                  else _from_model(model, overrides, run, launch))
    _check_ignored(run, pipe, spec)
    if longest_context and fit:
        raise LLMTrainError("--longest-context and --fit answer two questions: ask one at a time.")
    longest = fitting.longest_context(shape, spec) if longest_context else None
    est = longest if longest is not None else estimate_run(shape, spec)
    est = dataclasses.replace(est, notes=assumed + est.notes)
    network = Network(**{k: v for k, v in given.items() if v is not None})
    traffic = traffic_run(shape, est.spec, network)  # with --longest-context: at that length
    # the data-parallel layouts beside it keep the recipe's train.fsdp_accumulate (est.spec is the pipeline's)
    beside = (compared(shape, est.spec.but(fsdp_accumulate=spec.fsdp_accumulate), network)
              if est.spec.pipeline_parallel > 1 else [])
    result = fitting.fit(shape, spec, global_batch=global_batch, network=network) if fit else None
    advice = fitting.recommendation(shape, est, global_batch=global_batch, network=network)
    if as_json:
        out = est.to_dict()
        out["communication"] = traffic.to_dict()
        out["recommendation"] = advice
        if beside:  # the pipeline, DDP, FSDP and HSDP on the same GPUs at the same global batch
            out["pipeline_compared"] = [{"layout": label, "per_gpu_peak_bytes": e.per_gpu_peak_bytes, "fits": e.fits,
                                         "step_s": t.step_s, "compute_s": t.compute_s, "network_s": t.network_s}
                                        for label, e, t in beside]
        if result is not None:
            out["fit"] = _fit_dict(result)
        if longest_context:
            out["longest_context_tokens"] = longest.spec.seq_len if longest is not None else None
        typer.echo(json.dumps(out, indent=1))
    else:
        if longest_context:
            from llmtrain.memory.render import say

            say(_longest_line(longest, spec, positions=shape.max_positions,
                              scaled=recipe is not None and _rope_scaled(recipe, overrides)))
        _render(est, advice, traffic, launch_mp, result, global_batch=global_batch, target=target, beside=beside)
    found = result.best is not None if result is not None else longest is not None if longest_context else est.fits
    if not found:
        raise typer.Exit(DOES_NOT_FIT)


def _recipe_stages(recipe: Path | None, overrides) -> int | None:
    """The recipe's parallel.pipeline_parallel (None without a readable recipe: its own error comes later)."""
    from llmtrain.config import load_recipe

    try:
        return load_recipe(recipe, overrides).parallel.pipeline_parallel if recipe is not None else None
    except LLMTrainError:
        return None


def _rope_scaled(recipe: Path, overrides) -> bool:
    """The recipe extends the model's context itself (model.rope_scaling)."""
    from llmtrain.config import load_recipe

    return load_recipe(recipe, overrides).model.rope_scaling is not None


def _longest_line(est, spec, *, positions: int | None = None, scaled: bool = False) -> str:
    """--longest-context's answer, above the estimate at that length (`est`: the search's; None when nothing fit).
    `positions`: the model's max_position_embeddings, said where the answer is past it and the run does not scale
    RoPE (`scaled`): memory allows that length, the model was not trained for it."""
    from llmtrain.memory.fit import LONGEST_STEP

    gpus = f"{spec.world} x {spec.gpu_memory_gib:g} GiB" if spec.world > 1 else f"one {spec.gpu_memory_gib:g} GiB GPU"
    if est is None:
        return (f"longest context: not even {LONGEST_STEP:,} tokens fit {gpus} with this run (the estimate "
                "below is the run as given)")
    host = est.long_context.get("offload_host_bytes")
    more = (f"; the activation offload takes {host / 2**30:,.1f} GiB of pinned host RAM per process "
            f"({host * spec.num_gpus / 2**30:,.1f} GiB per node)") if host else ""
    split = (f", split {spec.sequence_parallel} ways ({est.spec.gpu_tokens:,} tokens a GPU)"
             if spec.sequence_parallel > 1 else "")
    tokens = est.spec.seq_len
    each = ("in one sequence" if spec.min_examples == 1 else
            f"a sequence, {spec.min_examples} sequences a micro-batch (KTO's KL estimate pairs each prompt with "
            "another example's completion)")
    past = (f" That is past the model's max_position_embeddings={positions:,}: memory allows it, but positions past "
            f"{positions:,} were never trained; train that long with model.rope_scaling (e.g. {{rope_type: yarn, "
            f"factor: {-(-tokens // positions)}}}, docs/long-context.md), or keep data.max_seq_len at {positions:,}."
            if positions and tokens > positions and not scaled else "")
    return (f"longest context that fits {gpus}: {tokens:,} tokens {each}{split} (within "
            f"90% of the card, as --fit; in steps of {LONGEST_STEP:,}){more}.{past} The estimate at that length:")


def _render(est, advice: str, traffic, launch_mp: str | None, result, *, global_batch: int | None, target,
            beside) -> None:
    """The tables: the estimate (a pipeline's stages, and the pipeline beside FSDP and HSDP), and with --fit the
    search's result."""
    from llmtrain.memory.render import render_estimate, render_fit, say

    render_estimate(est, advice, traffic=traffic, launch_mp=launch_mp, beside=beside)
    if result is not None:
        spec = est.spec
        if global_batch:  # the recipe's per-GPU batch times these GPUs: say what --fit keeps, it may not be intended
            unit = "tokens" if spec.micro_batch_tokens else "examples"
            say(f"--fit keeps the global batch at {global_batch:,} {unit} a step: the recipe's "
                f"{global_batch // (spec.grad_accum_steps * spec.data_ranks)} x {spec.grad_accum_steps} "
                f"accumulation per GPU on {spec.data_ranks} data-parallel "
                f"GPU{'s' * (spec.data_ranks != 1)}; set train.grad_accum_steps for another")
        render_fit(result, target=target)


def _from_recipe(recipe: Path, overrides, run: dict, launch: dict):
    """(shape, spec, global batch kept by --fit, what --fit names, assumptions) of a recipe and its overrides."""
    from llmtrain import capabilities
    from llmtrain.config import load_recipe
    from llmtrain.layout import Layout
    from llmtrain.memory.params import reads_hub, recipe_model_shape, transformers_config
    from llmtrain.memory.spec import spec_from_recipe

    given = [f"--{k.replace('_', '-')} (set {RUN_OPTIONS[k]})" for k in run]
    if given:
        raise LLMTrainError("with a recipe, the run is set by the recipe and key=value overrides: "
                            + ", ".join(given) + ".")
    r = load_recipe(recipe, overrides)
    config = r.model.name_or_path if reads_hub(r.model.name_or_path) else None  # None: local or built in
    prompts = (r.model.tokenizer or r.model.name_or_path, r.data.path,  # their lengths
               *(s.path for s in r.data.sources or ())) if r.rl is not None else ()
    ask_hub(config, *prompts)
    lengths, unread = rl_prompt_lengths(r) if r.rl is not None else (None, None)
    spec = spec_from_recipe(r, prompt_lengths=lengths, **launch)
    if found := capabilities.problems(r, Layout.of_strategy(r, spec.strategy, gpus=spec.num_gpus,
                                                            nodes=spec.num_nodes, tp=spec.tp,
                                                            offload=spec.cpu_offload),
                                      model=transformers_config(r.model.name_or_path)):
        gpus = spec.num_gpus * spec.num_nodes
        raise LLMTrainError(f"{recipe} would be refused on {gpus} GPU{'s' if gpus != 1 else ''} ({spec.strategy}"
                            f"{f' x TP {spec.tp}' if spec.tp > 1 else ''}), so there is no run to estimate: "
                            + capabilities.paragraph(found))
    # kept by --fit: examples per step, or tokens per step with a budget
    global_batch = (r.train.micro_batch_tokens or r.train.micro_batch_size) * r.train.grad_accum_steps * \
        spec.data_ranks
    assumed = (f"online RL: the prompts could not be read ({unread}), so each is taken at data.max_seq_len",) \
        if unread else ()
    return recipe_model_shape(r), spec, global_batch, (str(recipe), tuple(overrides or ())), assumed


def rl_prompt_lengths(r) -> tuple[list[int] | None, str | None]:
    """An online-RL recipe's prompt lengths in tokens, tokenised as training does (and cached as training caches
    them); or None and why, where its tokenizer or data cannot be read."""
    from llmtrain.data.chat import data_tokenizer
    from llmtrain.data.prepare import prepare_recipe
    from llmtrain.model.modeling import load_tokenizer

    try:
        train = prepare_recipe(r, data_tokenizer(load_tokenizer(r.model), r.data))[0]
    except (LLMTrainError, OSError, ValueError) as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return list(train["length"]), None


def _from_model(model: str, overrides, run: dict, launch: dict):
    """The same from a model's config.json and the run options."""
    from llmtrain.memory.params import load_model_shape, reads_hub, run_lora_plan
    from llmtrain.memory.spec import TrainSpec

    if overrides:
        raise LLMTrainError("KEY=VALUE overrides change a recipe; with --model the run is given by options: "
                            + "; ".join(_option_for(o) for o in overrides) + ".")
    ask_hub(model if reads_hub(model) else None)
    shape, assumed = load_model_shape(model, "--model"), ()
    if run.get("quantize"):  # what training refuses of the checkpoint (capabilities.model_problems)
        from llmtrain.capabilities import stored_quantization_problem
        from llmtrain.memory.params import read_config

        if problem := stored_quantization_problem(run["quantize"], read_config(model)[0], key="--quantize"):
            raise LLMTrainError(f"{model}: {problem}.")
    if run.get("method") == "lora" and "dtype" not in run:
        run = {**run, "dtype": LORA_BASE_DTYPE}
        assumed = (f"LoRA base weights in {LORA_BASE_DTYPE}, as the shipped LoRA recipes keep them "
                   "(--dtype float32 for an fp32 base)",)
    elif "dtype" not in run and "mixed_precision" not in run and run.get("method") != "lora":
        assumed = ("float32 weights and no autocast, a recipe's defaults: a full fine-tune as the shipped 7B recipes "
                   "run it is --mixed-precision bf16 (fp32 master weights, bf16 compute); --dtype bfloat16 "
                   "stores the weights in bf16 too",)
    spec = TrainSpec(**{SPEC_FIELDS.get(k, k): v for k, v in run.items()}, **launch)
    _check_attention(model, spec)
    if shape.experts and "lora_dropout" not in run and spec.method == "lora" and run_lora_plan(shape, spec).moe_params:
        # a recipe's lora.dropout default (0.05) is refused where peft adapts the experts as parameters (Qwen3-MoE's
        # under all-linear, any under lora.target_parameters): estimate what it must set
        spec = spec.but(lora_dropout=0.0)
        assumed += ("LoRA dropout 0, as a recipe for a mixture of experts must set it (peft adapts the experts as "
                    "parameters, which take no dropout)",)
    return shape, spec, None, None, assumed


def _check_attention(model: str, spec) -> None:
    """What training refuses of the model's attention under --attn and --packing (capabilities.attention_problems:
    transformers' kernels the model lacks, such as GPT-OSS's sdpa; capped or chunked attention under the varlen one),
    refused as a recipe's estimate refuses it: --model had estimated runs that can never start."""
    from types import SimpleNamespace

    from llmtrain import capabilities
    from llmtrain.config import ModelConfig
    from llmtrain.memory.params import transformers_config

    config = transformers_config(model)
    if config is None:
        return
    run = SimpleNamespace(model=ModelConfig(name_or_path=str(model), attn_implementation=spec.attn_implementation),
                          data=SimpleNamespace(packing=spec.packing),
                          train=SimpleNamespace(micro_batch_tokens=spec.micro_batch_tokens))
    if found := capabilities.attention_problems(run, config,
                                                sinks=getattr(config, "model_type", None) in capabilities.SINKS):
        raise LLMTrainError(f"{model} would be refused with these options (--attn is model.attn_implementation, "
                            "--packing data.packing, --micro-batch-tokens train.micro_batch_tokens), so there is "
                            "no run to estimate: " + capabilities.paragraph(found))


def _check_ignored(run: dict, pipe: dict, spec) -> None:
    """Options that set what the estimated run does not have, refused as --quantize without LoRA is (they had been
    dropped without a word: --dora without --method lora estimated a full fine-tune's 121 GiB; audit 10)."""
    lora = [f"--{k.replace('_', '-')}" for k in ("lora_r", "lora_dropout", "dora", "lora_target_parameters")
            if k in run]
    if lora and spec.method != "lora":
        raise LLMTrainError(f"{', '.join(lora)} set{'s' if len(lora) == 1 else ''} the LoRA adapters (lora.*), and "
                            "the run estimated is a full fine-tune: add --method lora, or leave "
                            f"{'it' if len(lora) == 1 else 'them'} out.")
    stages = [f"--{k.replace('_', '-')}" for k in ("pipeline_schedule", "pipeline_chunks") if pipe.get(k) is not None]
    if stages and spec.pipeline_parallel == 1:
        raise LLMTrainError(f"{' and '.join(stages)} set{'s' if len(stages) == 1 else ''} the pipeline's schedule, "
                            "and the run estimated has no pipeline: add --pipeline-parallel N (parallel."
                            f"pipeline_parallel), or leave {'it' if len(stages) == 1 else 'them'} out.")


def _option_for(override: str) -> str:
    """The --option that sets what a KEY=VALUE override would, for the refusal of overrides with --model."""
    key, _, value = override.partition("=")
    option = next((name for name, k in RUN_OPTIONS.items() if k == key), None)
    if option is None:
        return f"{override} has no option (write a recipe with it, and pass the recipe instead of --model)"
    flag = "--" + option.replace("_", "-")
    if value.lower() in ("true", "false"):
        return f"{override} is {flag if value.lower() == 'true' else '--no-' + option.replace('_', '-')}"
    return f"{override} is {flag} {value}"


def ask_hub(*names: str | None) -> None:
    """Before anything is read from the hub (transformers and datasets are not imported yet): whether it answers,
    once (llmtrain.hub); when it does not, one line on stderr (stdout may be --json) says that the hub ids are read
    from the local cache only."""
    from llmtrain import hub

    line = hub.fall_back(hub.hub_ids(*names))
    if line:
        typer.echo(line, err=True)


def launch_from_header(recipe: Path, *, say: bool = True) -> Path | None:
    """header_launch, said in one line where a command reads the launch from the recipe (estimate-memory, doctor)."""
    found = header_launch(recipe)
    if found is not None and say:
        from llmtrain.memory.render import say

        say(f"launch: {found}, from the recipe's header (--accelerate-config FILE for another)")
    return found


def _header_agrees(recipe: Path, num_gpus: int | None, num_nodes: int | None) -> bool:
    """Whether the recipe header's launch (header_launch) is the one --num-gpus / --num-nodes describe, where given:
    the same counts (then its strategy is read too: `--num-gpus 8` of a recipe launched with FSDP on 8 is FSDP)."""
    if num_gpus is None and num_nodes is None:
        return True
    found = header_launch(recipe)
    if found is None:
        return False
    from llmtrain.memory.launch import read_accelerate_config

    base = read_accelerate_config(found)
    return num_gpus in (None, base.gpus_per_node) and num_nodes in (None, base.nodes)


def header_launch(recipe: Path) -> Path | None:
    """The accelerate config of the first launch command in a recipe's header comment (`accelerate launch
    --config_file accelerate_configs/X.yaml ... llmtrain finetune`), where that file exists (relative to the working
    folder, or to the recipe's repository); None where the first command is a plain `llmtrain finetune`."""
    import re

    try:
        lines = Path(recipe).read_text().splitlines()
    except OSError:
        return None
    # the header's first launch command (`[accelerate launch --config_file X ...] llmtrain finetune ...`)
    first = next((line for line in lines if line.startswith("#") and "finetune" in line), "")
    found = re.search(r"--config_file\s+(\S+\.yaml)", first)
    if not found:
        return None
    for base in (Path.cwd(), Path(recipe).resolve().parent.parent):
        if (base / found.group(1)).is_file():
            return base / found.group(1) if base != Path.cwd() else Path(found.group(1))
    return None


def _layout(path: Path | None, *, strategy, num_gpus, num_nodes, cpu_offload: bool, tp: int | None,
            fit: bool, stages: int | None = None) -> tuple[dict, str | None]:
    """Strategy and GPU counts (explicit options, else the accelerate config, else one GPU), and the
    launch config's mixed_precision. `stages`: --pipeline-parallel; as many as the GPUs is one GPU a stage, launched
    with a DDP config, with nothing left to choose."""
    from llmtrain.memory.launch import read_accelerate_config

    base = read_accelerate_config(path) if path else None
    gpus = num_gpus or (base.gpus_per_node if base else 1)
    nodes = num_nodes or (base.nodes if base else 1)
    chosen = strategy or (base.strategy if base else None)
    if chosen is None and stages == gpus * nodes > 1:
        chosen = "ddp"
    if chosen is None:
        if gpus * nodes > 1 and not fit:
            raise LLMTrainError(f"{gpus * nodes} GPUs: say how they are used with --strategy ddp or --strategy fsdp "
                                "(or --accelerate-config FILE, or --fit to search).")
        chosen = "single" if gpus * nodes == 1 else "ddp"
    offload = cpu_offload or (base.offload if base else False)
    layout = dict(strategy=chosen, num_gpus=gpus, num_nodes=nodes, cpu_offload=offload,
                  tp=tp or (base.tp if base and chosen == base.strategy else 1),
                  reshard_after_forward=base.reshard if base and chosen == base.strategy else True)
    return layout, base.precision if base else None


def _fit_dict(result) -> dict:
    from llmtrain.memory.fit import size

    more = result.more_gpus
    return {
        "found": result.best is not None, "overrides": list(result.overrides),
        "accelerate_config": result.accelerate_config, "launch_flags": list(result.launch_flags), "note": result.note,
        "best": result.best.estimate.to_dict() if result.best else None,
        "candidates": [{"strategy": c.spec.strategy, "pipeline_parallel": c.spec.pipeline_parallel,
                        "gradient_checkpointing": c.spec.gradient_checkpointing,
                        "micro_batch": c.spec.micro_batch, "micro_batch_tokens": c.spec.micro_batch_tokens,
                        "size": size(c.spec), "per_gpu_peak_bytes": c.estimate.per_gpu_peak_bytes,
                        "relative_throughput": round(c.score, 4)} for c in result.candidates],
        # nothing fits: the fewest GPUs (FSDP) on which something does, searched the same way
        "more_gpus": None if more is None else {"num_gpus": more.best.spec.num_gpus,
                                                "num_nodes": more.best.spec.num_nodes, **_fit_dict(more)},
    }
