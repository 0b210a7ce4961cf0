"""Checks that run before anything is loaded or written: can this checkpoint be resumed by this recipe, and
is the run already complete.

Everything here reads the checkpoint's `train_state.json` and `recipe.yaml` (and the run's summary.json), so
a resume that cannot work is refused in a second, with the key that differs and what to do, before the data
is tokenised, the model loaded or the run folder touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from llmtrain.capabilities import MODES, SECTIONS, mode_of, section_of
from llmtrain.config import SAMPLING, Recipe
from llmtrain.data.sources import is_split_name
from llmtrain.errors import LLMTrainError
from llmtrain.run.checkpoint import FSDP_MODEL_DIR, step_dirs
from llmtrain.run.rundir import finished_without_checkpoint, has_checkpoints
from llmtrain.run.state import position_problem

# Keys whose change makes a checkpoint a different run: refused, whatever the flags.
IDENTITY = ["model.name_or_path", "model.tokenizer", "model.dtype", "model.random_init", "data.path", "data.sources",
            "data.name", "data.split", "data.format", "data.fields", "data.roles", "data.chat_template",
            "data.system_prompt", "data.max_seq_len", "data.train_on_prompt", "data.chat_template_kwargs",
            "data.packing", "train.seed", "train.micro_batch_tokens"]
# Keys that change the rest of the run (the learning-rate curve, the number of steps): allowed, and said, only
# with --allow-recipe-change.
# (With token budgets, the bins of a step, accumulation x processes, are compared as a whole: 2 processes x
# accumulation 2 resume as 1 process x 4.)
SCHEDULE = ["train.max_steps", "train.epochs", "train.lr", "train.schedule", "train.warmup_steps",
            "train.min_lr_ratio", "train.weight_decay", "train.betas", "rl.num_iterations"]
# Keys that change what the rest of the run trains (its loss, reference, sampling, rewards, gradient clip,
# precision, adapter): allowed, and said, only with --allow-recipe-change, as SCHEDULE's are. A section stands for
# each of its keys, every mode's section (capabilities.SECTIONS) among them; which mode's section a recipe has at all
# is the run itself.
OBJECTIVE = ["lora", *SECTIONS, "train.eps", "train.neftune_alpha", "train.sft_loss", "train.max_grad_norm",
             "train.disable_dropout",
             "train.mixed_precision", "model.quantize", "model.rope_scaling",
             "model.router_aux_loss_coef"]
# What fixes a finished run's weights: a finished run whose recipe differs in none of these is complete as it is
# (logging, checkpoint, eval and layout settings change nothing of what it trained).
TRAINED = [*IDENTITY, *SCHEDULE, *OBJECTIVE, "train.micro_batch_size", "train.grad_accum_steps", "train.optimizer",
           "model.new_tokens", "data.eval_split"]


# Keys of a mode's section that change how the run computes its steps, or what it evaluates, not what it trains
# (the same completions' distribution, losses and gradients): taken at resume without the flag, and said; a finished
# run is complete whatever they are (they had been refused as "what it trains would differ"; audit 57).
# (Not merged_copy: a 16-bit merged copy is not the trained policy, and its samples differ: docs/rl.md.)
HOW = ["rl.num_generations_eval", "rl.sampler", "rl.micro_batch_tokens", "distill.sampler"]

# a local file or folder, however written (a split's name, a fraction or a bool is left as it is)
PATHS = ("model.name_or_path", "model.tokenizer", "data.path", "data.eval_split", "data.chat_template",
         "distill.teacher")


def _same(key: str, was, now) -> bool:
    """A recipe value unchanged: a path named otherwise (a trailing slash, ./, ..) is the same file where it exists,
    in data.path's list and in each of data.sources too (it had been refused as "another model or other data"; audit
    55)."""
    return was == now or _as_files(key, was) == _as_files(key, now)


def _as_files(key: str, value):
    """`value` with each existing local path of it resolved (PATHS, and each data.sources entry's path)."""
    def resolved(v):
        if isinstance(v, list):
            return [resolved(x) for x in v]
        try:
            return str(Path(v).resolve()) if isinstance(v, str) and Path(v).exists() else v
        except OSError:  # (a name too long to be a path)
            return v

    def entry(e):  # a data.sources entry's path and eval_split, an rl.rewards entry's path
        return {**e, **{k: resolved(e[k]) for k in ("path", "eval_split") if k in e}} if isinstance(e, dict) else e

    if key in PATHS:
        return resolved(value)
    if key in ("data.sources", "rl.rewards") and isinstance(value, list):
        return [entry(e) for e in value]
    return value


def _no_step_left(step: int) -> str:
    """What a finished run given a change at its last checkpoint (`step`) is told: check_resume's and finished_run's
    refusals (the flag had been advised, then refused as "nothing is left to train"; audit 57)."""
    return (f"no step is left to train with the new values. Raise train.max_steps above {step:,} (with "
            "--allow-recipe-change) to train it further with them, or start a new run in another output_dir; nothing "
            "was changed.")


def _split_how(recipe: dict) -> tuple[dict, dict]:
    """(the recipe without HOW's keys, {HOW key: its value})."""
    import copy

    out, how = copy.deepcopy(recipe), {}
    for dotted in HOW:
        section, leaf = dotted.split(".")
        if isinstance(out.get(section), dict) and leaf in out[section]:
            how[dotted] = out[section].pop(leaf)
    return out, how


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = (d or {}).get(part)
    return d


def _leaves(saved: dict, now: dict, key: str):
    """(dotted key, saved value, value now) of each key under `key` whose value differs (`key` itself where either
    side is not a section)."""
    a, b = _get(saved, key), _get(now, key)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from _leaves(saved, now, f"{key}.{k}")
    elif a != b:
        yield key, a, b


def _recipe_of(path: Path) -> dict:
    """A saved recipe with today's defaults filled in (a key added since it was written reads as its default)."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise LLMTrainError(f"cannot read {path} ({e}); the checkpoint is incomplete. Resume from another one "
                            "(--resume PATH) or start again.") from None
    try:
        return Recipe.model_validate(raw).model_dump(mode="json")
    except ValueError:  # written by a version with keys that no longer exist: compare what is there
        return raw


def check_resume(ckpt: Path, recipe: Recipe, *, world: int, fsdp: bool, allow_recipe_change: bool,
                 files: list[tuple[str, str]] | None = None) -> list[str]:
    """Refuse a resume that cannot work; return the notes of what changed (allowed schedule changes). `files`: the
    input files changed since the checkpoint (inputs_changed), as the main process's disk says; None: read here."""
    (saved, saved_how), (now, now_how) = _split_how(_recipe_of(ckpt / "recipe.yaml")), _split_how(
        recipe.model_dump(mode="json"))
    how = f"Resume with the recipe that wrote it ({ckpt / 'recipe.yaml'}), or start a new run in another output_dir."
    if (saved.get("lora") is None) != (now.get("lora") is None):
        kind = "LoRA" if saved.get("lora") is not None else "full fine-tuning"
        raise LLMTrainError(f"checkpoint {ckpt} was written by a {kind} run and this recipe is "
                            f"{'LoRA' if now.get('lora') is not None else 'a full fine-tune'}. {how}")
    if (was := _get(saved, "model.new_tokens")) != (got := _get(now, "model.new_tokens")):  # (it had been allowed,
        # then the checkpoint's embedding and head ended in torch's size mismatch at its load)
        raise LLMTrainError(f"checkpoint {ckpt} has model.new_tokens={was!r} and this recipe model.new_tokens="
                            f"{got!r}: the embedding and the head have other rows, which the checkpoint's cannot be "
                            f"read into. Set model.new_tokens={was!r} to resume it. {how}")
    if saved.get("lora") is not None:
        # what the checkpoint's adapter or optimizer state cannot be read into (another value of the others is a
        # change of what the run trains: OBJECTIVE); LoRA+'s rates, not whether it is on, may change
        for key, why in (("r", "the adapter's shapes differ"), ("target_modules", "the adapter's shapes differ"),
                         ("modules_to_save", "the adapter's shapes differ"),
                         ("dora", "the adapter's parameters differ (DoRA's magnitude vectors)"),
                         ("lr_ratio", "LoRA+ gives the optimizer other parameter groups (lora_B's, the embeddings') "
                                      "than plain LoRA")):
            was, got = saved["lora"].get(key), now["lora"].get(key)
            if was != got and (key != "lr_ratio" or None in (was, got)):
                raise LLMTrainError(f"checkpoint {ckpt} has lora.{key}={was!r} and this recipe lora.{key}={got!r}: "
                                    f"{why}, which the checkpoint's state cannot be read into. Set lora.{key}={was!r} "
                                    f"to resume it. {how}")
    if (was := _get(saved, "train.optimizer") or "adamw") != now["train"]["optimizer"]:
        raise LLMTrainError(f"checkpoint {ckpt} holds train.optimizer={was}'s state and this recipe has "
                            f"train.optimizer={now['train']['optimizer']}: one optimizer's state cannot be read into "
                            "the other (AdamW's moments in the weights' dtype, bitsandbytes' in blocks of 8 bits). Set "
                            f"train.optimizer={was} to resume it, or start a new run in another output_dir.")
    if section_of(saved) != section_of(now):  # GRPO <-> RLOO is a change of rl.algorithm, under OBJECTIVE
        trains = [MODES[mode_of(r)].name for r in (saved, now)]
        raise LLMTrainError(f"checkpoint {ckpt} was written by a run of {trains[0]} and this recipe trains "
                            f"{trains[1]}: that is another run. To go on from its weights, set model.name_or_path to "
                            f"its final/ in a recipe with another output_dir. {how}")
    for key in IDENTITY:
        if not _same(key, _get(saved, key), _get(now, key)):
            raise LLMTrainError(f"checkpoint {ckpt} was written with {key}={_get(saved, key)!r}; this recipe has "
                                f"{_get(now, key)!r}. That is another model or other data, not the same run. {how}")
    if (was := _get(saved, "data.eval_split")) != (eval_split := _get(now, "data.eval_split")) and any(
            isinstance(v, float) for v in (was, eval_split)):  # (a file or a split of its own leaves the train rows)
        raise LLMTrainError(f"checkpoint {ckpt} was written with data.eval_split={was!r}; this recipe has "
                            f"{eval_split!r}. A fraction held out of the training file decides which rows train and "
                            f"their order, so the checkpoint's place in the epoch would point into other rows (and "
                            f"the eval could hold rows it trained on). Set data.eval_split={was!r} to resume it. {how}")
    sharded = (ckpt / FSDP_MODEL_DIR).is_dir()
    if sharded != fsdp and not (ckpt / "pipeline").is_dir():  # a pipeline's stage files are whole, FSDP or not
        unknown = sharded and "tensor_parallel" not in _state(ckpt)  # (a checkpoint written before it was recorded)
        raise LLMTrainError(
            f"checkpoint {ckpt} was written {'under' if sharded else 'without'} FSDP and this launch "
            f"{'does not use' if sharded else 'uses'} it. Resume it under the launch that wrote it: "
            f"{resume_launch(ckpt)}"
            f"{' (with the launch config it was written under: a tensor-parallel one too)' if unknown else ''}.")
    staged, stages_now = (ckpt / "pipeline").is_dir(), now.get("parallel", {}).get("pipeline_parallel", 1)
    if staged != (stages_now > 1):  # another pipeline degree (or schedule) is fine: the stages' files are by name
        raise LLMTrainError(
            f"checkpoint {ckpt} was written {'by' if staged else 'without'} pipeline stages and this recipe has "
            f"parallel.pipeline_parallel={stages_now}: their weights and optimizer state are saved "
            f"{'one file a stage' if staged else 'as one model'}. Resume it with parallel.pipeline_parallel "
            f"{'> 1 (any degree)' if staged else '= 1'}.")
    state = _state(ckpt)
    files = inputs_changed(ckpt, recipe) if files is None else files
    if files and not allow_recipe_change:
        listed = "; ".join(f"{key}: {what}" for key, what in files)
        if all(key.endswith("eval_split") for key, _ in files):  # (said as training rows had been; review 122)
            raise LLMTrainError(f"the eval files have changed since checkpoint {ckpt} was written ({listed}): the "
                                "run's eval lines after the resume would not compare with those before it. Put the "
                                "files back, or resume with --allow-recipe-change to evaluate on these (said).")
        raise LLMTrainError(f"the files this run trains from have changed since checkpoint {ckpt} was written ("
                            f"{listed}): resuming would go on with other weights or other rows under the "
                            "checkpoint's place in them. Put the files back, or start a new run in another "
                            "output_dir; to go on with these files, resume with --allow-recipe-change (said).")
    if not now["train"]["micro_batch_tokens"]:
        mb = now["train"]["micro_batch_size"]
        if state.get("examples_per_micro") != mb * world:
            want = state.get("examples_per_micro")
            fix = (f"Set train.micro_batch_size={want // world} (so that the product is {want}) to resume it"
                   if want and want % world == 0 else
                   f"{want} examples do not split over {world} data-parallel ranks: resume it on "
                   f"{' or '.join(str(n) for n in range(1, (want or 1) + 1) if want % n == 0)} (with "
                   f"train.micro_batch_size {want} / ranks)")
            accum_was, accum = _get(saved, "train.grad_accum_steps") or 1, now["train"]["grad_accum_steps"]
            same_batch = (f" (with train.grad_accum_steps={accum_was}, as it was written: the global batch is the "
                          "same, but micro_batch_size x data-parallel ranks fixes the order the rows are read in)"
                          if accum != accum_was and mb * world * accum == (want or 0) * accum_was else "")
            raise LLMTrainError(
                f"the checkpoint was written with micro_batch_size x data-parallel ranks = {want}, this run has "
                f"{mb} x {world} = {mb * world}. {fix}{same_batch}.")
    changed = [(k, _get(saved, k), _get(now, k)) for k in SCHEDULE if _get(saved, k) != _get(now, k)]
    changed += [c for key in OBJECTIVE for c in _leaves(saved, now, key) if c[0] not in SCHEDULE and not _same(*c)]
    # A step is grad_accum_steps global micro-batches; by tokens, a global micro-batch is one bin per process.
    per_rank = bool(now["train"]["micro_batch_tokens"])
    before = (_get(saved, "train.grad_accum_steps") or 1) * (state.get("processes", world) if per_rank else 1)
    after = now["train"]["grad_accum_steps"] * (world if per_rank else 1)
    if before != after:
        what = ("token bins per step (train.grad_accum_steps x data-parallel ranks)" if per_rank else
                "train.grad_accum_steps")
        changed.append((what, before, after))
    if changed and not allow_recipe_change:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed)
        ended, step = _finished_after(ckpt), int(state.get("step") or 0)
        if _summary_steps(ckpt.parent.parent) == step and not any(k in SCHEDULE for k, _, _ in changed):
            # the finished run's last checkpoint: no step is left to train with the new values (the flag had been
            # advised, and then refused as "nothing is left to train"; audit 57)
            raise LLMTrainError(f"this recipe changes {listed} against checkpoint {ckpt}, the last step of the run "
                                f"in {ckpt.parent.parent}, which is complete: {_no_step_left(step)}")
        raise LLMTrainError(f"this recipe changes {listed} against checkpoint {ckpt}: the rest of the run (its "
                            "learning-rate curve, its length, what it trains) would differ from the run that "
                            + (f"wrote it (which went on from it to finish at step {ended:,}: final/ is that run's, "
                               "with the recipe.yaml beside it; that recipe resumed says it is complete). "
                               if ended else "was interrupted. ") +
                            "Resume with the checkpoint's values, or pass --allow-recipe-change to continue with the "
                            "new ones.")
    if problem := position_problem(state, accum=now["train"]["grad_accum_steps"], processes=world,
                                   micro_batch_tokens=now["train"]["micro_batch_tokens"] or 0,
                                   written_accum=_get(saved, "train.grad_accum_steps")):
        raise LLMTrainError(problem)  # (after the changes: a refusal without the flag names them first)
    # what draws the completions, changed inside a generation round: from the next round (the checkpoint holds the
    # round's completions; the note had said "at resume"; audit 55)
    every, step = _get(saved, "rl.num_iterations") or 1, int(state.get("step") or 0)
    within = "" if every == 1 or not step % every else (
        f" (from step {step + every - step % every + 1}: step {step} is inside a generation round of "
        f"rl.num_iterations={every}, whose completions the checkpoint holds)")
    drawn = {f"rl.{k}" for k in ("num_generations", "max_completion_tokens", *SAMPLING)}
    return [f"{k} changed from {a!r} to {b!r} at resume" + (within if k in drawn else "")
            for k, a, b in changed] + [
        f"{k} changed from {saved_how.get(k)!r} to {now_how.get(k)!r} at resume (how the steps are computed or the "
        "eval is drawn, not what is trained)" for k in HOW if saved_how.get(k) != now_how.get(k)] + [
        f"the files of {key} changed since the checkpoint ({what}), taken with --allow-recipe-change"
        for key, what in files]


def input_files(recipe: Recipe) -> dict[str, list]:
    """The local files a run's weights come from, each [name, size, a hash of three 64 KiB samples of it], by recipe
    key: the model folder's weights, config and tokenizer, the training and eval data (data.path, data.eval_split's
    files, each data.sources path and eval_split), a chat template file, and the models that score or teach it
    (distill.teacher, each reward model of rl.rewards: replaced in place, they had been resumed on silently too).
    Hub ids and hub datasets have none. Saved with every checkpoint (TrainState.inputs) and compared at resume
    (check_resume): a model or a data file replaced under the same path (a base retrained with --overwrite, an edited
    dataset) had been resumed on silently: an adapter on another base, other rows at the checkpoint's place in the
    epoch (audit 55). By content, not by date: a copy made again (a job's local disk, another node) is the same."""
    skip = [Path(p).expanduser().resolve() for p in (recipe.data.cache_dir, recipe.output_dir)]

    def wanted(f: Path, root: Path, model: bool) -> bool:
        if any(p.startswith(".") for p in f.relative_to(root).parts) or any(s in f.resolve().parents for s in skip):
            return False
        if model:
            return f.suffix in (".safetensors", ".bin") or f.name in MODEL_FILES
        return f.suffix in DATA_SUFFIXES

    def listed(paths, *, model: bool = False) -> list:
        given = [paths] if isinstance(paths, str) else list(paths or [])
        out = []
        for k, name in enumerate(given):
            root = Path(name).expanduser()
            files = [root] if root.is_file() else sorted(
                f for f in root.rglob("*") if f.is_file() and wanted(f, root, model)) if root.is_dir() else []
            for f in files:
                label = str(f.relative_to(root)) if f != root else f.name
                out.append([f"{k + 1}:{label}" if len(given) > 1 else label, f.stat().st_size, _sampled(f)])
        return out

    def held_out(split) -> list:  # eval file(s); a fraction, or a split's name, is the training data's
        return listed(split) if isinstance(split, (str, list)) and not is_split_name(split) else []

    d = recipe.data
    found = {"model.name_or_path": listed(recipe.model.name_or_path, model=True), "data.path": listed(d.path),
             "data.eval_split": held_out(d.eval_split),
             "data.chat_template": listed(d.chat_template) if isinstance(d.chat_template, str) else []}
    for i, source in enumerate(d.sources or []):
        found[f"data.sources[{i}].path"] = listed(source.path)
        found[f"data.sources[{i}].eval_split"] = held_out(source.eval_split)
    if recipe.distill is not None:
        found["distill.teacher"] = listed(recipe.distill.teacher, model=True)
    for i, reward in enumerate(recipe.rl.rewards if recipe.rl is not None else []):
        found[f"rl.rewards[{i}].path"] = listed(reward.path, model=True) if reward.path else []
    return {k: v for k, v in found.items() if v}


MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "adapter_config.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def _sampled(f: Path, block: int = 1 << 16) -> str:
    """A hash of a file's first, middle and last 64 KiB (all of a small one): weights trained again, or rows edited,
    change it; three reads whatever the file's size."""
    import hashlib

    h, size = hashlib.sha256(), f.stat().st_size
    with f.open("rb") as fh:
        for at in sorted({0, max(0, size // 2 - block // 2), max(0, size - block)}):
            fh.seek(at)
            h.update(fh.read(block))
    return h.hexdigest()[:16]


def inputs_changed(ckpt: Path, recipe: Recipe) -> list[tuple[str, str]]:
    """[(recipe key, what changed)] for the checkpoint's input files that differ now (input_files; a checkpoint
    written before 2026-12-07 records none). Read on the main process (another node's copies are its own)."""
    was = _state(ckpt).get("inputs") or {}
    now, out = input_files(recipe) if was else {}, []
    for key, files in was.items():
        if key in now and now[key] != files:
            before, after = {f[0]: f[1:] for f in files}, {f[0]: f[1:] for f in now[key]}
            names = sorted(set(before) | set(after))
            what = [f"{n} {'added' if n not in before else 'gone' if n not in after else 'rewritten'}"
                    for n in names if before.get(n) != after.get(n)]
            out.append((key, ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")))
    return out


def resume_launch(ckpt: Path) -> str:
    """The command that resumes `ckpt` as it was written: FSDP's shards under an FSDP launch, any other under DDP (one
    process: finetune) on the processes its train_state.json records, with the CPU configs where this machine has no
    GPU (it had named fsdp.yaml first, "cpu_fsdp.yaml on a CPU" after; audit 41), and the recipe it holds."""
    import torch

    processes = _state(ckpt).get("processes")  # data-parallel ranks: a sequence group or a pipeline's stages more
    if isinstance(processes, int):
        parallel = _recipe_of(ckpt / "recipe.yaml").get("parallel") or {}
        processes *= int(parallel.get("sequence_parallel") or 1) * int(parallel.get("pipeline_parallel") or 1)
    sharded = (ckpt / FSDP_MODEL_DIR).is_dir()
    if processes == 1 and not sharded:
        return f"`llmtrain finetune {ckpt}/recipe.yaml --resume {ckpt}`"
    gpu = torch.cuda.is_available()
    config = f"accelerate_configs/{'' if gpu else 'cpu_'}{'fsdp' if sharded else 'ddp'}.yaml"
    tp = _state(ckpt).get("tensor_parallel") or 1  # (written since 2026-12-08: a TP run's had been named FSDP's, with
    # its data ranks as the processes; audit 57)
    if tp > 1:
        config = f"accelerate_configs/{'fsdp_tp' if gpu else 'cpu_tp'}.yaml"
        processes = processes * tp if isinstance(processes, int) else processes
    count = f" --num_processes {processes}" if isinstance(processes, int) else ""
    size = f" (its parallelism_config_tp_size: {tp})" if tp > 1 else ""
    return f"`llmtrain launch --config_file {config}{count} {ckpt}/recipe.yaml --resume {ckpt}`{size}"


def _finished_after(ckpt: Path) -> int | None:
    """The last step of the run in the checkpoint's output_dir where that run finished after the checkpoint (its
    summary.json says so), else None: a checkpoint a finished run kept, not where an interrupted one stopped."""
    steps = _summary_steps(ckpt.parent.parent)
    return steps if steps is not None and steps > int(_state(ckpt).get("step", 0)) else None


def _summary_steps(out: Path) -> int | None:
    """The step a run in `out` finished at (its summary.json), None where it has not finished."""
    try:
        return int(json.loads((out / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_steps_left(ckpt: Path | None, total_steps: int, *, out: Path) -> None:
    """Refuse a resume from a checkpoint at or past the run's last step (a complete run resumed with a changed
    schedule and --allow-recipe-change, the same train.max_steps): it would train 0 steps and write final/ again."""
    if ckpt is None or (step := int(_state(ckpt).get("step", 0))) < total_steps:
        return
    if step == total_steps and ((done := _summary_steps(out)) is None or done < step):  # stopped at its last step
        # before it finished (a stop during it, kill -9 before final/): the resume trains 0 steps and writes what the
        # stop left unwritten (a checkpoint past a lowered train.max_steps is refused below)
        return
    raise LLMTrainError(f"checkpoint {ckpt} is at step {step:,} and this recipe's run ends at step {total_steps:,} "
                        "(train.max_steps, or train.epochs over the data): nothing is left to train. Raise "
                        f"train.max_steps above {step:,} (with --allow-recipe-change) to train {out} further, or start "
                        "a new run in another output_dir; nothing was changed.")


def _state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / "train_state.json").read_text())
    except (OSError, ValueError) as e:
        raise LLMTrainError(f"cannot read {ckpt / 'train_state.json'} ({e}); the checkpoint is damaged. Resume from "
                            "another one (--resume PATH) or start again.") from None


def finished_run(out: Path, recipe: Recipe, *, allow_recipe_change: bool) -> dict | None:
    """The summary of a run in `out` that already completed with this recipe's training (TRAINED), else None.

    A complete run is left exactly as it is. One whose recipe now asks for more steps (or another schedule)
    continues only with --allow-recipe-change, from its newest checkpoint; any other difference is for
    check_resume to judge."""
    summary_path, saved_path = out / "summary.json", out / "recipe.yaml"
    if not (summary_path.is_file() and saved_path.is_file()):
        return None
    saved = _split_how(_recipe_of(saved_path))[0]
    if (_get(saved, "checkpoint.save_final") is not False or recipe.checkpoint.save_final) \
            and not (out / "final").is_dir():  # (final/ asked for now, where the run wrote none: not complete)
        return None
    # output_dir is `out` in both, however written (runs/x then /abs/runs/x: the finished run had been taken for
    # an interrupted one, and its refusal said so)
    now = {**_split_how(recipe.model_dump(mode="json"))[0], "output_dir": saved.get("output_dir")}
    if all(_same(*c) for k in TRAINED for c in _leaves(saved, now, k)):  # the same weights: logging, checkpoints,
        # eval and layout change nothing of a finished run (any change had trained its last steps again and written
        # final/ over it; audit 55)
        return json.loads(summary_path.read_text())
    changed = [k for k in SCHEDULE if _get(saved, k) != _get(now, k)]
    def without_changed(recipe: dict) -> dict:
        return {**recipe, "train": {k: v for k, v in recipe["train"].items() if f"train.{k}" not in changed}}

    same_otherwise = without_changed(saved) == without_changed(now)
    if not has_checkpoints(out):  # whatever the recipe changes, nothing can continue this run (rundir's refusal)
        raise LLMTrainError(finished_without_checkpoint(out, "auto"))
    if changed and same_otherwise and not allow_recipe_change:
        listed = ", ".join(f"{k} {_get(saved, k)!r} -> {_get(now, k)!r}" for k in changed)
        newest = int(step_dirs(out / "checkpoints")[-1].name.removeprefix("step_"))
        if isinstance(steps := _get(now, "train.max_steps"), int) and steps <= newest:  # the flag would meet "nothing
            # is left to train" (check_steps_left): said now (review of audit 57)
            raise LLMTrainError(f"the run in {out} is complete, and this recipe changes {listed}: its newest "
                                f"checkpoint is at step {newest:,}, so {_no_step_left(newest)}")
        raise LLMTrainError(f"the run in {out} is complete, and this recipe changes {listed}. To train it further "
                            "from its newest checkpoint with the new values, add --allow-recipe-change; nothing was "
                            "changed.")
    return None
