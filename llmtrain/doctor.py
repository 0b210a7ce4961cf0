"""`llmtrain doctor`: the checks that catch a silent failure before any GPU time is spent.

Each check is a small function that returns rows of (name, status, detail), status one of pass / warn / fail,
so tests call them directly; `run_doctor` runs them all in order and `doctor` prints the table. Nothing here
loads model weights: the memory check is the estimator's arithmetic on config.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmtrain import hub
from llmtrain.config import Recipe
from llmtrain.data.checks import (Check, check_chat_template, check_context, check_new_tokens, check_tokenizer,
                                  load_data)
from llmtrain.errors import LLMTrainError

BIG_MODEL_PARAMS = 3e9  # above this a full fine-tune keeps ~16 bytes/param of state: FSDP, not DDP
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/scratch/local")  # folders that are per node on every cluster we know


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


# --------------------------------------------------------------------------- launch config and memory


def read_launch(path: Path | None) -> dict:
    """The accelerate YAML as a dict ({} without one: one process, no mixed precision of its own)."""
    from llmtrain.parallel.launch import read_launch_file

    return read_launch_file(path, name=f"--accelerate-config {path}") if path is not None else {}


def check_precision(recipe: Recipe, launch: dict) -> list[Check]:
    mp, ours = launch.get("mixed_precision"), recipe.train.mixed_precision
    if mp is None or str(mp) == ours:
        return [("mixed precision", "pass", f"train.mixed_precision={ours}")]
    return [("mixed precision", "warn", f"the launch config says mixed_precision: {mp}, the recipe "
             f"train.mixed_precision={ours}; the recipe wins. Set mixed_precision: {ours} in the launch config.")]


def data_ranks(launch: dict, recipe: Recipe) -> int:
    """Processes that read different batches (layout.Layout.data_ranks): a tensor-parallel group reads one, and so do
    a sequence group and a pipeline's stages."""
    from llmtrain.layout import Layout

    return Layout.from_launch(launch, recipe).data_ranks


def check_layout(recipe: Recipe, launch: dict, *, where: str = "the launch config") -> list[Check]:
    """The recipe on the launch's layout, as `llmtrain launch` and every process of finetune check it
    (capabilities.py: the training mode's cell, each parallelism's rules, the mesh and degrees, and what they ask of
    the model's heads and layers). Without a launch config, the layout the recipe alone sets (its processes unknown)."""
    from llmtrain import capabilities
    from llmtrain.layout import Layout
    from llmtrain.memory.params import hf_config, load_model_shape
    from llmtrain.model.modeling import load_model_config

    layout = Layout.from_launch(launch, recipe, where=where) if launch else Layout.from_recipe(recipe)
    found = capabilities.problems(recipe, layout)
    unknown = ""
    if not found:
        try:  # the model's config (a folder or the hub's cache; else a preset or a built-in hub id's shape)
            try:
                config = load_model_config(recipe.model)
            except LLMTrainError:
                shape = load_model_shape(recipe.model.name_or_path)
                # transformers' config built from the one it was read from (its tensor-parallel plan, a mixture's
                # experts, Gemma 4's layers of their own)
                config = hf_config(shape.model_type, json.loads(shape.config_json), recipe.model.name_or_path)
            found = capabilities.problems(recipe, layout, model=config)
        except LLMTrainError as e:
            if capabilities.needs_model(recipe, layout):  # else the model's own row says it cannot be read
                unknown = f"; the model's config could not be read ({e}), so what the run asks of it is unchecked"
    if found:
        return [("layout", "fail", capabilities.paragraph(found))]
    mode = capabilities.MODES[capabilities.mode_of(recipe)].name
    p = recipe.parallel
    if not launch and (needs := max(p.sequence_parallel, p.pipeline_parallel)) > 1:  # (audit 34: it had passed)
        unknown += (f"; without --accelerate-config this checks no launch, and the run of one process that "
                    f"`llmtrain finetune` starts refuses this layout (it needs {needs} processes or more): pass the "
                    "launch's config with --accelerate-config")
    return [("layout", "warn" if unknown else "pass", f"{mode} on {layout.describe()}{unknown}")]


def check_sequence_parallel(recipe: Recipe, launch: dict) -> list[Check]:
    """How parallel.sequence_parallel N splits the model's heads and the launch's processes (none when off, or when
    the layout row fails); a distillation teacher's heads must split too (it attends through the same all-to-all)."""
    from llmtrain.capabilities import sequence_heads_problem
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import sequence_kv_heads

    n = recipe.parallel.sequence_parallel
    procs = int(launch.get("num_processes", 1) or 1)
    if n == 1 or procs % n:
        return []
    try:
        shape = load_model_shape(recipe.model.name_or_path)
    except LLMTrainError:
        return []

    def heads_problem(model, whose="the model's"):  # each layer's K/V heads (Gemma 4's global layers have their own)
        kvs = dict.fromkeys(model.layer(i).kv_heads for i in range(model.layers))
        return next((p for kv in kvs if (p := sequence_heads_problem(n, model.heads, kv, whose=whose))), None)

    if heads_problem(shape) is not None:  # the layout row fails (capabilities.sequence_config_problem)
        return []
    splits = [f"{kv // n} K/V head(s)" if sequence_kv_heads(n, kv) == kv else
              f"1 K/V head (each of {kv} repeated {n // kv} times)"
              for kv in dict.fromkeys(shape.layer(i).kv_heads for i in range(shape.layers))]
    groups = procs // n
    detail = (f"{procs} processes = {groups} group{'s' if groups > 1 else ''} of {n}, each GPU with 1/{n} of every "
              f"micro-batch's tokens and, in attention, {shape.heads // n} of the {shape.heads} query heads and "
              f"{' or '.join(splits)}{' (by layer)' if len(splits) > 1 else ''}; keep a group inside a node (NVLink)")
    if recipe.distill is not None:
        try:
            teacher = load_model_shape(recipe.distill.teacher, "distill.teacher")
        except LLMTrainError:  # the teacher's own row says why it cannot be read
            teacher = None
        if teacher is not None and (problem := heads_problem(teacher, whose="its")):
            return [("sequence parallelism", "fail", f"the teacher {recipe.distill.teacher} (distill.teacher) "
                     f"attends through the group's all-to-all too: {problem}")]
    return [("sequence parallelism", "pass", detail)]


def check_launch_settings(launch: dict, path: Path | None = None) -> list[Check]:
    """The launch config's settings that accelerate ignores or llmtrain does not follow, as finetune refuses them,
    and what accelerate launch itself refuses of the file at `path` or starts otherwise (launch.accelerate_problem,
    as `llmtrain launch` checks it), none without a launch config."""
    from llmtrain.parallel.launch import accelerate_problem, unhonoured

    if not launch:
        return []
    problems = unhonoured(launch)
    if not problems and path is not None and (problem := accelerate_problem(
            ["--config_file", str(path), "RECIPE.yaml"], where=f"--accelerate-config {path}")):
        problems = [problem]
    if problems:
        return [("launch settings", "fail", f"{'; '.join(problems)}.")]
    return [("launch settings", "pass", "every setting is one llmtrain follows"), *check_gpus_here(launch, path)]


def check_gpus_here(launch: dict, path: Path | None) -> list[Check]:
    """The launch's processes, one a GPU, against this machine's GPUs, as `llmtrain launch` refuses a launch this
    machine cannot run (doctor had passed it; audit 53): a warn, since doctor may check a recipe away from the
    machine that runs it."""
    import torch

    from llmtrain.parallel.launch import gpus_problem

    problem = gpus_problem(launch, where=f"--accelerate-config {path}", gpus=torch.cuda.device_count())
    return [("GPUs here", "warn", f"{problem} (a warn: fine where doctor checks the recipe away from the machine that "
             "runs it)")] if problem else []


def check_batch(recipe: Recipe, launch: dict) -> list[Check]:
    from llmtrain import capabilities
    from llmtrain.layout import Layout

    t, layout = recipe.train, Layout.from_launch(launch, recipe)
    procs = layout.data_ranks
    unit = "tokens" if t.micro_batch_tokens else capabilities.unit_of(recipe)
    per = t.micro_batch_tokens or t.micro_batch_size
    ranks = ("process" if procs == 1 else "processes") if not layout.splits_the_model else \
        "data-parallel rank" + "s" * (procs != 1)
    total = procs * per * t.grad_accum_steps
    sampled = f" ({total * recipe.rl.num_generations:,} completions)" if recipe.rl is not None else ""
    return [("global batch", "pass", f"{procs} {ranks} x {per} {unit} (train.micro_batch_"
             f"{'tokens' if t.micro_batch_tokens else 'size'}) x {t.grad_accum_steps} (train.grad_accum_steps) = "
             f"{total:,} {unit}{sampled} per optimizer step")]


def check_hub(recipe: Recipe) -> list[Check]:
    """Whether the Hugging Face hub answers, asked once (hub.HUB_PROBE_S) when the recipe names a hub id. When it
    does not, the rest of doctor reads hub ids from the local cache only (HF_HUB_OFFLINE=1 for this process), so
    that each lookup fails at once instead of retrying for a minute."""
    row = hub.check(hub.recipe_hub_ids(recipe))
    return [("hub", *row)] if row else []


def check_fsdp(recipe: Recipe, launch: dict, *, params: int, fits: bool | None) -> list[Check]:
    fsdp = str(launch.get("distributed_type", "NO")) == "FSDP"
    if recipe.lora is not None or params <= BIG_MODEL_PARAMS or fsdp:
        return [("fsdp", "pass", "FSDP" if fsdp else f"not needed ({'LoRA' if recipe.lora else 'small model'})")]
    what = (f"full fine-tune of {params / 1e9:.1f}B parameters without FSDP: every GPU holds all weights, "
            "gradients and optimizer state. Launch with accelerate_configs/fsdp.yaml (and check it here with "
            "--accelerate-config accelerate_configs/fsdp.yaml)")
    why = {False: "", True: " (it fits these GPUs; FSDP would leave room for a larger micro-batch)",
           None: " (pass --gpu-memory to see whether it fits)"}[fits]
    return [("fsdp", "fail" if fits is False else "warn", what + why)]


def gpu_memory_here() -> float | None:
    """GiB of the first GPU of this machine, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def check_memory(recipe: Recipe, launch_path: Path | None, gpu_memory: float | None, *,
                 prompt_lengths=None) -> tuple[list[Check], object]:
    """The per-GPU estimate against `gpu_memory` GiB (None: no GPU known, a warn), with the --fit advice when it
    does not fit (online RL: at the data's `prompt_lengths` where read). Returns the rows and the Estimate (None when
    it cannot be made)."""
    from llmtrain.memory import estimate_run
    from llmtrain.memory import fit as fitting
    from llmtrain.memory.launch import read_accelerate_config
    from llmtrain.memory.params import recipe_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    try:
        layout = read_accelerate_config(launch_path).estimate_layout() if launch_path else {}
        shape = recipe_model_shape(recipe)
        card = {"gpu_memory_gib": gpu_memory} if gpu_memory else {}  # (unset: TrainSpec's default)
        spec = spec_from_recipe(recipe, prompt_lengths=prompt_lengths, **card, **layout)
        est = estimate_run(shape, spec)  # a pipeline's worst stage, where the recipe has one
    except LLMTrainError as e:  # one row: nothing to check against a card either
        return [("memory", "warn", f"no estimate: {e}")], None
    if gpu_memory is None:
        return [("memory", "info", f"no GPU here: {_gib(est.per_gpu_peak_bytes)} per GPU estimated, not checked "
                 "against a card; pass --gpu-memory 79 to check it against an 80 GB H100 (79.6 GiB in all)")], est
    t = recipe.train
    global_batch = (t.micro_batch_tokens or t.micro_batch_size) * t.grad_accum_steps * spec.data_ranks
    advice = fitting.recommendation(shape, est, global_batch=global_batch)
    worst = f" (worst case, sequences of data.max_seq_len: {_gib(est.worst_case_bytes)})" if est.worst_case_bytes \
        else ""
    detail = f"{_gib(est.per_gpu_peak_bytes)} per GPU estimated{worst}; {advice}"
    return [("memory", "pass" if est.fits else "fail", detail)], est


def host_memory_here() -> int | None:
    """Bytes of RAM of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_offload(est, *, host_memory: int | None) -> list[Check]:
    """model.activation_offload keeps the checkpointed layers' inputs in pinned host memory, per process: the node's
    processes together against this machine's RAM (None: not known), beside what loading the model takes."""
    if est is None or "offload_host_bytes" not in est.long_context:
        return []
    per_node = est.long_context["offload_host_bytes"] * est.spec.num_gpus
    need = f"{_gib(per_node)} of pinned host RAM per node for the activation offload (estimate-memory)"
    if host_memory is None:
        return [("host memory", "info", f"{need}; this machine's RAM is unknown")]
    if per_node > host_memory:
        return [("host memory", "warn", f"{need}, more than this machine's {_gib(host_memory)}: on it the run "
                 "would run out of host memory. Train fewer tokens a micro-batch (train.micro_batch_tokens), or turn "
                 "model.activation_offload off (more GPU memory), or run where the host has the RAM.")]
    return [("host memory", "pass", f"{need}, of this machine's {_gib(host_memory)}")]


def check_shared_fs(recipe: Recipe, launch: dict, *, cwd: Path | None = None) -> list[Check]:
    """Multi-node: every node writes checkpoints to output_dir and reads the tokenised cache from data.cache_dir,
    so both must be the same folder on every node: on a shared filesystem (NFS, Lustre, ...). One under /tmp (or
    another node-local folder) is on each node's own disk: a checkpoint's shards would be split over the nodes, and
    resume would find half of them. A relative path is each node's working directory's (`cwd`: this one's, as the
    launch here starts there): said with where it resolves, a warning unless that is node-local (it had failed the
    documented multi-node commands, whose default data.cache_dir is relative, from a shared home)."""
    machines = int(launch.get("num_machines", 1) or 1)
    if machines <= 1:
        return [("shared filesystem", "pass", "one node")]
    here = cwd if cwd is not None else Path.cwd()
    paths = {"output_dir": recipe.output_dir, "data.cache_dir": recipe.data.cache_dir}
    resolved = {k: (here / p if not Path(p).is_absolute() else Path(p)) for k, p in paths.items()}
    local = {k: p for k, p in paths.items() if resolved[k].as_posix().startswith(NODE_LOCAL)}
    if local:
        listed = ", ".join(f"{k}={p}" + ("" if Path(p).is_absolute() else f" ({resolved[k]})")
                           for k, p in local.items())
        return [("shared filesystem", "fail", f"{machines} nodes, and {listed} is node-local: each node would write "
                 "its own copy. Set it to an absolute path on a filesystem all nodes mount.")]
    relative = [k for k, p in paths.items() if not Path(p).is_absolute()]
    listed = ", ".join(f"{k}={p}" + (f" ({resolved[k]} from here)" if k in relative else "") for k, p in paths.items())
    where = (" Relative paths are each node's working directory's: launch every node from the same shared folder, "
             "or give absolute paths." if relative else "")
    return [("shared filesystem", "warn", f"{machines} nodes: {listed} must be on a filesystem all nodes share "
             f"(not checked from here).{where}")]


def cpu_vector_isa() -> str | None:
    """'avx512' or 'avx2' where this x86 processor has them, else None (torch.cpu asks cpuinfo, whatever kernel set
    ATEN_CPU_CAPABILITY chose)."""
    import torch

    try:
        return "avx512" if torch.cpu._is_avx512_supported() else "avx2" if torch.cpu._is_avx2_supported() else None
    except AttributeError:  # a torch without them: its chosen kernels, the best it has
        capability = torch.backends.cpu.get_cpu_capability()
        return "avx512" if "AVX512" in capability else "avx2" if "AVX2" in capability else None


def check_quantize(recipe: Recipe, launch: dict | None = None) -> list[Check]:
    """model.quantize: bitsandbytes is installed and runs on this machine's device (a CUDA GPU, or an x86 CPU with
    AVX2, where bitsandbytes 0.50 runs its 4-bit layers)."""
    import importlib.util

    import torch

    if recipe.model.quantize is None:
        return []
    name = "4-bit base"
    if importlib.util.find_spec("bitsandbytes") is None:
        return [(name, "fail", f"model.quantize={recipe.model.quantize} needs bitsandbytes, which is not installed: "
                 "pip install 'llmtrain[qlora]'.")]
    import bitsandbytes

    if torch.cuda.is_available():
        where = f"CUDA ({torch.cuda.get_device_name(0)})"
    else:
        # the processor's own instructions, not the kernel set ATen picked (ATEN_CPU_CAPABILITY may lower that one,
        # as `make test-portable` does; bitsandbytes' 4-bit layers still run)
        isa = cpu_vector_isa()
        if isa is None:
            return [(name, "fail", "no CUDA GPU and this CPU has no AVX2: bitsandbytes cannot run its 4-bit layers "
                     "here. Run on a GPU, or set model.quantize=null.")]
        where = f"CPU ({'AVX-512' if isa == 'avx512' else 'AVX2'})"
    return [(name, "pass", f"bitsandbytes {bitsandbytes.__version__} on {where}: {recipe.model.quantize}, double "
             f"quantisation, stored as {recipe.model.dtype}")] + check_experts_quantized(recipe, launch)


def check_optimizer(recipe: Recipe) -> list[Check]:
    """train.optimizer=adamw_8bit: bitsandbytes is installed (its 8-bit AdamW runs on CUDA and on an x86 CPU)."""
    import importlib.util

    if recipe.train.optimizer != "adamw_8bit":
        return []
    if importlib.util.find_spec("bitsandbytes") is None:
        return [("8-bit AdamW", "fail", "train.optimizer=adamw_8bit needs bitsandbytes, which is not installed: pip "
                 "install 'llmtrain[qlora]', or set train.optimizer=adamw.")]
    import bitsandbytes

    return [("8-bit AdamW", "pass", f"bitsandbytes {bitsandbytes.__version__}: both moments of each tensor of 4,096 "
             "elements or more in 8 bits with their block scales (about 2 bytes a trained parameter against fp32 "
             "AdamW's 8)")]


def check_reference(recipe: Recipe, launch: dict | None = None) -> list[Check]:
    """Where the run's reference comes from (a mode that reads one: preference pairs, KTO, online RL with rl.beta > 0),
    whether it follows the policy (sync_reference), and under an FSDP launch how the copy is held: said before the
    run, where a new user cannot see it."""
    from llmtrain import capabilities
    from llmtrain.layout import Layout

    if recipe.preference is None and recipe.kto is None and (recipe.rl is None or not recipe.rl.beta):
        return []
    sync = capabilities.reference_sync(recipe)
    kind = capabilities.reference_kind(recipe) if recipe.preference is not None else \
        "copy" if capabilities.reference_copy(recipe) else "adapter"
    if kind == "none":
        return [("reference", "pass", f"none: preference.loss={recipe.preference.loss} is reference-free")]
    if recipe.lora is not None and sync is not None:
        what = (f"the base model (the adapter disabled) until step {sync.every_steps}, then every "
                f"{sync.every_steps} steps the adapter as it was then (sync_reference, TR-DPO's hard update)")
        if launch and Layout.from_launch(launch, recipe).fsdp and capabilities.rollout_adapter(recipe):
            what += ("; under FSDP its snapshot is also kept whole, to swap into the weights FSDP holds gathered "
                     "for each rollout (RLOO's KL runs there): the trained weights twice more, in the estimate")
    elif kind == "adapter":
        what = "the base model, the adapter disabled (no copy of the weights)"
    elif kind == "precomputed":
        what = ("the starting weights' log-probabilities of every pair, computed once before training and cached "
                "beside the tokenised data")
    else:
        what = "a frozen copy of the starting weights (one more set of weights, in the estimate)"
        if launch and Layout.from_launch(launch, recipe).fsdp:
            what += ("; under FSDP sharded like the policy, copied from its shards (nothing read again), the LM head "
                     "whole" +
                     (", its decoder gathered whole for each rollout (RLOO's KL runs there)"
                      if recipe.rl is not None and recipe.rl.algorithm == "rloo" else ""))
        if sync is not None:
            what += (f", mixed with the policy every {sync.every_steps} steps at alpha {sync.alpha:g} "
                     "(sync_reference, TR-DPO)")
    return [("reference", "pass", what)]


def check_experts_quantized(recipe: Recipe, launch: dict | None = None) -> list[Check]:
    """model.quantize on a mixture of experts: bitsandbytes quantizes linear layers, and transformers holds each
    layer's experts as 3-D parameters, which stay in model.dtype (the run says the same at start-up, from the loaded
    model), each process holding its share on the launch's layout (FSDP's shards, the pipeline's stages). Counted on
    the meta device from the model's config; nothing where the config cannot be read."""
    import torch

    from llmtrain.capabilities import experts
    from llmtrain.layout import Layout
    from llmtrain.memory.params import hf_config, meta_model, read_config

    try:
        raw, source = read_config(recipe.model.name_or_path)
        config = hf_config(raw.get("model_type"), raw, source)
        if not experts(config):
            return []
        model = meta_model(config, source)
    except LLMTrainError:  # no config here, or none transformers builds
        return []
    whole = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    total = sum(p.numel() for p in model.parameters())
    size = torch.finfo(getattr(torch, recipe.model.dtype)).bits // 8
    layout = Layout.from_launch(launch, recipe) if launch else Layout.from_recipe(recipe)
    return [("4-bit experts", "warn", f"model.quantize={recipe.model.quantize} quantizes linear layers, and "
             f"{raw['model_type']}'s experts are 3-D parameters (every expert of a layer in one tensor), which "
             f"bitsandbytes leaves in {recipe.model.dtype}: {whole:,} of its {total:,} weights, "
             f"{_gib(whole * size)} (at 4 bits a weight: {_gib(whole // 2)}){layout.each_holds()}. LoRA trains as "
             "asked")]


# --------------------------------------------------------------------------- all together


def check_weights(recipe: Recipe) -> list[Check]:
    """A local model folder with a config.json and no weights file, which finetune refuses at the load (doctor had
    passed it: nothing here loads weights, and none need be loaded to find them missing)."""
    from llmtrain.model.modeling import weights_problem

    if not recipe.model.random_init and (problem := weights_problem(recipe.model.name_or_path)):
        return [("model weights", "fail", problem)]
    return []


def check_family(recipe: Recipe) -> list[Check]:
    """Whether the model is a family of the capability table (docs/models.md), whose every allowed path is tested, or
    another model_type, which trains through transformers with llmtrain's checks of what its attention and packed
    rows compute (the layout row) and nothing else of it tested. A config that cannot be read fails here, as
    finetune and launch refuse it (a model that needs trust_remote_code, a damaged config.json: doctor had passed
    them, with the memory row's warning alone; audit 53)."""
    from llmtrain import capabilities
    from llmtrain.model.modeling import load_model_config

    try:
        model_type = getattr(load_model_config(recipe.model), "model_type", None)
    except LLMTrainError as e:
        return [("model", "fail", str(e))]
    if (family := capabilities.FAMILIES.get(model_type)) is not None:
        return [("model family", "pass", f"{family.name} ({model_type}): a family of the capability table "
                 "(docs/models.md), each path its row allows tested")]
    return [("model family", "warn", f"{model_type} is not a family of the capability table (docs/models.md): it "
             "trains through transformers, with llmtrain's checks of what its varlen attention and packed rows "
             "compute of it (the layout row); its other paths (the estimate, tensor and pipeline parallelism, the "
             "tiled MLP, the fast sampler) are untested on it. Try a short run (train.max_steps=20) before a long one")]


def _embedding_rows(recipe: Recipe, tokenizer) -> int | None:
    """The rows of the model's embedding (modeling.embedding_rows) where its config can be read (a folder, or a hub
    id in the local cache), else None."""
    from llmtrain.model.modeling import embedding_rows, load_model_config

    try:
        return embedding_rows(recipe, tokenizer, load_model_config(recipe.model))
    except LLMTrainError:
        return None


def _max_positions(model) -> int | None:
    """max_position_embeddings of the model's config as estimate-memory reads it (params.read_config: a local
    config.json, a hub id's in the local cache, or the built-in config of a shipped recipe's hub id), scaled by
    model.rope_scaling as the run scales it (modeling.scale_rope: finetune's context check takes the loaded model's);
    None when there is none."""
    import types

    from llmtrain.memory.params import read_config
    from llmtrain.model.modeling import context_reach, scale_rope

    try:
        config = read_config(model.name_or_path)[0]
    except LLMTrainError:
        return None
    if config.get("max_position_embeddings") is None:
        return None
    scaled = types.SimpleNamespace(max_position_embeddings=config["max_position_embeddings"],
                                   rope_parameters=config.get("rope_parameters"))
    scale_rope(scaled, model.rope_scaling)
    return context_reach(scaled)


def check_rewards_run(recipe: Recipe, tokenizer, *, world: int = 1) -> list[Check]:
    """Online RL: every reward function imports and runs on the first rows (as finetune tries them before it
    writes anything), given the trainer_state the run gives it (its max_steps counted over the data's epochs where
    train.max_steps is unset: 0 had failed a function that divides by it; audit 53)."""
    if recipe.rl is None:
        return []
    from llmtrain.data.checks import total_steps
    from llmtrain.data.prepare import prepare_recipe, sources
    from llmtrain.objectives.rewards import build_rewards, check_rewards, trainer_state

    try:
        train = prepare_recipe(recipe, tokenizer)[0]
        rewards = build_rewards(recipe.rl, answer_pattern=recipe.train.eval_answer_pattern, columns=train.column_names,
                                data=recipe.data)
        steps = total_steps(recipe, train["length"], world=world,
                            sources=train["source"] if recipe.data.sources is not None else None)
        check_rewards(rewards, list(train.select(range(min(2, len(train))))), where=sources(recipe.data)[0],
                      state=trainer_state(recipe, total_steps=steps))
    except LLMTrainError as e:
        return [("rewards", "fail", str(e))]
    return [("rewards", "pass", f"{', '.join(n for n, _, _ in rewards)} import and score the first rows")]


def check_tools(recipe: Recipe, tokenizer) -> list[Check]:
    """Online RL with tools: each tool (or the environment's methods) imports and is described, and the chat template
    writes tool calls in a form that can be read back (as finetune checks them before it writes anything)."""
    if recipe.rl is None or not (recipe.rl.tools or recipe.rl.environment):
        return []
    from llmtrain.data.chat import read_template
    from llmtrain.objectives.tool_calls import Tools, check_reset

    try:
        tools = Tools(recipe.rl.tools, tokenizer=tokenizer, template=read_template(recipe.data, tokenizer),
                      environment=recipe.rl.environment)
        if tools.environment is not None:  # its reset's arguments against the data's columns, as the run checks
            # them (doctor had passed a reset that needs a column the data lack; audit 53)
            from llmtrain.data.prepare import prepare_recipe
            from llmtrain.objectives.rewards import reward_columns

            columns = reward_columns(prepare_recipe(recipe, tokenizer)[0].column_names)
            check_reset(recipe.rl.environment, tools.environment, list(columns))
    except LLMTrainError as e:
        return [("tools", "fail", str(e))]
    return [("tools", "pass", f"{', '.join(tools.names())} import and are described; the template writes calls as "
             f"{tools.syntax.opener or 'a JSON turn'} {{{tools.syntax.name_key!r}, {tools.syntax.arguments_key!r}}}")]


def check_output(recipe: Recipe, recipe_file: Path | None = None, overrides: list[str] | None = None) -> list[Check]:
    """output_dir as finetune and `llmtrain launch` check it before writing (rundir.check_output_folder: a file, not
    a run, another run's folder in use or finished; doctor had no row, and passed a file; audit 34): a fail where no
    flag lets the run start (a file, a folder on the way that is a file or read-only, the recipe file or an input
    that starting again there deletes: audit 53), else a warn, since --overwrite or --resume decide the rest and
    doctor has neither; the warn says which of them would be accepted."""
    from llmtrain.run.rundir import (another_runs_recipe, check_output_folder, finished_run_without_checkpoints,
                                     inputs_inside, recipe_inside)

    out = Path(recipe.output_dir)
    if recipe_file is not None and (problem := another_runs_recipe(out, recipe_file, overrides)):
        return [("output_dir", "fail", problem)]

    def deleted(*, overwrite: bool) -> str | None:  # an input the start (or --overwrite) would delete first
        return inputs_inside(out, recipe.model_dump(mode="json"), resume=None, overwrite=overwrite) or (
            recipe_inside(out, recipe_file, resume=None, overwrite=overwrite) if recipe_file is not None else None)

    try:
        check_output_folder(out, overwrite=False)
    except LLMTrainError as e:
        if not out.is_dir():  # a file, or a folder that cannot be made: no flag starts the run
            return [("output_dir", "fail", str(e))]
        detail = str(e)
        if finished_run_without_checkpoints(out):  # whose --resume auto would be refused
            detail = (f"output_dir '{out}' holds a finished run that kept no checkpoint, so --resume auto has nothing "
                      "to continue from: start again there with --overwrite, or set output_dir=<new path>"
                      + (" (its final/ can be a new run's model.name_or_path)" if (out / "final").exists() else ""))
        if problem := deleted(overwrite=True):
            detail += f"; and with --overwrite: {problem}"
        return [("output_dir", "warn", detail)]
    if problem := deleted(overwrite=False):
        return [("output_dir", "fail", problem)]
    return [("output_dir", "pass", f"{out} {'is a new folder' if not out.exists() else 'can be written'}")]


def check_needs(recipe: Recipe, launch: dict) -> list[Check]:
    """What the run needs of this machine's packages and of the model before it trains, as `llmtrain launch` checks
    it (launcher.needs_problems, modeling.lora_problem): a tracker's library, liger-kernel and CUDA for
    model.kernels=liger, the eval: section's harness, final/ and tasks, and lora.target_modules' names on the model
    (doctor had passed each, which every process then refused; audit 34). Rows only where there is something to say
    or check."""
    from llmtrain.launcher import needs_problems
    from llmtrain.model.modeling import load_model_config, lora_problem

    rows = [("run needs", "fail", problem) for problem in needs_problems(recipe, launch, user_code=False, tasks=True)]
    if recipe.lora is not None:
        try:
            problem = lora_problem(recipe, load_model_config(recipe.model))
        except LLMTrainError:  # the model's own rows say it cannot be read: nothing checked here
            return rows
        rows.append(("LoRA targets", "fail", problem) if problem else
                    ("LoRA targets", "pass", "every name in lora.target_modules (modules_to_save, target_parameters) "
                     "is a module of this model"))
    return rows


def check_teacher(recipe: Recipe, tokenizer) -> list[Check]:
    """Distillation: the teacher shares the student's vocabulary, id by id, and its folder has weights (as finetune
    checks it, from the teacher's config.json, tokenizer and file names: no weights read)."""
    if recipe.distill is None:
        return []
    from llmtrain.model.teacher import teacher_problem

    if problem := teacher_problem(recipe, tokenizer):
        return [("teacher", "fail", problem)]
    d = recipe.distill
    return [("teacher", "pass", f"{d.teacher} shares the student's vocabulary ({len(tokenizer.get_vocab()):,} "
             f"tokens, id by id); beta={d.beta:g}, temperature={d.temperature:g}, the student samples "
             f"{d.lmbda:.0%} of the steps' completions")]


def run_doctor(recipe: Recipe, *, accelerate_config: Path | None = None, gpu_memory: float | None = None,
               recipe_file: Path | None = None, overrides: list[str] | None = None) -> list[Check]:
    hub = check_hub(recipe)  # first: before huggingface_hub, transformers and datasets read HF_HUB_OFFLINE
    import datasets

    from llmtrain.model.modeling import load_tokenizer

    datasets.disable_progress_bars()
    launch = read_launch(accelerate_config)
    checks: list[Check] = [("recipe", "pass", "validates (doctor RECIPE --show-recipe prints it resolved)"), *hub,
                           *check_quantize(recipe, launch), *check_optimizer(recipe), *check_reference(recipe, launch)]
    try:
        tokenizer = load_tokenizer(recipe.model)
    except LLMTrainError as e:
        tokenizer = None
        checks.append(("tokenizer eos/pad", "fail", str(e)))
        checks += [(name, "skipped", "needs the tokenizer") for name in ("chat template", "data", "loss mask",
                                                                         "eos trained", "schedule")]
    if tokenizer is not None:
        template = check_chat_template(recipe, tokenizer)
        checks += check_tokenizer(tokenizer) + check_new_tokens(recipe, tokenizer) + template
        if any(status == "fail" for _, status, _ in template):  # every row would fail as the template does
            checks.append(("data", "skipped", "needs a chat template that renders (the chat template row)"))
        else:
            from llmtrain.data.chat import data_tokenizer

            data_tokenizer(tokenizer, recipe.data)  # as finetune's: its cache entry
            checks += load_data(recipe, tokenizer, world=data_ranks(launch, recipe),
                                rows=_embedding_rows(recipe, tokenizer))
        checks += check_rewards_run(recipe, tokenizer, world=data_ranks(launch, recipe))
        checks += check_tools(recipe, tokenizer) + check_teacher(recipe, tokenizer)
    checks += check_context(recipe.data.max_seq_len, _max_positions(recipe.model))
    checks += check_weights(recipe) + check_family(recipe) + check_needs(recipe, launch)
    checks += check_output(recipe, recipe_file, overrides)
    gpu = gpu_memory if gpu_memory is not None else gpu_memory_here()
    lengths = None
    if recipe.rl is not None and tokenizer is not None:  # the estimate at the prompts' real lengths
        from llmtrain.memory.cli import rl_prompt_lengths

        lengths = rl_prompt_lengths(recipe)[0]
    rows, est = check_memory(recipe, accelerate_config, gpu, prompt_lengths=lengths)
    checks += rows + check_host_offload(est, host_memory=host_memory_here()) + check_precision(recipe, launch)
    if est is not None:
        checks += check_fsdp(recipe, launch, params=est.params_total, fits=est.fits if gpu else None)
    return said_once(checks + check_launch_settings(launch, accelerate_config) +
                     check_layout(recipe, launch, where=f"--accelerate-config {accelerate_config}") +
                     check_sequence_parallel(recipe, launch) +
                     check_batch(recipe, launch) + check_shared_fs(recipe, launch))


def said_once(checks: list[Check]) -> list[Check]:
    """The checks with a failure's paragraph said once: a later row failing with the same words (an rl.environment
    that does not import fails the data, the rewards and the tools alike: three copies, audit 36) is skipped, naming
    the row that says it."""
    first: dict[str, str] = {}
    out = []
    for name, status, detail in checks:
        if status == "fail" and detail in first:
            out.append((name, "skipped", f"fails as the {first[detail]} row says"))
            continue
        if status == "fail":
            first[detail] = name
        out.append((name, status, detail))
    return out


def doctor(recipe: Recipe, *, accelerate_config: Path | None = None, gpu_memory: float | None = None,
           show_recipe: bool = False, recipe_file: Path | None = None, overrides: list[str] | None = None) -> int:
    """Print the checks (and, with show_recipe, the resolved recipe first); 1 when a check fails, else 0."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    if show_recipe:
        console.print(escape(recipe.to_yaml()))
    checks = run_doctor(recipe, accelerate_config=accelerate_config, gpu_memory=gpu_memory, recipe_file=recipe_file,
                        overrides=overrides)
    table = Table(title="llmtrain doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    colour = {"pass": "green", "info": "cyan", "skipped": "dim", "warn": "yellow", "fail": "bold red"}
    for name, status, detail in checks:
        table.add_row(name, f"[{colour[status]}]{status}[/]", escape(detail))
    console.print(table)
    return 1 if any(status == "fail" for _, status, _ in checks) else 0
