"""The run folder: --overwrite deletes only llmtrain runs, and one run at a time holds a folder, through an OS
lock that dies with its process. prepare_output_dir directly first, then the real CLI in real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ENV, LLMTRAIN, REPO, cli, invoke, records, write_recipe

from llmtrain.errors import LLMTrainError
from llmtrain.run.checkpoint import MANIFEST, checkpoint_problem, step_dirs
from llmtrain.run.rundir import MARKER, prepare_output_dir

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"


pytestmark = pytest.mark.long(70)  # tests/conftest.py


class OneProcess:
    """What prepare_output_dir asks of the Accelerator, for one process."""

    is_main_process = True
    num_processes = 1

    def __init__(self):
        self.printed = []

    def print(self, *args) -> None:
        self.printed.append(" ".join(map(str, args)))


def _prepare(out, *, resume=None, overwrite=False):
    return prepare_output_dir(OneProcess(), out, resume=resume, overwrite=overwrite)


def _snapshot(folder):
    """Every path below `folder` with its bytes and mtime: equal snapshots mean nothing was touched."""
    return {p.relative_to(folder): (p.lstat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _not_a_run(tmp_path):
    mine = tmp_path / "home"
    (mine / "precious").mkdir(parents=True)
    (mine / "precious" / "file.txt").write_text("years of work\n")
    (mine / "notes.txt").write_text("do not delete\n")
    return mine


@pytest.mark.parametrize("flags, why", [({"overwrite": True}, "--overwrite will not delete it"),
                                        ({}, "llmtrain will not write into it"),
                                        ({"resume": "auto"}, "there is no run in it to resume")])
def test_a_folder_that_is_not_a_run_is_refused_and_untouched(tmp_path, flags, why):
    mine = _not_a_run(tmp_path)
    before = _snapshot(mine)
    with pytest.raises(LLMTrainError) as err:
        _prepare(mine, **flags)
    message = str(err.value)
    assert f"output_dir '{mine}' is not empty (notes.txt, precious)" in message
    assert f"not an llmtrain run folder (it has no {MARKER} file)" in message and why in message
    assert "output_dir=<new path>" in message and "\n" not in message
    assert _snapshot(mine) == before  # no marker, no checkpoints/, nothing


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "out"
    file.write_text("x")
    with pytest.raises(LLMTrainError, match="is a file, not a folder"):
        _prepare(file, overwrite=True)
    assert file.read_text() == "x"


def test_overwrite_empties_a_run_but_keeps_its_lock_file_and_never_follows_links(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    _prepare(run).release()  # a fresh run folder: marker and checkpoints/
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "checkpoints"]
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoints" / "step_000002").mkdir()
    (run / "checkpoints" / "step_000002" / "train_state.json").write_text('{"step": 2}')
    (run / "link").symlink_to(outside, target_is_directory=True)
    marker = (run / MARKER).stat().st_ino

    rundir = _prepare(run, overwrite=True)
    assert rundir.checkpoint is None
    assert sorted(p.name for p in run.rglob("*")) == [MARKER, "checkpoints"]
    assert (run / MARKER).stat().st_ino == marker  # the same file: a run locking it now contends with us
    assert (outside / "precious.txt").read_text() == "keep"  # the link went, not what it pointed to
    rundir.release()


def test_overwrite_accepts_an_older_llmtrain_run_and_resume_accepts_copied_checkpoints(tmp_path):
    legacy = tmp_path / "legacy"  # what every run of llmtrain before the marker holds
    (legacy / "checkpoints").mkdir(parents=True)
    (legacy / "metrics.jsonl").write_text("{}\n")
    (legacy / "recipe.yaml").write_text("x: 1\n")
    _prepare(legacy, overwrite=True).release()
    assert sorted(p.name for p in legacy.iterdir()) == [MARKER, "checkpoints"]

    copied = tmp_path / "copied"  # checkpoints copied into a new folder, to resume elsewhere
    (copied / "checkpoints" / "step_000002").mkdir(parents=True)
    (copied / "checkpoints" / "step_000002" / "train_state.json").write_text('{"step": 2}')
    with pytest.raises(LLMTrainError, match="--overwrite will not delete it"):
        _prepare(copied, overwrite=True)  # not a run: never deleted
    rundir = _prepare(copied, resume="auto")
    assert rundir.checkpoint == copied / "checkpoints" / "step_000002"
    assert (copied / MARKER).is_file()
    rundir.release()


def test_another_runs_checkpoint_resumes_into_a_new_folder_but_never_over_a_run(tmp_path):
    """--resume PATH of a checkpoint of another run folder (a copied run's checkpoint, given with the original's
    recipe): into output_dir holding a run, refused and nothing touched (it had resumed there, writing over that run's
    later checkpoints and final/); into a new folder, a run branched from it."""
    def checkpoint(run, step):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "train_state.json").write_text(json.dumps({"step": step}))

    mine, other = tmp_path / "mine", tmp_path / "other"
    for run in (mine, other):
        checkpoint(run, 2)
        checkpoint(run, 4)
        (run / "metrics.jsonl").write_text("{}\n")
        _prepare(run, resume="auto").release()  # (each a run: its marker)
    before = _snapshot(mine)
    with pytest.raises(LLMTrainError) as refused:
        _prepare(mine, resume=str(other / "checkpoints" / "step_000002"))
    said = " ".join(str(refused.value).split())
    assert f"is not one of output_dir '{mine}''s, which holds a run of its own" in said
    assert f"Resume the checkpoint's own run (output_dir={other})" in said and _snapshot(mine) == before
    own = _prepare(mine, resume=str(mine / "checkpoints" / "step_000002"))
    assert own.checkpoint.name == "step_000002"
    own.release()
    branch = _prepare(tmp_path / "branch", resume=str(other / "checkpoints" / "step_000002"))
    assert branch.checkpoint == other / "checkpoints" / "step_000002"
    branch.release()


def test_leftovers_of_killed_saves_and_prunes_are_removed_at_start(tmp_path):
    run = tmp_path / "run"
    _prepare(run).release()
    for left in (".tmp-step_000006", ".trash-step_000002"):
        (run / "checkpoints" / left).mkdir()
        (run / "checkpoints" / left / "optimizer.bin").write_bytes(b"half")
    _prepare(run, resume="auto").release()
    assert list((run / "checkpoints").iterdir()) == []


def test_lock_is_exclusive_until_released(tmp_path):
    run = tmp_path / "run"
    first = _prepare(run)
    (run / "metrics.jsonl").write_text("{}\n")
    before = _snapshot(run)
    for flags in ({"resume": "auto"}, {"overwrite": True}, {}):
        with pytest.raises(LLMTrainError, match="is in use by another llmtrain run") as err:
            _prepare(run, **flags)
        assert f"pid {os.getpid()}" in str(err.value) and "this very process" in str(err.value)
    assert _snapshot(run) == before  # --overwrite deleted nothing under the running run
    first.release()
    with _prepare(run, resume="auto") as second:
        assert second.checkpoint is None


# --------------------------------------------------------------------------- the real CLI, real processes


@pytest.fixture
def long_run(tiny_assets, tmp_path):
    """start(recipe, run, ...) -> a `llmtrain finetune` process that trains far longer than the test, and is
    found holding `run` (it has written a checkpoint); it is killed when the test ends. Once it holds the folder it is
    paused (SIGSTOP): alive and holding its lock, as a run is between two steps, but no longer taking a core from the
    processes the test starts next."""
    procs = []

    def start(recipe, run, *extra):
        log = open(tmp_path / f"first-{len(procs)}.log", "w")
        proc = subprocess.Popen([*LLMTRAIN, "finetune", str(recipe), f"output_dir={run}", *extra], env=ENV,
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.monotonic() + 90
        while not list((run / "checkpoints").glob("step_*")):
            assert proc.poll() is None, (tmp_path / f"first-{len(procs) - 1}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run wrote no checkpoint in 90 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _long_recipe(tiny_assets, tmp_path):
    return write_recipe(tiny_assets, tmp_path, train={"max_steps": 100_000},
                        checkpoint={"every_steps": 10, "keep_last": 2, "save_final": True})


@pytest.mark.slow
def test_cli_overwrite_refuses_a_folder_that_is_not_a_run(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2})
    mine = _not_a_run(tmp_path)
    before = _snapshot(mine)
    proc = cli("finetune", str(recipe), f"output_dir={mine}", "--overwrite", check=False)
    assert proc.returncode == 2
    assert f"output_dir '{mine}' is not empty" in proc.stderr and "--overwrite will not delete it" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert _snapshot(mine) == before
    assert (mine / "precious" / "file.txt").read_text() == "years of work\n"


@pytest.mark.slow
def test_cli_second_run_into_a_busy_folder_is_refused_and_kill_9_leaves_no_stale_lock(tiny_assets, tmp_path,
                                                                                         long_run):
    recipe, run = _long_recipe(tiny_assets, tmp_path), tmp_path / "run"
    first = long_run(recipe, run)
    for flags in (["--overwrite"], ["--resume", "auto"]):  # in this process (invoke): the same command and words
        proc = invoke("finetune", str(recipe), f"output_dir={run}", *flags, check=False)
        assert proc.returncode == 2, proc.stderr
        assert f"output_dir '{run}' is in use by another llmtrain run: pid {first.pid}" in proc.stderr
        assert "wait for it to finish or stop it" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    # llmtrain launch says it once, before any process starts (it had started both, and each said it)
    proc = cli("launch", "--config_file", str(CPU_DDP), str(recipe), f"output_dir={run}", "--resume", "auto",
               check=False)
    assert proc.returncode == 2 and proc.stderr.count(f"is in use by another llmtrain run: pid {first.pid}") == 1
    assert "llmtrain launch: process" not in proc.stderr, proc.stderr
    # The first run was neither deleted nor disturbed: still running, and its log still has one line per step.
    assert first.poll() is None
    steps = [r["step"] for r in records(run)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 10

    first.kill()  # SIGKILL: no clean-up of any kind; the kernel drops the lock with the process
    first.wait()
    again = invoke("finetune", str(recipe), f"output_dir={run}", "train.max_steps=2", "--overwrite")
    assert again.returncode == 0
    assert [r["step"] for r in records(run)] == [1, 2]
    assert f"pid: {first.pid}\n" not in (run / MARKER).read_text()


def launch(recipe, port, *args, check=True, **kwargs) -> subprocess.CompletedProcess:
    """`accelerate launch` of 2 CPU processes (DDP over gloo) running `llmtrain finetune RECIPE ARGS...`."""
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_DDP),
                           "--main_process_port", str(port), "-m", "llmtrain", "finetune", str(recipe), *args],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300, **kwargs)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.extended  # main tier: test_cli_second_run_into_a_busy_folder_is_refused_and_kill_9_leaves_no_stale_lock
@pytest.mark.slow
def test_two_process_launch_locks_on_the_main_process_only(tiny_assets, tmp_path, long_run, free_port):
    """Into a busy folder every rank stops with the main process's refusal (none hangs); into a free one the
    two ranks share the main process's lock and train."""
    recipe, run = _long_recipe(tiny_assets, tmp_path), tmp_path / "run"
    first = long_run(recipe, run, "train.micro_batch_size=4")
    busy = launch(recipe, free_port, f"output_dir={run}", "train.micro_batch_size=2", "--resume", "auto",
                   check=False)
    assert busy.returncode != 0
    assert busy.stderr.count(f"is in use by another llmtrain run: pid {first.pid}") == 2  # both ranks say why
    assert first.poll() is None
    first.kill()
    first.wait()
    launch(recipe, free_port, f"output_dir={run}", "train.micro_batch_size=2", "train.max_steps=2",
           "checkpoint.every_steps=1", "--overwrite")
    assert [r["step"] for r in records(run)] == [1, 2]
    # Both ranks' parts are flushed and in the manifest the main process wrote.
    for ckpt in step_dirs(run / "checkpoints"):
        assert checkpoint_problem(ckpt) is None
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(json.loads((ckpt / MANIFEST).read_text())["files"])


def _saved_run(tiny_assets, tmp_path):
    """A 2-step run started in tmp_path/work (its relative model and output_dir), and an empty folder elsewhere."""
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny_assets / "model", work / "base")
    recipe = write_recipe(tiny_assets, work, model={"name_or_path": "base"}, train={"max_steps": 2},
                          checkpoint={"every_steps": 1, "keep_last": 1}, output_dir="runs/x")
    assert _llmtrain(work, "finetune", str(recipe)).returncode == 0
    return work, elsewhere


def _llmtrain(where, *args):
    return subprocess.run([*LLMTRAIN, *args], env=ENV, cwd=where, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_runs_saved_recipe_resumes_it_from_any_directory(tiny_assets, tmp_path):
    """`llmtrain finetune runs/x/recipe.yaml --resume auto`, the command a stopped run prints, run from another
    directory (a job script's): the recipe's relative output_dir and model are from where the run was started, and
    had been read from here: "no complete checkpoint in runs/x; starting from step 0", a new run begun in ./runs/x.
    Now the process works where the run was started, said in one line (`llmtrain launch` too: the test below). A copy
    of the recipe elsewhere is any recipe: from here."""
    import shutil

    work, elsewhere = _saved_run(tiny_assets, tmp_path)
    saved = work / "runs" / "x" / "recipe.yaml"
    proc = _llmtrain(elsewhere, "finetune", "../work/runs/x/recipe.yaml", "--resume", "auto",
                     "--allow-recipe-change", "train.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{saved} is its run's saved recipe: its relative paths are from {work}, where the run was started" in \
        " ".join(proc.stderr.split())
    assert [r["step"] for r in records(work / "runs" / "x")] == [1, 2, 3] and not (elsewhere / "runs").exists()
    # a copy of the saved recipe in another directory is read from there, as any recipe (its first line aside)
    shutil.copy(saved, elsewhere / "mine.yaml")
    shutil.copytree(tiny_assets / "model", elsewhere / "base")
    proc = _llmtrain(elsewhere, "finetune", "mine.yaml", "train.max_steps=1")
    assert proc.returncode == 0 and "saved recipe" not in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in records(elsewhere / "runs" / "x")] == [1]


@pytest.mark.slow
@pytest.mark.extended  # the main tier: the one-process resume above, and test_launch's checks before the launch
def test_llmtrain_launch_resumes_a_saved_recipe_from_any_directory(tiny_assets, tmp_path, free_port):
    """`llmtrain launch` of a run's saved recipe from another directory: its relative --config_file and --resume are
    read from here first; 2 processes resume the step-2 checkpoint. A micro-batch check that every process would
    fail alike is said once, not twice."""
    import shutil

    work, elsewhere = _saved_run(tiny_assets, tmp_path)
    shutil.copy(CPU_DDP, elsewhere / "ddp.yaml")
    args = ["launch", "--config_file", "ddp.yaml", "--main_process_port", str(free_port), "../work/runs/x/recipe.yaml",
            "--resume", "../work/runs/x/checkpoints/step_000002", "--allow-recipe-change", "train.max_steps=3"]
    proc = _llmtrain(elsewhere, *args)  # 2 x 4 examples a micro-batch against the checkpoint's 4: said once, not twice
    assert proc.returncode == 2 and proc.stderr.count("the checkpoint was written with micro_batch_size x "
                                                      "data-parallel ranks = 4, this run has 4 x 2 = 8") == 1, \
        proc.stderr[-3000:]
    proc = _llmtrain(elsewhere, *args, "train.micro_batch_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(work / "runs" / "x")] == [1, 2, 3] and not (elsewhere / "runs").exists()


@pytest.mark.slow
def test_estimate_memory_reads_a_runs_saved_recipe_from_where_the_run_started(tiny_assets, tmp_path):
    """estimate-memory of a run's saved recipe from another directory reads its relative model from where the run
    was started, as finetune, launch and doctor do (it had looked for ./base here and stopped: "could not read a
    model config for 'base'")."""
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny_assets / "model", work / "base")
    recipe = write_recipe(tiny_assets, work, model={"name_or_path": "base"}, train={"max_steps": 1},
                          output_dir="runs/x")
    run = subprocess.run([*LLMTRAIN, "finetune", str(recipe)], env=ENV, cwd=work, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    proc = subprocess.run([*LLMTRAIN, "estimate-memory", "../work/runs/x/recipe.yaml", "--json"], env=ENV,
                          cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "where the run was started" in " ".join(proc.stderr.split())
    assert json.loads(proc.stdout)["per_gpu_peak_bytes"] > 0


def test_a_runs_recipe_yaml_that_no_longer_validates_is_one_paragraph(tiny_assets, tmp_path):
    """A run's saved recipe.yaml that this llmtrain refuses (a key a later version refuses, a hand edit): generate,
    eval and export read it through run_recipe, where pydantic's ValidationError had reached the user as a
    traceback. One paragraph naming the file and the key, exit 2."""
    import yaml

    from llmtrain.config import load_recipe
    from llmtrain.errors import RecipeError
    from llmtrain.run.rundir import run_recipe

    run = tmp_path / "run"
    run.mkdir()
    saved = yaml.safe_load(load_recipe(write_recipe(tiny_assets, tmp_path)).to_yaml())
    saved["train"]["lr"] = "fast"
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(RecipeError, match=rf"Invalid recipe '{run / 'recipe.yaml'}' \(the run's own\):\n  - train.lr"):
        run_recipe(run)
    (run / "final").mkdir()
    proc = invoke("generate", str(run), "reverse abc =", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said and "train.lr" in said, said


def test_a_copied_run_folders_recipe_is_refused_where_it_names_the_run_it_was_copied_from(tiny_assets, tmp_path):
    """Audit 55: `finetune runs/COPY/recipe.yaml --resume auto` (a run folder copied to keep it, or to branch from it)
    read output_dir from the file: the original's, which it resumed and finished (final/ and summary.json written
    there), the copy untouched. Refused before anything is written, saying how to continue either; with output_dir
    given it continues the copy. `llmtrain launch` refuses it alike before any process starts."""
    import shutil

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2},
                          output_dir=str(tmp_path / "orig"))
    invoke("finetune", str(recipe))
    shutil.rmtree(tmp_path / "orig" / "final")
    (tmp_path / "orig" / "summary.json").unlink()  # a run stopped at its checkpoint, copied
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "orig").rglob("*")}
    copied = str(tmp_path / "copy" / "recipe.yaml")
    for command in (["finetune", copied, "--resume", "auto"],
                    ["finetune", copied, "--overwrite"],
                    ["launch", "--config_file", str(CPU_DDP), copied, "--resume", "auto"]):
        proc = invoke(*command, check=False)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and f"is the saved recipe of the run folder {tmp_path / 'copy'}" in said, said
        assert f"add output_dir={tmp_path / 'copy'} after the recipe" in said
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "orig").rglob("*")} == before
    doctor = invoke("doctor", copied, check=False)  # doctor says what finetune would
    assert doctor.returncode == 1 and "is the saved recipe of the run folder" in " ".join(doctor.stdout.split())
    done = invoke("finetune", copied, f"output_dir={tmp_path / 'copy'}", "--resume", "auto")
    assert "resumed from" in done.stdout + done.stderr and (tmp_path / "copy" / "final").is_dir()
    assert not (tmp_path / "orig" / "final").exists()
