"""Resumable checkpoints: Accelerate's state plus an explicit TrainState, written durably and verified.

Layout: <output_dir>/checkpoints/step_000200/ holds the model (or only the LoRA weights), optimizer,
scheduler, the RNG state of every rank, `train_state.json`, the resolved `recipe.yaml` and, written last,
`manifest.json` (every file's size and CRC32s). A checkpoint is written as `.tmp-step_000200`, flushed to
the disk (fsync of every file and folder) and renamed when every rank has finished, so a folder named
`step_*` is always complete, even after a power cut; resume never reads a folder that is not. Pruning runs
the other way round: a checkpoint is renamed out of the `step_*` names (`.trash-step_000100`) before it is
deleted. Resume checks a checkpoint against its manifest before loading it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmtrain.errors import Everywhere, LLMTrainError
from llmtrain.parallel.collectives import gathered, global_sum
from llmtrain.run.state import TrainState

MANIFEST = "manifest.json"
_BLOCK = 64 << 20  # checksummed in 64 MiB blocks on parallel threads: a 7B optimizer state goes at disk speed


def step_dirs(root: Path) -> list[Path]:
    """Published checkpoints, oldest first. Ordered by the step in the folder name (save_checkpoint writes it),
    because a damaged checkpoint may have no readable train_state.json; the state itself is never read from it."""
    found = [d for d in root.glob("step_*") if d.is_dir() and d.name[5:].isdigit()]
    return sorted(found, key=lambda d: int(d.name[5:]))


def write_manifest(folder: Path, *, step: int) -> None:
    """Record every file of a checkpoint (relative path, size, CRC32 of each block) in manifest.json."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)
    files = {n: {"bytes": (folder / n).stat().st_size, "crc32": crcs} for n, crcs in _checksums(folder, names).items()}
    _write_durable(folder / MANIFEST, json.dumps({"step": step, "block_bytes": _BLOCK, "files": files}, indent=1))


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint folder, in a few words (None: it is intact).

    Sizes first (a truncated file costs no read), then every block's checksum against manifest.json. A
    checkpoint from before manifests existed can only be checked for a readable train_state.json.
    """
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        try:
            json.loads((path / "train_state.json").read_text())["step"]
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return f"it has no {MANIFEST} and its train_state.json is missing or unreadable"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, entry in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        size = (path / name).stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size:,} bytes where {entry['bytes']:,} were written"
    sums = _checksums(path, list(files))
    bad = [name for name, entry in files.items() if sums[name] != entry["crc32"]]
    return f"{bad[0]} does not match its checksum (its bytes changed after it was written)" if bad else None


def _checksums(folder: Path, names: list[str]) -> dict[str, str]:
    """CRC32 of every 64 MiB block of every file, in hex; zlib and file reads release the GIL, so threads overlap."""
    blocks = [(n, at) for n in names for at in range(0, max((folder / n).stat().st_size, 1), _BLOCK)]
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(lambda block: _crc32(folder / block[0], block[1]), blocks))
    sums: dict[str, list[str]] = {n: [] for n in names}
    for (name, _), crc in zip(blocks, crcs):
        sums[name].append(f"{crc:08x}")
    return {name: " ".join(crcs) for name, crcs in sums.items()}


def _crc32(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return zlib.crc32(f.read(_BLOCK))


def checkpoints_there(where: Path) -> str:
    """Which checkpoints a folder holds, in words (the newest four): what a mistyped step (step_300 for step_000300)
    given to --resume or `llmtrain generate` is told."""
    steps = sorted(p.name for p in where.glob("step_*") if p.is_dir()) if where.is_dir() else []
    if not steps:
        return f"{where} holds no checkpoint"
    return f"the checkpoints in {where} are {', '.join(steps[-4:])}" + (f" (and {len(steps) - 4} older)"
                                                                        if len(steps) > 4 else "")


def named_checkpoint(resume: str, output_dir: Path) -> Path:
    """The folder --resume PATH names: PATH, or a step folder's name alone (step_000004) as output_dir's."""
    path = Path(resume)
    if not path.exists() and len(path.parts) == 1 and (output_dir / "checkpoints" / path).is_dir():
        return output_dir / "checkpoints" / path
    return path


def resolve_resume(resume: str, output_dir: Path, *, warn) -> Path | None:
    """Map --resume auto|PATH to an intact checkpoint folder (None: auto found no checkpoint at all).

    auto takes the newest intact checkpoint: a damaged one is skipped, and `warn` is told which and why. A PATH
    must be intact; a damaged one is refused.
    """
    if resume == "auto":
        return _newest_intact(output_dir / "checkpoints", warn)
    path = named_checkpoint(resume, output_dir)
    if not path.exists():  # a mistyped step (step_300 for step_000300): say which there are
        there = checkpoints_there(path.parent if len(path.parts) > 1 and path.parent.is_dir()
                                  else output_dir / "checkpoints")
        raise LLMTrainError(f"--resume {resume}: '{path}' does not exist; {there}. Use --resume auto for the newest, "
                            "or --resume with one of them.")
    if not (path / "train_state.json").is_file():
        raise LLMTrainError(
            f"--resume {resume}: '{path}' is not a complete checkpoint (no train_state.json). "
            f"Use --resume auto, or one of the step_* folders under {output_dir / 'checkpoints'}."
        )
    problem = checkpoint_problem(path)
    if problem:
        others = [p for p in step_dirs(path.parent) if p != path]  # (it had offered --resume auto with none there)
        raise LLMTrainError(
            f"--resume {resume}: checkpoint '{path}' is damaged ({problem}), so it cannot be resumed. "
            + (f"Use --resume auto to continue from the newest intact checkpoint, or --resume with another step_* "
               f"folder under {path.parent}." if others else
               f"It is the only checkpoint under {path.parent}: start again with --overwrite, or set "
               "output_dir=<new path>.")
        )
    return path


def _newest_intact(root: Path, warn) -> Path | None:
    damaged = []
    steps = step_dirs(root)
    for i, path in enumerate(reversed(steps)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if i + 1 < len(steps):  # (it had said so of the oldest too, with none before it)
            warn(f"warning: checkpoint {path} is damaged ({problem}); skipping it for the one before.")
        damaged.append(f"{path.name}: {problem}")
    if damaged:
        raise LLMTrainError(
            f"--resume auto: every checkpoint under {root} is damaged ({'; '.join(damaged)}), so nothing can be "
            "resumed. Start again with --overwrite, or set output_dir=<new path>."
        )
    return None


def remove_leftovers(root: Path) -> None:
    """Remove what a killed save (.tmp-*) or prune (.trash-*) left behind: never a complete checkpoint."""
    for left in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
        shutil.rmtree(left)


def lora_only_hooks(accelerator, trainable_names: set[str]) -> None:
    """Save only trainable weights (the adapter) for LoRA runs instead of the frozen 7B base every time.

    Under FSDP Accelerate saves the model through save_fsdp_model (every rank writes its shard of the
    whole model, frozen base included) and hands this hook no weights, so there it changes nothing.
    """

    def save_hook(models, weights, output_dir):
        for i in range(len(weights)):
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable_names}

    accelerator.register_save_state_pre_hook(save_hook)


FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # where Accelerate writes a sharded (DCP) model: one .distcp file per rank


def verify_saved(path: Path, *, model_keys: set[str], trainable: set[str] | None,
                 adapter_moved: bool | None = None) -> None:
    """Check a checkpoint before it is published, by reading back what was written.

    Its weights must hold the model's keys (only the adapter's, `trainable`, for LoRA outside FSDP) and,
    for LoRA, the B matrices must not all be zero: an adapter saved as zeros is silently a no-op. A
    sharded (FSDP) checkpoint is read through its DCP metadata: every shard's bytes must be on disk, and
    the LoRA B matrices are loaded back from the shards in this one process.
    """
    weights, sharded = path / "model.safetensors", path / FSDP_MODEL_DIR
    stages = sorted(path.glob("pipeline/stage_*"))
    if stages:  # pipeline parallelism: each stage's weights by name in the whole model (parallel/pipeline/checkpoint.py)
        from safetensors import safe_open

        saved, lora_b = set(), {}
        for f in (s for s in stages if s.suffix == ".safetensors"):
            with safe_open(str(f), "pt") as r:
                saved |= set(r.keys())
                lora_b.update({k: r.get_tensor(k) for k in r.keys() if "lora_B" in k})
        expected = trainable or model_keys
        if saved != expected:
            raise LLMTrainError(f"checkpoint {path} failed verification: its pipeline stages saved {len(saved)} "
                                f"weights, the model has {len(expected)}. It was not published.")
    elif weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            saved = set(f.keys())
            lora_b = {k: f.get_tensor(k) for k in saved if "lora_B" in k}
        expected = trainable or model_keys
    elif sharded.is_dir():
        saved, lora_b = _read_sharded(sharded, path, lora=trainable is not None)
        expected = model_keys  # FSDP saves the whole model, frozen base included, as shards
    else:
        raise LLMTrainError(f"checkpoint {path} failed verification: it holds no model weights "
                            f"(model.safetensors or {FSDP_MODEL_DIR}/). It was not published.")
    # Tied weights are stored once, so a full model may save fewer keys than its state dict has.
    if not saved or not saved <= expected or (trainable is not None and not trainable <= saved):
        raise LLMTrainError(f"checkpoint {path} failed verification: saved keys do not match the model "
                            f"({len(saved)} saved, {len(expected)} expected). It was not published.")
    # all zero where the adapter in memory is not (or where that is not known): a broken save. An adapter that has not
    # moved yet (adapter_moved False: every gradient so far 0) is saved as it is.
    if trainable is not None and adapter_moved is not False and not any(t.any() for t in lora_b.values()):
        raise LLMTrainError(f"checkpoint {path} failed verification: every LoRA B matrix is zero, so the adapter "
                            "would do nothing, where the adapter in memory has moved. It was not published; check "
                            "train.lr and the LoRA settings.")


def _read_sharded(folder: Path, path: Path, *, lora: bool) -> tuple[set[str], dict]:
    """Keys of a DCP model checkpoint (Accelerate nests them under "model."), and its LoRA B matrices."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata()
    for item in meta.storage_data.values():
        shard = folder / item.relative_path
        if not shard.is_file() or shard.stat().st_size < item.offset + item.length:
            raise LLMTrainError(f"checkpoint {path} failed verification: shard {shard.name} is missing or "
                                "truncated. It was not published.")
    saved = {k.removeprefix("model.") for k in meta.state_dict_metadata}
    lora_b = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()
              if lora and "lora_B" in k}
    if lora_b:  # the whole tensors, assembled from every rank's shard, in this process alone
        loaded = {"model": {k.removeprefix("model."): t for k, t in lora_b.items()}}
        with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process", each time
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(loaded, storage_reader=reader, no_dist=True)
        lora_b = loaded["model"]
    return saved, lora_b


def whole_weights(path: Path, names: set[str]) -> dict:
    """A checkpoint's weights named `names` (the model's state dict names: the adapter's alone for LoRA), read as one
    model in this one process whatever layout wrote them: model.safetensors (one process, DDP), a pipeline's stage
    files (each its stages' weights by name in the whole model) or FSDP's DCP shards (assembled from every rank's
    pieces, as verify_saved reads their LoRA B matrices). Names it does not hold are left out (the caller says which
    it needed); a sharded checkpoint's other names (a LoRA run's frozen base) are not read."""
    from safetensors import safe_open

    files = ([path / "model.safetensors"] if (path / "model.safetensors").is_file()
             else sorted(path.glob("pipeline/stage_*.safetensors")))
    if files:
        found = {}
        for f in files:
            with safe_open(str(f), "pt") as r:
                found.update({k: r.get_tensor(k) for k in r.keys() if k in names})
        return found
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path / FSDP_MODEL_DIR))
    kept = {k.removeprefix("model."): md for k, md in reader.read_metadata().state_dict_metadata.items()
            if k.removeprefix("model.") in names}
    loaded = {"model": {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in kept.items()}}
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    return loaded["model"]


def save_checkpoint(accelerator, *, output_dir: Path, state: TrainState, recipe_yaml: str, keep_last: int,
                    model_keys: set[str], trainable: set[str] | None, write_stage=None, write_round=None,
                    write_reference=None, adapter_moved: bool | None = None) -> Path:
    """Write, flush, verify and publish a checkpoint, then prune to the newest `keep_last`. `write_stage(folder)`:
    pipeline parallelism's writer of this process's stages (weights and optimizer; Accelerate saves the rest);
    `write_round(folder)`: online RL's writer of this process's generation round in progress (loop/rounds.py);
    `write_reference(folder)`: a moving reference's writer (model/reference.Reference.write; every process calls it).

    A failed write (disk full, permission) stops every process with one LLMTrainError that says what
    happened; the partial checkpoint is removed and the published ones are left as they were.
    """
    root = output_dir / "checkpoints"
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    # Every process writes its part (its RNG state; under FSDP its shards). Then, once every part is complete
    # (writers such as safetensors rename their files into place), each flushes them: its own data reaches the
    # disk on any file system, and the others' files cost it a no-op.
    def write() -> None:
        accelerator.save_state(str(tmp))
        if write_stage is not None:
            write_stage(tmp)
        if write_round is not None:
            write_round(tmp)
        if write_reference is not None:
            write_reference(tmp)

    for stage in (write, lambda: _fsync_tree(tmp)):
        _stop_if_any_failed(accelerator, _attempt(stage), final=final)  # also the barrier between the stages
    error = None
    if accelerator.is_main_process:
        error = _attempt(lambda: _publish(tmp, final, state=state, recipe_yaml=recipe_yaml, keep_last=keep_last,
                                          model_keys=model_keys, trainable=trainable, adapter_moved=adapter_moved))
    _stop_if_any_failed(accelerator, error, final=final)
    return final


def _publish(tmp: Path, final: Path, *, state: TrainState, recipe_yaml: str, keep_last: int,
             model_keys: set[str], trainable: set[str] | None, adapter_moved: bool | None = None) -> None:
    verify_saved(tmp, model_keys=model_keys, trainable=trainable, adapter_moved=adapter_moved)
    _write_durable(tmp / "train_state.json", json.dumps(state.state_dict(), indent=1))
    _write_durable(tmp / "recipe.yaml", recipe_yaml)
    write_manifest(tmp, step=state.step)  # last: it vouches for every file above
    _fsync(tmp)
    if final.exists():  # only when resuming from an older step (--resume PATH, or past a damaged checkpoint)
        _discard(final)
    tmp.rename(final)
    _fsync(final.parent)  # the rename itself is on the disk
    discard_later(final.parent, state.step)
    for old in step_dirs(final.parent)[:-keep_last]:
        if old != final:
            _discard(old)


def discard_later(root: Path, step: int, keep=lambda step: False) -> None:
    """Delete the checkpoints under `root` past `step` (but those `keep(step)` says this run wrote): a run's steps only
    rise, so they are of the run a resume from an older step left (--resume PATH), which --resume auto would go back
    to. At this run's first checkpoint, and at its end (where it wrote none, the next --resume auto had continued
    the run it went back on; audit 55)."""
    for later in later_than(root, step):
        if not keep(int(later.name[5:])):
            _discard(later)


def later_than(root: Path, step: int) -> list[Path]:
    """The checkpoints under `root` past `step`."""
    return [d for d in step_dirs(root) if int(d.name[5:]) > step]


def _discard(path: Path) -> None:
    """Delete a checkpoint without ever leaving a partial step_* folder: out of the step_* names first, then
    delete (a kill in between leaves a .trash-* folder, which the next start removes)."""
    trash = path.with_name(f".trash-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    _fsync(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's data to the disk (fsync works on a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):  # children before the folders that list them
        _fsync(path)
    _fsync(folder)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _attempt(fn) -> Exception | None:
    try:
        fn()
    except Exception as e:  # handed to _stop_if_any_failed, which raises it on every process
        return e
    return None


def _stop_if_any_failed(accelerator, error: Exception | None, *, final: Path) -> None:
    """One collective per stage: when any process failed, all of them stop here together (none is left waiting
    in a later collective), the partial checkpoint is removed, and the failure is raised as one message."""
    (failed,) = global_sum(accelerator, error is not None)
    if not failed:
        return
    if accelerator.is_main_process:
        shutil.rmtree(final.with_name(f".tmp-{final.name}"), ignore_errors=True)
    if error is None:
        raise LLMTrainError(f"saving checkpoint {final.name} failed on another process (see its error); the run "
                            "stopped.")
    from safetensors import SafetensorError

    if isinstance(error, (OSError, RuntimeError, SafetensorError)):
        raise LLMTrainError(_save_failed(error, final)) from error
    raise error  # LLMTrainError (verification) as it is; anything else is a bug, with its traceback


_WHY = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
        errno.EFBIG: "a file grew past the size limit (ulimit -f)", errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


def _save_failed(error: Exception, final: Path) -> str:
    root = final.parent
    kept = step_dirs(root)
    before = f"the newest published checkpoint, {kept[-1].name}, is intact" if kept else "there is no earlier one"
    fewer = "lower checkpoint.keep_last, or " if len(kept) > 1 else ""  # (one kept: a lower keep_last frees nothing)
    fix = (f"Make {root} writable" if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM,
           errno.EROFS) else f"Free disk space (or {fewer}set output_dir on a larger disk)")
    return (f"saving checkpoint {final.name} in {root} failed: {write_failure(error, root)}. The run stopped; what "
            f"was written of {final.name} was removed and {before}. {fix}, then continue with --resume auto.")


def write_failure(error: Exception, root: Path) -> str:
    """Why a write under `root` failed, in words, with the space left on its disk."""
    if isinstance(error, OSError):
        reason = f"{_WHY.get(error.errno, error.strerror or error)} ({error.filename or root})"
    else:  # torch's writer reports a full disk as "[enforce fail at inline_container.cc:672] . unexpected pos ..."
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        reason = re.sub(r"^\[enforce fail at [^]]*\][ .]*", "the write stopped short: ", first)[:300]
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        usage = None
    if usage is not None:
        free = (f"{usage.free / 2**30:.2f} GiB" if usage.free >= 2**30 else f"{usage.free / 2**20:.1f} MiB") + \
            " free on that disk"  # (3 MiB had read "0.00 GiB")
        # torch's writer says only that it stopped short; a disk with (almost) nothing left is the reason to say first
        full = usage.free < min(256 * 2**20, usage.total // 100) and not isinstance(error, OSError)
        reason = f"the disk is full ({free}; {reason})" if full else f"{reason}; {free}"
    return reason


def _check_8bit_shards(accelerator, path: Path) -> None:
    """Refuse, on every process alike, 8-bit moments saved on other shards than this launch's (adamw_8bit.py)."""
    eight_bit = sys.modules.get("llmtrain.model.adamw_8bit")  # imported where an 8-bit AdamW was built (bitsandbytes)
    if eight_bit is None or not (path / "optimizer_0").is_dir() or not accelerator._optimizers:
        return
    problem = eight_bit.resume_problem(accelerator._models[0], accelerator._optimizers[0].optimizer, path)
    if problems := [p for p in gathered(accelerator, [problem]) if p]:
        raise Everywhere(problems[0])


def load_checkpoint(accelerator, path: Path, *, trainable_names: set[str] | None) -> None:
    """Restore model, optimizer, scheduler, RNG and registered objects (TrainState) from `path`.

    For LoRA only the adapter was saved, so loading is non-strict; the saved keys are then checked
    against the trainable parameters so that a mismatch can never pass silently. Whether this run can resume
    it at all (FSDP or not, LoRA or full, the batch layout) was checked before anything loaded:
    preflight.check_resume; the 8-bit AdamW's sharded moments are checked against this launch's shards here, where
    the optimizer exists.
    """
    _check_8bit_shards(accelerator, path)
    if trainable_names is None or (path / "pipeline").is_dir():  # a pipeline's stages are read by read_stages
        accelerator.load_state(str(path))
        return
    from safetensors import safe_open

    weights = path / "model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            saved = set(f.keys())
        if saved != trainable_names:
            raise LLMTrainError(
                f"checkpoint {path} does not match this run's trainable parameters "
                f"({len(saved)} saved, {len(trainable_names)} expected; e.g. missing "
                f"{sorted(trainable_names - saved)[:2]}). Resume with the recipe that wrote it ({path}/recipe.yaml)."
            )
    accelerator.load_state(str(path), strict=False)
