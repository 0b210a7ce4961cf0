"""Durable, verified checkpoints: every file and folder is flushed before the rename, a manifest written last
vouches for every byte, a damaged checkpoint is never loaded (--resume auto falls back past it, --resume PATH
refuses it), a failed save stops the run cleanly, and a kill while pruning never leaves a partial step_*."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ENV, REPO, cli, load_weights, losses, max_abs_diff, records, run_train, write_recipe
from test_rundir import launch

from llmtrain.errors import LLMTrainError
from llmtrain.run import checkpoint
from llmtrain.run.checkpoint import MANIFEST, checkpoint_problem, step_dirs, write_manifest

# --------------------------------------------------------------------------- the manifest, on plain files


pytestmark = pytest.mark.long(130)  # tests/conftest.py


def test_manifest_catches_truncated_changed_and_missing_files(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_BLOCK", 1000)  # several blocks per file
    (tmp_path / "shards").mkdir()
    (tmp_path / "optimizer.bin").write_bytes(os.urandom(4500))
    (tmp_path / "shards" / "__0_0.distcp").write_bytes(os.urandom(10))
    (tmp_path / "train_state.json").write_text('{"step": 4}')
    write_manifest(tmp_path, step=4)
    assert checkpoint_problem(tmp_path) is None

    data = (tmp_path / "optimizer.bin").read_bytes()
    (tmp_path / "optimizer.bin").write_bytes(data[:3000])
    assert checkpoint_problem(tmp_path) == "optimizer.bin has 3,000 bytes where 4,500 were written"
    (tmp_path / "optimizer.bin").write_bytes(data[:4200] + bytes([data[4200] ^ 1]) + data[4201:])  # same size
    assert checkpoint_problem(tmp_path) == ("optimizer.bin does not match its checksum (its bytes changed after "
                                            "it was written)")
    (tmp_path / "optimizer.bin").write_bytes(data)
    (tmp_path / "shards" / "__0_0.distcp").unlink()
    assert checkpoint_problem(tmp_path) == "shards/__0_0.distcp is missing"

    (tmp_path / MANIFEST).write_text('{"files": {"optimizer.bin": ')  # cut short
    assert checkpoint_problem(tmp_path) == f"its {MANIFEST} is unreadable"
    (tmp_path / MANIFEST).unlink()  # a checkpoint from before manifests: its train state must still read
    assert checkpoint_problem(tmp_path) is None
    (tmp_path / "train_state.json").write_text('{"st')
    assert "train_state.json is missing or unreadable" in checkpoint_problem(tmp_path)


def test_every_file_and_folder_is_flushed_before_the_rename_and_the_parent_after(tiny_assets, tmp_path,
                                                                                 monkeypatch):
    flushed = []  # (path, published yet?) in the order fsync saw them
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        flushed.append((path, os.path.isdir(run / "checkpoints" / "step_000002")))
        real_fsync(fd)

    run = tmp_path / "run"
    monkeypatch.setattr(os, "fsync", fsync)
    run_train(write_recipe(tiny_assets, tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2}))
    monkeypatch.undo()
    ckpt, tmp = run / "checkpoints" / "step_000002", str(run / "checkpoints" / ".tmp-step_000002")
    before = [p for p, published in flushed if not published]
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*")}
    assert files and {os.path.relpath(p, tmp) for p in before if p.startswith(tmp + "/")} == files
    assert before[-1] == tmp and before.index(f"{tmp}/{MANIFEST}") > before.index(f"{tmp}/train_state.json")
    assert (str(run / "checkpoints"), True) in flushed  # the rename is on the disk too
    assert checkpoint_problem(ckpt) is None


# --------------------------------------------------------------------------- the real CLI on a real run


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """An uninterrupted 8-step run, checkpoints at steps 2, 4, 6, 8 (the newest two kept): the reference."""
    tmp = tmp_path_factory.mktemp("straight")
    recipe = write_recipe(tiny_assets, tmp, train={"max_steps": 8, "lr": 3e-3},
                          checkpoint={"every_steps": 2, "keep_last": 2})
    cli("finetune", str(recipe), f"output_dir={tmp / 'run'}")
    assert [p.name for p in step_dirs(tmp / "run" / "checkpoints")] == ["step_000006", "step_000008"]
    return recipe, tmp / "run"


def _interrupted_copy(straight, tmp_path, *, drop_newest: bool = False):
    """The straight run as a job killed after its last save leaves it (no final/, no summary.json)."""
    run = tmp_path / "run"
    shutil.copytree(straight[1], run)
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    if drop_newest:
        shutil.rmtree(run / "checkpoints" / "step_000008")
    return run


def _assert_equals_straight(run, straight):
    assert [r["step"] for r in records(run)] == list(range(1, 9))
    assert losses(run) == pytest.approx(losses(straight[1]), abs=1e-6)
    assert max_abs_diff(load_weights(run / "final"), load_weights(straight[1] / "final")) < 1e-6
    assert all(checkpoint_problem(d) is None for d in step_dirs(run / "checkpoints"))
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["optimizer.bin", "model.safetensors", "train_state.json"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(straight, tmp_path, damaged, capsys):
    """Resumed in this process (the CLI's exits are the other tests'): what it says is what the CLI prints."""
    run = _interrupted_copy(straight, tmp_path)
    file = run / "checkpoints" / "step_000008" / damaged
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # as a full disk or a crash leaves it
    run_train(straight[0], f"output_dir={run}", resume="auto")
    said = " ".join(capsys.readouterr().out.split())  # the console folds long lines
    assert (f"warning: checkpoint {run / 'checkpoints' / 'step_000008'} is damaged ({damaged} has " in said
            and "skipping it for the one before" in said)
    assert f"resumed from {run / 'checkpoints' / 'step_000006'} at step 6" in said
    _assert_equals_straight(run, straight)  # step_000008 was written again, intact


@pytest.mark.slow
def test_damaged_checkpoint_is_refused_by_path_and_all_damaged_refuse_auto(straight, tmp_path):
    run = _interrupted_copy(straight, tmp_path)
    for step in ("step_000006", "step_000008"):  # one flipped bit each: sizes are right, checksums are not
        file = run / "checkpoints" / step / "optimizer.bin"
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x10
        file.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    newest = run / "checkpoints" / "step_000008"
    by_path = cli("finetune", str(straight[0]), f"output_dir={run}", "--resume", str(newest), check=False)
    assert by_path.returncode == 2 and "Traceback" not in by_path.stderr + by_path.stdout
    assert (f"checkpoint '{newest}' is damaged (optimizer.bin does not match its checksum" in by_path.stderr
            and "cannot be resumed" in by_path.stderr and "--resume auto" in by_path.stderr)
    auto = cli("finetune", str(straight[0]), f"output_dir={run}", "--resume", "auto", check=False)
    assert auto.returncode == 2 and "Traceback" not in auto.stderr + auto.stdout
    assert f"every checkpoint under {run / 'checkpoints'} is damaged (step_000008: optimizer.bin" in auto.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing was changed


@pytest.mark.slow
@pytest.mark.extended  # main tier: a failed save is one clear error and leaves nothing partial; one rank's failed write
def test_failed_write_stops_the_run_and_keeps_the_previous_checkpoint(straight, tmp_path):
    """A real failed write through the CLI: files are capped at 3 MB (ulimit -f), so the resumed run's step-8
    save writes model.safetensors (2 MB) and fails inside torch's writer on optimizer.bin (4 MB), which is
    exactly how a full disk shows up."""
    run = _interrupted_copy(straight, tmp_path, drop_newest=True)
    kept = {p: p.read_bytes() for p in (run / "checkpoints" / "step_000006").iterdir()}
    cap = 3_000_000

    failed = subprocess.run([sys.executable, "-m", "llmtrain", "finetune", str(straight[0]), f"output_dir={run}",
                             "--resume", "auto"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap)))
    assert failed.returncode == 2 and "Traceback" not in failed.stderr + failed.stdout
    assert (f"saving checkpoint step_000008 in {run / 'checkpoints'} failed: the write stopped short: unexpected "
            "pos" in failed.stderr)
    assert ("the newest published checkpoint, step_000006, is intact" in failed.stderr
            and "then continue with --resume auto" in failed.stderr)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006"]  # no .tmp-* left
    assert {p: p.read_bytes() for p in (run / "checkpoints" / "step_000006").iterdir()} == kept
    assert not (run / "final").exists()

    cli("finetune", str(straight[0]), f"output_dir={run}", "--resume", "auto")  # space is back
    _assert_equals_straight(run, straight)


@pytest.mark.slow
def test_failed_write_on_one_rank_stops_every_rank(tiny_assets, tmp_path, free_port):
    """2 DDP processes, files capped at 3 MB: the main process fails writing optimizer.bin while rank 1 writes
    its RNG state fine. Both stop at the save (rank 1 is not left waiting in a collective), nothing partial."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "micro_batch_size": 2},
                          checkpoint={"every_steps": 2})
    run, cap = tmp_path / "run", 3_000_000
    proc = launch(recipe, free_port, f"output_dir={run}", check=False,
                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap)))
    assert proc.returncode != 0
    assert "saving checkpoint step_000002 in" in proc.stderr and "there is no earlier one" in proc.stderr
    assert "saving checkpoint step_000002 failed on another process (see its error)" in proc.stderr
    assert [r["step"] for r in records(run)] == [1, 2]
    assert list((run / "checkpoints").iterdir()) == []


KILL_IN_PRUNE = """
import os, shutil, sys
from pathlib import Path
delete = shutil.rmtree
def rmtree(path, *args, **kwargs):  # the first real prune: delete one file of it, then die like kill -9
    path = Path(path)
    if path.name.startswith(".trash-") and path.exists():
        next(p for p in path.iterdir() if p.is_file()).unlink()
        os._exit(137)
    delete(path, *args, **kwargs)
shutil.rmtree = rmtree
sys.argv = ["llmtrain", *sys.argv[1:]]
from llmtrain.cli import main
main()
"""


@pytest.mark.slow
def test_kill_while_pruning_leaves_only_complete_checkpoints(straight, tmp_path):
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILL_IN_PRUNE, "finetune", str(straight[0]), f"output_dir={run}"],
                            env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr[-3000:]
    # Killed while deleting step_000002 after publishing step_000006: what is left of it is out of the step_* names.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [".trash-step_000002", "step_000004", "step_000006"]
    assert all(checkpoint_problem(d) is None for d in step_dirs(run / "checkpoints"))

    proc = cli("finetune", str(straight[0]), f"output_dir={run}", "--resume", "auto")
    assert f"resumed from {run / 'checkpoints' / 'step_000006'} at step 6" in proc.stdout
    _assert_equals_straight(run, straight)  # and the .trash-* is gone


# --------------------------------------------------------------------------- failed saves, in process


@pytest.mark.parametrize("stage, code, says", [
    ("save_state", errno.ENOSPC, "the disk is full"),
    ("write_manifest", errno.EACCES, "permission denied"),
])
def test_failed_save_is_one_clear_error_and_leaves_nothing_partial(tiny_assets, tmp_path, monkeypatch, stage,
                                                                   code, says):
    """The step-4 save fails, while Accelerate writes or while the checkpoint is published."""
    from accelerate import Accelerator

    real = {"save_state": Accelerator.save_state, "write_manifest": checkpoint.write_manifest}[stage]
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            return real(*args, **kwargs)
        folder = args[1] if stage == "save_state" else args[0]
        os.makedirs(folder, exist_ok=True)
        (Path(folder) / "optimizer.bin").write_bytes(b"half of it")
        raise OSError(code, os.strerror(code), str(Path(folder) / "optimizer.bin"))

    if stage == "save_state":
        monkeypatch.setattr(Accelerator, "save_state", failing)
    else:
        monkeypatch.setattr(checkpoint, "write_manifest", failing)
    run = tmp_path / "run"
    with pytest.raises(LLMTrainError) as err:
        run_train(write_recipe(tiny_assets, tmp_path, train={"max_steps": 6}, checkpoint={"every_steps": 2}))
    message = str(err.value)
    assert f"saving checkpoint step_000004 in {run / 'checkpoints'} failed: {says}" in message
    assert "step_000002, is intact" in message and "--resume auto" in message and "GiB free" in message
    assert "keep_last" not in message  # one checkpoint kept: a lower keep_last would free nothing
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert checkpoint_problem(run / "checkpoints" / "step_000002") is None


def test_a_failed_write_of_final_is_one_clear_error_and_the_resume_writes_it(tiny_assets, tmp_path, monkeypatch):
    """A full disk while final/ is written: safetensors' traceback, and final.tmp/ left behind."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def full_disk(self, folder, *args, **kwargs):
        os.makedirs(folder, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(folder) / "model.safetensors"))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    with pytest.raises(LLMTrainError) as err:
        run_train(recipe)
    message = str(err.value)
    assert message.startswith(f"writing final/ in {run} failed: the disk is full ({run / 'final.tmp'}") and \
        " free on that disk. The run stopped after its last step" in message and "--resume auto" in message, message
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [
        "checkpoints", "metrics.jsonl", "recipe.yaml", "train.log"]  # no final.tmp/, no final/
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)  # space freed: the resume writes final/ alone
    summary = run_train(recipe, resume="auto")
    assert summary["steps"] == 4 and (run / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
