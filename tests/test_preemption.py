"""Preemption and divergence through the real CLI: real signals to real processes, real files.

- SIGTERM (and a first Ctrl-C) mid-run: the step finishes, a complete checkpoint is written at it, the run
  exits 143 (130), and `--resume auto` ends with the uninterrupted run's weights. One process, and 2 CPU
  DDP processes signalled as SLURM does (the whole process group).
- A second Ctrl-C stops at once.
- A non-finite gradient stops the run (exit 3) naming the step, publishes nothing non-finite, and keeps
  metrics.jsonl strict JSON; train.max_bad_steps skips such steps first.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ENV, LLMTRAIN, REPO, cli, load_weights, losses, max_abs_diff, records, run_train, write_recipe

CPU_DDP = REPO / "accelerate_configs" / "cpu_ddp.yaml"
# A signalled run is signalled once it has logged 3 steps and stops at the end of the step it is in (under DDP, of the
# step whose collective carries the vote): it stops well inside these, and every step left is trained again on resume.
STEPS = 40


pytestmark = pytest.mark.long(180)  # tests/conftest.py


def _start(args: list[str]) -> subprocess.Popen:
    # A session of its own: the test signals the whole group, as SLURM and Kubernetes do.
    return subprocess.Popen(args, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_steps(run: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (run / "metrics.jsonl").is_file() and len(records(run)) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no {n} steps in {timeout} s")


def _interrupt(proc: subprocess.Popen, run: Path, sig: int) -> tuple[int, str, float]:
    _wait_for_steps(run, proc, 3)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out + err, time.monotonic() - t0


def _steps_on_disk(run: Path) -> list[int]:
    return sorted(int(d.name[5:]) for d in (run / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run): the STEPS steps that the signalled runs are stopped in, trained once by the CLI to the end; the
    signal tests resume to its weights (read only)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    recipe = write_recipe(tiny_assets, folder, train={"max_steps": STEPS, "micro_batch_size": 8})
    cli("finetune", str(recipe), f"output_dir={folder / 'full'}")  # a process as the resumed ones: equal bit for bit
    return recipe, folder / "full"


@pytest.mark.slow
# One signal in the main tier: both take the same path (SIGTERM under DDP:
# test_sigterm_under_ddp_stops_every_rank_at_one_step).
@pytest.mark.parametrize(("sig", "code"), [pytest.param(signal.SIGTERM, 143, marks=pytest.mark.extended),
                                           (signal.SIGINT, 130)])
def test_signal_mid_run_saves_and_resumes_exactly(uninterrupted, tmp_path, sig, code):
    recipe, full = uninterrupted
    cut = tmp_path / "cut"
    proc = _start([*LLMTRAIN, "finetune", str(recipe), f"output_dir={cut}"])
    rc, output, seconds = _interrupt(proc, cut, sig)
    assert rc == code, output[-2000:]
    assert "Traceback" not in output
    steps = _steps_on_disk(cut)
    last_logged = records(cut)[-1]["step"]
    # The step that was running finished, and the checkpoint is at that very step.
    assert steps == [last_logged] and 3 <= last_logged < STEPS, (steps, last_logged)
    assert f"{signal.Signals(sig).name} at step {last_logged}" in output and "--resume auto" in output
    assert not (cut / "final").exists()
    print(f"{signal.Signals(sig).name} -> exit in {seconds:.2f} s, checkpoint step {last_logged}")
    cli("finetune", str(cut / "recipe.yaml"), "--resume", "auto")
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6)
    assert max_abs_diff(load_weights(cut / "final"), load_weights(full / "final")) == 0.0


@pytest.mark.extended  # main tier: test_signal_mid_run_saves_and_resumes_exactly (2 DDP processes)
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "llmtrain"])
def test_sigterm_under_ddp_stops_every_rank_at_one_step(tiny_assets, tmp_path, free_port, launcher):
    """2 gloo processes: the ranks vote in the step's collective, so both stop after the same step; the
    checkpoint is complete (both ranks' RNG files) and resuming ends like an uninterrupted run. Under `accelerate
    launch` the launcher, signalled with them, then exits 1 with torchrun's traceback; `llmtrain launch` exits 143
    (as one process does) with one line."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": STEPS, "micro_batch_size": 2})
    single, cut = tmp_path / "single", tmp_path / "cut"
    run_train(recipe, f"output_dir={single}", "train.micro_batch_size=4")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_DDP),
              "--main_process_port", str(free_port), "-m", "llmtrain", "finetune", str(recipe), f"output_dir={cut}"]
    if launcher == "llmtrain":
        launch = [*LLMTRAIN, "launch", "--config_file", str(CPU_DDP), "--main_process_port", str(free_port),
                  str(recipe), f"output_dir={cut}"]
    rc, output, seconds = _interrupt(_start(launch), cut, signal.SIGTERM)
    # Each worker exits 143 after the checkpoint; torchrun, signalled with them, reports that as a failure: the
    # launcher exits 1 (docs/checkpoints.md). What says the stop was clean is the one stop line and the checkpoint.
    if launcher == "accelerate":
        assert rc == 1, output[-3000:]
    else:
        assert rc == 143 and "Traceback" not in output, output[-3000:]
        assert "llmtrain launch: SIGTERM reached the launcher, which passed it to the processes" in output
    assert output.count("stopped: SIGTERM at step") == 1, output[-3000:]  # once a node, not once a process
    steps = _steps_on_disk(cut)
    assert len(steps) == 1 and steps[0] == records(cut)[-1]["step"], (steps, output[-3000:])
    ckpt = cut / "checkpoints" / f"step_{steps[0]:06d}"
    assert {"random_states_0.pkl", "random_states_1.pkl", "train_state.json"} <= {p.name for p in ckpt.iterdir()}
    assert f"SIGTERM at step {steps[0]}" in output
    # the launch's command to continue, not finetune's (which a layout of several processes refuses; audit 36)
    assert f"Continue with: llmtrain launch [the same accelerate flags] {cut / 'recipe.yaml'} --resume auto" in output
    print(f"DDP SIGTERM -> exit in {seconds:.2f} s, checkpoint step {steps[0]}")
    launch[launch.index("--main_process_port") + 1] = str(free_port + 1)
    subprocess.run([*launch, "--resume", "auto"], env=ENV, cwd=REPO, check=True, capture_output=True, timeout=300)
    assert losses(cut) == pytest.approx(losses(single), abs=1e-5)
    assert max_abs_diff(load_weights(cut / "final"), load_weights(single / "final")) < 1e-5


@pytest.mark.slow
def test_a_launcher_killed_by_sigkill_stops_its_processes_as_a_preemption_does(tiny_assets, tmp_path, free_port):
    """kill -9 of `llmtrain launch` alone (the OOM killer, a job's first process killed) passes no signal on: the 2
    processes it started had trained on to the end unwatched, orphaned, holding the run folder (a --resume then
    refused: in use). The kernel now sends each SIGTERM as its launcher dies: they stop after one step with a
    complete checkpoint at it, as a preempted run does."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": STEPS, "micro_batch_size": 2})
    cut = tmp_path / "cut"
    proc = _start([*LLMTRAIN, "launch", "--config_file", str(CPU_DDP), "--main_process_port", str(free_port),
                   str(recipe), f"output_dir={cut}"])
    _wait_for_steps(cut, proc, 3)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, not its group
    out, err = proc.communicate(timeout=120)  # the pipes close when the processes, which hold them too, have exited
    output = out + err
    assert output.count("stopped: SIGTERM at step") == 1, output[-3000:]
    assert output.count("SIGTERM: finishing this step") == 1, output[-3000:]  # once a node (it was once a process)
    steps = _steps_on_disk(cut)
    assert len(steps) == 1 and steps[0] == records(cut)[-1]["step"] < STEPS, (steps, output[-3000:])
    ckpt = cut / "checkpoints" / f"step_{steps[0]:06d}"
    assert {"random_states_0.pkl", "random_states_1.pkl", "train_state.json"} <= {p.name for p in ckpt.iterdir()}
    assert not (cut / "final").exists() and "Traceback" not in output


def test_second_ctrl_c_stops_at_once():
    from llmtrain.loop.signals import StopRequests

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job a shell started in the background
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # let the handler run
        assert stop.signum == signal.SIGINT  # the first: recorded, the run goes on to the step's end
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before  # restored: as it was before, whatever that was


def test_divergence_stops_and_publishes_nothing_non_finite(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 12, "lr": 1e12, "max_grad_norm": None},
                          checkpoint={"every_steps": 1, "keep_last": 20})
    proc = cli("finetune", str(recipe), check=False)
    run = tmp_path / "run"
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for ln in lines]
    bad = rows[-1]
    assert bad["skipped"] is True and bad["grad_norm"] is None and bad["loss"] is None
    assert f"step {bad['step']}: the gradient norm is nan" in proc.stderr
    assert not (run / "final").exists()
    for ckpt in (run / "checkpoints").glob("step_*"):  # every published checkpoint holds finite weights
        assert int(ckpt.name[5:]) < bad["step"]
        assert all(t.isfinite().all() for t in load_weights(ckpt).values())


def test_max_bad_steps_skips_updates_then_stops(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 8, "lr": 1e12, "max_grad_norm": None,
                                                        "max_bad_steps": 2})
    proc = cli("finetune", str(recipe), check=False)
    rows = records(tmp_path / "run")
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert proc.returncode == 3 and len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3))
    assert all(math.isfinite(r["loss"]) for r in rows if not r["skipped"])
    assert "update skipped (1 of train.max_bad_steps=2)" in proc.stdout + proc.stderr


@pytest.fixture
def fp16_loss_scale(monkeypatch):
    """Accelerate's fp16 on a GPU, on this CPU (tests/fp16_on_cpu.py: its GradScaler at 2^24, where fp16's gradients
    of the tiny model overflow for the first 7 steps, its autocast and its unscale before the norm)."""
    import fp16_on_cpu

    fp16_on_cpu.patch(monkeypatch.setattr)


def test_fp16_on_a_cpu_says_that_it_computes_in_the_models_dtype(tiny_assets, tmp_path, capsys):
    """Accelerate makes fp16's autocast and loss scale on GPUs only: on a CPU the run says so, where it used to train
    in fp32 without a word; bf16 (CPU autocast) says nothing."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 1, "eval_every_steps": None})
    run_train(recipe, "train.mixed_precision=fp16", f"output_dir={tmp_path / 'fp16'}")
    said = " ".join(capsys.readouterr().out.split())
    assert "warning: train.mixed_precision=fp16 on a CPU computes in the model's dtype (float32): Accelerate runs " \
        "neither fp16 autocast nor a loss scale on a CPU" in said
    run_train(recipe, "train.mixed_precision=bf16", f"output_dir={tmp_path / 'bf16'}")
    assert "mixed_precision=" not in capsys.readouterr().out


def test_fp16s_overflows_halve_the_loss_scale_and_the_run_trains_on_and_resumes_it(fp16_loss_scale, tiny_assets,
                                                                                   tmp_path):
    """train.mixed_precision fp16: a step whose scaled gradients overflow is the loss scale's to skip (the scaler
    halves it), not a bad step: each is said, none counts against train.max_bad_steps=0, and once the scale fits the
    run trains. Before, the first overflow stopped the run as diverged (exit 3), and with max_bad_steps > 0 the next
    step raised (the scaler's unscale_ called twice without its update). A resume from a checkpoint taken while the
    scale was still falling goes on with the checkpoint's scale (Accelerate saves the scaler): the same scales and
    losses as the straight run."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 12, "mixed_precision": "fp16", "lr": 1e-3,
                                                        "warmup_steps": 0, "eval_every_steps": None},
                          checkpoint={"every_steps": 4, "keep_last": 5}, logging={"every_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    rows = records(tmp_path / "straight")
    scales = [r["loss_scale"] for r in rows]
    assert scales[:7] == [2.0 ** (23 - i) for i in range(7)] and set(scales[7:]) == {2.0 ** 17}
    assert [r["skipped"] for r in rows] == [True] * 7 + [False] * 5
    assert rows[-1]["loss"] < rows[7]["loss"] - 0.3  # it trained once the scale fit (4.82 -> 4.21 measured)
    log = (tmp_path / "straight" / "train.log").read_text()
    assert "step 1: fp16's gradients overflowed at loss scale 1.67772e+07, update skipped; the loss scale is now " \
        "8.38861e+06 (dynamic loss scaling: not counted in train.max_bad_steps)" in log
    run_train(recipe, f"output_dir={tmp_path / 'again'}",
              resume=str(tmp_path / "straight" / "checkpoints" / "step_000004"))
    assert [(r["step"], r["loss_scale"], r["loss"]) for r in records(tmp_path / "again")] == \
        [(r["step"], r["loss_scale"], r["loss"]) for r in rows[4:]]


@pytest.mark.extended  # main tier: test_max_bad_steps_skips_updates_then_stops, the resumes
@pytest.mark.slow  # a longer run: make test, not the fast tier
def test_max_bad_steps_counts_across_a_resume(tiny_assets, tmp_path):
    """The skips are a count of the whole run: a resume from a checkpoint saved after two skips may not skip two
    more (before, the count restarted at 0 and a preempted run could skip without end)."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 12, "lr": 1e12, "max_grad_norm": None,
                                                        "max_bad_steps": 2},
                          checkpoint={"every_steps": 1, "keep_last": 20})
    run = tmp_path / "run"
    first = cli("finetune", str(recipe), check=False)
    skipped = [r["step"] for r in records(run) if r["skipped"]]
    assert first.returncode == 3 and len(skipped) == 3, first.stderr
    # The run stopped at its third bad step; the newest checkpoint is after the second, holding a count of 2.
    assert _steps_on_disk(run)[-1] == skipped[1]
    state = json.loads((run / "checkpoints" / f"step_{skipped[1]:06d}" / "train_state.json").read_text())
    assert state["bad_steps"] == 2
    again = cli("finetune", str(run / "recipe.yaml"), "--resume", "auto", check=False)
    assert again.returncode == 3, again.stderr
    # the first bad step after the resume is the third of the run: no "update skipped (1 of ...)" again
    assert "of train.max_bad_steps=2)" not in again.stdout + again.stderr
    assert f"step {skipped[2]}: the gradient norm is nan" in again.stderr


def test_a_stop_at_once_says_what_was_saved(capsys):
    """A second Ctrl-C (StopRequests raises KeyboardInterrupt), or one before training starts or in another command:
    one line saying nothing more was saved and how a run goes on, exit 130 (it had ended with no word; audit 11)."""
    import typer

    from llmtrain.cli import user_errors

    def stop(command):  # a command of that name, stopped
        def interrupted():
            raise KeyboardInterrupt

        interrupted.__name__ = command
        with pytest.raises(typer.Exit) as stopped:
            user_errors(interrupted)()
        assert stopped.value.exit_code == 130
        return capsys.readouterr().err

    said = stop("finetune")
    assert "stopped at once (Ctrl-C): nothing more was saved" in said and "--resume auto" in said
    # generate's --out keeps each batch's replies as they are drawn (it had been told nothing was saved; audit 42)
    said = stop("generate")
    assert "--out, where given, holds the replies of every batch drawn" in said and "--resume" not in said
    assert stop("plot").strip() == "stopped at once (Ctrl-C)."


def test_ctrl_c_after_a_sigterm_stops_at_once_and_a_sigterm_before_the_loop_is_one_line(capsys):
    """Audit 54: Ctrl-C after a SIGTERM was ignored (only Ctrl-C after Ctrl-C counted as 'again'), and a SIGTERM
    before the training loop (the data's preparation, the model's load) ended the process with no word (-15): it
    stops at once with one line and exit 143, as Ctrl-C does with 130."""
    import typer

    from llmtrain.cli import user_errors
    from llmtrain.loop.signals import StopRequests, stop_at_once_on_sigterm

    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    before = signal.getsignal(signal.SIGTERM)

    def finetune():  # a command stopped while it prepares its run
        stop_at_once_on_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        raise AssertionError("the SIGTERM did not stop it")

    try:
        with pytest.raises(typer.Exit) as stopped:
            user_errors(finetune)()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.exit_code == 143
    assert "stopped at once (SIGTERM): nothing more was saved" in capsys.readouterr().err


def test_under_a_launcher_a_sigterm_after_a_ctrl_c_is_the_second_ctrl_c(monkeypatch):
    """Audit 54: under `llmtrain launch` the terminal's Ctrl-C reaches the launcher alone (torchrun starts its processes
    in sessions of their own); it passes the first on as SIGINT, and a second one makes it send SIGTERM and wait
    again, which the processes ignored: the second Ctrl-C did nothing. There, a SIGTERM after a SIGINT stops at once;
    in one process (a SIGTERM from a scheduler after a Ctrl-C) the stop goes on to its checkpoint."""
    from llmtrain.loop.signals import StopRequests

    def second_signal_stops(under_launcher: bool) -> bool:
        if under_launcher:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with StopRequests() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert stop.signum == signal.SIGINT
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
            except KeyboardInterrupt:
                return True
        return False

    assert second_signal_stops(under_launcher=True)
    assert not second_signal_stops(under_launcher=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with StopRequests() as stop:  # SIGTERM after SIGTERM (SLURM signals the job's processes and the launcher passes
        os.kill(os.getpid(), signal.SIGTERM)  # it on too): one stop, at its checkpoint
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.signum == signal.SIGTERM


@pytest.mark.parametrize("during", ["save", "evaluate_and_sample"])
def test_a_signal_during_a_save_or_an_eval_stops_at_that_step(tiny_assets, tmp_path, monkeypatch, during):
    """Audit 54: a SIGTERM that came while a checkpoint was written (or an eval ran) was read only after the next
    step: one more step and a second save, past a cloud's 30 s grace. The run now stops at the step whose save or
    eval it interrupted, with one checkpoint there, and --resume auto ends with the uninterrupted run's weights."""
    import llmtrain.loop.train as loop
    from llmtrain.errors import Stopped

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 8, "eval_every_steps": 3},
                          data={"eval_split": 0.1}, checkpoint={"every_steps": 3, "save_final": True})
    full = run_train(recipe, f"output_dir={tmp_path / 'full'}")
    real, calls = getattr(loop, during), []

    def signalled(*args, **kwargs):  # the first save / eval (step 3) gets the signal while it runs
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, during, signalled)
    with pytest.raises(Stopped, match="SIGTERM at step 3"):
        run_train(recipe)
    run = tmp_path / "run"
    assert _steps_on_disk(run) == [3]  # it had gone on to step 4 and saved there too
    assert max(r["step"] for r in records(run)) == 3
    monkeypatch.setattr(loop, during, real)
    summary = run_train(recipe, resume="auto")
    assert summary["final_loss"] == full["final_loss"]
    assert max_abs_diff(load_weights(run / "final"), load_weights(tmp_path / "full" / "final")) == 0.0


def test_a_stop_during_an_eval_ends_it_at_its_next_batch_and_the_resume_evaluates_that_step_first(
        tiny_assets, tmp_path, monkeypatch, capsys):
    """A stop that came during an eval waited for the whole eval (minutes of online RL's generations, on a GPU: past a
    30 s grace period, the checkpoint after it lost). The eval ends at its next batch with nothing written, the
    checkpoint at that step owes it (train_state.json's eval_owed), and the resumed run evaluates that step first:
    its eval lines and final weights are the uninterrupted run's."""
    import llmtrain.loop.train as loop
    from llmtrain.errors import Stopped

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 8, "eval_every_steps": 3, "eval_batch_size": 2},
                          data={"eval_split": 0.1}, checkpoint={"every_steps": 4, "save_final": True})
    full = run_train(recipe, f"output_dir={tmp_path / 'full'}")
    real, begun = loop.evaluate, []

    def signalled(*args, on_batch, **kwargs):  # the first eval (step 3) is signalled as its second batch begins
        def batch(done, total):
            begun.append((done, total))
            if done == 1 and len(begun) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            on_batch(done, total)
        return real(*args, on_batch=batch, **kwargs)

    monkeypatch.setattr(loop, "evaluate", signalled)
    with pytest.raises(Stopped, match="SIGTERM at step 3"):
        run_train(recipe)
    run = tmp_path / "run"
    assert [done for done, _ in begun] == [0, 1] and begun[0][1] > 2  # it had evaluated every batch
    said = capsys.readouterr()
    assert "step 3's eval is cut short by the stop: the resumed run evaluates step 3 first" in said.out
    assert "SIGTERM: finishing this step (an eval: its batch), then saving a checkpoint and stopping." in said.err
    assert _steps_on_disk(run) == [3] and records(run, "eval") == []  # a save at the eval's step, no eval line
    assert json.loads((run / "checkpoints" / "step_000003" / "train_state.json").read_text())["eval_owed"] is True
    # stopped again during the owed eval (a job requeued and preempted again): cut too, the checkpoint still owing it
    begun.clear()
    with pytest.raises(Stopped, match=r"SIGTERM during step 3's eval, which the checkpoint owes: nothing was trained "
                                      r"or saved since it"):
        run_train(recipe, resume="auto")
    assert [done for done, _ in begun] == [0, 1] and _steps_on_disk(run) == [3] and records(run, "eval") == []
    assert json.loads((run / "checkpoints" / "step_000003" / "train_state.json").read_text())["eval_owed"] is True
    monkeypatch.setattr(loop, "evaluate", real)
    # a resume that wrote the owed eval's line and died before its next checkpoint (kill -9): the line was kept and
    # written again (audit 59)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(records(tmp_path / "full", "eval")[0]) + "\n")
    summary = run_train(recipe, resume="auto")
    assert records(run, "eval") == records(tmp_path / "full", "eval") and [e["step"] for e in records(run, "eval")] \
        == [3, 6, 8]
    assert summary["final_loss"] == full["final_loss"]
    assert max_abs_diff(load_weights(run / "final"), load_weights(tmp_path / "full" / "final")) == 0.0


@pytest.mark.slow
def test_a_signal_to_one_process_during_an_eval_ends_it_on_both_at_one_batch(tiny_assets, tmp_path, free_port):
    """2 gloo processes, the SIGTERM to rank 1 alone as the first eval's second batch begins (tests/stop_probe.py):
    the processes vote before each eval batch, so both end the eval there (none waits in a collective for the
    other), save the step, and the resumed launch evaluates it first: its eval lines are one process's."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "eval_every_steps": 3, "eval_batch_size": 2,
                                                        "micro_batch_size": 2},
                          data={"eval_split": 0.1}, checkpoint={"every_steps": 6})
    single, cut = tmp_path / "single", tmp_path / "cut"
    run_train(recipe, f"output_dir={single}", "train.micro_batch_size=4")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_DDP),
              "--main_process_port", str(free_port)]
    proc = subprocess.run([*launch, str(REPO / "tests" / "stop_probe.py"), "finetune", str(recipe),
                           f"output_dir={cut}"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "stopped: SIGTERM at step 3" in output, output[-3000:]
    assert "step 3's eval is cut short by the stop" in output and records(cut, "eval") == [], output[-3000:]
    assert _steps_on_disk(cut) == [3]
    launch[launch.index("--main_process_port") + 1] = str(free_port + 1)
    subprocess.run([*launch, "-m", "llmtrain", "finetune", str(recipe), f"output_dir={cut}", "--resume", "auto"],
                   env=ENV, cwd=REPO, check=True, capture_output=True, timeout=300)
    evals, once = records(cut, "eval"), records(single, "eval")
    assert [e["step"] for e in evals] == [e["step"] for e in once] == [3, 6]
    assert [e["eval_loss"] for e in evals] == pytest.approx([e["eval_loss"] for e in once], abs=1e-5)
    assert losses(cut) == pytest.approx(losses(single), abs=1e-5)


def test_a_signal_during_the_teardown_ends_the_process_with_the_commands_status():
    """Audit 54: a second Ctrl-C under `llmtrain launch` reaches the processes as torchrun's SIGTERM, often once the
    command has returned: the stop handler raised in an atexit callback ("Exception ignored in atexit callback" and a
    traceback after the run's last line). Once the command has returned, a signal ends the process at once with the
    command's own status."""
    script = ("import atexit, os, signal, sys, time\n"
              "from llmtrain.cli import main\n"
              "from llmtrain.loop.signals import stop_at_once_on_sigterm\n"
              "stop_at_once_on_sigterm()  # as finetune has it until its loop starts\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(2)))\n"
              "sys.argv = ['llmtrain', '--version']\n"
              "main()\n")
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("llmtrain ")
