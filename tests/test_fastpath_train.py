"""The fast path through the real training loop on the tiny task (in this process, CPU, fp32).

- varlen attention (the default, `auto`) trains exactly like transformers' eager attention on padded rows;
- token-budget micro-batches: every example once per epoch, packing efficiency reported, exact resume,
  a too-small budget refused at start-up;
- logging.every_steps: fewer lines, the same numbers;
- a checkpoint at the end of an epoch whose micro-batches are not a multiple of the accumulation resumes
  (issue 8's bug), from every checkpoint of a 3-epoch run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import cli, load_weights, losses, max_abs_diff, records, run_train, write_recipe


pytestmark = pytest.mark.long(110)  # tests/conftest.py


@pytest.fixture
def recipe(tiny_assets, tmp_path):
    return write_recipe(tiny_assets, tmp_path)


def test_varlen_attention_trains_like_eager_padded(recipe, tmp_path):
    """attn auto (varlen: packed rows, attention per example, chunked loss) against eager attention on
    padded rows with the same examples: the same losses, token counts, and weights."""
    common = ["train.micro_batch_size=6", "train.max_steps=5", "train.loss_chunk_tokens=16"]
    run_train(recipe, f"output_dir={tmp_path / 'eager'}", "model.attn_implementation=eager", *common)
    run_train(recipe, f"output_dir={tmp_path / 'varlen'}", "model.attn_implementation=auto", *common)
    eager, varlen = records(tmp_path / "eager"), records(tmp_path / "varlen")
    assert [r["loss"] for r in varlen] == pytest.approx([r["loss"] for r in eager], abs=1e-5)
    assert [r["grad_norm"] for r in varlen] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-4)
    assert [r["tokens"] for r in varlen] == [r["tokens"] for r in eager]
    assert [r["trained_tokens"] for r in varlen] == [r["trained_tokens"] for r in eager]
    # Adam divides each element's step by its own gradient scale, so where a gradient is near zero the kernels'
    # rounding differences move that element by a visible fraction of lr (1e-3): 2.4e-5 after 5 steps on torch
    # 2.13 + transformers 5.24. The loss and gradient-norm checks above are the tight ones.
    assert max_abs_diff(load_weights(tmp_path / "eager" / "final"), load_weights(tmp_path / "varlen" / "final")) < 1e-4


@pytest.mark.slow  # a longer run: make test, not the fast tier
def test_token_budget_epoch_covers_every_example_once(tiny_assets, tmp_path):
    """A token-budget epoch: the steps' input tokens add up to the dataset's tokens exactly (no example
    dropped or repeated), every micro-batch stays within the budget, and the packing efficiency
    reported in summary.json is real tokens / (bins x budget). The first 1,001 examples of the task (an odd count:
    the epoch's last step may hold one bin)."""
    rows = tmp_path / "train1001.jsonl"
    rows.write_text("".join((tiny_assets / "data" / "train.jsonl").read_text().splitlines(True)[:1001]))
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(rows)},
                          train={"max_steps": None, "epochs": 1, "micro_batch_size": 1, "micro_batch_tokens": 160,
                                 "grad_accum_steps": 2})
    summary = run_train(recipe, "model.attn_implementation=auto")
    steps = records(tmp_path / "run")
    data = summary["data"]["train"]
    assert sum(r["tokens"] for r in steps) == data["tokens"]
    assert sum(r["trained_tokens"] for r in steps) == data["trained_tokens"]
    assert all(r["tokens"] <= 2 * 160 for r in steps)  # two bins per step
    bins = 2 * len(steps) - (1 if data["tokens"] > 0 and len(steps) * 2 * 160 * summary["packing_efficiency"]
                              < data["tokens"] else 0)
    assert summary["packing_efficiency"] == pytest.approx(data["tokens"] / (bins * 160), rel=0.01)
    assert summary["packing_efficiency"] > 0.95


def test_token_budget_resume_is_exact(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "micro_batch_size": 1,
                                                        "micro_batch_tokens": 128, "grad_accum_steps": 2},
                          checkpoint={"every_steps": 2, "keep_last": 5})
    run_train(recipe, f"output_dir={tmp_path / 'full'}")
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", "train.max_steps=6")
    cut = tmp_path / "cut"
    for step in (4, 6):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:06d}")
    shutil.rmtree(cut / "final")
    run_train(recipe, f"output_dir={cut}", resume="auto")
    assert losses(cut) == pytest.approx(losses(tmp_path / "full"), abs=1e-6)
    assert [r["step"] for r in records(cut)] == [1, 2, 3, 4, 5, 6]
    assert max_abs_diff(load_weights(cut / "final"), load_weights(tmp_path / "full" / "final")) == 0.0


def test_budget_smaller_than_an_example_is_refused(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"micro_batch_size": 1, "micro_batch_tokens": 8})
    proc = cli("finetune", str(recipe), check=False)
    assert proc.returncode == 2
    assert "train.micro_batch_tokens=8 is smaller than the longest example" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_budget_with_micro_batch_size_is_refused(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"micro_batch_size": 4, "micro_batch_tokens": 256})
    proc = cli("finetune", str(recipe), check=False)
    assert proc.returncode == 2
    assert "train.micro_batch_size" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_logging_every_steps_keeps_the_numbers(recipe, tmp_path):
    """Lines every 3 steps (and at the last step) carry exactly the numbers of an every-step run."""
    run_train(recipe, f"output_dir={tmp_path / 'each'}", "train.max_steps=7")
    run_train(recipe, f"output_dir={tmp_path / 'every3'}", "train.max_steps=7", "logging.every_steps=3")
    each, every3 = records(tmp_path / "each"), records(tmp_path / "every3")
    assert [r["step"] for r in every3] == [3, 6, 7]
    for r in every3:
        same = each[r["step"] - 1]
        for key in ("loss", "grad_norm", "tokens", "trained_tokens", "tokens_seen", "lr"):
            assert r[key] == pytest.approx(same[key], rel=1e-6), key
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["mfu"] is None  # no peak known on CPU
    mfu = run_train(recipe, f"output_dir={tmp_path / 'mfu'}", "train.max_steps=2", "logging.peak_tflops=0.5")
    assert mfu["steps"] == 2
    line = records(tmp_path / "mfu")[-1]
    assert line["mfu"] == pytest.approx(line["tflops_per_gpu"] / 0.5)


def test_every_checkpoint_of_a_three_epoch_run_resumes(tiny_assets, tmp_path):
    """20 examples, micro-batch 4, accumulation 2: 5 micro-batches per epoch, so every epoch ends in a
    one-micro-batch window. Every checkpoint (one per step) resumes and ends equal to the uninterrupted run."""
    rows = (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:20]
    data = tmp_path / "twenty.jsonl"
    data.write_text("\n".join(rows) + "\n")
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data)},
                          train={"max_steps": None, "epochs": 3, "micro_batch_size": 4, "grad_accum_steps": 2},
                          checkpoint={"every_steps": 1, "keep_last": 100})
    full = tmp_path / "run"
    run_train(recipe)
    assert [r["epoch"] for r in records(full)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # the position rolled over with each epoch's last step, before its checkpoint was written
    state = json.loads((full / "checkpoints" / "step_000003" / "train_state.json").read_text())
    assert (state["epoch"], state["micro_in_epoch"]) == (1, 0)
    reference = load_weights(full / "final")
    for step in range(1, 9):
        part = tmp_path / f"from_{step}"
        shutil.copytree(full / "checkpoints" / f"step_{step:06d}", part / "checkpoints" / f"step_{step:06d}")
        (part / "metrics.jsonl").write_text("".join(
            json.dumps(r) + "\n" for r in records(full) if r["step"] <= step))
        run_train(recipe, f"output_dir={part}", resume="auto")
        assert losses(part) == pytest.approx(losses(full), abs=1e-6), step
        assert max_abs_diff(load_weights(part / "final"), reference) == 0.0, step


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default",
                    reason="torch.compile's C++ code does not build under ATEN_CPU_CAPABILITY=default (inductor picks "
                    "the CPU's vector ISA, the headers are built for none): an artefact of lowering ATen's kernels "
                    "on an AVX2 machine, which no user's CPU does")
def test_compiled_layers_train_like_eager_layers(recipe, tmp_path):
    """model.compile: each decoder layer compiled (the varlen attention left out of the graph): the same
    losses as the uncompiled run, and the start-up line says how many layers were compiled."""
    common = ["train.max_steps=3", "model.attn_implementation=auto"]
    run_train(recipe, f"output_dir={tmp_path / 'plain'}", *common)
    proc = cli("finetune", str(recipe), f"output_dir={tmp_path / 'compiled'}", "model.compile=true", *common)
    assert "compile: 2 decoder layers" in proc.stdout
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "plain"), abs=1e-5)


def test_deterministic_runs_with_torch_deterministic_kernels_and_restores(recipe, tmp_path, monkeypatch):
    """train.deterministic: every step runs under torch.use_deterministic_algorithms, strict (warn_only off: the
    only mode in which aten's flash attention backward is deterministic), with cuBLAS's fixed workspace, the losses
    are those of the default run (on the CPU the kernels are deterministic anyway: the GPU check is gpu_session.sh
    smoke), and the process's setting is put back afterwards."""
    import torch

    import llmtrain.loop.train as T

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen, real = [], T.train_step
    monkeypatch.setattr(T, "train_step", lambda *a, **k: seen.append(
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
         os.environ.get("CUBLAS_WORKSPACE_CONFIG"))) or real(*a, **k))
    run_train(recipe, "train.deterministic=true", f"output_dir={tmp_path / 'det'}")
    assert seen and set(seen) == {(True, False, ":4096:8")}
    assert not torch.are_deterministic_algorithms_enabled()
    seen.clear()
    run_train(recipe, f"output_dir={tmp_path / 'default'}")
    assert set(seen) == {(False, False, ":4096:8")}  # the variable stays: cuBLAS read it once, at its start
    assert losses(tmp_path / "det") == losses(tmp_path / "default")
