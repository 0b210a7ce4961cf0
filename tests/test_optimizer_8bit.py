"""train.optimizer=adamw_8bit: bitsandbytes' 8-bit AdamW (its CPU kernels run here): it trains as AdamW does,
resumes bit for bit, its state is what the estimate counts, and the layouts with sharded parameters refuse it."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import REPO, crash_at_step, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import load_recipe

pytest.importorskip("bitsandbytes")


def _recipe(tiny_assets, tmp_path, **train):
    return write_recipe(tiny_assets, tmp_path, train={"max_steps": 6, "micro_batch_size": 8, "lr": 3e-3,
                                                      "warmup_steps": 0, "seed": 7, **train},
                        checkpoint={"every_steps": 3}, logging={"every_steps": 1, "progress": False, "plot": False})


@pytest.mark.slow
def test_it_trains_as_adamw_does_and_resumes_bit_for_bit(tiny_assets, tmp_path, monkeypatch):
    """Six steps of the tiny full fine-tune: the 8-bit moments follow fp32 AdamW's losses to within 1% (the first
    step exactly: both start from zero moments, and Adam's first update is lr x sign-like g / |g|); a run killed in
    step 5 and resumed from the step-3 checkpoint ends with the uninterrupted run's losses and weights, bit for bit
    (the quantised moments and their absmax are saved and restored as they were)."""
    recipe = _recipe(tiny_assets, tmp_path, optimizer="adamw_8bit")
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    run_train(recipe, f"output_dir={tmp_path / 'fp32'}", "train.optimizer=adamw")
    eight, fp32 = [r["loss"] for r in records(tmp_path / "straight")], [r["loss"] for r in records(tmp_path / "fp32")]
    assert eight[0] == fp32[0] and eight[-1] < eight[0] - 0.5
    assert eight == pytest.approx(fp32, rel=1e-2) and eight != fp32  # close, and not the same optimizer
    state = torch.load(tmp_path / "straight" / "checkpoints" / "step_000006" / "optimizer.bin", weights_only=False)
    moments = [s["__bnb_optimizer_quant_state__"] for s in state["state"].values()]  # bitsandbytes' saved layout
    assert {q[k].dtype for q in moments for k in ("state1", "state2") if q[k].numel() >= 4096} == {torch.uint8}
    assert {q["state1"].dtype for q in moments if q["state1"].numel() < 4096} == {torch.float32}  # the norms
    crash_at_step(monkeypatch, recipe, 5, f"output_dir={tmp_path / 'cut'}")
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", resume="auto")
    assert [r["loss"] for r in records(tmp_path / "cut")] == eight
    assert max_abs_diff(load_weights(tmp_path / "cut" / "final"), load_weights(tmp_path / "straight" / "final")) == 0


def test_its_state_is_what_the_estimate_counts(tiny_assets, tmp_path):
    """The bytes of bitsandbytes' state after a step (two uint8 moments and their fp32 absmax per block of 256) against
    memory.states.optimizer_bytes for the same parameters: equal where a tensor holds 4,096 elements or more (below,
    bitsandbytes keeps 32-bit moments: the tiny model's norms, 0.3% of its state). On Mistral-7B the state is about a
    quarter of fp32 AdamW's."""
    from transformers import AutoModelForCausalLM

    from llmtrain.memory.states import optimizer_bytes
    from llmtrain.model.modeling import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"), dtype=torch.float32)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                                kind="adamw_8bit")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    big = [p for p in model.parameters() if p.numel() >= 4096]
    measured = sum(t.numel() * t.element_size() for p in big for k, t in optimizer.state[p].items()
                   if k in ("state1", "state2", "absmax1", "absmax2"))
    counted = optimizer_bytes(sum(p.numel() * 4 for p in big), "adamw_8bit", param_bytes=4)
    assert measured == pytest.approx(counted, rel=2e-3)
    everything = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                     if k in ("state1", "state2", "absmax1", "absmax2"))
    assert counted <= everything <= 1.01 * counted
    assert optimizer_bytes(4 * 10**9, "adamw_8bit") / optimizer_bytes(4 * 10**9) == pytest.approx(0.254, abs=1e-3)


@pytest.mark.parametrize("dtype, ratio", [("float32", 2 * (1 + 4 / 256) / 8), ("bfloat16", 2 * (1 + 4 / 256) / 4)])
def test_the_estimate_counts_a_quarter_of_fp32_adamws_state(tmp_path, dtype, ratio):
    """recipes/mistral7b-full.yaml on one GPU: the optimizer row against AdamW's, whose moments are in the weights'
    dtype (8 bytes a parameter in fp32, 4 in bf16: 54.0 and 27.0 GiB; 8-bit 13.7 either way); the rest unchanged."""
    from llmtrain.memory import estimate_for_recipe

    path = tmp_path / "r.yaml"
    path.write_text((REPO / "recipes" / "mistral7b-full.yaml").read_text())
    plain = estimate_for_recipe(load_recipe(path, [f"model.dtype={dtype}"]))
    eight = estimate_for_recipe(load_recipe(path, [f"model.dtype={dtype}", "train.optimizer=adamw_8bit"]))
    assert eight.breakdown["optimizer"] / plain.breakdown["optimizer"] == pytest.approx(ratio, rel=1e-6)
    assert eight.breakdown["optimizer"] / 2**30 == pytest.approx(13.71, abs=0.01)
    assert eight.breakdown["weights"] == plain.breakdown["weights"]
    assert eight.per_gpu_peak_bytes < plain.per_gpu_peak_bytes


@pytest.mark.parametrize("config, words", [("cpu_fsdp.yaml", "under FSDP / HSDP"), ("cpu_tp.yaml", "under tensor "
                                                                                                   "parallelism")])
def test_layouts_with_sharded_parameters_refuse_it_in_one_paragraph(tiny_assets, tmp_path, config, words):
    from llmtrain.doctor import check_layout

    recipe = load_recipe(_recipe(tiny_assets, tmp_path, optimizer="adamw_8bit"))
    launch = yaml.safe_load((REPO / "accelerate_configs" / config).read_text())
    (name, status, detail), = check_layout(recipe, launch)
    assert status == "fail" and f"train.optimizer=adamw_8bit {words}" in detail and "train.optimizer=adamw" in detail
    ddp = yaml.safe_load((REPO / "accelerate_configs" / "cpu_ddp.yaml").read_text())
    assert check_layout(recipe, ddp)[0][1] == "pass"


def test_fit_proposes_no_layout_that_refuses_it(tmp_path):
    """--fit for an 8-bit full fine-tune on 8 GPUs had proposed FSDP (launch then refused it): DDP only, and no
    'FSDP on more GPUs' where nothing fits."""
    from llmtrain.memory import fit as fitting
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    shape = load_model_shape("mistral-7b")
    spec = TrainSpec(method="full", dtype="bfloat16", mixed_precision="bf16", strategy="ddp", num_gpus=8,
                     optimizer="adamw_8bit", gpu_memory_gib=80.0)
    result = fitting.fit(shape, spec)
    assert result.best is not None and {c.spec.strategy for c in result.candidates} == {"ddp"}
    assert fitting.more_gpus(shape, spec.but(gpu_memory_gib=16.0)) is None
    assert "fsdp" in {c.spec.strategy for c in fitting.fit(shape, spec.but(optimizer="adamw")).candidates}
    from llmtrain.memory import estimate_run

    tight = spec.but(gpu_memory_gib=16.0, dtype="float32")
    text = fitting.recommendation(shape, estimate_run(shape, tight))
    assert "refuses the 8-bit optimizer" in text and "FSDP (with --cpu-offload where it alone does not fit) and " \
        "train.optimizer=adamw" in text and "nor FSDP on up to" not in text
    one = tight.but(optimizer="adamw", strategy="single", num_gpus=1)  # AdamW on one card: 8-bit is one way down
    assert "8-bit AdamW (train.optimizer=adamw_8bit / --optimizer adamw_8bit)" in fitting.overflow_advice(
        estimate_run(shape, one))


def test_an_estimate_from_flags_refuses_it_under_fsdp_as_a_recipe_is():
    """`estimate-memory --model ... --optimizer adamw_8bit --strategy fsdp` said it fits (a recipe on an FSDP launch is
    refused: the table's rule); now the same paragraph's reason, exit 2; DDP is estimated."""
    from helpers import estimate_memory

    refused = estimate_memory("--model", "mistral-7b", "--method", "lora", "--optimizer", "adamw_8bit", "--strategy",
                              "fsdp", "--num-gpus", "8", check=False)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and "the 8-bit optimizer (--optimizer adamw_8bit, train.optimizer) under FSDP / " \
        "HSDP: bitsandbytes' 8-bit AdamW updates plain tensors" in said and "use adamw" in said
    assert estimate_memory("--model", "mistral-7b", "--method", "lora", "--optimizer", "adamw_8bit", "--strategy",
                           "ddp", "--num-gpus", "8").returncode == 0


def test_without_bitsandbytes_it_is_refused_in_one_line(monkeypatch):
    """finetune's refusal, and doctor's row (it had none: the recipe passed doctor, then finetune stopped)."""
    import importlib.util

    from llmtrain.config import Recipe
    from llmtrain.doctor import check_optimizer
    from llmtrain.errors import LLMTrainError
    from llmtrain.model.modeling import build_optimizer

    recipe = Recipe.model_validate({"model": {"name_or_path": "m"}, "output_dir": "runs/m",
                                    "data": {"path": "d.jsonl", "format": "prompt_completion"},
                                    "train": {"optimizer": "adamw_8bit"}})
    ((name, status, said),) = check_optimizer(recipe)
    assert (name, status) == ("8-bit AdamW", "pass") and said.startswith("bitsandbytes 0.")
    assert check_optimizer(recipe.model_copy(update={"train": recipe.train.model_copy(update={"optimizer": "adamw"})}
                                             )) == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(LLMTrainError, match=r"^train.optimizer=adamw_8bit needs bitsandbytes: pip install "
                       r"'llmtrain\[qlora\]', or set train.optimizer=adamw.$"):
        build_optimizer(torch.nn.Linear(2, 2), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                        kind="adamw_8bit")
    assert check_optimizer(recipe) == [("8-bit AdamW", "fail", "train.optimizer=adamw_8bit needs bitsandbytes, which "
                                        "is not installed: pip install 'llmtrain[qlora]', or set "
                                        "train.optimizer=adamw.")]
