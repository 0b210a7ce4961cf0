"""Resumable checkpoints: exact resume (full and LoRA), layout, retention, atomicity, and refusals."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from helpers import REPO, crash_at_step, load_weights, losses, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import load_recipe
from llmtrain.errors import LLMTrainError

STEP_DIR = re.compile(r"step_\d{6}")


def _step_dirs(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _preempt_after_step_4(run):
    """What a job killed right after its step-4 save leaves behind."""
    shutil.rmtree(run / "checkpoints" / "step_000008")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_is_exact(tiny_assets, tmp_path, kind):
    """8 steps straight == 8 steps of which the last 4 ran after a resume from the step-4 checkpoint.
    The LoRA case has dropout on, so it also proves the RNG state is restored."""
    extra = {"lora": {"r": 4, "alpha": 8, "dropout": 0.2}} if kind == "lora" else {}
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 8, "lr": 3e-3, "warmup_steps": 2},
                          checkpoint={"every_steps": 4, "keep_last": 2}, **extra)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(recipe, f"output_dir={straight}")
    run_train(recipe, f"output_dir={resumed}")
    _preempt_after_step_4(resumed)
    run_train(recipe, f"output_dir={resumed}", resume="auto")

    steps = records(resumed)
    assert [r["step"] for r in steps] == list(range(1, 9))  # steps 5-8 once each, not twice
    assert losses(resumed) == pytest.approx(losses(straight), abs=1e-6)
    assert [r["lr"] for r in steps] == pytest.approx([r["lr"] for r in records(straight)])  # scheduler restored
    assert [r["tokens_seen"] for r in steps] == [r["tokens_seen"] for r in records(straight)]
    assert max_abs_diff(load_weights(resumed / "final" / weights_file(kind)),
                        load_weights(straight / "final" / weights_file(kind))) < 1e-6
    assert _step_dirs(resumed) == ["step_000004", "step_000008"]
    if kind == "lora":
        # Resume checkpoints of a LoRA run hold the adapter only, never the frozen base.
        for step in ("step_000004", "step_000008"):
            keys = load_weights(resumed / "checkpoints" / step).keys()
            assert keys and all("lora_" in k for k in keys)


def weights_file(kind: str) -> str:
    return "adapter_model.safetensors" if kind == "lora" else "model.safetensors"


def test_resume_from_an_explicit_path(tiny_assets, tmp_path):
    """--resume PATH continues from that checkpoint (here an older one), and equals the straight run."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6}, checkpoint={"every_steps": 2, "keep_last": 3})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(recipe, f"output_dir={straight}")
    run_train(recipe, f"output_dir={resumed}")
    run_train(recipe, f"output_dir={resumed}", resume=str(resumed / "checkpoints" / "step_000002"))
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4, 5, 6]
    assert losses(resumed) == pytest.approx(losses(straight), abs=1e-6)
    assert max_abs_diff(load_weights(resumed / "final"), load_weights(straight / "final")) < 1e-6


def test_checkpoint_layout_and_retention(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 8},
                          checkpoint={"every_steps": 2, "keep_last": 2})
    run = tmp_path / "run"
    run_train(recipe)
    names = _step_dirs(run)
    assert names == ["step_000006", "step_000008"]  # the 2 newest, zero padded to 6 digits
    assert all(STEP_DIR.fullmatch(n) for n in names)
    train = {r["step"]: r for r in records(run)}
    resolved = load_recipe(recipe)
    for name in names:
        ckpt = run / "checkpoints" / name
        state = yaml.safe_load((ckpt / "train_state.json").read_text())  # JSON is YAML
        step = int(name.removeprefix("step_"))
        assert state["step"] == step and state["epoch"] == 0
        assert state["tokens_seen"] == train[step]["tokens_seen"]
        assert (ckpt / "model.safetensors").is_file()
        # The recipe that wrote it, resolved: it loads and equals the run's recipe.
        assert load_recipe(ckpt / "recipe.yaml") == resolved
    assert load_recipe(run / "recipe.yaml") == resolved


def test_incomplete_tmp_checkpoint_is_never_resumed_and_is_cleaned(tiny_assets, tmp_path, capsys):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2, "keep_last": 5})
    run = tmp_path / "run"
    run_train(recipe)
    # A save of step 6 that was killed before its rename: it even has a train_state.json.
    tmp = run / "checkpoints" / ".tmp-step_000006"
    shutil.copytree(run / "checkpoints" / "step_000004", tmp)
    (tmp / "train_state.json").write_text((tmp / "train_state.json").read_text().replace('"step": 4', '"step": 6'))
    (tmp / "model.safetensors").write_bytes(b"truncated")
    capsys.readouterr()
    run_train(recipe, "train.max_steps=6", resume="auto", allow_recipe_change=True)
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in capsys.readouterr().out
    assert not tmp.exists()
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5, 6]
    assert _step_dirs(run) == ["step_000002", "step_000004", "step_000006"]
    assert yaml.safe_load((run / "checkpoints" / "step_000006" / "train_state.json").read_text())["step"] == 6


def test_a_finished_run_trained_further_and_stopped_is_not_called_complete(tiny_assets, tmp_path, monkeypatch):
    """A finished 4-step run extended to 8 steps (--allow-recipe-change) and preempted at step 7: `--resume auto`, the
    command the stop prints, had called it "already complete (4 steps, final/ written)" and left final/ the 4-step
    model (audit 27), its old summary.json standing beside the new recipe.yaml. The summary is set aside as the
    extension starts (summary-step_000004.json), so the resume finishes the run: 8 steps, a new final/, and the
    losses of an uninterrupted 8-step run."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "schedule": "constant", "warmup_steps": 0},
                          checkpoint={"every_steps": 2, "keep_last": 5})
    run = tmp_path / "run"
    run_train(recipe)
    first = load_weights(run / "final")
    import llmtrain.loop.train as T

    real, calls = T.train_step, []

    def preempted(*a, **k):  # the third step of the extension (step 7) dies, as a preempted job does
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("preempted")
        return real(*a, **k)

    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="preempted"):
        patch.setattr(T, "train_step", preempted)
        run_train(run / "recipe.yaml", "train.max_steps=8", resume="auto", allow_recipe_change=True)
    assert json.loads((run / "summary-step_000004.json").read_text())["steps"] == 4
    assert not (run / "summary.json").exists()
    run_train(run / "recipe.yaml", resume="auto")
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
    assert max_abs_diff(load_weights(run / "final"), first) > 0
    straight = tmp_path / "straight"
    run_train(recipe, "train.max_steps=8", f"output_dir={straight}")
    assert [r["loss"] for r in records(run)] == pytest.approx([r["loss"] for r in records(straight)], abs=1e-6)


def test_a_learning_rate_changed_at_resume_is_the_one_trained_with(tiny_assets, tmp_path):
    """--allow-recipe-change with another train.lr: said and written to metrics.jsonl, and the checkpoint's optimizer
    and scheduler state had put the old lr back (the lrs and losses after it were the unchanged run's)."""
    from llmtrain.model.modeling import lr_factor

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "lr": 1e-3, "warmup_steps": 2},
                          checkpoint={"every_steps": 3})
    run = tmp_path / "run"
    run_train(recipe, "logging.every_steps=1")
    kept = {r["step"]: r for r in records(run)}
    run_train(recipe, "logging.every_steps=1", "train.lr=0.05", resume=str(run / "checkpoints" / "step_000003"),
              allow_recipe_change=True)
    again = {r["step"]: r for r in records(run)}
    assert [again[s]["lr"] for s in (1, 2, 3)] == [kept[s]["lr"] for s in (1, 2, 3)]
    for step in (4, 5, 6):  # the lr a step trained with: the schedule's factor at its update, of the new peak
        assert again[step]["lr"] == pytest.approx(0.05 * lr_factor(step - 1, warmup=2, total=6, schedule="cosine",
                                                                      min_ratio=0.0), rel=1e-12), step
    assert again[4]["loss"] == kept[4]["loss"] and again[5]["loss"] != kept[5]["loss"]
    notes = [r for r in records(run, "note")]
    assert [n["note"] for n in notes] == ["train.lr changed from 0.001 to 0.05 at resume"]


def test_the_recipes_optimizer_settings_outlive_the_checkpoints_groups():
    """weight_decay, betas and eps changed at resume: torch's load_state_dict takes them from the saved groups."""
    import torch

    from llmtrain.model.modeling import lr_factor, reapply_hyperparameters, recipe_hyperparameters

    def built(lr, wd, betas, eps):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, betas=betas, eps=eps)
        return p, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup=2, total=10,
                                                                                   schedule="linear", min_ratio=0.0))

    p, opt, sched = built(1e-3, 0.0, (0.9, 0.999), 1e-8)
    for _ in range(3):
        p.sum().backward()
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    _, opt2, sched2 = built(2e-3, 0.1, (0.8, 0.99), 1e-6)
    kept = recipe_hyperparameters(sched2)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    assert opt2.param_groups[0]["weight_decay"] == 0.0 and sched2.base_lrs == [1e-3]  # the checkpoint's, as torch
    reapply_hyperparameters(sched2, kept)
    (group,) = opt2.param_groups
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.1, (0.8, 0.99), 1e-6)
    assert sched2.base_lrs == [2e-3] and group["lr"] == 2e-3 * lr_factor(3, warmup=2, total=10, schedule="linear",
                                                                          min_ratio=0.0)
    assert sched2.get_last_lr() == [group["lr"]]
    # the same recipe's settings again: the checkpoint's own, bit for bit
    _, opt3, sched3 = built(1e-3, 0.0, (0.9, 0.999), 1e-8)
    kept = recipe_hyperparameters(sched3)
    opt3.load_state_dict(saved[0])
    sched3.load_state_dict(saved[1])
    reapply_hyperparameters(sched3, kept)
    assert opt3.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and sched3.base_lrs == sched.base_lrs


def test_a_complete_run_resumed_with_no_step_left_is_refused_and_untouched(tiny_assets, tmp_path):
    """--allow-recipe-change on a complete run with a changed warm-up but the same max_steps: its newest checkpoint
    is the last step. It trained 0 steps, wrote final/ again and said "final loss None" (issue 53); now refused."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 4})
    run = tmp_path / "run"
    run_train(recipe)
    before = _snapshot(run)
    with pytest.raises(LLMTrainError, match=r"checkpoint .*step_000004 is at step 4 and this recipe's run ends at step "
                                            r"4 .* nothing is left to train. Raise train.max_steps above 4"):
        run_train(recipe, "train.warmup_steps=1", resume="auto", allow_recipe_change=True)
    assert _snapshot(run) == before


def test_a_run_stopped_at_its_last_step_before_it_finished_resumes_to_finish(tiny_assets, tmp_path, capsys):
    """A stop during the last step (its checkpoint is at max_steps) or kill -9 before final/ and summary.json were
    written: `--resume auto`, the command the stop prints, was refused ("nothing is left to train") and nothing could
    finish the run. It trains 0 steps and writes them; the summary's final loss and best eval are the run's."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "eval_every_steps": 2},
                          data={"eval_split": 0.1}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    first = run_train(recipe)
    weights = load_weights(run / "final")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    lines = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    summary = run_train(recipe, resume="auto")
    said = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in said
    assert f"done: 4 steps, final loss {round(first['final_loss'], 4)}" in said
    assert summary["steps"] == 4 and summary["final_loss"] == first["final_loss"]
    assert max_abs_diff(load_weights(run / "final"), weights) == 0.0
    assert (run / "metrics.jsonl").read_text() == lines  # no step trained again
    best = min(records(run, "eval"), key=lambda e: e["eval_loss"])
    assert f"{best['eval_loss']:.4f} (step {best['step']}" in said  # the evals before the resume count
    # finished now: the same command says so and changes nothing
    capsys.readouterr()
    again = run_train(recipe, resume="auto")
    assert again == json.loads((run / "summary.json").read_text())
    # a checkpoint past a lowered train.max_steps is not "the last step": refused as before, nothing written
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    with pytest.raises(LLMTrainError, match="nothing is left to train"):
        run_train(recipe, "train.max_steps=2", resume="auto", allow_recipe_change=True)
    assert not (run / "final").exists()


def test_a_finished_run_without_final_is_finished(tiny_assets, tmp_path):
    """checkpoint.save_final: false: its --resume auto had been refused ("nothing is left to train"); it is complete."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2,
                                                                                     "save_final": False})
    first = run_train(recipe)
    assert not (tmp_path / "run" / "final").exists()
    assert run_train(recipe, resume="auto") == json.loads((tmp_path / "run" / "summary.json").read_text()) != {}
    assert first["steps"] == 2


def test_a_resume_to_an_older_step_removes_the_later_checkpoints_at_its_first_save(tiny_assets, tmp_path, capsys):
    """--resume PATH to an older step: the checkpoints past it were of the run it goes back on, and --resume auto
    after a stop picked them (the highest step), undoing the rewind; pruning kept them and deleted the new ones."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6}, checkpoint={"every_steps": 2, "keep_last": 5})
    run = tmp_path / "run"
    run_train(recipe)
    assert _step_dirs(run) == ["step_000002", "step_000004", "step_000006"]
    capsys.readouterr()
    run_train(recipe, "train.max_steps=4", resume=str(run / "checkpoints" / "step_000002"), allow_recipe_change=True)
    assert ("note: step_000004, step_000006 are of the run this resume goes back on (or damaged), and are removed "
            "at this run's first checkpoint") in capsys.readouterr().out
    assert _step_dirs(run) == ["step_000002", "step_000004"]
    assert json.loads((run / "checkpoints" / "step_000004" / "recipe.yaml").read_text().split("max_steps: ")[1]
                      .split()[0]) == 4  # the new run's


def test_a_resume_to_an_older_step_that_ends_without_a_checkpoint_removes_the_later_ones_at_its_end(tiny_assets,
                                                                                                   tmp_path):
    """Audit 55: a resume from an older step that reached its end before a checkpoint was due (final/ written, none
    at a step of its own) left the abandoned run's later checkpoints: the next --resume auto (more steps) continued
    that run, not this one, its lines joined to this one's in metrics.jsonl. They go at the end too, so --resume
    auto continues from the newest checkpoint this run can stand on."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6}, checkpoint={"every_steps": 2, "keep_last": 5})
    run = tmp_path / "run"
    run_train(recipe)
    run_train(recipe, "train.lr=5e-4", "checkpoint.every_steps=100", resume=str(run / "checkpoints" / "step_000002"),
              allow_recipe_change=True)
    assert _step_dirs(run) == ["step_000002"]
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5, 6]  # one run's lines: the branch's 3 to 6
    branch = [r["loss"] for r in records(run)]
    run_train(recipe, "train.lr=5e-4", "checkpoint.every_steps=100", "train.max_steps=8", resume="auto",
              allow_recipe_change=True)
    assert [r["loss"] for r in records(run)][:2] == branch[:2] and [r["step"] for r in records(run)] == \
        list(range(1, 9))
    # the abandoned run's checkpoints past this run's end go too, whatever the cadence says (review 121: step 8 of a
    # run saving every 4 had stayed after a branch from step 4 that ended at 6)
    other = write_recipe(tiny_assets, tmp_path, name="other.yaml", train={"max_steps": 10},
                         checkpoint={"every_steps": 4, "keep_last": 5}, output_dir=str(tmp_path / "other"))
    run_train(other)
    run_train(other, "train.max_steps=6", resume=str(tmp_path / "other" / "checkpoints" / "step_000004"),
              allow_recipe_change=True)
    assert _step_dirs(tmp_path / "other") == ["step_000004"]


def test_a_finished_run_given_a_change_that_trains_nothing_is_complete(tiny_assets, tmp_path, capsys):
    """Audit 55: `--resume auto` on a finished run whose recipe differs in a logging, checkpoint or eval setting had
    trained its steps since the last checkpoint again and written final/ and summary.json over the run's (or, where
    the last step had a checkpoint, said "nothing is left to train"). It is complete, and nothing changes."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 5}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    run_train(recipe)
    before = _snapshot(run)
    capsys.readouterr()
    for change in ("logging.every_steps=5", "checkpoint.every_steps=5", "checkpoint.keep_last=1"):
        run_train(recipe, change, resume="auto")
        assert "is already complete (5 steps, final/ written); nothing was changed" in capsys.readouterr().out
    assert _snapshot(run) == before
    with pytest.raises(LLMTrainError, match="is complete, and this recipe changes train.max_steps 5 -> 7"):
        run_train(recipe, "train.max_steps=7", resume="auto")  # more steps: still asked for with the flag
    with pytest.raises(LLMTrainError, match="holds train.optimizer=adamw's state"):  # what it trains: not complete
        run_train(recipe, "train.optimizer=adamw_8bit", resume="auto")


def test_a_resume_names_a_layout_that_takes_it_and_reads_a_path_however_written(tiny_assets, tmp_path):
    """Audit 55: a checkpoint of 16 examples a micro-batch resumed on 3 processes was told to set micro_batch_size=16
    (48: refused again, with the same advice); the data-parallel ranks that can take it are named. And the model's
    or the data's path written otherwise (a trailing slash, ./) had been refused as "another model or other data"."""
    from llmtrain.config import load_recipe
    from llmtrain.run.preflight import check_resume

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2, "micro_batch_size": 16},
                          checkpoint={"every_steps": 2})
    run_train(recipe)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    with pytest.raises(LLMTrainError) as refused:
        check_resume(ckpt, load_recipe(recipe, ["train.micro_batch_size=8"]), world=3, fsdp=False,
                     allow_recipe_change=False)
    assert "16 examples do not split over 3 data-parallel ranks: resume it on 1 or 2 or 4 or 8 or 16" in \
        str(refused.value)
    with pytest.raises(LLMTrainError, match=r"Set train.micro_batch_size=8 \(so that the product is 16\)"):
        check_resume(ckpt, load_recipe(recipe), world=2, fsdp=False, allow_recipe_change=False)
    # the same global batch as 8 x accumulation 2: the refusal says the accumulation goes back too
    with pytest.raises(LLMTrainError, match=r"to resume it \(with train.grad_accum_steps=1, as it was written: the "
                                            r"global batch is the same"):
        check_resume(ckpt, load_recipe(recipe, ["train.micro_batch_size=8", "train.grad_accum_steps=2"]), world=1,
                     fsdp=False, allow_recipe_change=True)
    model, data = tiny_assets / "model", tiny_assets / "data"
    spelled = [f"model.name_or_path={model}/", f"data.path={data}/../data/train.jsonl"]
    assert check_resume(ckpt, load_recipe(recipe, spelled), world=1, fsdp=False, allow_recipe_change=False) == []
    with pytest.raises(LLMTrainError, match="That is another model or other data"):
        check_resume(ckpt, load_recipe(recipe, [f"data.path={data / 'eval.jsonl'}"]), world=1, fsdp=False,
                     allow_recipe_change=False)
    # a list of data files, written otherwise
    listed = write_recipe(tiny_assets, tmp_path, name="listed.yaml", train={"max_steps": 2, "micro_batch_size": 16},
                          checkpoint={"every_steps": 2}, output_dir=str(tmp_path / "listed"),
                          data={"path": [str(data / "train.jsonl")]})
    run_train(listed)
    assert check_resume(tmp_path / "listed" / "checkpoints" / "step_000002",
                        load_recipe(listed, [f"data.path=[{data}/../data/train.jsonl]"]), world=1, fsdp=False,
                        allow_recipe_change=False) == []
    # an accumulation the checkpoint's place in the epoch (3 micro-batches) is no whole number of: refused before
    # anything loads, naming the value it was written with (it had been refused after the model was built)
    odd = write_recipe(tiny_assets, tmp_path, name="odd.yaml", train={"max_steps": 3, "micro_batch_size": 16},
                       checkpoint={"every_steps": 3}, output_dir=str(tmp_path / "odd"))
    run_train(odd)
    with pytest.raises(LLMTrainError, match=r"stopped 3 micro-batches into an epoch, which is not a whole number of "
                                            r"train.grad_accum_steps=2 windows: resume with train.grad_accum_steps=1, "
                                            r"which it was written with"):
        check_resume(tmp_path / "odd" / "checkpoints" / "step_000003", load_recipe(odd, ["train.grad_accum_steps=2"]),
                     world=1, fsdp=False, allow_recipe_change=True)


def test_a_model_or_data_file_replaced_under_its_path_is_refused_at_resume(tiny_assets, tmp_path, capsys,
                                                                         monkeypatch):
    """Audit 55: the base model's weights or the training file replaced under the same path (a base retrained with
    --overwrite, an edited dataset) were resumed on silently: a LoRA adapter on another base, other rows at the
    checkpoint's place in the epoch. Each checkpoint records its input files (name, size, a hash of samples of its
    bytes); a change is refused naming the file, or taken with --allow-recipe-change and said; a copy made again, or
    a README edited beside the weights, is the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmtrain.config import load_recipe
    from llmtrain.run.preflight import check_resume

    shutil.copytree(tiny_assets / "model", tmp_path / "base")
    (tmp_path / "data").mkdir()
    shutil.copy(tiny_assets / "data" / "train.jsonl", tmp_path / "data" / "train.jsonl")
    recipe = write_recipe(tiny_assets, tmp_path, model={"name_or_path": str(tmp_path / "base")},
                          data={"path": str(tmp_path / "data" / "train.jsonl")},
                          train={"max_steps": 4}, checkpoint={"every_steps": 2}, lora={"r": 4, "alpha": 8})
    crash_at_step(monkeypatch, recipe, 3)  # killed in step 3: its checkpoint at step 2
    monkeypatch.undo()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "train_state.json").read_text())
    assert [f[0] for f in state["inputs"]["data.path"]] == ["train.jsonl"] and \
        "model.safetensors" in [f[0] for f in state["inputs"]["model.name_or_path"]]
    for f in (tmp_path / "base").iterdir():  # copied again (new dates, the same bytes) and a README edited: the same
        f.write_bytes(f.read_bytes())
    (tmp_path / "base" / "README.md").write_text("notes")
    assert check_resume(tmp_path / "run" / "checkpoints" / "step_000002", load_recipe(recipe), world=1, fsdp=False,
                        allow_recipe_change=False) == []
    weights = load_file(tmp_path / "base" / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, tmp_path / "base" / "model.safetensors",
              metadata={"format": "pt"})  # another base of the same shapes (and size)
    with pytest.raises(LLMTrainError, match=r"have changed since checkpoint .*model.name_or_path: model.safetensors "
                                            r"rewritten"):
        run_train(recipe, resume="auto")
    rows = (tmp_path / "data" / "train.jsonl").read_text().splitlines()
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(rows[: len(rows) // 2]) + "\n")
    with pytest.raises(LLMTrainError, match="model.safetensors rewritten; data.path: train.jsonl rewritten"):
        run_train(recipe, resume="auto")
    capsys.readouterr()
    run_train(recipe, resume="auto", allow_recipe_change=True)
    said = capsys.readouterr().out
    assert "resumed from" in said and "the files of model.name_or_path changed since the checkpoint " \
        "(model.safetensors rewritten), taken with --allow-recipe-change" in said
    assert "the files of data.path changed since the checkpoint (train.jsonl rewritten)" in said


def test_the_teacher_reward_models_eval_files_and_a_chat_template_are_checked_at_resume_too(tiny_assets, tmp_path):
    """Audit 55's check covered the model and the training data only: a distillation teacher or an RL reward model
    retrained in place (`make demo-*` rewrites runs/tiny/final), an eval file or a Jinja chat template edited, were
    resumed on silently (another teacher's distribution, other rewards, other rows rendered otherwise). Each is an
    input file now; a split's name or a fraction of the training data is none."""
    from safetensors.torch import load_file, save_file

    from llmtrain.run.preflight import input_files, inputs_changed

    for name in ("teacher", "scorer"):
        shutil.copytree(tiny_assets / "model", tmp_path / name)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    data = tiny_assets / "data"
    distill = load_recipe(REPO / "recipes" / "tiny-distill.yaml", [
        f"model.name_or_path={tiny_assets / 'model'}", f"data.path={data / 'train.jsonl'}",
        f"distill.teacher={tmp_path / 'teacher'}", f"data.eval_split={data / 'eval.jsonl'}",
        f"data.chat_template={template}"])
    found = input_files(distill)
    assert {"distill.teacher", "data.eval_split", "data.chat_template"} <= set(found)
    assert "model.safetensors" in [f[0] for f in found["distill.teacher"]] and \
        [f[0] for f in found["data.eval_split"]] == ["eval.jsonl"]
    grpo = load_recipe(REPO / "recipes" / "tiny-grpo.yaml", [
        f"model.name_or_path={tiny_assets / 'model'}", f"data.path={data / 'train.jsonl'}", "data.eval_split=0.1",
        "rl.rewards=[{type: answer_match, column: completion}, "
        f"{{type: reward_model, path: {tmp_path / 'scorer'}}}]"])
    found = input_files(grpo)
    assert "rl.rewards[1].path" in found and "rl.rewards[0].path" not in found and "data.eval_split" not in found
    assert "data.eval_split" not in input_files(load_recipe(REPO / "recipes" / "tiny-grpo.yaml", [
        f"data.path={data / 'train.jsonl'}", "data.eval_split=test"]))  # a split's name

    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    for recipe in (distill, grpo):
        (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "inputs": input_files(recipe)}))
        assert inputs_changed(ckpt, recipe) == []
    weights = load_file(tmp_path / "scorer" / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, tmp_path / "scorer" / "model.safetensors",
              metadata={"format": "pt"})
    assert inputs_changed(ckpt, grpo) == [("rl.rewards[1].path", "model.safetensors rewritten")]
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "inputs": input_files(distill)}))
    shutil.copy(tmp_path / "scorer" / "model.safetensors", tmp_path / "teacher" / "model.safetensors")
    template.write_text("{{ messages[0]['content'] }}")
    assert inputs_changed(ckpt, distill) == [("data.chat_template", "chat.jinja rewritten"),
                                             ("distill.teacher", "model.safetensors rewritten")]


def test_a_sampling_change_inside_a_generation_round_is_said_from_the_next_round(tmp_path):
    """Audit 55: rl.num_generations changed (with the flag) at a checkpoint inside a round of rl.num_iterations=2 was
    said to apply "at resume", though the round's next update trains the completions the checkpoint holds: the note
    names the step it applies from; a change of the loss (rl.beta) applies at resume."""
    from llmtrain.config import load_recipe
    from llmtrain.run.preflight import check_resume

    grpo = REPO / "recipes" / "tiny-grpo.yaml"
    written = load_recipe(grpo, ["rl.num_iterations=2"])
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    (ckpt / "recipe.yaml").write_text(written.to_yaml())
    (ckpt / "train_state.json").write_text(json.dumps({"step": 3, "examples_per_micro": written.train.micro_batch_size,
                                                        "processes": 1, "micro_in_epoch": 3}))
    notes = check_resume(ckpt, load_recipe(grpo, ["rl.num_iterations=2", "rl.num_generations=4", "rl.beta=0.1"]),
                         world=1, fsdp=False, allow_recipe_change=True)
    assert "rl.beta changed from 0.0 to 0.1 at resume" in notes
    assert "rl.num_generations changed from 16 to 4 at resume (from step 5: step 3 is inside a generation round of " \
        "rl.num_iterations=2, whose completions the checkpoint holds)" in notes


def _written(folder, recipe, step: int):
    """A checkpoint folder as check_resume reads it: its recipe.yaml and train_state.json."""
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(recipe.to_yaml())
    (folder / "train_state.json").write_text(json.dumps({"step": step, "processes": 1, "micro_in_epoch": step,
                                                         "examples_per_micro": recipe.train.micro_batch_size}))
    return folder


def test_how_a_mode_computes_is_taken_and_said_and_its_paths_are_the_same_however_written(tmp_path):
    """Audit 57: rl.sampler, rl.num_generations_eval, rl.micro_batch_tokens, distill.sampler (how the steps are
    computed, what the eval draws: not what is trained) needed --allow-recipe-change, refused as "what it trains would
    differ"; distill.teacher and a reward model's path with a trailing slash were other paths. They are taken at
    resume and said; a finished run is complete whatever they are."""
    from llmtrain.run.preflight import check_resume, finished_run

    (tmp_path / "teacher").mkdir()
    distill = REPO / "recipes" / "tiny-distill.yaml"
    ckpt = _written(tmp_path / "d" / "checkpoints" / "step_000002", load_recipe(distill, [
        f"distill.teacher={tmp_path / 'teacher'}"]), 2)
    notes = check_resume(ckpt, load_recipe(distill, [f"distill.teacher={tmp_path / 'teacher'}/",
                                                     "distill.sampler=static"]),
                         world=1, fsdp=False, allow_recipe_change=False, files=[])
    assert notes == ["distill.sampler changed from 'graph' to 'static' at resume (how the steps are computed or the "
                     "eval is drawn, not what is trained)"]
    (tmp_path / "scorer").mkdir()
    grpo, scored = REPO / "recipes" / "tiny-grpo.yaml", f"rl.rewards=[{{type: reward_model, path: {tmp_path}/scorer}}]"
    ckpt = _written(tmp_path / "g" / "checkpoints" / "step_000002", load_recipe(grpo, [scored]), 2)
    now = load_recipe(grpo, [scored.replace("scorer", "scorer/"), "rl.sampler=reference", "rl.num_generations_eval=4",
                             "rl.micro_batch_tokens=1024"])
    notes = check_resume(ckpt, now, world=1, fsdp=False, allow_recipe_change=False, files=[])
    assert [n.split(" changed")[0] for n in notes] == ["rl.num_generations_eval", "rl.sampler", "rl.micro_batch_tokens"]
    with pytest.raises(LLMTrainError, match=r"this recipe changes rl.beta 0.0 -> 0.1 against checkpoint"):
        check_resume(ckpt, load_recipe(grpo, [scored, "rl.beta=0.1"]), world=1, fsdp=False, allow_recipe_change=False,
                     files=[])
    run = tmp_path / "g"  # finished: a new sampler (or eval draws) changes nothing of what it trained
    (run / "final").mkdir()
    (run / "recipe.yaml").write_text((ckpt / "recipe.yaml").read_text())
    (run / "summary.json").write_text(json.dumps({"steps": 2}))
    assert finished_run(run, now, allow_recipe_change=False) == {"steps": 2}


def test_a_change_of_what_a_finished_run_trains_at_its_last_checkpoint_says_no_step_is_left(tmp_path):
    """Audit 57: kto.beta changed on a finished run whose last checkpoint is its last step was refused as a change to
    "the run that was interrupted", with --allow-recipe-change advised, which was then refused as "nothing is left to
    train". The refusal says the run is complete and no step is left: raise train.max_steps, or a new output_dir."""
    from llmtrain.run.preflight import check_resume

    kto = REPO / "recipes" / "tiny-kto.yaml"
    recipe = load_recipe(kto, ["train.max_steps=4"])
    ckpt = _written(tmp_path / "k" / "checkpoints" / "step_000004", recipe, 4)
    (tmp_path / "k" / "summary.json").write_text(json.dumps({"steps": 4}))
    with pytest.raises(LLMTrainError) as e:
        check_resume(ckpt, load_recipe(kto, ["train.max_steps=4", "kto.beta=0.3"]), world=1, fsdp=False,
                     allow_recipe_change=False, files=[])
    assert str(e.value) == (f"this recipe changes kto.beta 0.1 -> 0.3 against checkpoint {ckpt}, the last step of the "
                            f"run in {tmp_path / 'k'}, which is complete: no step is left to train with the new "
                            "values. Raise train.max_steps above 4 (with --allow-recipe-change) to train it further "
                            "with them, or start a new run in another output_dir; nothing was changed.")


def test_a_finished_runs_schedule_change_with_no_step_left_and_eval_files_are_said_as_such(tmp_path, monkeypatch):
    """Review of audit 57's fixes: train.lr changed on a finished run whose newest checkpoint is its last step was told
    to add --allow-recipe-change, which then met "nothing is left to train"; an eval file rewritten was refused as
    training rows; a chat template or eval file written otherwise (./x for x) was another path."""
    from llmtrain.run.preflight import check_resume, finished_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    (tmp_path / "eval.jsonl").write_text("{}\n")
    tiny = REPO / "recipes" / "tiny.yaml"
    written = load_recipe(tiny, ["train.max_steps=4", "data.chat_template=chat.jinja", "data.eval_split=eval.jsonl"])
    ckpt = _written(tmp_path / "r" / "checkpoints" / "step_000004", written, 4)
    run = tmp_path / "r"
    (run / "final").mkdir()
    (run / "recipe.yaml").write_text(written.to_yaml())
    (run / "summary.json").write_text(json.dumps({"steps": 4}))
    same = load_recipe(tiny, ["train.max_steps=4", "data.chat_template=./chat.jinja", "data.eval_split=./eval.jsonl"])
    assert finished_run(run, same, allow_recipe_change=False) == {"steps": 4}
    assert check_resume(ckpt, same, world=1, fsdp=False, allow_recipe_change=False, files=[]) == []
    with pytest.raises(LLMTrainError, match=r"its newest checkpoint is at step 4, so no step is left to train with "
                                            r"the new values. Raise train.max_steps above 4 \(with "
                                            r"--allow-recipe-change\)"):
        finished_run(run, load_recipe(tiny, ["train.max_steps=4", "train.lr=1e-4", "data.chat_template=chat.jinja",
                                             "data.eval_split=eval.jsonl"]), allow_recipe_change=False)
    with pytest.raises(LLMTrainError, match=r"the eval files have changed since checkpoint .*: the run's eval lines "
                                            r"after the resume would not compare with those before it"):
        check_resume(ckpt, same, world=1, fsdp=False, allow_recipe_change=False,
                     files=[("data.eval_split", "eval.jsonl rewritten")])


def test_resume_auto_without_checkpoint_starts_from_zero(tiny_assets, tmp_path):
    """--resume auto on an empty output_dir (a job's first start under a requeue script) just trains."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2})
    run_train(recipe, resume="auto")
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]


def _snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def test_existing_output_dir_is_refused_and_untouched(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    run_train(recipe)
    before = _snapshot(run)
    with pytest.raises(LLMTrainError, match="already exists.*--resume auto.*--overwrite"):
        run_train(recipe, "train.max_steps=3")
    assert _snapshot(run) == before


def test_overwrite_starts_again(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run = tmp_path / "run"
    run_train(recipe)
    run_train(recipe, "train.max_steps=2", "checkpoint.every_steps=1", overwrite=True)
    assert [r["step"] for r in records(run)] == [1, 2]
    assert _step_dirs(run) == ["step_000001", "step_000002"]  # the old step_000004 is gone


def test_resume_from_a_non_checkpoint_is_a_clear_error(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2})
    not_a_checkpoint = tmp_path / "somewhere"
    not_a_checkpoint.mkdir()
    with pytest.raises(LLMTrainError, match=r"is not a complete checkpoint \(no train_state.json\)"):
        run_train(recipe, resume=str(not_a_checkpoint))
    with pytest.raises(LLMTrainError, match=f"'{tmp_path / 'missing'}' does not exist; {tmp_path} holds no checkpoint"):
        run_train(recipe, resume=str(tmp_path / "missing"))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_mistyped_step_folder_is_said_missing_with_the_steps_there(tiny_assets, tmp_path):
    """--resume runs/x/checkpoints/step_4 (the folder is step_000004) said "not a complete checkpoint" (issue 53)."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run_train(recipe)
    ckpts = tmp_path / "run" / "checkpoints"
    with pytest.raises(LLMTrainError, match=rf"'{ckpts / 'step_4'}' does not exist; the checkpoints in {ckpts} are "
                                            r"step_000002, step_000004\. Use --resume auto for the newest"):
        run_train(recipe, resume=str(ckpts / "step_4"))


def test_resume_with_a_different_batch_layout_is_refused(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    run_train(recipe)
    with pytest.raises(LLMTrainError, match="micro_batch_size x data-parallel ranks = 4"):
        run_train(recipe, "train.max_steps=6", "train.micro_batch_size=2", resume="auto", allow_recipe_change=True)


@pytest.mark.parametrize("saved, now, refused", [
    ({"data": {"eval_split": 0.05}}, {"data": {"eval_split": 0.5}}, "data.eval_split=0.05"),  # other train rows
    ({"data": {"eval_split": 0.05}}, {"data": {"eval_split": "e.jsonl"}}, "data.eval_split=0.05"),
    ({"data": {"eval_split": "e.jsonl"}}, {"data": {"eval_split": "f.jsonl"}}, None),  # the train rows unchanged
    ({"model": {"tokenizer": "t1"}}, {"model": {"tokenizer": "t2"}}, "model.tokenizer='t1'"),  # other token ids
    # a LoRA run's base rebuilt from random weights: step 9's loss 4.595 where the run had 4.018 (audit 27)
    ({"model": {"random_init": False}}, {"model": {"random_init": True}}, "model.random_init=False"),
])
def test_a_resume_that_would_train_other_rows_or_other_token_ids_is_refused(tmp_path, saved, now, refused):
    """preflight.check_resume: a changed held-out fraction (it decides which rows of the file train, and their order)
    and another tokenizer (the same text, other ids) were resumed without a word; an eval file of its own was and
    is free to change."""
    import json

    from llmtrain.config import Recipe
    from llmtrain.run.preflight import check_resume

    def recipe(changes):
        base = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl", "format": "prompt_completion"},
                "output_dir": str(tmp_path / "run")}
        return Recipe.model_validate({**base, **{k: {**base[k], **v} for k, v in changes.items()}})

    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "recipe.yaml").write_text(yaml.safe_dump(recipe(saved).model_dump(mode="json")))
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "examples_per_micro": 1, "processes": 1}))
    if refused is None:
        assert check_resume(ckpt, recipe(now), world=1, fsdp=False, allow_recipe_change=False) == []
        return
    with pytest.raises(LLMTrainError, match=re.escape(refused)):
        check_resume(ckpt, recipe(now), world=1, fsdp=False, allow_recipe_change=False)


def test_a_write_that_stopped_short_on_a_full_disk_says_first_that_the_disk_is_full(tmp_path, monkeypatch):
    """torch's writer reports ENOSPC as "[enforce fail at inline_container.cc:672] . unexpected pos ...": with (almost)
    no space left on the disk the message leads with the cause; with space left it says what it knows."""
    import shutil
    from collections import namedtuple

    from llmtrain.run.checkpoint import _save_failed

    Usage = namedtuple("Usage", "total used free")
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1031680 vs 1031572")
    (tmp_path / "checkpoints").mkdir()
    final = tmp_path / "checkpoints" / "step_000004"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100 * 2**30, 100 * 2**30, 3 * 2**20))
    assert "failed: the disk is full (3.0 MiB free on that disk; the write stopped short: unexpected pos" in \
        _save_failed(error, final)  # (3 MiB had read "0.00 GiB free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100 * 2**30, 50 * 2**30, 50 * 2**30))
    message = _save_failed(error, final)
    assert "failed: the write stopped short: unexpected pos 1031680 vs 1031572; 50.00 GiB free" in message
    assert "disk is full" not in message
