"""DoRA (lora.dora, peft's use_dora): a run trains and saves each adapted linear's magnitudes, resumes exactly, loads
back in peft and merges to the same model; the estimate counts the model's adapter weights; the layouts and models
that cannot run it refuse it in one paragraph (a
mixture of experts whose experts peft adapts as parameters). (What its layers keep for backward and its step's peak:
tests/test_memory_saved.py and test_memory_step.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml
from helpers import (REPO, crash_at_step, invoke, launch_finetune, load_weights, max_abs_diff, records, run_train,
                     write_recipe)

from llmtrain.config import LoraConfig, ModelConfig, load_recipe

pytestmark = pytest.mark.long(60)  # tests/conftest.py

TEXT = ["reverse abcde = edcba", "reverse qwer = rewq"]


@torch.no_grad()
def _logits(model, tokenizer) -> torch.Tensor:
    return model(**tokenizer(TEXT, return_tensors="pt", padding=True)).logits


def _base(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_assets / "model"), attn_implementation="eager").eval()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_the_estimate_counts_the_models_adapter_weights(tiny_assets, targets):
    """A and B of each adapted linear, and DoRA's magnitude (one per output row), as peft builds them."""
    from llmtrain.memory.params import _shape_from_json, lora_plan
    from llmtrain.model.modeling import load_model

    shape = _shape_from_json((tiny_assets / "model" / "config.json").read_text(), "tiny")
    counted = {}
    for dora in (False, True):
        model = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"),
                           LoraConfig(r=4, dora=dora, target_modules=targets), device=torch.device("cpu"), empty=False)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        plan = lora_plan(shape, r=4, targets=targets if isinstance(targets, str) else tuple(targets), dora=dora)
        assert plan.trainable(shape) == trained
        counted[dora] = trained
    magnitudes = sum(o for layer in plan.adapted for _, o in layer.values())
    assert counted[True] - counted[False] == magnitudes > 0


def test_a_dora_run_saves_its_magnitudes_resumes_exactly_and_merges_to_the_same_model(tiny_assets, tmp_path,
                                                                                       monkeypatch):
    """Killed in step 4 and resumed from step 2's checkpoint: the same losses, evals and adapter bit for bit. The
    adapter says use_dora and holds a magnitude per adapted linear, moved off the base's row norms (where peft starts
    it); peft loads it to the logits the merged export gives."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "eval_every_steps": 2, "lr": 1e-2},
                          checkpoint={"every_steps": 2, "keep_last": 2},
                          lora={"r": 4, "alpha": 8, "dropout": 0.1, "dora": True}, data={"eval_split": 0.05})
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_train(recipe, f"output_dir={straight}", "logging.every_steps=1")
    crash_at_step(monkeypatch, recipe, 4, f"output_dir={killed}", "logging.every_steps=1")
    run_train(recipe, f"output_dir={killed}", "logging.every_steps=1", resume="auto")
    assert [r["loss"] for r in records(killed)] == [r["loss"] for r in records(straight)]
    assert records(killed, "eval") == records(straight, "eval") != []
    adapter = "final/adapter_model.safetensors"
    assert max_abs_diff(load_weights(killed / adapter), load_weights(straight / adapter)) == 0

    final = straight / "final"
    assert json.loads((final / "adapter_config.json").read_text())["use_dora"] is True
    saved = load_weights(final / adapter.split("/")[1])
    magnitudes = {k: v for k, v in saved.items() if k.endswith("lora_magnitude_vector")}
    assert len(magnitudes) == 7 * 2  # q, k, v, o, gate, up and down of each of the two layers
    base = _base(tiny_assets)
    weights = dict(base.named_parameters())
    for key, m in magnitudes.items():
        row_norms = weights[key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")].norm(
            dim=1)
        assert m.shape == row_norms.shape and (m - row_norms).abs().max() > 1e-4, key  # trained

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_assets / "model"))
    adapted = _logits(PeftModel.from_pretrained(_base(tiny_assets), str(final)).eval(), tokenizer)
    assert (adapted - _logits(base, tokenizer)).abs().max() > 1e-4
    invoke("export", str(straight), "--merge")
    merged = AutoModelForCausalLM.from_pretrained(str(straight / "final-merged"), attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(merged, tokenizer), adapted, atol=1e-5, rtol=1e-5)


def test_every_layout_takes_it_and_the_estimate_splits_its_magnitudes_under_tensor_parallelism(tiny_assets, tmp_path):
    """Tensor parallelism, FSDP and DDP pass the layout check (tensor parallelism had refused DoRA: it trains like one
    process, tests/test_tp.py). Under FSDP x TP a GPU holds its slice's magnitudes: a column-wise layer's split with
    its output rows (q, k, v, gate, up: out / tp), a row-wise one's whole (o, down), each FSDP-sharded over the
    shards; so Mistral-7B's LoRA weights per GPU on TP 2 x 4 shards gain (17,408 + 8,192) x 32 fp32 magnitudes / 4
    with DoRA, and its whole model's trainable count the 1,376,256 of one GPU. An estimate under TP makes the row
    norms as llmtrain does there (B A directly, W added in place: two [out, in] tensors of the slice), not through
    peft's in x in identity."""
    from llmtrain.doctor import check_layout
    from llmtrain.memory import activations as act

    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, lora={"r": 4, "dora": True}), [])
    layouts = {name: yaml.safe_load((REPO / "accelerate_configs" / f"cpu_{name}.yaml").read_text())
               for name in ("tp", "fsdp", "ddp")}
    assert [check_layout(recipe, layouts[name])[0][1] for name in ("tp", "fsdp", "ddp")] == ["pass"] * 3
    runs = {}
    for dora in ("--dora", "--no-dora"):
        out = invoke("estimate-memory", "--model", "mistral-7b", "--method", "lora", "--lora-dropout", "0", dora,
                     "--tp", "2", "--strategy", "fsdp", "--num-gpus", "8", "--json")
        runs[dora] = json.loads(out.stdout)
    assert runs["--dora"]["params_trainable"] - runs["--no-dora"]["params_trainable"] == 1_376_256
    weights = runs["--dora"]["breakdown"]["weights"] - runs["--no-dora"]["breakdown"]["weights"]
    assert weights == (17_408 + 8_192) * 32 * 4 // 4  # fp32 magnitudes, a quarter of them on each of 4 shards
    p = act.Pass(rows=1, row_len=8, resid=2, cd=2, autocast=True, attn="sdpa", mask=False, trainable_base=False,
                 adapters_in_cd=True, dora=True)
    assert act.dora_forward_temp(p, 14336, 2048) == 14336 * 14336 * 2 + 4 * 14336 * 2048 * 2
    assert act.dora_forward_temp(replace(p, dora_split=True), 14336, 2048) == 2 * 14336 * 2048 * 2


@pytest.mark.slow
@pytest.mark.extended  # two processes (about 40 s); main tier: FSDP's LoRA tests, and DoRA's layers as peft runs them
def test_two_fsdp_processes_train_what_one_process_trains(tiny_assets, tmp_path, free_port):
    """2 FSDP shards x 4 examples against one process's 8: the same losses and magnitudes (measured by hand: losses to
    6e-7, the adapter to 3e-8 over 10 steps)."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3, "micro_batch_size": 4, "lr": 1e-2},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0, "dora": True})
    run_train(recipe, f"output_dir={tmp_path / 'one'}", "train.micro_batch_size=8", "logging.every_steps=1")
    launch_finetune(REPO / "accelerate_configs" / "cpu_fsdp.yaml", 2, free_port, recipe,
                    f"output_dir={tmp_path / 'fsdp'}", "logging.every_steps=1")
    ours, theirs = records(tmp_path / "fsdp"), records(tmp_path / "one")
    assert len(ours) == 3 and [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=1e-5)
    adapter = "final/adapter_model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "fsdp" / adapter), load_weights(tmp_path / "one" / adapter)) < 1e-5


def test_the_estimate_says_what_dora_keeps_a_layer_by_hand():
    """Mistral-7B, all-linear, bf16 autocast, 4 x 2048 tokens: each adapted linear keeps its base and adapter outputs
    (T x out x 2 bytes each; out sums to 43,008 a layer) and three fp32 vectors of out; with dropout 0.05 the weight
    copy of every re-run base matmul too (218,103,808 weights a layer in bf16: 416.0 MiB)."""
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import TrainSpec

    mistral = load_model_shape("mistral-7b")
    spec = TrainSpec(method="lora", lora_r=16, dtype="bfloat16", mixed_precision="bf16", micro_batch=4, seq_len=2048,
                     lora_dora=True)
    outputs = 8192 * 43_008 * (2 + 2) + 3 * 43_008 * 4
    copies = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) * 2
    assert copies == 436_207_616
    (note,) = [n for n in estimate(mistral, spec).notes if n.startswith("lora.dora")]
    assert f"{(outputs + copies) / 2**20:,.1f} MiB a layer, of which 416.0 MiB" in note
    (note,) = [n for n in estimate(mistral, spec.but(lora_dropout=0.0)).notes if n.startswith("lora.dora")]
    assert note.endswith(f"{outputs / 2**20:,.1f} MiB a layer")
    plain = estimate(mistral, spec.but(lora_dora=False))
    assert not any(n.startswith("lora.dora") for n in plain.notes)
