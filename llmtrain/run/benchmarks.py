"""Benchmark scores of a run or a model (`llmtrain eval`), through EleutherAI's lm-evaluation-harness.

llmtrain does not re-implement the harness: it says which model a run is in the harness's own terms (model "hf" and
its model_args: a whole model's folder, or a LoRA adapter with `peft=` on the base its recipe names, as `lm_eval
--model_args pretrained=BASE,peft=ADAPTER` loads it), checks the tasks and their data before any model is loaded, and
calls `lm_eval.simple_evaluate` with the CLI's defaults, so the numbers are the ones `lm_eval` prints for the same
folder. A checkpoint (checkpoints/step_N) is handed over as the model llmtrain loads from it (one process). Results
go into the run folder (lm_eval/, one JSON a call, never overwritten) and a table is printed; `--baseline` scores a
second model on the same tasks and prints the two side by side.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from llmtrain.errors import LLMTrainError

INSTALL = ("llmtrain eval runs EleutherAI's lm-evaluation-harness, which is not installed here: pip install "
           "'llmtrain[eval]' (or pip install lm-eval)")


@dataclass
class Target:
    """A model as the harness is given it."""

    name: str  # in the table and the messages
    model_args: dict  # lm_eval's model_args for model "hf" (pretrained, peft, tokenizer, dtype)
    run: Path | None  # the run folder results are written into; None for a model folder or hub id
    load: object = None  # a checkpoint: a function of the device returning (model, tokenizer), handed over as objects
    base: str | None = None  # a run's base model (its recipe's model.name_or_path): --baseline base
    chats: dict | None = None  # a run's chats as it trained them (`rendering`): --apply-chat-template's
    chat_trained: bool = False  # a run that trained on chats through a chat template (replies.trained_on_chats)


def rendering(target: Target) -> dict:
    """How --apply-chat-template renders the prompts of a run's benchmark as the run rendered its chats: its
    data.system_prompt (the harness's system_instruction) and data.chat_template_kwargs (the harness's
    chat_template_args: Qwen3's enable_thinking); {} for a model that is not a run. final/'s tokenizer keeps the
    template without the kwargs, so final/ had been prompted in thinking mode where the run's checkpoints (whose
    template read_template gives) were not, and neither with the system prompt (audit 33). The baseline is rendered
    the same, so the two are scored on the same prompts."""
    return {k: v for k, v in (target.chats or {}).items() if v}


def resolve(target: str, *, dtype: str) -> Target:
    """What `target` is: a run folder (its final/), a checkpoint of one, a model folder or a hub id."""
    from llmtrain.hub import missing_local
    from llmtrain.run.replies import trained_on_chats
    from llmtrain.run.rundir import missing_source, run_folder, run_recipe

    path = Path(target).expanduser()
    if missing_local(target):  # (it had named the recipe keys model.name_or_path / model.tokenizer: there is none)
        raise LLMTrainError(missing_source(target))
    path = run_folder(path)  # a run's final/ is the run, as generate reads it (a LoRA's had been refused; audit 33)
    if not (path / "recipe.yaml").is_file():
        if path.exists() and not (path / "config.json").is_file():
            raise LLMTrainError(f"'{target}' is neither a run folder (recipe.yaml), a checkpoint of one nor a model "
                                "folder (config.json). Give a run's folder (runs/NAME), one of its "
                                "checkpoints/step_N, a model folder or a hub id")
        _readable(target)
        return Target(target, {"pretrained": target, "dtype": dtype}, None)
    recipe = run_recipe(path)
    chats = {"system_instruction": recipe.data.system_prompt,
             "chat_template_args": dict(recipe.data.chat_template_kwargs or {})}
    return replace(_resolve_run(path, recipe, target, dtype=dtype), chats=chats,
                   chat_trained=trained_on_chats(recipe.data))


def template_note(target: Target) -> str | None:
    """A word where a run that trained on chats is scored without --apply-chat-template: the harness's own warning
    of an instruct model scored without its template is silenced with its INFO lines (quiet), and the README's first
    example (a LoRA of Mistral-7B-Instruct trained through its template) is that case (audit 33)."""
    if not target.chat_trained:
        return None
    return (f"note: {target.run} trained on chats rendered through its chat template, and the tasks' prompts are "
            "scored as plain text; --apply-chat-template renders them as it trained (its system prompt and template "
            "settings too). Both are legitimate; published few-shot numbers are usually without it")


def _resolve_run(path: Path, recipe, target: str, *, dtype: str) -> Target:
    """A run folder's or a checkpoint's Target (resolve)."""
    from llmtrain.run.replies import unreadable_checkpoint
    from llmtrain.run.rundir import unfinished

    checkpoint = (path / "train_state.json").is_file()
    run = path.parent.parent if checkpoint else path
    if checkpoint and (problem := recipe_problem(recipe, target, adapter=recipe.lora is not None)
                       or unreadable_checkpoint(path)):  # (had been found loading it, after "scoring ...")
        raise LLMTrainError(problem)
    if checkpoint:
        return Target(str(path), _built_args(recipe, dtype), run, _loader(path, dtype), recipe.model.name_or_path)
    final = path / "final"
    if not final.is_dir():
        raise LLMTrainError(unfinished(path, "Evaluate"))
    if not (final / "adapter_config.json").is_file():
        if problem := recipe_problem(recipe, target, adapter=False):
            raise LLMTrainError(problem)
        return Target(str(final), {"pretrained": str(final), "dtype": dtype}, run, base=recipe.model.name_or_path)
    if problem := recipe_problem(recipe, target, adapter=True):
        raise LLMTrainError(problem)
    base = recipe.model.name_or_path
    config = _readable(base)
    if spare_rows(config, final):  # the harness would cut the base's head to the tokenizer: handed over built
        return Target(f"{final} (LoRA on {base}, its {config.get_text_config().vocab_size:,} vocabulary rows kept)",
                      {"pretrained": base, "peft": str(final), **_built_args(recipe, dtype)}, run,
                      _loader(path, dtype), base)
    if recipe.model.quantize:  # the harness's hf model does not quantize a base as llmtrain does: handed over built
        return Target(f"{final} (LoRA on {base} in 4 bits, {recipe.model.quantize})",
                      {"pretrained": base, "peft": str(final), **_built_args(recipe, dtype)}, run,
                      _loader(path, dtype), base)
    if recipe.model.rope_scaling is not None:  # nor scale its rotary embedding as the run did: handed over built
        return Target(f"{final} (LoRA on {base}, RoPE {recipe.model.rope_scaling.rope_type} x "
                      f"{recipe.model.rope_scaling.factor:g})", {"pretrained": base, "peft": str(final),
                                                                **_built_args(recipe, dtype)}, run,
                      _loader(path, dtype), base)
    return Target(f"{final} (LoRA on {base})", {"pretrained": base, "peft": str(final), "tokenizer": str(final),
                                                 "dtype": dtype}, run, base=base)


def spare_rows(config, final: Path) -> bool:
    """Whether a LoRA run's base (`config`) has more vocabulary rows than final/'s tokenizer has tokens (Qwen's bases:
    151,936 rows, 151,669 tokens; model.new_tokens takes spare rows and keeps them). The harness's peft path resizes
    the base to the tokenizer before it reads the adapter: a run that saved the embeddings or the head
    (modules_to_save, new tokens) then failed to load in a size-mismatch traceback, and any other was scored with
    its softmax over fewer rows than it trained with and its merged export is scored with (audit 33)."""
    from transformers import AutoTokenizer

    return config.get_text_config().vocab_size > len(AutoTokenizer.from_pretrained(final))


def _readable(model: str):
    """Refuse, in llmtrain's paragraph, a model the harness could not read (a hub id not in the cache without the
    hub, a folder without a config): its config is read here, as load_model reads it (the harness would end in
    transformers' OSError and its traceback). Returns the config."""
    from llmtrain.capabilities import scorer_problem
    from llmtrain.config import ModelConfig
    from llmtrain.model.modeling import load_model_config

    config = load_model_config(ModelConfig(name_or_path=model), key="the model to score")  # (not a recipe's keys)
    if problem := scorer_problem(config, model, "the model to score"):
        raise LLMTrainError(problem + ". Evaluate the policy it was trained for")
    return config


def base_of(ours: Target, *, dtype: str) -> Target:
    """--baseline base: the model the run started from. A QLoRA run's base is scored as it trained on it, quantized
    (the unquantized base would put the quantization's cost into the difference); any other's as a model folder or
    hub id."""
    if ours.run is None or ours.base is None:
        raise LLMTrainError("--baseline base means the run's base model, and the target is not a run; give the "
                            "baseline model's folder or hub id")
    from llmtrain.run.rundir import run_recipe

    recipe = run_recipe(ours.run)
    if recipe.model.random_init:  # (model.name_or_path's trained weights had been scored as where it started)
        raise LLMTrainError(f"--baseline base means the model the run started from, and {ours.run} started from "
                            "random weights (model.random_init: true): there is none to score. Give the baseline "
                            "model's folder or hub id, or leave --baseline out")
    if not recipe.model.quantize:
        return resolve(ours.base, dtype=dtype)

    def load(device: str):
        import torch

        from llmtrain.model.modeling import load_model, load_tokenizer
        from llmtrain.run.replies import trained_model

        model_cfg = trained_model(recipe)
        model = load_model(model_cfg, None, device=torch.device(device))
        model.set_attn_implementation("sdpa")
        return model.eval(), load_tokenizer(model_cfg)
    return Target(f"{ours.base} (in 4 bits, {recipe.model.quantize})",
                  {"pretrained": ours.base, "quantize": recipe.model.quantize}, None, load)


def recipe_problem(recipe, target: str, *, adapter: bool) -> str | None:
    """Why the harness cannot score a run of `recipe` (its final/ a LoRA adapter where `adapter`), in a paragraph; None
    where it can. Asked by `llmtrain eval` and, for eval: in a recipe, before training starts."""
    if recipe.reward_model is not None:
        return (f"'{target}' is a reward model's run: it scores sequences under a one-output head and has no LM head "
                "for a benchmark's likelihoods or generations. Evaluate the policy it trained")
    if not adapter:
        return None
    from llmtrain.run.replies import unsaved_base

    return unsaved_base(recipe.model, target)


def _built_args(recipe, dtype: str) -> dict:
    """What a model handed over built records of itself (the results' model_args): its dtype, --dtype's where given (a
    4-bit base refuses another: it is scored as the run held it), else the run's; a 4-bit base's quantization."""
    if dtype not in DTYPES:
        raise LLMTrainError(f"--dtype {dtype}: give auto (the run's {recipe.model.dtype}), float32, bfloat16 or "
                            "float16")
    if recipe.model.quantize and dtype != "auto":
        raise LLMTrainError(f"--dtype {dtype}: this run's base is held in 4 bits ({recipe.model.quantize}, "
                            "model.quantize) and is scored as the run held it, its compute dtype the run's: leave "
                            "--dtype out")
    return {"dtype": recipe.model.dtype if dtype == "auto" else dtype,
            **({"quantize": recipe.model.quantize} if recipe.model.quantize else {})}


def _loader(path: Path, dtype: str = "auto"):
    """A function of the device returning (model, tokenizer) as `llmtrain generate` loads `path` (a checkpoint, or a
    run whose final/ is an adapter on a 4-bit base): handed to the harness as objects, in --dtype where given (it had
    been ignored), the tokenizer with the run's chat template (--apply-chat-template: a checkpoint had been rendered
    through its base's, exact match 0.0 where final/ of the same weights scored 1.0)."""
    def load(device: str):
        import torch

        from llmtrain.run.replies import load_source

        source = load_source(str(path), device=device)
        if dtype != "auto":
            source.model.to(getattr(torch, dtype))
        if source.template is not None:
            source.tokenizer.chat_template = source.template
        base = source.model.get_base_model() if hasattr(source.model, "get_base_model") else source.model
        base.set_attn_implementation("sdpa")  # the run's varlen attention trains only (no KV cache)
        return source.model, source.tokenizer
    return load


def check_recipe(recipe, *, tasks: bool = True) -> None:
    """A recipe's eval: section, before anything is written: the harness installed, the run scorable, final/ saved,
    and (`tasks`) the tasks known and their data readable (the harness's index: seconds; `llmtrain launch` leaves
    them to the processes)."""
    import importlib.util

    if recipe.eval is None:
        return
    if problem := recipe_problem(recipe, recipe.output_dir, adapter=recipe.lora is not None):
        raise LLMTrainError(f"eval: {problem}; or remove the eval: section")
    if not recipe.checkpoint.save_final:
        raise LLMTrainError("eval: scores final/, and checkpoint.save_final is false: set it true, or remove the "
                            "eval: section (and run `llmtrain eval` on a checkpoint)")
    if importlib.util.find_spec("lm_eval") is None:
        raise LLMTrainError(f"eval: {INSTALL}; or remove the eval: section")
    if not tasks:
        return
    quiet()
    check_tasks(recipe.eval.tasks, task_manager(recipe.eval.include_path, recipe.eval.tasks),
                folders="eval.include_path")


def after_training(recipe, accelerator, say) -> Path | None:
    """eval: on the finished run's final/, every process taking part as under `accelerate launch` (the harness splits
    the requests over GPUs); the main process prints the table and writes RUN/lm_eval/. The training's model and
    optimizer are gone by now (their memory given back first)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    b = recipe.eval
    target = resolve(recipe.output_dir, dtype="auto")
    chats = rendering(target) if b.apply_chat_template else {}
    how = dict(num_fewshot=b.num_fewshot, batch_size=b.batch_size, limit=b.limit,
               apply_chat_template=b.apply_chat_template, device=str(accelerator.device),
               **({"chats": chats} if chats else {}))
    say(f"eval: scoring {target.name} on {', '.join(b.tasks)} (lm-evaluation-harness)")
    results = evaluate(target, b.tasks, task_manager(b.include_path, b.tasks), **how, accelerator=accelerator)
    if not accelerator.is_main_process or results is None:
        return None
    say(table(results))
    path = write(target.run, record(target, b.tasks, how, results))
    say(f"eval: wrote {path}")
    return path


def record(target: Target, tasks: list[str], how: dict, results: dict, base: Target | None = None,
           base_results: dict | None = None) -> dict:
    """What RUN/lm_eval/TASKS.json holds: the model, the settings, the harness's results and versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        harness = version("lm-eval")
    except PackageNotFoundError:
        harness = None
    return {"target": target.name, "tasks": tasks, "model_args": target.model_args, **how,
            "results": results["results"], "versions": results.get("versions"), "n-shot": results.get("n-shot"),
            "lm_eval_version": harness,
            **({"baseline": {"target": base.name, "results": base_results["results"]}} if base else {})}


def task_manager(include_path: list[str] | None, tasks: list[str] = ()):
    """The harness's tasks, with the YAML task folders given (tasks on local files). When every task named is a plain
    task in those folders, only they are indexed: the harness's own index of its ~14,000 YAML files takes about 20 s
    a process, for tasks that are not used (a group or tag may name the harness's tasks, so it gets the full index)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LLMTrainError(INSTALL) from None
    for folder in include_path or []:
        if not Path(folder).is_dir():
            raise LLMTrainError(f"--include-path '{folder}' is not a folder; give a folder of the harness's task YAML "
                                "files (tasks/ has the tiny task's)")
    if include_path and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        kinds = [getattr(getattr(local.task_index.get(n), "kind", None), "name", None) for n in tasks]
        if all(kind in ("TASK", "PY_TASK") for kind in kinds):
            return local
    return TaskManager(include_path=include_path or None)


def check_tasks(names: list[str], manager, *, folders: str = "--include-path") -> None:
    """The tasks by name, their data read now (datasets caches it for the evaluation), before any model is loaded: an
    unknown name is said with the nearest ones, a task whose data is on the hub (unreachable, or offline) with where
    to point it instead."""
    from llmtrain.hub import local_task, task_yaml

    known = set(manager.all_tasks)
    if unknown := [n for n in names if n not in known]:
        near = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        raise LLMTrainError("unknown task" + ("s " if len(unknown) > 1 else " ") + "; ".join(
            f"'{n}'" + (f" (nearest: {', '.join(near[n])})" if near[n] else "") for n in unknown)
            + f". `lm_eval ls tasks` lists the {len(known):,} the harness knows; a task on local files is a YAML "
            f"file in a folder given with {folders} (tasks/tiny_reverse.yaml)")
    for name in names:
        try:
            manager.load([name])
        except Exception as e:  # datasets' ConnectionError, DatasetNotFoundError, offline mode, a missing file
            config = getattr(manager.task_index.get(name), "yaml_path", None) or ""
            if isinstance(e, FileNotFoundError):
                raise LLMTrainError(
                    f"task '{name}' reads files that are not there ({str(e).splitlines()[0][:200]}). A task's "
                    f"data_files are read from the folder the command runs in ({Path.cwd()}): run it from the folder "
                    f"they are relative to, or give absolute paths in its YAML ({config or 'the task file'})") from None
            if config and (conf := task_yaml(config)) is not None and local_task(conf):  # (audit 33: hub advice)
                raise LLMTrainError(
                    f"task '{name}' could not be built from its YAML ({config}), which reads local files: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200]}. Fix the YAML: its doc_to_text and "
                    "doc_to_target name fields of the data's rows ({{field}}), and its test_split (or "
                    "validation_split) is a split its data_files give") from None
            raise LLMTrainError(
                f"task '{name}' could not read its data ({type(e).__name__}: {str(e).splitlines()[0][:200]}). A "
                "task whose dataset_path is a hub dataset needs the hub (or the dataset in the local Hugging Face "
                "cache); without it, copy its YAML" + (f" ({config})" if config else "") + " into a folder of your "
                "own with dataset_path: json and dataset_kwargs: {data_files: {test: FILE}} pointing at local files, "
                "and pass that folder with --include-path (eval.include_path in a recipe)") from None


DTYPES = ("auto", "float32", "bfloat16", "float16")


def command_options(batch_size: str, *, limit: float | None, dtype: str, device: str | None) -> tuple[int | str, str]:
    """`llmtrain eval`'s --batch-size (a count, auto or auto:N) and --device (default: cuda where there is one), each
    refused in one paragraph before anything loads, with --limit 0 and an unknown --dtype: they had ended in the
    harness's tracebacks, or (a batch of 0, -2, 'autox'; a device 'bogus') run as one batch of every request on the
    CPU and been recorded as given."""
    import re

    import torch

    if re.fullmatch(r"auto(:[1-9]\d*)?", batch_size):
        size: int | str = batch_size
    elif re.fullmatch(r"[1-9]\d*", batch_size):
        size = int(batch_size)
    else:
        raise LLMTrainError(f"--batch-size {batch_size}: give a number of examples a forward pass (e.g. 16), auto "
                            "(the largest that fits, found by the harness) or auto:N (found again N times)")
    if limit is not None and limit <= 0:
        raise LLMTrainError(f"--limit {limit:g} scores nothing: give a number of examples a task (e.g. 100), a share "
                            "of them below 1 (0.1), or leave it out for all")
    if dtype not in DTYPES:
        raise LLMTrainError(f"--dtype {dtype}: give {', '.join(DTYPES[:-1])} or {DTYPES[-1]} (auto: the model's own)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # the harness's own default is cuda
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise LLMTrainError(f"--device {device} is not a device: give cuda, cuda:N, cpu or mps (default: cuda where "
                            "there is one)") from None
    backend = getattr(torch, kind, None) if kind != "cpu" else None
    if kind != "cpu" and not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
        raise LLMTrainError(f"--device {device}: this machine has no {kind} device that torch can use: leave "
                            "--device out (cuda where there is one, else cpu) or give --device cpu")
    return size, device


def evaluate(target: Target, tasks: list[str], manager, *, num_fewshot: int | None, batch_size: int | str,
             limit: float | None, apply_chat_template: bool, device: str | None, accelerator=None,
             chats: dict | None = None) -> dict | None:
    """The harness's results for `target` on the tasks, with its CLI's defaults (None on every process but the main
    one); `accelerator`: the processes taking part (a finished run's; else accelerate launch's, share_requests).
    `chats`: with apply_chat_template, the run's rendering of its chats (`rendering`: system_instruction,
    chat_template_args)."""
    import torch
    from lm_eval import simple_evaluate

    chats = (chats or {}) if apply_chat_template else {}
    template_args = {"chat_template_args": chats["chat_template_args"]} if "chat_template_args" in chats else {}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # the harness's own default is cuda
    model, args = "hf", {**target.model_args, **template_args}
    if target.load is not None:
        from lm_eval.models.huggingface import HFLM

        instance, tokenizer = target.load(device)
        model = share_requests(HFLM(pretrained=instance, tokenizer=tokenizer, batch_size=batch_size,
                                    **template_args), accelerator)
        args = None
    import lm_eval.evaluator as harness

    probe, harness.get_git_commit_hash = harness.get_git_commit_hash, _git_hash
    try:
        return simple_evaluate(model=model, model_args=args, tasks=tasks, num_fewshot=num_fewshot,
                               batch_size=batch_size, device=device, limit=limit,
                               apply_chat_template=apply_chat_template, log_samples=False, task_manager=manager,
                               system_instruction=chats.get("system_instruction"))
    except Exception as e:  # the harness reads the weights: a damaged file had been safetensors' traceback (audit 33)
        from llmtrain.model.modeling import DAMAGED

        if type(e).__name__ not in DAMAGED or args is None:
            raise
        where = " or ".join(f"'{args[k]}'" for k in ("peft", "pretrained") if k in args)
        raise LLMTrainError(f"the weights in {where} could not be read ({type(e).__name__}: {e}): a weights file is "
                            "truncated or damaged. Copy the folder again from where it was written (or score one of "
                            "the run's checkpoints: llmtrain eval RUN/checkpoints/step_N).") from None
    finally:
        harness.get_git_commit_hash = probe


def _git_hash() -> str | None:
    """The harness's results' git_hash (lm_eval.loggers.utils.get_git_commit_hash) as it finds it, without git's
    "fatal: not a git repository" on the console, once a model, wherever llmtrain eval runs outside a repository."""
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def share_requests(lm, accelerator=None):
    """The harness scores a model it is handed built (a checkpoint, a 4-bit base: Target.load) as if alone, so under
    `accelerate launch` every process would score every request. Give it the processes, as it takes them for a model
    it loads itself on GPUs: each scores its share of the requests (by rank) and the main process gathers them (over
    gloo on CPUs, as llmtrain's Accelerator joins them: cpu=True). `accelerator`: the run's, after training."""
    import torch
    from accelerate import Accelerator, PartialState

    cpu = not torch.cuda.is_available()
    if accelerator is None and PartialState(cpu=cpu).num_processes > 1:
        accelerator = Accelerator(cpu=cpu)
    if accelerator is not None and accelerator.num_processes > 1:
        lm._rank, lm._world_size, lm.accelerator = accelerator.process_index, accelerator.num_processes, accelerator
    return lm


def quiet() -> None:
    """The harness's and datasets' INFO lines and progress bars off: the command says what it does."""
    import importlib

    import datasets
    import transformers
    from tqdm import tqdm

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for name in ("lm-eval", "lm_eval", "lm_eval.models.huggingface", "lm_eval.evaluator"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Silent(tqdm):  # the harness's bars (building contexts, running requests) pass disable= themselves, so
        def __init__(self, *args, **kwargs):  # neither TQDM_DISABLE nor a default reaches them
            super().__init__(*args, **{**kwargs, "disable": True})

    for name in ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # not installed: task_manager says how to install it
            return
        if getattr(module, "tqdm", None) is tqdm:
            module.tqdm = Silent


def table(results: dict) -> str:
    """The harness's own markdown table (what `lm_eval` prints)."""
    from lm_eval.utils import make_table

    return make_table(results)


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the harness's results (numbers only, stderr apart)."""
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float))
                   and "_stderr" not in k and k != "alias"}
            for task, metrics in results["results"].items()}


def side_by_side(ours: dict, base: dict, *, names: tuple[str, str]) -> list[tuple[str, str, str, str, str]]:
    """(task, metric, model, baseline, difference) for every metric both have."""
    rows = []
    a, b = scores(ours), scores(base)
    for task in a:
        for metric, value in a[task].items():
            if metric in b.get(task, {}) and metric != "sample_len":
                rows.append((task, metric, f"{value:.4f}", f"{b[task][metric]:.4f}", f"{value - b[task][metric]:+.4f}"))
    return rows


def unkept(run: Path) -> str | None:
    """Why RUN/lm_eval/ cannot take the results (a file there, a read-only run), said before the scoring: it had been
    a traceback after hours of it, the printed table the only copy (audit 46); None where it can."""
    import os

    from llmtrain.run.rundir import cannot_create

    folder = run / "lm_eval"
    if folder.exists() and not folder.is_dir():
        return f"'{folder}' is a file, not a folder"
    if folder.is_dir():
        return None if os.access(folder, os.W_OK | os.X_OK) else f"the folder '{folder}' is not writable"
    return cannot_create(folder, "the results folder")


def write(run: Path, record: dict) -> Path:
    """The call's results as a new JSON file in RUN/lm_eval/ (never over an earlier one); a write that fails (a full
    disk) is a paragraph that says the printed table is the only copy."""
    folder = run / "lm_eval"
    stem = "-".join(record["tasks"])[:80]
    try:
        folder.mkdir(exist_ok=True)
        path = folder / f"{stem}.json"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"{stem}-{n}.json"
        text = json.dumps(record, indent=1, default=str)
        with open(path, "x") as f:  # a new file, never one another call wrote meanwhile
            f.write(text)
    except OSError as e:
        raise LLMTrainError(f"the scores could not be written to {folder} ({e.strerror or e}): the tables printed "
                            "above are their only copy. Free space there (or make it writable) and score again to "
                            "keep them.") from None
    return path
