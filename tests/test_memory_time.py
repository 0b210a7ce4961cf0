"""The estimate's step time counts the no-grad forwards a step runs beside its forward and backward (a reference, KTO's
KL sequences, online RL's log-probabilities a round, a distillation teacher, learned rewards), which MFU leaves out.
benchmarks/no_grad_forwards.py measures the same ratios on real runs. Numbers by hand."""

from __future__ import annotations

import pytest

from llmtrain.config import Recipe
from llmtrain.memory import traffic_run
from llmtrain.memory.comms import (
    DEFAULT_MFU,
    H100_TFLOPS,
    Network,
    forward_flops,
    no_grad_flops,
    recompute_flops,
    step_flops,
    step_traffic,
)
from llmtrain.memory.params import RewardModel, load_model_shape, score_head_shape
from llmtrain.memory.spec import TrainSpec, spec_from_recipe

MISTRAL = load_model_shape("mistral-7b")
SMALL = load_model_shape("llama-3.2-3b")
RATE = H100_TFLOPS * 1e12 * DEFAULT_MFU


def recipe(**sections) -> Recipe:
    base = {"model": {"name_or_path": "mistral-7b", "dtype": "bfloat16", "kernels": "none"},
            "data": {"path": "unread.jsonl", "format": "messages", "max_seq_len": 1024},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            "train": {"micro_batch_size": 2, "mixed_precision": "bf16"},
            "output_dir": "unwritten"}
    for name, values in sections.items():
        base[name] = None if values is None else {**base.get(name, {}), **values}
    return Recipe.model_validate(base)


PAIRS = dict(data={"format": "preference"}, preference={"loss": "dpo"})
UNPAIRED = dict(data={"format": "unpaired"}, kto={"loss_type": "kto"})
RL = dict(data={"format": "prompt"}, train={"micro_batch_size": 2},
          rl={"num_generations": 4, "max_completion_tokens": 256, "rewards": [{"type": "format", "pattern": "x"}]})


def rl(**keys) -> Recipe:
    return recipe(**{**RL, "rl": {**RL["rl"], **keys}})


@pytest.mark.parametrize(("made", "passes"), [
    (recipe(), 0.0),  # supervised: none
    (recipe(**PAIRS), 1.0),  # LoRA's auto reference: the adapter disabled before each micro-batch
    (recipe(**PAIRS, lora=None), 0.0),  # a full fine-tune's auto reference: precomputed once before training
    (recipe(data=PAIRS["data"], preference={"loss": "dpo", "reference": "precomputed"}), 0.0),
    (recipe(data=PAIRS["data"], preference={"loss": "simpo"}), 0.0),  # no reference
    (recipe(**UNPAIRED), 3.0),  # the reference, and the KL sequences by the policy and the reference
    (recipe(data=UNPAIRED["data"], kto={"loss_type": "apo_zero_unpaired"}), 1.0),
    (rl(), 0.0),  # GRPO at TRL's beta 0, sampling every step
    (rl(beta=0.04), 1.0),  # the reference in every update's loss
    (rl(num_iterations=4), 0.25),  # the sampling policy's log-probabilities once a round of 4
    (rl(beta=0.04, num_iterations=2), 1.0),  # the policy's and the reference's once a round of 2 (the rollout's)
    # LoRA's moving reference stays in each update: 1 + 0.5
    (rl(beta=0.04, num_iterations=2, sync_reference={"every_steps": 2, "alpha": 1.0}), 1.5),
    (rl(sampler_correction="sequence_mask"), 1.0),  # the policy's log-probabilities each rollout, for the ratios
    (rl(algorithm="rloo"), 2.0),  # TRL's beta 0.05: the policy's and the reference's, for the reward's KL
    (rl(algorithm="rloo", num_iterations=2), 1.0),  # the same two, once a round of 2
    (rl(algorithm="rloo", beta=0.0, num_iterations=2), 0.5),  # the policy's alone
    (rl(algorithm="rloo", beta=0.0), 0.0),
])
def test_each_mode_counts_the_no_grad_passes_its_objective_runs(made, passes):
    spec = spec_from_recipe(made)
    assert spec.extra_forwards == pytest.approx(passes)
    assert bool(spec.extra_forwards_what) == bool(passes)


def test_a_forward_is_a_third_of_a_full_fine_tunes_model_flops_and_priced_at_the_rate_recompute_implies():
    """A forward is 2 FLOPs a matrix parameter a token and attention's 2 L; a full fine-tune's step 6 and 6 L
    (exactly 3 forwards). At the stated MFU the device also runs what the step recomputes (the loss chunks' head, and
    with gradient checkpointing the layers' forward), so a forward outside the step costs its FLOPs over
    MFU x (step + recompute) / step: by hand, for one reference pass of a LoRA step with and without checkpointing."""
    spec = TrainSpec(method="full", micro_batch=2, seq_len=1024, grad_accum_steps=2)
    assert 3 * forward_flops(MISTRAL, spec) == pytest.approx(step_flops(MISTRAL, spec, 1.0))
    tokens = 2 * 1024 * 2
    head = 2.0 * tokens * MISTRAL.head_outputs * MISTRAL.hidden
    for checkpointing in (False, True):
        lora = TrainSpec(method="lora", micro_batch=2, seq_len=1024, grad_accum_steps=2, extra_forwards=1.0,
                         gradient_checkpointing=checkpointing)
        forward = forward_flops(MISTRAL, lora)
        step = step_flops(MISTRAL, lora, 0.0)
        recompute = head + (forward - head if checkpointing else 0.0)
        assert recompute_flops(MISTRAL, lora) == pytest.approx(recompute)
        t = step_traffic(MISTRAL, lora)
        assert t.forwards_s == pytest.approx(forward / (RATE * (step + recompute) / step))
        assert t.compute_s == pytest.approx(step / RATE + t.forwards_s)
        assert t.to_dict()["no_grad_forwards_s"] == t.forwards_s
    # checkpointing makes a reference pass a smaller share of the step: 1/3 of a LoRA step's hardware FLOPs plus
    # the head's recompute without, 1/4 with (the 7B head is small beside the layers)
    plain, checkpointed = (step_traffic(MISTRAL, TrainSpec(method="lora", micro_batch=2, seq_len=1024,
                                                          extra_forwards=1.0, gradient_checkpointing=c))
                           for c in (False, True))
    assert plain.forwards_s / (plain.compute_s - plain.forwards_s) == pytest.approx(0.5 / 1.02, rel=0.02)
    assert checkpointed.forwards_s / (checkpointed.compute_s - checkpointed.forwards_s) == pytest.approx(1 / 3,
                                                                                                         rel=0.02)


def test_a_teachers_forward_is_of_its_own_shape_and_learned_rewards_score_once_a_round():
    """Distillation: the teacher's forward over every sequence of the step, its own layers and head. A learned
    reward: its model (under its one-output score head) over the completions once a round, 1 / num_iterations a
    step. Neither counts a policy pass (extra_forwards 0)."""
    base = TrainSpec(method="lora", micro_batch=4, seq_len=1024)
    assert no_grad_flops(MISTRAL, base) == 0.0
    taught = base.but(teacher=SMALL)
    assert no_grad_flops(MISTRAL, taught) == pytest.approx(forward_flops(SMALL, base))
    assert forward_flops(SMALL, base) < forward_flops(MISTRAL, base) / 2
    judge = RewardModel("judge", score_head_shape(SMALL), "bfloat16", 0, 8)
    unread = RewardModel("gone", None, "bfloat16", 0, 8)
    scored = base.but(reward_models=(judge, unread), num_generations=4, max_completion_tokens=256, prompt_tokens=768)
    assert no_grad_flops(MISTRAL, scored) == pytest.approx(forward_flops(score_head_shape(SMALL), scored))
    rounds = scored.but(num_iterations=4)
    assert no_grad_flops(MISTRAL, rounds) == pytest.approx(no_grad_flops(MISTRAL, scored) / 4)
    t = step_traffic(MISTRAL, taught)
    assert t.forwards_s > 0 and "teacher" in t.forwards_what


def test_a_recipes_reference_adds_its_forward_to_the_step_on_every_layout():
    """The same DPO recipe with its reference run each step (adapter) and precomputed: the step's compute differs by
    exactly the forwards' seconds, on one GPU, under FSDP, and on a pipeline of 2 stages (the pass runs through the
    stages: the pacing stage's share)."""
    def pair(reference: str, **keys) -> TrainSpec:
        return spec_from_recipe(recipe(data=PAIRS["data"], preference={"loss": "dpo", "reference": reference},
                                       **keys), **{k: v for k, v in LAYOUTS[layout].items()})

    piped = dict(parallel={"pipeline_parallel": 2},
                 train={"micro_batch_size": 1, "micro_batch_tokens": 2048, "grad_accum_steps": 4})
    LAYOUTS = {"single": {}, "fsdp": dict(strategy="fsdp", num_gpus=2), "pipeline": dict(strategy="ddp", num_gpus=2)}
    ratios = {}
    for layout in LAYOUTS:
        keys = piped if layout == "pipeline" else {}
        with_ref, without = (traffic_run(MISTRAL, pair(r, **keys)) for r in ("adapter", "precomputed"))
        assert without.forwards_s == 0.0 and with_ref.forwards_s > 0
        assert with_ref.compute_s - without.compute_s == pytest.approx(with_ref.forwards_s)
        ratios[layout] = with_ref.compute_s / without.compute_s
    assert ratios["single"] == pytest.approx(1.5, rel=0.03)  # LoRA, no checkpointing: 2 / 4 of the model FLOPs
    assert ratios["fsdp"] == pytest.approx(ratios["single"])
    assert ratios["pipeline"] == pytest.approx(ratios["single"], rel=0.05)


def test_estimate_memory_says_what_the_forwards_add(capsys):
    from typer.testing import CliRunner

    from llmtrain.cli import app

    result = CliRunner().invoke(app, ["estimate-memory", "recipes/mistral7b-kto.yaml"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("no-grad forwards:"))
    assert "the reference's over each micro-batch; 2 x the KL sequences'" in line
    sft = CliRunner().invoke(app, ["estimate-memory", "recipes/mistral7b-lora.yaml"], env={"COLUMNS": "200"})
    assert "no-grad forwards" not in sft.output


def test_a_pipeline_stage_without_the_head_prices_its_forwards_by_its_layers():
    """A stage's forwards are its layers' (the last stage's with the head), each at its own stage's rate: the two
    stages' seconds add up to one GPU's for the whole model (within the rates' difference), the last's the larger."""
    from llmtrain.memory.pipeline import as_trained, stage_traffic, stages_of

    spec = as_trained(spec_from_recipe(recipe(data=PAIRS["data"], preference={"loss": "dpo", "reference": "adapter"},
                                              parallel={"pipeline_parallel": 2},
                                              train={"micro_batch_size": 1, "micro_batch_tokens": 2048,
                                                     "grad_accum_steps": 4}),
                                       strategy="ddp", num_gpus=2))
    stages = [stage_traffic(MISTRAL, spec, s, Network()) for s in stages_of(MISTRAL, spec)]
    assert len(stages) == 2
    first, last = stages
    assert last.forwards_s > first.forwards_s > 0  # the head's forward
    whole = step_traffic(MISTRAL, spec.but(pipeline_parallel=1, strategy="single", num_gpus=1))
    assert first.forwards_s + last.forwards_s == pytest.approx(whole.forwards_s, rel=0.03)


def test_fit_scores_a_step_with_its_forwards():
    """--fit's throughput score counts a step's no-grad forwards as work per token (2 units each, in forwards of the
    trained model), so checkpointing costs a DPO run with its adapter reference less of its speed: LoRA 4 units, +2
    the reference, +2 the recompute: 6 against 8, not 4 against 6."""
    from llmtrain.memory.fit import throughput_score

    spec = spec_from_recipe(recipe(**PAIRS))
    precomputed = spec_from_recipe(recipe(data=PAIRS["data"], preference={"loss": "dpo", "reference": "precomputed"}))
    util = spec.gpu_tokens / (spec.gpu_tokens + 256)
    assert throughput_score(precomputed, MISTRAL) == pytest.approx(util / 4)
    assert throughput_score(spec, MISTRAL) == pytest.approx(util / 6)
    assert throughput_score(spec.but(gradient_checkpointing=True), MISTRAL) == pytest.approx(util / 8)
    assert throughput_score(spec) == pytest.approx(util / 4)  # without the shape: the step's own work only
    # a teacher's forward in the trained model's: a 3B teacher of a 7B student, 2 x its share of the FLOPs a token
    sft = spec_from_recipe(recipe())
    share = forward_flops(SMALL, sft) / forward_flops(MISTRAL, sft)
    assert 0.3 < share < 0.6
    util = sft.gpu_tokens / (sft.gpu_tokens + 256)
    assert throughput_score(sft.but(teacher=SMALL), MISTRAL) == pytest.approx(util / (4 + 2 * share))
