"""The training loop on the tiny task: exact loss normalisation, packing, determinism, learning, metrics, LoRA.

Every run is the real `llmtrain.loop.train.train` on the tiny Llama (fp32, eager attention, no dropout), in
this process, for a handful of steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import load_weights, losses, max_abs_diff, records, run_train, write_recipe


pytestmark = pytest.mark.long(60)  # tests/conftest.py


@pytest.fixture
def recipe(tiny_assets, tmp_path):
    return write_recipe(tiny_assets, tmp_path)


def test_tiny_model_has_no_dropout(tiny_assets):
    """The exactness tests below compare runs whose RNG use differs; they rely on a dropout-free model."""
    config = json.loads((tiny_assets / "model" / "config.json").read_text())
    assert config.get("attention_dropout", 0.0) == 0.0


def test_accumulation_equals_a_larger_micro_batch(recipe, tmp_path):
    """8 examples per step as 8 x 1 or as 1 x 8 accumulated: the loss is normalised over the whole window's
    trained tokens, so every step's loss and the final weights agree."""
    run_train(recipe, f"output_dir={tmp_path / 'mb8'}", "train.micro_batch_size=8", "train.max_steps=5")
    run_train(recipe, f"output_dir={tmp_path / 'acc8'}", "train.micro_batch_size=1", "train.grad_accum_steps=8",
              "train.max_steps=5")
    big, accumulated = records(tmp_path / "mb8"), records(tmp_path / "acc8")
    assert [r["step"] for r in big] == [r["step"] for r in accumulated] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in accumulated] == pytest.approx([r["loss"] for r in big], abs=1e-5)
    # The same examples each step: the same token counts, and the same gradient before clipping.
    assert [r["trained_tokens"] for r in accumulated] == [r["trained_tokens"] for r in big]
    assert [r["grad_norm"] for r in accumulated] == pytest.approx([r["grad_norm"] for r in big], rel=1e-4)
    assert max_abs_diff(load_weights(tmp_path / "mb8" / "final"), load_weights(tmp_path / "acc8" / "final")) < 1e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packing_gives_the_same_losses(recipe, tmp_path, attn):
    """Packed rows restart position ids per example, so no example attends to another: the losses equal
    the padded run's step for step."""
    common = ["train.micro_batch_size=6", "train.max_steps=5", f"model.attn_implementation={attn}"]
    run_train(recipe, f"output_dir={tmp_path / 'padded'}", *common)
    run_train(recipe, f"output_dir={tmp_path / 'packed'}", "data.packing=true", *common)
    padded, packed = records(tmp_path / "padded"), records(tmp_path / "packed")
    assert [r["loss"] for r in packed] == pytest.approx([r["loss"] for r in padded], abs=1e-5)
    assert [r["trained_tokens"] for r in packed] == [r["trained_tokens"] for r in padded]
    # Padding-free: the packed run processes exactly the real tokens the padded run's attention mask counts.
    assert [r["tokens"] for r in packed] == [r["tokens"] for r in padded]
    if attn == "eager":
        # fp32, but not the same sums (padded rows against one packed row), and AdamW passes a near-zero gradient's
        # round-off to a whole update (it divides by the gradient's own scale): the final weights' bound is in
        # updates, not ulps. Measured 2.0e-5 under ATen's default kernels, under 1e-5 under AVX2 (issue 59); bound
        # 5e-5, a hundredth of 5 steps x lr 1e-3
        assert max_abs_diff(load_weights(tmp_path / "padded" / "final"),
                            load_weights(tmp_path / "packed" / "final")) < 5e-5


def test_two_identical_runs_are_bit_identical(recipe, tmp_path):
    run_train(recipe, f"output_dir={tmp_path / 'a'}", "train.max_steps=5")
    run_train(recipe, f"output_dir={tmp_path / 'b'}", "train.max_steps=5")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a, b = load_weights(tmp_path / "a" / "final"), load_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_seed_changes_the_run(recipe, tmp_path):
    """The converse of determinism: the seed really drives the data order."""
    run_train(recipe, f"output_dir={tmp_path / 'a'}", "train.max_steps=3", "train.seed=1")
    run_train(recipe, f"output_dir={tmp_path / 'b'}", "train.max_steps=3", "train.seed=2")
    assert losses(tmp_path / "a")[1:] != losses(tmp_path / "b")[1:]


def test_loss_decreases_on_the_tiny_task(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={
        "max_steps": 30, "micro_batch_size": 16, "lr": 3e-3, "warmup_steps": 3, "eval_every_steps": 15,
        "eval_batch_size": 64}, data={"eval_split": str(tiny_assets / "data" / "eval.jsonl")})
    summary = run_train(recipe)
    train_losses = losses(tmp_path / "run")
    assert len(train_losses) == 30 and all(math.isfinite(x) for x in train_losses)
    first, last = sum(train_losses[:3]) / 3, sum(train_losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(vocab) = 4.6 at init
    evals = records(tmp_path / "run", "eval")
    assert [e["step"] for e in evals] == [15, 30]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert summary["steps"] == 30 and summary["final_loss"] == train_losses[-1]


def test_metrics_jsonl_and_summary(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={
        "max_steps": 5, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 2, "schedule": "linear",
        "eval_every_steps": 2, "eval_batch_size": 16}, data={"eval_split": 0.02})
    summary = run_train(recipe)
    run = tmp_path / "run"
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["type"] for r in lines} == {"train", "eval"}
    train = records(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # one line per optimizer step
    for r in train:
        for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"):
            assert key in r, key
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])
        assert isinstance(r["tokens"], int) and 0 < r["trained_tokens"] < r["tokens"]
        assert r["tokens_per_s"] > 0
    # The lr of each update: linear warmup over 2 steps, then linear decay to 0 at step 5.
    assert [r["lr"] for r in train] == pytest.approx([5e-4, 1e-3, 1e-3, 2e-3 / 3, 1e-3 / 3])
    assert [r["tokens_seen"] for r in train] == [sum(t["tokens"] for t in train[: i + 1]) for i in range(5)]

    assert not (run / "loss.png").exists()  # logging.plot false (the tests' default); drawn: test_samples.py

    # Evaluated every 2 steps and at the last step.
    evals = records(run, "eval")
    assert [e["step"] for e in evals] == [2, 4, 5]
    for e in evals:
        assert e["eval_ppl"] == pytest.approx(math.exp(e["eval_loss"]))
        assert 0 <= e["eval_token_accuracy"] <= 1 and 0 <= e["eval_teacher_forced_match"] <= 1
    # Eval lines come right after the train line of their step.
    order = [(r["type"], r["step"]) for r in lines]
    assert order.index(("eval", 2)) == order.index(("train", 2)) + 1

    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 5
    assert on_disk["final_loss"] == train[-1]["loss"]
    assert on_disk["tokens_seen"] == train[-1]["tokens_seen"]
    assert on_disk["params_trainable"] == on_disk["params_total"] > 0  # full fine-tune
    # eval_split=0.02 of the 5000 training examples is held out.
    assert on_disk["data"]["train"]["examples"] + on_disk["data"]["eval"]["examples"] == 5000
    assert on_disk["data"]["eval"]["examples"] == 100


def test_lora_trains_only_the_adapter(tiny_assets, tmp_path, monkeypatch):
    """Capture the model at export time: every base weight equals the original checkpoint bit for bit,
    every LoRA B matrix (zero at init) has moved."""
    import llmtrain.loop.train as train_mod

    captured = {}
    real_save_final = train_mod.save_final

    def spy(accelerator, model, tokenizer, path, **kwargs):
        sd = accelerator.unwrap_model(model).state_dict()
        captured.update({k: v.detach().clone() for k, v in sd.items()})
        real_save_final(accelerator, model, tokenizer, path, **kwargs)

    monkeypatch.setattr(train_mod, "save_final", spy)
    recipe = write_recipe(tiny_assets, tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 4, "lr": 1e-2})
    summary = run_train(recipe)
    assert 0 < summary["params_trainable"] < summary["params_total"] / 5

    original = load_weights(tiny_assets / "model")
    lora = {k: v for k, v in captured.items() if "lora_" in k}
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
            for k, v in captured.items() if "lora_" not in k}
    assert base.keys() == original.keys()
    assert all(torch.equal(base[k], original[k]) for k in original), "a frozen base weight changed"
    b_matrices = [v for k, v in lora.items() if "lora_B" in k]
    assert b_matrices and all(v.abs().max() > 0 for v in b_matrices), "a LoRA B matrix never moved"
    assert losses(tmp_path / "run")[-1] < losses(tmp_path / "run")[0]


def test_messages_and_alpaca_formats_train(tiny_assets, tmp_path):
    """The same examples as chat messages and as alpaca records: both train (LoRA), and both put loss
    on exactly the reply (the reversed word + EOS), so their per-step trained token counts agree."""
    data = tiny_assets / "data"
    common = ["train.max_steps=12", "train.micro_batch_size=8", "train.lr=1e-2", "lora.r=8", "lora.dropout=0.0"]
    runs = {}
    for fmt, path, seq in [("messages", "train_messages.jsonl", 32), ("alpaca", "train_alpaca.jsonl", 256),
                           ("prompt_completion", "train.jsonl", 32)]:
        recipe = write_recipe(tiny_assets, tmp_path, name=f"{fmt}.yaml",
                              data={"path": str(data / path), "format": fmt, "max_seq_len": seq})
        run_train(recipe, f"output_dir={tmp_path / fmt}", *common)
        runs[fmt] = records(tmp_path / fmt)
    for fmt in ("messages", "alpaca"):
        steps = runs[fmt]
        assert len(steps) == 12 and all(math.isfinite(r["loss"]) for r in steps)
        assert sum(r["loss"] for r in steps[-3:]) / 3 < steps[0]["loss"] - 0.3, fmt
    assert [r["trained_tokens"] for r in runs["messages"]] == [r["trained_tokens"] for r in runs["alpaca"]]
    # prompt_completion also trains the space before the word: one more token per example.
    assert [r["trained_tokens"] + 8 for r in runs["messages"]] == [r["trained_tokens"] for r in
                                                                   runs["prompt_completion"]]


def test_eval_data_without_eval_every_steps_is_evaluated_at_the_end(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3},
                          data={"eval_split": str(tiny_assets / "data" / "eval.jsonl")})
    run_train(recipe)
    assert [e["step"] for e in records(tmp_path / "run", "eval")] == [3]


def test_a_failed_first_run_leaves_no_folder(tiny_assets, tmp_path):
    """Every check runs before the run folder is created: a wrong data path leaves nothing behind, so the
    corrected run is not refused as "already exists"."""
    from llmtrain.errors import LLMTrainError

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 2})
    with pytest.raises(LLMTrainError, match="does not exist"):
        run_train(recipe, "data.path=/nonexistent.jsonl")
    assert not (tmp_path / "run").exists()
    run_train(recipe)
    assert len(records(tmp_path / "run")) == 2


def test_allowed_recipe_change_at_resume_is_recorded(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3}, checkpoint={"every_steps": 2})
    run_train(recipe)
    run_train(recipe, "train.max_steps=5", resume="auto", allow_recipe_change=True)
    notes = records(tmp_path / "run", "note")
    assert [n["note"] for n in notes] == ["train.max_steps changed from 3 to 5 at resume"]
    assert notes[0]["step"] == 2 and [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_a_resume_that_changes_what_the_run_trains_needs_allow_recipe_change(tiny_assets, tmp_path):
    """A resume with another loss (train.sft_loss) and gradient clip went on silently (step 4's loss 0.0955 where the
    run's was 3.80): now those keys, the mode's section and the adapter's settings are refused as a changed schedule
    is (the keys listed, nothing written), pass with --allow-recipe-change and are recorded; another mode (a DPO
    recipe on an SFT checkpoint) is another run, refused whatever the flags."""
    import shutil

    from llmtrain.errors import LLMTrainError

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0})
    run_train(recipe)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000004")
    shutil.rmtree(tmp_path / "run" / "final")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    changes = ("train.sft_loss=dft", "train.max_grad_norm=0.5", "lora.alpha=16")
    with pytest.raises(LLMTrainError, match=r"^this recipe changes lora.alpha 8.0 -> 16.0, train.sft_loss 'nll' -> "
                       r"'dft', train.max_grad_norm 1.0 -> 0.5 against checkpoint .*what it trains"):
        run_train(recipe, *changes, resume="auto")
    dpo = ("preference.beta=0.1", f"data.path={tiny_assets / 'data' / 'train_pairs.jsonl'}", "data.format=preference")
    with pytest.raises(LLMTrainError, match=r"written by a run of supervised fine-tuning and this recipe trains "
                       r"preference pairs \(preference:\): that is another run"):
        run_train(recipe, *dpo, resume="auto", allow_recipe_change=True)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    run_train(recipe, *changes, resume="auto", allow_recipe_change=True)
    assert [n["note"] for n in records(tmp_path / "run", "note")] == [
        "lora.alpha changed from 8.0 to 16.0 at resume", "train.sft_loss changed from 'nll' to 'dft' at resume",
        "train.max_grad_norm changed from 1.0 to 0.5 at resume"]
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4]


@pytest.mark.precision
def test_runs_with_different_mixed_precision_in_one_process(recipe, tmp_path):
    """A notebook (or a test session) calls train() again with another train.mixed_precision: Accelerate keeps one
    state per process and refused the change ("AcceleratorState has already been initialized")."""
    first = run_train(recipe, f"output_dir={tmp_path / 'fp32'}", "train.max_steps=2")
    second = run_train(recipe, f"output_dir={tmp_path / 'bf16'}", "train.max_steps=2", "train.mixed_precision=bf16")
    assert first["steps"] == second["steps"] == 2
    assert losses(tmp_path / "bf16") != losses(tmp_path / "fp32")  # bf16 autocast really ran
    assert losses(tmp_path / "bf16") == pytest.approx(losses(tmp_path / "fp32"), rel=2e-2)


def test_a_lora_run_with_checkpointing_prints_no_future_warning(tiny_assets, tmp_path):
    """transformers 5.24 deprecated gradient_checkpointing_enable and is_gradient_checkpointing: a LoRA run warned on
    every start. Checkpointing is still on (the new name), and nothing is warned."""
    import warnings

    recipe = write_recipe(tiny_assets, tmp_path, model={"gradient_checkpointing": True},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0}, train={"max_steps": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # as the CLI
        run_train(recipe)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    from llmtrain.config import load_recipe
    from llmtrain.model.modeling import load_model

    model = load_model(load_recipe(recipe).model, None)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_warm_up_is_hfs_one_step_ahead_and_the_decay_is_hfs(schedule):
    """What docs/recipes.md and train.warmup_steps' description say (issue 53): update k (0-based index k - 1) of the
    warm-up is at lr x k / W, where transformers' schedules (which TRL uses) give lr x (k - 1) / W; from the peak on,
    the two are the same."""
    from transformers.optimization import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from llmtrain.model.modeling import lr_factor

    warmup, total = 4, 20
    hf = (get_linear_schedule_with_warmup if schedule == "linear" else get_cosine_schedule_with_warmup)(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup, total).lr_lambdas[0]
    ours = [lr_factor(i, warmup=warmup, total=total, schedule=schedule, min_ratio=0.0) for i in range(total)]
    assert ours[:warmup] == [0.25, 0.5, 0.75, 1.0] and [hf(i) for i in range(warmup)] == [0.0, 0.25, 0.5, 0.75]
    assert ours[:warmup - 1] == [hf(i + 1) for i in range(warmup - 1)]  # one step ahead
    assert ours[warmup:] == pytest.approx([hf(i) for i in range(warmup, total)], abs=1e-12)
