"""A full fine-tune's frozen reference (model/reference.py) and TR-DPO's sync of it (sync_reference, TRL's
sync_ref_model): the mix is TRL's SyncRefModelCallback's, bit for bit; a DPO run with it trains as TRL's DPOTrainer
with sync_ref_model does (losses, policy and reference weights after 3 steps); a checkpoint carries the moved reference
and a resume goes on with it; online RL with rl.beta > 0 trains a full fine-tune against a frozen copy; the
combinations that cannot work are refused in one paragraph, and the estimate counts the copy."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import load_weights, records, run_train, write_recipe

from llmtrain.errors import LLMTrainError

pytestmark = pytest.mark.long(120)  # tests/conftest.py

PAIRS = [
    {"prompt": "reverse abc =", "chosen": " cba", "rejected": " abc"},
    {"prompt": "reverse hello =", "chosen": " olleh", "rejected": " hello"},
    {"prompt": "reverse xy =", "chosen": " yx", "rejected": " xyy"},
    {"prompt": "reverse stop =", "chosen": " pots", "rejected": " spot"},
]
SYNC = {"every_steps": 1, "alpha": 0.6}


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (cpu=True); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _tiny(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                attn_implementation="eager")


def _moved(model, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.05])
def test_the_mix_is_trls_sync_callback_bit_for_bit(tiny_assets, alpha):
    """mix(reference, policy, alpha) against TRL's SyncRefModelCallback._sync_target_model on the same two models,
    twice in a row: every weight equal (torch.equal), and moved (not vacuous)."""
    trl = pytest.importorskip("trl")
    from llmtrain.model.reference import mix

    policy = _moved(_tiny(tiny_assets), 0.02, 0)
    ours, theirs = _tiny(tiny_assets), _tiny(tiny_assets)
    start = {n: p.clone() for n, p in ours.named_parameters()}
    for round_ in range(2):
        mix(ours, policy, alpha)
        trl.trainer.callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, alpha)
        _moved(policy, 0.01, round_ + 1)
    got, want = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got)
    assert min((got[n] - start[n]).abs().max().item() for n in got) > 1e-4


def _dpo_recipe(tiny_assets, tmp_path, **preference):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return write_recipe(
        tiny_assets, tmp_path, name="dpo.yaml", preference={"loss": "dpo", "beta": 0.1, **preference},
        data={"path": str(path), "format": "preference", "max_seq_len": 64,
              "cache_dir": str(tiny_assets.parent / "data-cache")},
        train={"max_steps": 3, "micro_batch_size": len(PAIRS), "lr": 1e-3, "schedule": "constant", "warmup_steps": 0,
               "max_grad_norm": 1.0, "seed": 7},
        checkpoint={"every_steps": 1, "keep_last": 3, "save_final": True})


def test_a_dpo_run_with_sync_reference_trains_as_trls_dpo_trainer_with_sync_ref_model(tiny_assets, tiny_tok, tmp_path,
                                                                                      fresh_accelerate_state):
    """TRL's DPOTrainer with sync_ref_model (ref_model_sync_steps 1, ref_model_mixup_alpha 0.6) and llmtrain's
    preference.sync_reference {every_steps: 1, alpha: 0.6}, each 3 steps of the same 4 pairs (one micro-batch a step)
    from the same tiny model, AdamW at lr 1e-3, constant, clipped at 1: the same loss every step (to 1e-6; the
    reference of steps 2 and 3 is the mixed one: without the sync step 2's loss is 0.578, with it 0.678). The
    reference in each checkpoint is TRL's own callback applied to the checkpoints' policies from the starting weights
    (to 1e-6). After the run, the policy and the reference are TRL's to 1e-4: 7.6e-5 measured, and as much without
    the sync (Adam moves a weight whose gradient is near 0 by about lr whatever its last bits, and packed and padded
    passes differ there; at lr 1e-2 the losses part by 3e-5 at step 3 too, with or without the sync)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from llmtrain.model.reference import FOLDER

    recipe = _dpo_recipe(tiny_assets, tmp_path, reference="copy", sync_reference=SYNC)
    run_train(recipe, f"output_dir={tmp_path / 'ours'}")
    run_train(recipe, f"output_dir={tmp_path / 'fixed'}", "preference.sync_reference=null")
    ours, fixed = records(tmp_path / "ours"), records(tmp_path / "fixed")

    policy, ref = _tiny(tiny_assets), _tiny(tiny_assets)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS), report_to="none",
                         beta=0.1, loss_type=["sigmoid"], max_length=None, use_cpu=True, bf16=False, fp16=False,
                         learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, max_steps=3,
                         optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                         save_strategy="no", seed=7, sync_ref_model=True, ref_model_sync_steps=1,
                         ref_model_mixup_alpha=0.6)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(PAIRS),
                             processing_class=tiny_tok)
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 3
    assert [r["loss"] for r in ours] == pytest.approx(theirs, abs=1e-6)
    assert abs(fixed[1]["loss"] - ours[1]["loss"]) > 1e-2  # the reference moved
    final = load_weights(tmp_path / "ours" / "final" / "model.safetensors")
    trained = dict(trainer.model.named_parameters())
    assert max((final[n] - trained[n].detach()).abs().max().item() for n in final) < 1e-4

    # the checkpoints' references: TRL's callback applied to the checkpoints' policies, from the starting weights
    chain = _tiny(tiny_assets)
    for step in (1, 2, 3):
        folder = tmp_path / "ours" / "checkpoints" / f"step_{step:06d}"
        weights = load_weights(folder / "model.safetensors")
        step_policy = _tiny(tiny_assets)
        step_policy.load_state_dict(weights, strict=False)
        trl.trainer.callbacks.SyncRefModelCallback._sync_target_model(step_policy, chain, 0.6)
        saved = _saved_reference(folder / FOLDER, chain)
        assert max((saved[n] - p).abs().max().item() for n, p in chain.state_dict().items()) < 1e-6
    assert max((p - q).abs().max().item() for p, q in zip(chain.parameters(), trainer.ref_model.parameters())) < 1e-4


def _saved_reference(folder, like) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {n: torch.empty_like(p) for n, p in like.state_dict().items()}
    dcp.load(state, checkpoint_id=str(folder))
    return state


def test_a_resume_goes_on_with_the_moved_reference_and_a_checkpoint_without_one_is_refused(tiny_assets, tmp_path):
    """Every 2 steps at alpha 0.6: a run killed after step 3 (its checkpoint holds the reference moved at step 2)
    and resumed to 5 logs the straight run's losses at steps 4 and 5 and ends at its weights. A checkpoint written
    without sync_reference, past the first sync, is refused before anything is written."""
    recipe = _dpo_recipe(tiny_assets, tmp_path, reference="copy", sync_reference={"every_steps": 2, "alpha": 0.6})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}", "train.max_steps=5")
    run_train(recipe, f"output_dir={tmp_path / 'resumed'}", "train.max_steps=3", "checkpoint.save_final=false")
    assert (tmp_path / "resumed" / "checkpoints" / "step_000003" / "reference").is_dir()
    assert not (tmp_path / "resumed" / "checkpoints" / "step_000001" / "reference").exists()  # before the first sync
    run_train(recipe, f"output_dir={tmp_path / 'resumed'}", "train.max_steps=5", resume="auto",
              allow_recipe_change=True)
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], abs=1e-6)
    a = load_weights(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_weights(tmp_path / "resumed" / "final" / "model.safetensors")
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6

    run_train(recipe, f"output_dir={tmp_path / 'plain'}", "train.max_steps=3", "preference.sync_reference=null")
    before = sorted(p.name for p in (tmp_path / "plain").iterdir())
    with pytest.raises(LLMTrainError, match=r"past the first sync of the reference .*holds no reference"):
        run_train(recipe, f"output_dir={tmp_path / 'plain'}", "train.max_steps=5", resume="auto",
                  allow_recipe_change=True)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == before


@pytest.mark.parametrize("algorithm, lora", [("grpo", False), ("rloo", False), ("grpo", True)])
def test_online_rl_trains_a_full_fine_tune_against_a_frozen_copy_and_a_full_sync_zeroes_the_kl(tiny_assets, tmp_path,
                                                                                             algorithm, lora):
    """rl.beta > 0 without lora: (refused before: no reference) trains against a frozen copy of the starting
    weights: the KL to it is 0 at the first step (the policy is the copy) and above 0 after the policy moved. With
    sync_reference {every_steps: 1, alpha: 1} the reference is the policy of the step before, which is the policy the
    next step's KL reads: 0 at every step. LoRA (GRPO): the same with the adapter's snapshot as the reference."""
    import yaml
    from helpers import REPO

    recipe = yaml.safe_load((REPO / "recipes" / "tiny-grpo.yaml").read_text())
    recipe["model"]["name_or_path"] = str(tiny_assets / "model")
    recipe["data"].update(path=str(tiny_assets / "data" / "train.jsonl"), eval_split=None,
                          cache_dir=str(tiny_assets.parent / "data-cache"))
    recipe["rl"].update(algorithm=algorithm, beta=0.04, num_generations=4, max_completion_tokens=8,
                        rewards=[{"type": "format", "pattern": "[aeiou]"}])
    if algorithm == "rloo":
        recipe["rl"].pop("loss_type")
    if lora:
        recipe["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    recipe["train"].update(max_steps=3, micro_batch_size=2, grad_accum_steps=1, lr=1e-2 if lora else 1e-3,
                           warmup_steps=0, eval_every_steps=None, eval_samples=0)
    recipe["logging"] = {"progress": False, "plot": False, "every_steps": 1}
    recipe["checkpoint"] = {"save_final": False}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_train(path, f"output_dir={tmp_path / 'fixed'}")
    run_train(path, f"output_dir={tmp_path / 'synced'}", "rl.sync_reference.every_steps=1",
              "rl.sync_reference.alpha=1")
    fixed, synced = records(tmp_path / "fixed"), records(tmp_path / "synced")
    assert len(fixed) == len(synced) == 3
    assert fixed[0]["kl"] == pytest.approx(0, abs=1e-7) and fixed[2]["kl"] > 1e-6
    assert [r["kl"] for r in synced] == pytest.approx([0, 0, 0], abs=1e-7)


# --------------------------------------------------------------------------- refusals and the estimate


def _recipe_dict(tiny_assets, tmp_path, **changes) -> dict:
    import yaml

    return yaml.safe_load(_dpo_recipe(tiny_assets, tmp_path, **changes).read_text())


@pytest.mark.parametrize("changes, needle", [
    ({"sync_reference": True, "reference": "precomputed"},
     "preference.sync_reference moves the reference as the policy trains, and preference.reference=precomputed is "
     "computed once"),
    ({"sync_reference": {"every_steps": 0}}, "every_steps"),
    ({"sync_reference": {"alpha": 0}}, "alpha"),
])
def test_the_schema_refuses_a_sync_it_cannot_run(tiny_assets, tmp_path, changes, needle):
    from llmtrain.config import Recipe

    with pytest.raises(ValueError, match=needle):
        Recipe.model_validate(_recipe_dict(tiny_assets, tmp_path, **changes))


def test_true_is_trls_defaults_and_auto_makes_the_copy(tiny_assets, tmp_path):
    from llmtrain.capabilities import reference_copy, reference_kind, reference_sync
    from llmtrain.config import Recipe

    recipe = Recipe.model_validate(_recipe_dict(tiny_assets, tmp_path, sync_reference=True))
    assert (recipe.preference.sync_reference.every_steps, recipe.preference.sync_reference.alpha) == (512, 0.6)
    assert reference_kind(recipe) == "copy" and reference_copy(recipe) and reference_sync(recipe) is not None
    plain = Recipe.model_validate(_recipe_dict(tiny_assets, tmp_path))
    assert reference_kind(plain) == "precomputed" and not reference_copy(plain)


@pytest.mark.parametrize("mode", ["preference", "kto", "rl"])
def test_lora_takes_sync_reference_whole_only_and_not_on_split_layers(tiny_assets, tmp_path, mode):
    """A LoRA run's reference can be the adapter as it was (alpha 1), not a mix (TRL refuses PEFT altogether):
    TRL's default alpha 0.6 is refused in one paragraph naming the key and both fixes; alpha 1 is taken on one
    process, DDP, FSDP, FSDP x TP and pipeline stages (RLOO's KL too, under FSDP x TP since 2026-12-05)."""
    from llmtrain import capabilities
    from llmtrain.config import Recipe
    from llmtrain.layout import Layout

    data = _recipe_dict(tiny_assets, tmp_path)
    data["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    if mode != "preference":
        data.pop("preference")
        data["data"]["format"] = "unpaired" if mode == "kto" else "prompt"
        data[mode] = {"beta": 0.1} if mode == "kto" else {"beta": 0.04, "rewards": [{"type": "answer_match"}]}
    data[mode]["sync_reference"] = True
    with pytest.raises(ValueError) as e:
        Recipe.model_validate(data)
    said = " ".join(str(e.value).split())
    assert f"{mode}.sync_reference.alpha=0.6 with LoRA: a LoRA run's reference can follow the policy only whole" in said
    assert f"Set {mode}.sync_reference.alpha=1, or remove the lora: section" in said
    data[mode]["sync_reference"] = {"every_steps": 4, "alpha": 1}
    recipe = Recipe.model_validate(data)
    assert capabilities.problems(recipe, Layout(processes=2)) == []
    fsdp = capabilities.problems(recipe, Layout(processes=2, fsdp=True))
    if mode == "rl":  # RLOO's KL runs in the rollout, over the gathered weights: FSDP takes it (the whole snapshot
        # swapped in), and FSDP x TP, whose gathered weights TP splits (each process its slice of the snapshot; refused
        # before 2026-12-05)
        assert fsdp == []
        tp = Layout(processes=4, tp=2, shard=2, mesh=True, fsdp=True)
        assert capabilities.problems(recipe, tp) == []
        recipe = Recipe.model_validate({**data, "rl": {**data["rl"], "algorithm": "rloo"}})
        assert capabilities.problems(recipe, Layout(processes=2, fsdp=True)) == []
        assert capabilities.problems(recipe, tp) == []
        assert capabilities.problems(recipe, Layout(processes=2)) == []
    else:
        assert fsdp == []
    stages = Layout(processes=2, pp=2)  # each stage swaps its part of the snapshot in (StagePairs.follow; RLOO's KL
    # in the rollout too, since 2026-12-05)
    assert not [p for p in capabilities.problems(recipe, stages) if "sync_reference" in p]
    if mode != "rl":
        assert capabilities.problems(recipe, Layout(processes=4, tp=2, shard=2, mesh=True, fsdp=True)) == []


def test_the_layouts_that_cannot_hold_the_copy_are_refused_by_the_table(tiny_assets, tmp_path):
    """Online RL's copy trains on one process, DDP, FSDP and FSDP x TP (sharded like the policy, over the whole mesh
    under TP) and is refused under TP without FSDP, as KTO's and preference's copy are; a preference copy on pipeline
    stages trains (each stage a copy of its own part: tests/test_pipeline.py). rl.sync_reference with rl.beta 0 is
    refused."""
    from llmtrain import capabilities
    from llmtrain.config import Recipe
    from llmtrain.layout import Layout

    rl = _recipe_dict(tiny_assets, tmp_path)
    rl.pop("preference")
    rl["data"]["format"] = "prompt"
    rl["rl"] = {"beta": 0.04, "rewards": [{"type": "answer_match"}]}
    recipe = Recipe.model_validate(rl)
    assert capabilities.problems(recipe, Layout(processes=2)) == []
    assert capabilities.problems(recipe, Layout(processes=2, fsdp=True)) == []
    assert capabilities.sharding_problems(recipe) == []  # --fit may propose FSDP for it
    assert capabilities.problems(recipe, Layout(processes=4, tp=2, shard=2, mesh=True, fsdp=True)) == []
    tp = capabilities.problems(recipe, Layout(processes=2, tp=2, mesh=True))  # TP without FSDP: the copy whole
    assert any("without FSDP: a full fine-tune's reference" in p for p in tp), tp
    with pytest.raises(ValueError, match=r"rl.sync_reference moves the reference, which only the KL term reads"):
        Recipe.model_validate({**rl, "rl": {**rl["rl"], "beta": 0.0, "sync_reference": True}})

    dpo = Recipe.model_validate(_recipe_dict(tiny_assets, tmp_path, reference="copy"))
    tp = capabilities.problems(dpo, Layout(processes=2, tp=2, mesh=True))
    assert any("without FSDP: a full fine-tune's reference (preference.reference: copy)" in p for p in tp), tp
    assert not any("reference" in p for p in capabilities.problems(dpo, Layout(processes=4, tp=2, shard=2, mesh=True,
                                                                               fsdp=True)))
    with pytest.raises(ValueError) as e:  # on stages each holds a copy of its own part: the pipeline's own demands
        Recipe.model_validate({**_recipe_dict(tiny_assets, tmp_path, reference="copy"),
                               "parallel": {"pipeline_parallel": 2}})
    assert "train.micro_batch_tokens" in str(e.value) and "reference" not in str(e.value)


def test_the_estimate_counts_the_copy_for_every_mode_that_holds_one():
    """A full fine-tune's frozen copy is one more set of weights in the storage dtype on one GPU: preference.reference
    copy (precomputed holds none) and online RL with rl.beta > 0 (not with 0), as KTO's."""
    from llmtrain.config import Recipe
    from llmtrain.memory.estimate import estimate
    from llmtrain.memory.params import load_model_shape
    from llmtrain.memory.spec import spec_from_recipe

    mistral = load_model_shape("mistral-7b")
    base = {"model": {"name_or_path": "mistral-7b", "dtype": "bfloat16", "kernels": "none",
                      "gradient_checkpointing": True},
            "data": {"path": "unread.jsonl", "format": "preference", "max_seq_len": 512},
            "train": {"micro_batch_size": 1, "mixed_precision": "bf16"}, "output_dir": "unwritten"}

    def weights(spec) -> int:
        return estimate(mistral, spec).phase_parts["optimizer_step"]["weights"]

    copied = spec_from_recipe(Recipe.model_validate({**base, "preference": {"reference": "copy"}}))
    fixed = spec_from_recipe(Recipe.model_validate({**base, "preference": {}}))
    assert copied.frozen_reference and not fixed.frozen_reference
    assert weights(copied) - weights(fixed) == mistral.params_total * 2
    prompts = {**base, "data": {**base["data"], "format": "prompt"}}
    rewards = [{"type": "answer_match"}]
    with_kl = spec_from_recipe(Recipe.model_validate({**prompts, "rl": {"beta": 0.04, "rewards": rewards}}))
    without = spec_from_recipe(Recipe.model_validate({**prompts, "rl": {"beta": 0.0, "rewards": rewards}}))
    assert with_kl.frozen_reference and not without.frozen_reference
    assert weights(with_kl) - weights(replace(with_kl, frozen_reference=False)) == mistral.params_total * 2
    # under FSDP on 8 GPUs: the decoder in shards, the head whole; RLOO holds the decoder gathered through the
    # rollout (rollouts.held_whole), GRPO runs it in the update's passes (no more gathered while it samples)
    fsdp = dict(strategy="fsdp", num_gpus=8)
    rloo = spec_from_recipe(Recipe.model_validate({**prompts, "rl": {"algorithm": "rloo", "rewards": rewards}}),
                            **fsdp)
    grpo = spec_from_recipe(Recipe.model_validate({**prompts, "rl": {"beta": 0.04, "rewards": rewards}}), **fsdp)
    assert rloo.frozen_reference and rloo.rollout_reference and not grpo.rollout_reference
    decoder = mistral.params_total - mistral.params_head
    assert weights(rloo) - weights(replace(rloo, frozen_reference=False)) == (
        -(-decoder // 8) * 2 + mistral.vocab * mistral.hidden * 2)
    for spec in (rloo, replace(rloo, tp=2)):  # under FSDP x TP the gathered copy is whole too (not split by TP)
        for phase in ("generation", "generation_prefill", "rollout_logps_forward", "rollout_logps_loss"):
            held = estimate(mistral, spec).phase_parts[phase]["fsdp_buffers"]
            assert held - estimate(mistral, replace(spec, rollout_reference=False)).phase_parts[phase][
                "fsdp_buffers"] == decoder * 2
    lora = {**base, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}}
    moving = spec_from_recipe(Recipe.model_validate({**lora, "preference": {"sync_reference": {"alpha": 1}}}))
    still = spec_from_recipe(Recipe.model_validate({**lora, "preference": {}}))
    assert moving.adapter_reference and not moving.frozen_reference and not still.adapter_reference
    trained = estimate(mistral, still).phase_parts["optimizer_step"]["gradients"]  # the adapters' fp32 gradients
    assert trained > 0 and weights(moving) - weights(still) == 2 * trained
    moving, still = (replace(s, strategy="fsdp", num_gpus=8) for s in (moving, still))  # each process's shards
    sharded = estimate(mistral, still).phase_parts["optimizer_step"]["gradients"]
    assert weights(moving) - weights(still) == pytest.approx(2 * sharded, abs=2)
    # RLOO's KL swaps the snapshot into the weights FSDP holds gathered in the rollout: it and its spare whole too
    lora_rl = {**prompts, "lora": lora["lora"]}
    rloo = spec_from_recipe(Recipe.model_validate({**lora_rl, "rl": {
        "algorithm": "rloo", "rewards": rewards, "sync_reference": {"alpha": 1}}}), **fsdp)
    grpo = spec_from_recipe(Recipe.model_validate({**lora_rl, "rl": {
        "beta": 0.04, "rewards": rewards, "sync_reference": {"alpha": 1}}}), **fsdp)
    assert rloo.adapter_reference_whole and not grpo.adapter_reference_whole and grpo.adapter_reference
    assert weights(rloo) - weights(replace(rloo, adapter_reference_whole=False)) == 2 * trained
    ddp = replace(rloo, strategy="ddp")  # nothing gathered: the swap writes each weight itself
    assert weights(ddp) == weights(replace(ddp, adapter_reference_whole=False))


# --------------------------------------------------------------------------- LoRA: the adapter as it was (alpha 1)

LN2 = 0.6931471805599453


def _lora_dpo(tiny_assets, tmp_path, **preference):
    import yaml

    recipe = _dpo_recipe(tiny_assets, tmp_path, **preference)
    data = yaml.safe_load(recipe.read_text())
    data["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    data["train"]["lr"] = 1e-2
    recipe.write_text(yaml.safe_dump(data))
    return recipe


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_full_sync_each_step_makes_every_steps_dpo_loss_ln2(tiny_assets, tmp_path, lora):
    """With sync_reference {every_steps: 1, alpha: 1} the reference of step k + 1 is the policy after step k, which
    is the policy step k + 1 starts from: every log-ratio is 0, so every step's DPO loss is ln 2 and its rewards 0,
    while the run still trains (a gradient, and the policy moves). LoRA: the adapter's snapshot swapped in for the
    reference's forward (model/reference.AdapterReference); full: the frozen copy mixed at alpha 1. Every 2 steps:
    ln 2 at steps 1 and 3 only. Without the sync, no step but the first is ln 2."""
    make = _lora_dpo if lora else _dpo_recipe
    recipe = make(tiny_assets, tmp_path, sync_reference={"every_steps": 1, "alpha": 1.0},
                  **({} if lora else {"reference": "copy"}))
    run_train(recipe, f"output_dir={tmp_path / 'each'}", "train.max_steps=4")
    run_train(recipe, f"output_dir={tmp_path / 'two'}", "train.max_steps=4", "preference.sync_reference.every_steps=2")
    run_train(recipe, f"output_dir={tmp_path / 'none'}", "train.max_steps=4", "preference.sync_reference=null")
    each, two, none = (records(tmp_path / name) for name in ("each", "two", "none"))
    assert [r["loss"] for r in each] == pytest.approx([LN2] * 4, abs=1e-6)
    assert all(abs(r["rewards/chosen"]) < 1e-6 and r["grad_norm"] > 1e-3 for r in each)
    assert [abs(r["loss"] - LN2) < 1e-6 for r in two] == [True, False, True, False]
    assert [abs(r["loss"] - LN2) < 1e-6 for r in none] == [True, False, False, False]


def test_a_lora_resume_goes_on_with_the_adapters_snapshot(tiny_assets, tmp_path):
    """LoRA, every 2 steps: stopped after step 3 (its checkpoint holds the adapter as it was at step 2) and resumed
    to 5, the losses and the adapter are the straight run's."""
    recipe = _lora_dpo(tiny_assets, tmp_path, sync_reference={"every_steps": 2, "alpha": 1.0})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}", "train.max_steps=5")
    run_train(recipe, f"output_dir={tmp_path / 'resumed'}", "train.max_steps=3", "checkpoint.save_final=false")
    assert (tmp_path / "resumed" / "checkpoints" / "step_000003" / "reference").is_dir()
    run_train(recipe, f"output_dir={tmp_path / 'resumed'}", "train.max_steps=5", resume="auto",
              allow_recipe_change=True)
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], abs=1e-6)
    assert abs(straight[2]["loss"] - LN2) < 1e-6 and abs(straight[3]["loss"] - LN2) > 1e-4
    a = load_weights(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_weights(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6


@pytest.mark.slow
def test_loras_moving_reference_with_a_trained_head_under_fsdp_trains_what_one_process_trains(tiny_assets, tmp_path,
                                                                                           free_port):
    """DPO with LoRA, a trained copy of the LM head (lora.modules_to_save, in FSDP's root unit) and sync_reference
    every 2 steps, on 2 FSDP processes against 1: the same losses, gradient norms, eval and adapter. peft's
    disable_adapter (the reference of steps 1 and 2) froze the head copy's shards and unfroze its gathered tensors,
    which FSDP keeps after the reference's forward; from step 3, whose reference is the snapshot (no disable_adapter),
    each gathering took the shards' requires_grad: the head trained no more (step 3's gradient norm 0.149 against
    0.452, the head 2.5e-3 off at the end) until model/reference.adapter_off put every flag back."""
    from helpers import REPO, launch_finetune, max_abs_diff

    data = tiny_assets / "data"
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data / "train_pairs.jsonl"), "format": "preference",
                                                       "eval_split": str(data / "eval_pairs.jsonl")},
                          preference={"loss": "dpo", "sync_reference": {"every_steps": 2, "alpha": 1.0}},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0, "modules_to_save": ["lm_head"]},
                          train={"max_steps": 3, "micro_batch_size": 4, "lr": 1e-2, "eps": 1e-6, "eval_every_steps": 3,
                                 "eval_samples": 0, "eval_batch_size": 4})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    launch_finetune(REPO / "accelerate_configs" / "cpu_fsdp.yaml", 2, free_port, recipe,
                    f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=2", "train.eval_batch_size=2")
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    for key in ("loss", "rewards/margins"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], abs=1e-6), key
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    assert abs(one[2]["loss"] - LN2) < 1e-6  # step 3 through the snapshot
    (want,), (got,) = records(tmp_path / "one", "eval"), records(tmp_path / "two", "eval")
    for key in ("eval_loss", "eval_logps/chosen", "eval_rewards/margins"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key
    a, b = (load_weights(tmp_path / run / "final" / "adapter_model.safetensors") for run in ("one", "two"))
    assert any("lm_head" in k for k in a) and max_abs_diff(a, b) < 1e-5


def test_doctor_says_where_the_reference_comes_from(tiny_assets, tmp_path):
    """doctor's reference row, one per kind: precomputed (a full fine-tune's DPO), a frozen copy and its sync, LoRA's
    disabled adapter and its moving snapshot, none (simpo); no row for SFT or online RL at beta 0."""
    from llmtrain.config import Recipe
    from llmtrain.doctor import check_reference

    def row(**changes) -> str:
        data = _recipe_dict(tiny_assets, tmp_path)
        if changes.pop("lora", False):
            data["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
        data["preference"].update(changes)
        (found,) = check_reference(Recipe.model_validate(data))
        assert found[:2] == ("reference", "pass")
        return found[2]

    assert row().startswith("the starting weights' log-probabilities of every pair, computed once before training")
    assert row(reference="copy") == "a frozen copy of the starting weights (one more set of weights, in the estimate)"
    assert row(sync_reference={"every_steps": 64}).endswith(
        "mixed with the policy every 64 steps at alpha 0.6 (sync_reference, TR-DPO)")
    assert row(lora=True) == "the base model, the adapter disabled (no copy of the weights)"
    assert row(lora=True, sync_reference={"every_steps": 8, "alpha": 1}).startswith(
        "the base model (the adapter disabled) until step 8, then every 8 steps the adapter as it was then")
    assert row(loss="simpo") == "none: preference.loss=simpo is reference-free"
    sft = _recipe_dict(tiny_assets, tmp_path)
    sft.pop("preference")
    sft["data"]["format"] = "prompt"
    sft["rl"] = {"beta": 0.0, "rewards": [{"type": "answer_match"}]}
    assert check_reference(Recipe.model_validate(sft)) == []
    sft["rl"].update(algorithm="rloo", beta=0.05)  # a full fine-tune's RLOO under FSDP: sharded, gathered to sample
    launch = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}
    (found,) = check_reference(Recipe.model_validate(sft), launch)
    assert found[2].endswith("; under FSDP sharded like the policy, copied from its shards (nothing read again), "
                             "the LM head whole, its decoder gathered whole for each rollout (RLOO's KL runs there)")
    assert check_reference(Recipe.model_validate(sft))[0][2].endswith("in the estimate)")  # no launch: no layout
    sft["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}  # LoRA's moving reference in RLOO's rollout under FSDP
    sft["rl"]["sync_reference"] = {"every_steps": 4, "alpha": 1}
    (found,) = check_reference(Recipe.model_validate(sft), launch)
    assert found[2].endswith("; under FSDP its snapshot is also kept whole, to swap into the weights FSDP holds "
                             "gathered for each rollout (RLOO's KL runs there): the trained weights twice more, in the "
                             "estimate")
    assert "kept whole" not in check_reference(Recipe.model_validate(sft))[0][2]
