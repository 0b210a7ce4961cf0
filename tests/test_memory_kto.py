"""estimate-memory for KTO: the micro-batch's no-grad passes (its KL sequences and the reference) are phases of their
own, each the eval's forward of as many sequences with the window's gradients so far held; a full fine-tune holds one
more whole copy of the weights (its frozen reference; under FSDP sharded like the policy, its head whole). Numbers
against the same estimate without them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmtrain.config import Recipe
from llmtrain.memory.estimate import estimate
from llmtrain.memory.params import load_model_shape
from llmtrain.memory.spec import spec_from_recipe

MISTRAL = load_model_shape("mistral-7b")


def kto_recipe(*, lora: bool, accum: int = 1) -> Recipe:
    return Recipe.model_validate({
        "model": {"name_or_path": "mistral-7b", "dtype": "bfloat16" if lora else "float32", "kernels": "none",
                  "gradient_checkpointing": True},
        "data": {"path": "unread.jsonl", "format": "unpaired", "max_seq_len": 1024},
        "kto": {"beta": 0.1},
        **({"lora": {"r": 16, "alpha": 32, "dropout": 0.0}} if lora else {}),
        "train": {"micro_batch_size": 4, "grad_accum_steps": accum, "mixed_precision": "bf16"},
        "output_dir": "unwritten"})


@pytest.mark.parametrize("accum", [1, 4])
def test_the_no_grad_passes_are_the_evals_forward_of_the_micro_batch_with_its_gradients(accum):
    spec = spec_from_recipe(kto_recipe(lora=True, accum=accum))
    assert spec.no_grad_forwards and not spec.frozen_reference and spec.micro_batch == 4
    est = estimate(MISTRAL, spec)
    # The same run evaluated in micro-batches of 4, without the no-grad passes: its eval phases are theirs, less the
    # gradients the window holds between micro-batches (the whole LoRA gradient under accumulation, none without).
    as_eval = estimate(MISTRAL, replace(spec, no_grad_forwards=False, eval_micro_batch=4))
    held = est.phase_parts["no_grad_forward"].get("gradients", 0)
    assert held == (0 if accum == 1 else est.phase_parts["optimizer_step"]["gradients"])
    for ours, theirs in (("no_grad_forward", "eval_forward"), ("no_grad_loss", "eval_loss")):
        assert est.phases[ours] == as_eval.phases[theirs] + held
    # Without a graph they stay below the training forward and backward: the peak is where it was.
    plain = estimate(MISTRAL, replace(spec, no_grad_forwards=False))
    assert est.peak_phase == plain.peak_phase and est.per_gpu_peak_bytes == plain.per_gpu_peak_bytes
    assert max(est.phases["no_grad_forward"], est.phases["no_grad_loss"]) < est.phases[est.peak_phase]


def test_a_full_fine_tune_holds_its_frozen_reference_whole_in_the_storage_dtype():
    spec = spec_from_recipe(kto_recipe(lora=False))
    assert spec.frozen_reference and spec.method == "full"
    est = estimate(MISTRAL, spec)
    without = estimate(MISTRAL, replace(spec, frozen_reference=False))
    copy = MISTRAL.params_total * 4  # fp32 storage: the copy of 7.25e9 weights, 27 GiB
    for phase, parts in est.phase_parts.items():
        assert parts["weights"] == without.phase_parts[phase]["weights"] + copy, phase
    assert est.per_gpu_peak_allocated_bytes == without.per_gpu_peak_allocated_bytes + copy
    # a LoRA run's reference is its base with the adapter off: nothing more
    assert not spec_from_recipe(kto_recipe(lora=True)).frozen_reference


def test_under_fsdp_the_reference_is_sharded_like_the_policy_with_its_head_whole():
    """loop/phases.build_reference: under FSDP the reference's decoder is sharded over the GPUs as the policy's is, and
    its LM head is whole on every one (fsdp.shard_frozen)."""
    spec = replace(spec_from_recipe(kto_recipe(lora=False)), strategy="fsdp", num_gpus=8)
    est = estimate(MISTRAL, spec)
    without = estimate(MISTRAL, replace(spec, frozen_reference=False))
    head = MISTRAL.vocab * MISTRAL.hidden * 4  # untied, fp32 storage
    sharded = (MISTRAL.params_total * 4 - head) // 8 + head
    assert est.phase_parts["optimizer_step"]["weights"] == without.phase_parts["optimizer_step"]["weights"] + sharded
    assert sharded < MISTRAL.params_total * 4 / 6  # 3.6 GiB of the whole copy's 27


def test_under_fsdp_x_tp_the_reference_is_sharded_over_every_gpu_of_the_mesh():
    """Under FSDP x TP (4 shards x 2 TP) the reference is not split by TP: fsdp.shard_frozen spreads its decoder's
    shards over the TP pair too (fsdp._frozen_mesh), 1/8 a GPU as under plain FSDP on 8, its head whole; the
    policy's own weights are its TP slice's 1/4 shard."""
    spec = replace(spec_from_recipe(kto_recipe(lora=False)), strategy="fsdp", num_gpus=8, tp=2)
    est = estimate(MISTRAL, spec)
    without = estimate(MISTRAL, replace(spec, frozen_reference=False))
    head = MISTRAL.vocab * MISTRAL.hidden * 4
    sharded = -(-(MISTRAL.params_total * 4 - head) // 8) + head  # as on 8 FSDP shards (the test above)
    assert est.phase_parts["optimizer_step"]["weights"] - without.phase_parts["optimizer_step"]["weights"] == \
        pytest.approx(sharded, abs=8)


@pytest.mark.parametrize("budget", [False, True], ids=["examples", "tokens"])
def test_fit_and_the_longest_context_keep_two_examples_a_micro_batch(budget):
    """KTO's KL estimate pairs each prompt with another example's completion, so a micro-batch of one example is
    refused (kto.loss_type kto): `--fit` never proposes one (on 17 GiB it had proposed train.micro_batch_size=1, which
    the proposed command then refused), nor a token budget below two sequences of data.max_seq_len, with or without
    a global batch to keep; the longest context is that of each of two sequences a micro-batch."""
    from llmtrain.memory.fit import at_context, fit, least_micro_batch, longest_context

    recipe = kto_recipe(lora=True, accum=8)
    if budget:
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(
            update={"micro_batch_size": 1, "micro_batch_tokens": 4096})})
    spec = spec_from_recipe(recipe, gpu_memory_gib=17)
    assert spec.min_examples == 2 and least_micro_batch(spec) == (2048 if budget else 2)
    for global_batch in (None, 32 if not budget else 4096 * 8):
        result = fit(MISTRAL, spec, global_batch=global_batch)
        assert result.candidates
        for c in result.candidates:
            assert (c.spec.micro_batch_tokens >= 2048) if budget else (c.spec.micro_batch >= 2), c.spec
    one = replace(spec, min_examples=1)  # what a mode of single examples may take: 1 (the test can fail)
    if not budget:
        assert min(c.spec.micro_batch for c in fit(MISTRAL, one).candidates) == 1
    assert at_context(spec, 8192).micro_batch_tokens == 16384 and at_context(spec, 8192).seq_len == 8192
    card = dict(gpu_memory_gib=80)  # (on 17 GiB not 1,024 tokens fit beside the weights)
    longest, alone = longest_context(MISTRAL, replace(spec, **card)), longest_context(MISTRAL, replace(one, **card))
    assert longest.spec.micro_batch_tokens == 2 * longest.spec.seq_len
    assert longest.spec.seq_len < alone.spec.seq_len  # two sequences of it must fit, not one
    apo = recipe.model_copy(update={"kto": recipe.kto.model_copy(update={"loss_type": "apo_zero_unpaired"})})
    assert spec_from_recipe(apo).min_examples == 1  # no KL term: one example a micro-batch is fine
