"""The run folder: one run at a time, never clobber what is not a run, and find the checkpoint to resume from.

`<output_dir>/.llmtrain-run` marks a folder as an llmtrain run and is its lock. The main process holds an
flock on it for the whole run; the kernel drops it when the process ends, however it ends (kill -9
included), so a lock is never stale. It records who holds it (pid, host, start, command) for the message
a second run into the same folder gets. `--overwrite` deletes only a marked folder (or one an older
llmtrain wrote: metrics.jsonl, recipe.yaml and checkpoints/), and only after the lock is taken; it
deletes everything in it but the lock file, which must stay the one file every run locks. A marked folder
whose run ended before it kept anything (no checkpoint, no final/, no summary.json) is started again without
--overwrite.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.run.checkpoint import remove_leftovers, resolve_resume, step_dirs

MARKER = ".llmtrain-run"
LEGACY = ("metrics.jsonl", "recipe.yaml", "checkpoints")  # what every run folder of an older llmtrain holds
HEADER = "This folder is an llmtrain run. The run that uses it holds a lock on this file; the last one to hold it:"


class RunDir:
    """The prepared output folder: the checkpoint to resume from (None: start at step 0) and, on the main
    process, the lock, held until `release()` (or the end of a `with` block, or of the process)."""

    def __init__(self, path: Path, checkpoint: Path | None, lock=None):
        self.path, self.checkpoint, self._lock = path, checkpoint, lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_output_dir(accelerator, out: Path, *, resume: str | None, overwrite: bool) -> Path | None:
    """Every refusal the folder can cause, reading only (train calls it before loading anything), and the
    checkpoint to resume from. The main process looks; the others get its answer or its refusal."""
    return _on_main(accelerator, lambda: _check(out, resume=resume, overwrite=overwrite, warn=accelerator.print))


def check_output_folder(out: Path, *, overwrite: bool, resume: str | None = None) -> None:
    """check_output_dir before any process exists (`llmtrain launch`). A run that resumes is checked for what the
    folder itself refuses (a file, not a run, in use by another run); which checkpoint it continues from, and whether
    that one is intact (every block of it read), each process checks."""
    _check(out, resume=resume, overwrite=overwrite, warn=lambda _: None, checkpoint=False)


def claim_output_dir(accelerator, out: Path, *, resume: str | None, overwrite: bool,
                     expected: Path | None = None) -> RunDir:
    """Lock the folder and make it ready (train calls it once every check has passed, right before training).
    Looks again under the lock: another run may have started since check_output_dir, and the checkpoint found
    now must be `expected`, the one check_output_dir found and the resume checks judged."""

    def claim():
        lock = _lock(out)
        try:
            checkpoint = _check(out, resume=resume, overwrite=overwrite, warn=lambda _: None, locked=True)
            if resume and checkpoint != expected:
                raise LLMTrainError(
                    f"the checkpoints in {out} changed while this run was starting: it checked {expected} and now "
                    f"finds {checkpoint} (another process wrote to the folder). This run stopped before writing anything; "
                    "start it again to resume from what is there now.")
            _make_ready(out, resume=resume, overwrite=overwrite)
        except BaseException:
            lock.close()
            raise
        return checkpoint, lock

    checkpoint, lock = _on_main(accelerator, claim, pair=True)
    return RunDir(out, checkpoint, lock)


def prepare_output_dir(accelerator, out: Path, *, resume: str | None, overwrite: bool) -> RunDir:
    """check_output_dir, then claim_output_dir."""
    checkpoint = check_output_dir(accelerator, out, resume=resume, overwrite=overwrite)
    return claim_output_dir(accelerator, out, resume=resume, overwrite=overwrite, expected=checkpoint)


def _on_main(accelerator, fn, *, pair: bool = False):
    """Run fn on the main process only; its (picklable) answer, or its refusal (errors.Relayed), given to every
    process (collectives.on_first). pair: fn returns (answer, what the main process keeps: its lock)."""
    from llmtrain.parallel.collectives import on_first

    kept = [None]

    def answer():
        value, kept[0] = fn() if pair else (fn(), None)
        return value

    value = answer() if accelerator.num_processes == 1 else on_first(answer, group=None)
    return (value, kept[0]) if pair else value


def _check(out: Path, *, resume: str | None, overwrite: bool, warn, locked: bool = False,
           checkpoint: bool = True) -> Path | None:
    """Refuse what must be refused, reading only, so that a refused run leaves the folder byte for byte as it
    was; return the checkpoint to resume from (checkpoint=False: the folder's own checks alone, None)."""
    if out.exists() and not out.is_dir():
        raise LLMTrainError(f"output_dir '{out}' is a file, not a folder. Set output_dir=<a folder path>.")
    if not out.exists() and (problem := cannot_create(out, "output_dir")):
        raise LLMTrainError(problem)
    present = _contents(out)
    if present and not (_is_run(out) or (resume and has_checkpoints(out))):
        raise LLMTrainError(_not_a_run(out, present, resume=resume, overwrite=overwrite))
    holder = None if locked else _holder(out)
    if holder:
        raise LLMTrainError(_in_use(out, holder))
    if present and not resume and not overwrite:
        if not _restartable(out):
            raise LLMTrainError(_exists(out))
        warn(f"output_dir '{out}' holds a run that ended before its first checkpoint ({', '.join(present[:4])}"
             f"{', ...' if len(present) > 4 else ''}): starting again there, its files replaced")
    if not resume or not checkpoint:
        return None
    checkpoint = resolve_resume(resume, out, warn=warn)
    if checkpoint is None and ((out / "final").exists() or (out / "summary.json").exists()):
        raise LLMTrainError(finished_without_checkpoint(out, resume))
    if checkpoint is not None and (problem := foreign_checkpoint(checkpoint, out, resume)):
        raise LLMTrainError(problem)
    return checkpoint


def foreign_checkpoint(checkpoint: Path, out: Path, resume: str) -> str | None:
    """Why --resume CHECKPOINT may not continue in `out` (None: it may): the checkpoint is another run folder's and
    `out` holds a run of its own, which resuming there would write over (a copied run's checkpoint, given with the
    recipe it holds, had resumed into the original run, over its later checkpoints and final/). Into an empty or new
    folder it branches a run from it."""
    if checkpoint.resolve().parent == (out / "checkpoints").resolve() or not _contents(out):
        return None
    run = checkpoint.parent.parent
    return (f"--resume {resume}: checkpoint '{checkpoint}' is not one of output_dir '{out}''s, which holds a run of "
            "its own: resuming it there would write over that run. Resume the checkpoint's own run "
            f"(output_dir={run}), or branch a new run from it in an empty folder (output_dir={run}-2).")


def another_runs_recipe(out: Path, recipe_file: Path, overrides: list[str] | None) -> str | None:
    """Why `recipe_file` may not run into `out` (None: it may): it is the saved recipe of a run folder (its recipe.yaml,
    or a checkpoint's) whose output_dir, read from the file, names another folder: a copied run folder's recipe, which
    had resumed the run it was copied from, writing final/ there (or with --overwrite deleted it; audit 55). An
    output_dir given as an override is a new run's choice: taken."""
    if any(o.split("=", 1)[0].strip() == "output_dir" for o in overrides or []):
        return None
    file = Path(recipe_file).resolve()
    if file.name != "recipe.yaml":
        return None
    folders = [file.parent] + ([file.parent.parent.parent] if file.parent.parent.name == "checkpoints" else [])
    run = next((f for f in folders if _is_run(f) or has_checkpoints(f)), None)
    if run is None or run == out.resolve():
        return None
    return (f"{recipe_file} is the saved recipe of the run folder {run}, and its output_dir names another folder, "
            f"{out}: a copied run's recipe would continue (or with --overwrite delete) the run it was copied from. "
            f"To continue the run in {run}, add output_dir={run} after the recipe; to continue the one in {out}, "
            f"give {out / 'recipe.yaml'}.")


def recipe_inside(out: Path, recipe_file: Path, *, resume: str | None, overwrite: bool) -> str | None:
    """inputs_inside for the recipe file itself: `finetune runs/x/my.yaml --overwrite` had deleted the file it was
    given (audit 46). The run's own recipe.yaml is written again, resolved, as the run starts: it may be given."""
    if Path(recipe_file).resolve() == (out / "recipe.yaml").resolve():
        return None
    return inputs_inside(out, {"the recipe file": str(recipe_file)}, resume=resume, overwrite=overwrite)


def inputs_inside(out: Path, recipe: dict, *, resume: str | None, overwrite: bool) -> str | None:
    """Why this run may not start (None: it may): --resume with --overwrite, which would ignore one of them; or
    a run that empties output_dir (--overwrite, or a run that ended before its first checkpoint started again)
    while a file or folder the recipe reads (its model, tokenizer, data, teacher, reward model: any path in
    `recipe`, a Recipe's dict, but the tokenised data's cache) lies inside it, which that would delete before reading
    it."""
    if resume and overwrite:
        return (f"--resume {resume} continues the run in {out} and --overwrite deletes it to start again: give one "
                "of the two.")
    if resume or not out.is_dir() or not (overwrite or _restartable(out)):
        return None
    root = out.resolve()

    def paths(v, key: str):
        if isinstance(v, dict):
            for k, x in v.items():
                yield from paths(x, f"{key}.{k}" if key else k)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                yield from paths(x, f"{key}.{i}")
        elif isinstance(v, str) and v and key != "output_dir" and not key.endswith("cache_dir") and Path(v).exists():
            # (data.cache_dir: a cache, made again where it was deleted)
            yield key, v

    inside = [(key, v) for key, v in paths(recipe, "") if root in (p := Path(v).resolve(), *p.parents)]
    if not inside:
        return None
    key, p = inside[0]
    return (f"{key} '{p}' lies inside output_dir '{out}', which "
            f"{'--overwrite' if overwrite else 'starting this run again'} empties before the run reads it: it would "
            f"be deleted. Set output_dir to another folder (e.g. {out}-2), or move {key} out of it first.")


def finished_without_checkpoint(out: Path, resume: str) -> str:
    """Why --resume cannot continue a run that finished without keeping a checkpoint: starting again from step 0
    would replace its final/ and metrics, which nobody asked for."""
    return (f"--resume {resume}: the run in {out} finished (final/ written) but kept no checkpoint to continue from "
            f"(checkpoint.every_steps was above its steps, or checkpoint.keep_last removed them), and final/ holds the "
            f"weights without the optimizer state an exact resume needs; nothing was changed. To train it further, "
            f"start a new run from its weights: model.name_or_path={out}/final output_dir=<new path> (a LoRA run: "
            f"`llmtrain export {out} --merge` first, then model.name_or_path={out}/final-merged); to train it again "
            "from the start, use --overwrite without --resume.")


def cannot_create(path: Path, what: str) -> str | None:
    """Why the file or folder `path` cannot be made (one paragraph naming `what` sets it), checked before any work
    begins: a folder on the way is a file, or the nearest existing folder is read-only; None if it can."""
    path = Path(path)
    for above in path.absolute().parents:
        if not above.exists():
            continue
        if not above.is_dir():
            return (f"{what} '{path}' cannot be created: '{above}' is a file, not a folder. Give a path whose "
                    "folders are folders (or remove that file).")
        if not os.access(above, os.W_OK | os.X_OK):
            return f"{what} '{path}' cannot be created: the folder '{above}' is not writable. Give a writable path."
        return None
    return None


def _make_ready(out: Path, *, resume: str | None, overwrite: bool) -> None:
    """Under the lock: --overwrite empties the folder (all but the lock file); leftovers of killed saves go."""
    if (overwrite or _restartable(out)) and not resume:
        for path in out.iterdir():
            if path.name == MARKER:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    (out / "checkpoints").mkdir(exist_ok=True)
    remove_leftovers(out / "checkpoints")


def _contents(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != MARKER) if out.is_dir() else []


def _is_run(out: Path) -> bool:
    """A folder --overwrite may delete: marked as a run, or laid out as an older llmtrain's run."""
    return (out / MARKER).is_file() or all((out / name).exists() for name in LEGACY)


def _restartable(out: Path) -> bool:
    """A run that ended before it saved anything to keep (a failed start, a reward function that raised at step 0):
    no checkpoint, no final/ and no summary.json. Starting again in it needs no --overwrite: nothing is lost."""
    return (out / MARKER).is_file() and not (has_checkpoints(out) or (out / "final").exists()
                                             or (out / "summary.json").exists())


def finished_run_without_checkpoints(out: Path) -> bool:
    """A run folder, not in use, that finished (final/ or summary.json) and kept no checkpoint: a new start there is
    refused as existing, and --resume auto has nothing to continue from (doctor's advice: --overwrite)."""
    return (_is_run(out) and bool(_contents(out)) and _holder(out) is None and not has_checkpoints(out)
            and ((out / "final").exists() or (out / "summary.json").exists()))


def has_checkpoints(out: Path) -> bool:
    """llmtrain checkpoints copied into a folder: resumable, though the folder is not (yet) a run."""
    return any((d / "train_state.json").is_file() for d in (out / "checkpoints").glob("step_*"))


def _lock(out: Path):
    """Take the folder's lock, creating the folder and its marker if needed; the open, locked marker file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / MARKER, "a+")  # a+: created if missing, never truncated before the lock is ours
    except OSError as e:
        raise LLMTrainError(f"cannot create output_dir '{out}' ({e.strerror}: {e.filename}). Set "
                            "output_dir=<a writable path>.") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _describe(f.read())
        f.close()
        raise LLMTrainError(_in_use(out, holder)) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{HEADER}\npid: {os.getpid()}\nhost: {socket.gethostname()}\n"
                f"started: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\ncommand: {' '.join(sys.argv)}\n")
        f.flush()
    except OSError as e:  # a full disk: the marker says who holds the folder (audit 46: a traceback)
        f.close()
        from llmtrain.run.checkpoint import write_failure

        raise LLMTrainError(f"cannot write output_dir '{out}': {write_failure(e, out)}. Free space there, or set "
                            "output_dir to another disk; nothing else was written.") from None
    return f


def _holder(out: Path) -> str | None:
    """Who holds the folder's lock now (None: nobody). Only reads: a refused run leaves the folder as it was."""
    try:
        f = open(out / MARKER)
    except OSError:
        return None
    with f:  # closing drops the probe's shared lock
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(f.read())
    return None


def missing_source(source: str) -> str:
    """What `generate` and `eval` say of a run, checkpoint or model folder that is not there: the runs beside it, or
    how a run's folder is made (runs/tiny in a fresh clone: it had been offered as a hub id to download)."""
    path = Path(source).expanduser()
    runs = sorted(p.name for p in path.parent.glob("*") if (p / "recipe.yaml").is_file())
    there = (f"; the runs in {path.parent} are {', '.join(runs[:8])}" + (f" and {len(runs) - 8} more" if len(runs) > 8
                                                                        else "")) if runs else \
        " (`llmtrain finetune` writes a run's output_dir: `make demo` writes runs/tiny)"
    return (f"'{source}' does not exist. Give a run's output_dir, one of its checkpoints, a model folder or a hub "
            f"id{there}")


def _finished_saving_final(path: Path) -> bool | None:
    """checkpoint.save_final of the run in `path` where it finished (its summary.json written); None where it has not,
    or its recipe cannot be read."""
    try:
        return run_recipe(path).checkpoint.save_final is not False if (path / "summary.json").is_file() else None
    except LLMTrainError:
        return None


def finished_without_final(path: Path) -> bool:
    """Whether the run in `path` finished with checkpoint.save_final: false (its summary.json written, no final/)."""
    return _finished_saving_final(path) is False


def run_folder(path: Path) -> Path:
    """The run `path` names: itself, or for a run's final/ the run (generate, eval and export read RUN/final as the
    run: its adapter on its base, its prompts rendered as its data were)."""
    if path.name == "final" and (path.parent / "recipe.yaml").is_file() and path.parent.name != "checkpoints":
        return path.parent
    return path


def final_removed(path: Path) -> str | None:
    """Where the run in `path` finished with checkpoint.save_final (its summary.json written) and final/ is gone since
    (removed or moved): how to write it again, else None. A resume of a finished run is refused (nothing is left to
    train); without summary.json it trains 0 steps and writes final/ from the last checkpoint (audit 39: `--resume
    auto` had been advised, which refused)."""
    if not _finished_saving_final(path) or (path / "final").exists():
        return None
    return (f"'{path}' finished (its summary.json says so), but its final/ is gone (removed or moved since). Put it "
            f"back; or move {path / 'summary.json'} aside and run `llmtrain finetune {path}/recipe.yaml --resume "
            "auto`, which trains nothing and writes final/ again from the last checkpoint")


def unfinished(path: Path, doing: str) -> str:
    """What `generate` and `eval` say of a run without final/: still training (its folder's lock held: wait for it;
    resuming it would be refused as in use) or stopped (finish it)."""
    steps = step_dirs(path / "checkpoints")
    newest = steps[-1] if steps else "it has none yet"
    if (holder := _holder(path)) is not None:
        return (f"'{path}' is still training ({holder}) and has no final/ yet: {doing} one of its checkpoints "
                f"({newest}), or wait for it to finish.")
    if finished_without_final(path):  # (it had been told to finish with --resume auto, which says the run is complete)
        return (f"'{path}' finished with checkpoint.save_final: false, so it has no final/: {doing.lower()} one of its "
                f"checkpoints ({newest}).")
    if gone := final_removed(path):
        return f"{gone}; or {doing.lower()} one of its checkpoints ({newest})."
    return (f"'{path}' has no final/: the run has not finished (or ran with checkpoint.save_final: false). {doing} "
            f"one of its checkpoints ({newest}), or finish it with `llmtrain finetune {path}/recipe.yaml --resume "
            "auto`.")


def _describe(text: str) -> str:
    fields = dict(line.split(": ", 1) for line in text.splitlines()[1:] if ": " in line)
    if "pid" not in fields:
        return "a process that has not recorded itself yet"
    who = f"pid {fields['pid']} on {fields.get('host', '?')}, started {fields.get('started', '?')}"
    if fields["pid"] == str(os.getpid()) and fields.get("host") == socket.gethostname():
        who += ", i.e. this very process: an earlier train() call whose RunDir was not released"
    return f"{who} (`{fields.get('command', '?')}`)"


def _in_use(out: Path, holder: str) -> str:
    return (f"output_dir '{out}' is in use by another llmtrain run: {holder}. One run per folder: wait for it to "
            f"finish or stop it, or set output_dir=<new path>.")


def _exists(out: Path) -> str:
    return (f"output_dir '{out}' already exists and is not empty. Continue it with --resume auto, "
            f"delete and start again with --overwrite, or set output_dir=<new path>.")


def _not_a_run(out: Path, present: list[str], *, resume: str | None, overwrite: bool) -> str:
    shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
    if resume:
        what = "there is no run in it to resume"
    elif overwrite:
        what = "--overwrite will not delete it"
    else:
        what = "llmtrain will not write into it"
    return (f"output_dir '{out}' is not empty ({shown}) and is not an llmtrain run folder (it has no {MARKER} "
            f"file), so {what}. Set output_dir=<new path> or an empty folder; if you really mean to discard what "
            f"it holds, delete it yourself first.")


def run_recipe(folder: Path):
    """The Recipe a run (or one of its checkpoints) saved in `folder`/recipe.yaml, its relative model paths
    (model.name_or_path, model.tokenizer, distill.teacher) and data.chat_template file made absolute where they are
    not found from here but are
    from the directory the run was started in (recipe.yaml's first line names it): `llmtrain generate`, `export` and
    `eval` of a run trained on `model.name_or_path=my-model` then find its base from any directory."""
    import yaml
    from pydantic import ValidationError

    from llmtrain.config import Recipe, from_the_run, recipe_errors
    from llmtrain.errors import RecipeError

    try:
        recipe = Recipe.model_validate(yaml.safe_load((folder / "recipe.yaml").read_text()))
    except ValidationError as e:  # (pydantic's traceback had reached generate, eval and export)
        raise RecipeError(recipe_errors(e, f"'{folder / 'recipe.yaml'}' (the run's own)", [], set())) from None
    model = recipe.model.model_copy(update={"name_or_path": from_the_run(folder, recipe.model.name_or_path),
                                            "tokenizer": from_the_run(folder, recipe.model.tokenizer)})
    distill = recipe.distill and recipe.distill.model_copy(
        update={"teacher": from_the_run(folder, recipe.distill.teacher)})
    # a chat template file the data was rendered with (generate and a checkpoint's eval render prompts with it: from
    # another directory they had been refused, with a recipe fix the command cannot take)
    template = recipe.data.chat_template
    data = recipe.data.model_copy(update={"chat_template": from_the_run(folder, template)}) \
        if isinstance(template, str) else recipe.data
    return recipe.model_copy(update={"model": model, "distill": distill, "data": data})
