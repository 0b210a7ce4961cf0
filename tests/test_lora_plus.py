"""LoRA+ (lora.lr_ratio, Hayou et al. 2024): the optimizer's groups against peft's create_loraplus_optimizer, the
first update of each matrix against Adam's first step worked out by hand, and an exact resume."""

from __future__ import annotations

import pytest
import torch
from helpers import crash_at_step, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import LoraConfig, ModelConfig
from llmtrain.model.modeling import build_optimizer, load_model

pytestmark = pytest.mark.long(60)  # tests/conftest.py


def _lora_model(tiny_assets, **lora):
    torch.manual_seed(0)
    return load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"),
                      LoraConfig(r=4, alpha=8, dropout=0.0, **lora), device=torch.device("cpu"), empty=False)


def _rates(optimizer) -> dict[int, tuple[float, float]]:
    return {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("dora", [False, True])
def test_each_parameter_learns_at_the_rate_peft_gives_it(tiny_assets, dora):
    """LoRA on the attention projections and on the embedding, the norms trained in full (modules_to_save): every
    parameter's rate is the one peft's create_loraplus_optimizer gives it (B matrices and the norms' 1-D weights at lr
    x 16, the A matrices at lr, the embedding's LoRA at lora.lr_embedding; DoRA's magnitudes, 1-D, as B), over the
    same parameters. Weight decay stays llmtrain's (none on 1-D parameters). Without lora.lr_ratio, one rate."""
    from peft.optimizers import create_loraplus_optimizer

    model = _lora_model(tiny_assets, target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["norm"],
                        dora=dora)
    assert any("lora_magnitude_vector" in n for n, _ in model.named_parameters()) == dora
    ours = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, fused=False,
                           lora_lr_ratio=16, lora_lr_embedding=1e-5)
    theirs = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16,
                                       loraplus_lr_embedding=1e-5)
    ours_rates, their_rates = _rates(ours), _rates(theirs)
    assert ours_rates.keys() == their_rates.keys()
    names = {id(p): n for n, p in model.named_parameters()}
    for key, (lr, decay) in ours_rates.items():
        assert lr == pytest.approx(their_rates[key][0]), names[key]
        assert decay == (0.0 if model.get_parameter(names[key]).ndim == 1 else 0.1)
    by_kind = {}
    for key, (lr, _) in ours_rates.items():
        n = names[key]
        kind = "embedding" if "lora_embedding" in n else "B" if "lora_B" in n else "A" if "lora_A" in n else \
            "magnitude" if "lora_magnitude" in n else "full"
        by_kind.setdefault(kind, set()).add(lr)
    assert by_kind == {"A": {1e-3}, "B": {1e-3 * 16}, "embedding": {1e-5}, "full": {1e-3 * 16},
                       **({"magnitude": {1e-3 * 16}} if dora else {})}
    assert ours.param_groups[0]["lr"] == 1e-3 and ours.param_groups[0]["name"] == "decay"  # the rate logged
    plain = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, fused=False)
    assert {lr for lr, _ in _rates(plain).values()} == {1e-3}


@pytest.mark.parametrize("ratio", [None, 16.0])
def test_the_first_update_moves_each_b_by_its_rate(tiny_assets, tmp_path, ratio):
    """Adam's first update of a weight is its rate times g / (|g| + eps), so from B = 0 nearly every entry of B is
    +-lr (lr x 16 under LoRA+). The lr logged is train.lr's schedule either way."""
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, **({"lr_ratio": ratio} if ratio else {})}
    run_train(write_recipe(tiny_assets, tmp_path, train={"max_steps": 1, "lr": 1e-4, "schedule": "constant"},
                           lora=lora))
    weights = load_weights(tmp_path / "run" / "final" / "adapter_model.safetensors")
    b = torch.cat([w.flatten() for n, w in weights.items() if "lora_B" in n])
    assert b.abs().max().item() == pytest.approx(1e-4 * (ratio or 1), rel=1e-3)
    assert (b.abs() > 0.99e-4 * (ratio or 1)).float().mean().item() > 0.9
    assert records(tmp_path / "run")[0]["lr"] == pytest.approx(1e-4)


def test_a_lora_plus_run_resumes_exactly(tiny_assets, tmp_path, monkeypatch):
    """Killed in step 4 and resumed from step 2's checkpoint: the same losses and adapter as the run never stopped
    (the groups' rates and moments come back with the optimizer's state)."""
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "lr_ratio": 8.0}
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 5, "lr": 1e-3}, lora=lora,
                          checkpoint={"every_steps": 2, "keep_last": 3})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    crash_at_step(monkeypatch, recipe, 4, f"output_dir={tmp_path / 'killed'}")
    run_train(recipe, f"output_dir={tmp_path / 'killed'}", resume="auto")
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "killed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    final = "final/adapter_model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "killed" / final), load_weights(tmp_path / "straight" / final)) == 0


def test_a_pipeline_stages_checkpoint_gives_each_named_group_its_own_rate_back(tiny_assets, tmp_path):
    """Pipeline stages save their optimizer state by parameter name (parallel/pipeline/checkpoint.py), and a resume
    may split the model otherwise, so the groups' settings are found again by group: by name under LoRA+, whose
    groups share a weight decay (0 here). Matched by weight decay alone, the B matrices had come back at the A
    matrices' rate."""
    from llmtrain.parallel.pipeline.checkpoint import read_stages, write_stage
    from llmtrain.parallel.pipeline.group import PipelineGroup

    def optimizer_of(model):
        return build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False,
                               lora_lr_ratio=16)

    model = _lora_model(tiny_assets)
    saved = optimizer_of(model)
    model(torch.tensor([[1, 5, 6, 7]]), labels=torch.tensor([[1, 5, 6, 7]])).loss.backward()
    saved.step()
    write_stage(tmp_path, model, saved, g=PipelineGroup(), trainable_only=True)
    fresh = optimizer_of(model)
    for group in fresh.param_groups:  # a scheduler's decay by now: the checkpoint's rates must come back
        group["lr"] /= 10
    read_stages(tmp_path, model, fresh, trainable_only=True)
    assert [(g["name"], g["lr"]) for g in fresh.param_groups] == [("decay", 1e-3), ("lora_B", 1e-3 * 16)]
    assert [(g["name"], g["lr"]) for g in saved.param_groups] == [(g["name"], g["lr"]) for g in fresh.param_groups]
