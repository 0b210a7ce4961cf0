"""The estimator's predictions for the configurations the GPU calibration runs (benchmarks/gpu_session.sh calibrate),
pinned: a change to the memory model that moves any of them fails here and must update the table in
docs/memory.md, where each prediction stands beside its measured peak on the H100.

The recipes are the ones the calibration writes: GSM8K as chat messages with max_seq_len 1024, Mistral-7B LoRA r16
(all linear layers) on a bf16 base, and a ~1B Llama (Mistral's config and tokenizer, hidden 2048, 16 layers) in
fp32 with bf16 autocast, both random init; token budgets 2k-32k, gradient checkpointing off/on, padded
micro-batches of 1-32 examples of up to 512 tokens with SDPA, and FSDP2 on one process.

H200_SMOKE pins the first GPU run's measured peaks (issue 35, one H200, `gpu_session.sh smoke`) beside the estimate:
each within 10% of what was measured, the GRPO run at its data's prompt lengths.
"""

from __future__ import annotations

import json

import pytest

from llmtrain.config import Recipe
from llmtrain.memory import estimate_for_recipe
from llmtrain.memory.params import PRESETS

GIB = 2**30
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=32000, head_dim=64)

# name: (model, budget or None, checkpointing, micro-batch, max_seq_len, attention, strategy)
#   -> predicted (allocated, reserved, peak) GiB
CALIBRATION = {
    "cal-lora-2048-ckptfalse": (("lora", 2048, False, 1, 1024, "auto", "single"), (28.085, 30.894, 31.382)),
    "cal-lora-8192-ckptfalse": (("lora", 8192, False, 1, 1024, "auto", "single"), (68.764, 75.64, 76.129)),
    "cal-lora-16384-ckpttrue": (("lora", 16384, True, 1, 1024, "auto", "single"), (22.985, 25.283, 25.772)),
    "cal-lora-32768-ckpttrue": (("lora", 32768, True, 1, 1024, "auto", "single"), (31.998, 35.198, 35.686)),
    "cal-full-2048-ckptfalse": (("full", 2048, False, 1, 1024, "auto", "single"), (19.005, 20.905, 21.393)),
    "cal-full-8192-ckptfalse": (("full", 8192, False, 1, 1024, "auto", "single"), (31.898, 35.088, 35.577)),
    "cal-full-16384-ckpttrue": (("full", 16384, True, 1, 1024, "auto", "single"), (18.919, 20.811, 21.299)),
    "cal-full-32768-ckpttrue": (("full", 32768, True, 1, 1024, "auto", "single"), (21.999, 24.199, 24.688)),
    "cal-full-mb1-sdpa": (("full", None, False, 1, 512, "sdpa", "single"), (16.458, 18.104, 18.592)),
    "cal-full-mb8-sdpa": (("full", None, False, 8, 512, "sdpa", "single"), (24.169, 26.586, 27.075)),
    "cal-full-mb32-sdpa": (("full", None, False, 32, 512, "sdpa", "single"), (49.669, 54.636, 55.124)),
    # 42.296 before issue 35: the adapters' inputs counted as a copy each, which FSDP's bf16 adapters do not make
    "cal-fsdp1-lora-4096": (("lora", 4096, False, 1, 1024, "auto", "fsdp"), (38.296, 42.126, 42.614)),
}

# The first GPU run (one H200, torch 2.11, transformers 5.17, peft 0.21; issue 35): benchmarks/gpu_session.sh smoke's
# recipes (recipe() there) and their summary.json max_memory_allocated, GiB.
# name: (the run as smoke_recipe builds it, measured, predicted before issue 35's fixes, predicted now)
GSM8K_PROMPT_P90 = 98  # GSM8K's train prompts through Mistral-7B-Instruct-v0.3's template: 90% have <= 98 tokens
H200_SMOKE = {
    "lora-varlen": ("lora", 41.75, 42.124, 42.124),
    "full-varlen-budget": ("full", 31.93, 31.898, 31.898),
    "fsdp1-lora": ("fsdp1", 37.92, 42.296, 38.296),  # adapters gathered in bf16 share their inputs
    "qlora-nf4": ("qlora", 8.13, 9.518, 8.518),  # peft's 4-bit layers skip the input cast under autocast
    "dpo-lora": ("dpo", 41.73, None, 42.124),  # was refused: a token budget with micro_batch_size at its default
    "grpo-lora": ("grpo", 48.45, 121.98, 52.286),  # the data's prompts (90th percentile) + 256; 16 x 1024 worst case
}


def calibration_recipe(tmp_path, model: str, budget, ckpt: bool, micro: int, seq: int, attn: str) -> Recipe:
    if model == "lora":
        name, dtype = "mistral-7b", "bfloat16"
    else:
        name, dtype = str(tmp_path / "llama-1b"), "float32"
        (tmp_path / "llama-1b").mkdir(exist_ok=True)
        (tmp_path / "llama-1b" / "config.json").write_text(json.dumps({**PRESETS["mistral-7b"], **LLAMA_1B}))
    return Recipe.model_validate({
        "model": {"name_or_path": name, "dtype": dtype, "random_init": True, "kernels": "none",
                  "gradient_checkpointing": ckpt, "attn_implementation": attn},
        "data": {"path": str(tmp_path / "gsm8k-messages.jsonl"), "format": "messages", "max_seq_len": seq},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0} if model == "lora" else None,
        "train": {"max_steps": 3, "micro_batch_size": micro, "micro_batch_tokens": budget, "lr": 1e-5,
                  "mixed_precision": "bf16"},
        "output_dir": str(tmp_path / "run"),
    })


def smoke_recipe(tmp_path, run: str) -> tuple[Recipe, str]:
    """A run of gpu_session.sh smoke, as its recipe() and overrides write it, and the launch's strategy."""
    model, budget = {"full": ("full", 8192), "qlora": ("full", 4096)}.get(run, ("lora", 4096))  # full: the 1B
    recipe = calibration_recipe(tmp_path, model, budget, False, 1, 1024, "auto").model_dump()
    recipe["train"]["max_steps"] = 6
    if run == "qlora":  # a random 1B saved in bf16, loaded and quantised
        recipe["model"].update(dtype="bfloat16", random_init=False, quantize="nf4")
    if run == "dpo":
        recipe["data"].update(format="preference", chat_template=True, max_seq_len=2048)
        recipe["preference"] = {"loss": "dpo"}
    if run == "grpo":
        recipe["data"].update(format="prompt", chat_template=True, max_seq_len=1024)
        recipe["train"].update(micro_batch_tokens=None, micro_batch_size=4, max_steps=3, seed=1)
        recipe["rl"] = {"num_generations": 4, "max_completion_tokens": 256, "merged_copy": "off",  # as measured
                        "rewards": [{"type": "format", "pattern": "[0-9][0-9]"}]}
    if run == "grpo-fsdp1":  # gpu_session.sh i40: 8 prompts x 8 completions, one step, its update in one pass
        recipe["data"].update(format="prompt", chat_template=True, max_seq_len=1024)
        recipe["train"].update(micro_batch_tokens=None, micro_batch_size=8, max_steps=1, seed=1)
        recipe["rl"] = {"num_generations": 8, "max_completion_tokens": 256, "merged_copy": "off",  # as measured
                        "rewards": [{"type": "format", "pattern": "[0-9][0-9]"}]}
    if run == "qlora":
        recipe["lora"] = {"r": 16, "alpha": 32, "dropout": 0.0}
    return Recipe.model_validate(recipe), "fsdp" if run in ("fsdp1", "grpo-fsdp1") else "single"


def predicted(tmp_path, name: str) -> tuple[float, float, float]:
    (model, budget, ckpt, micro, seq, attn, strategy), _ = CALIBRATION[name]
    est = estimate_for_recipe(calibration_recipe(tmp_path, model, budget, ckpt, micro, seq, attn), strategy=strategy)
    return tuple(round(b / GIB, 3) for b in (est.per_gpu_peak_allocated_bytes, est.per_gpu_peak_reserved_bytes,
                                             est.per_gpu_peak_bytes))


@pytest.mark.parametrize("name", sorted(CALIBRATION))
def test_calibration_predictions_are_pinned(tmp_path, monkeypatch, name):
    import llmtrain.memory.estimate as estimate_module

    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)  # torch >= 2.11, as on the H100
    assert predicted(tmp_path, name) == pytest.approx(CALIBRATION[name][1], abs=0.002), (
        "the estimate moved: update CALIBRATION here and the table in docs/memory.md")


@pytest.mark.parametrize("name", sorted(H200_SMOKE))
def test_the_first_gpu_runs_peaks_are_predicted_within_ten_percent(tmp_path, monkeypatch, name):
    import llmtrain.memory.estimate as estimate_module

    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)  # torch 2.11 on the H200
    run, measured, _, pinned = H200_SMOKE[name]
    recipe, strategy = smoke_recipe(tmp_path, run)
    lengths = [GSM8K_PROMPT_P90] * 10 if run == "grpo" else None
    est = estimate_for_recipe(recipe, strategy=strategy, prompt_lengths=lengths)
    allocated = round(est.per_gpu_peak_allocated_bytes / GIB, 3)
    assert allocated == pytest.approx(pinned, abs=0.002), "the estimate moved: update H200_SMOKE and docs/memory.md"
    assert abs(allocated / measured - 1) <= 0.10


@pytest.fixture(scope="module")
def gsm8k_prompt_lengths(tmp_path_factory) -> list[int]:
    """GSM8K's train prompts through Mistral-7B-Instruct-v0.3's template, tokenised as estimate-memory reads an RL
    recipe's prompts (where this machine has ../shared's data and tokenizer), in the file's order."""
    from pathlib import Path

    from llmtrain.config import load_recipe
    from llmtrain.memory.cli import rl_prompt_lengths

    shared = Path(__file__).resolve().parents[2] / "shared"
    mistral, gsm8k = shared / "models" / "mistral-7b-instruct-v0.3", shared / "data" / "gsm8k" / "train.jsonl"
    if not (mistral / "tokenizer.json").is_file() or not gsm8k.is_file():
        pytest.skip("no Mistral tokenizer or GSM8K in ../shared")
    tmp_path = tmp_path_factory.mktemp("gsm8k")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": json.loads(line)["question"]}) + "\n"
                            for line in gsm8k.read_text().splitlines()))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "model": {"name_or_path": str(mistral), "dtype": "bfloat16"},
        "data": {"path": str(rows), "format": "prompt", "chat_template": True, "max_seq_len": 1024,
                 "cache_dir": str(tmp_path / "cache")},
        "lora": {"r": 16}, "train": {"micro_batch_size": 4, "mixed_precision": "bf16", "seed": 1},
        "rl": {"num_generations": 4, "max_completion_tokens": 256, "rewards": [{"type": "format", "pattern": "x"}]}}))
    lengths, unread = rl_prompt_lengths(load_recipe(recipe, []))
    assert unread is None
    return lengths


def test_the_grpo_runs_prompts_are_gsm8k_through_mistrals_template(gsm8k_prompt_lengths):
    """GSM8K_PROMPT_P90 is read off the real data and tokenizer: the estimate's prompts where it is not given the
    run's micro-batches."""
    from llmtrain.memory.spec import rl_prompt_tokens

    assert len(gsm8k_prompt_lengths) == 7473
    assert rl_prompt_tokens(gsm8k_prompt_lengths, cap=1024)[0] == GSM8K_PROMPT_P90


# The H200's GRPO steps at the prompts they sampled (seed 1): measured max_memory_allocated, the estimate pinned, GiB.
# Both sampled with the adapters unmerged (before rl.merged_copy): their recipes say rl.merged_copy=off.
# At GSM8K's 90th percentile for every prompt (98 tokens) they were +7.9% (52.29) and +11.2% (140.68); the heaviest
# micro-batch of the prompts they drew has 240 tokens of 4 (60 a prompt) and 466 of 8 (59): -0.2% and +0.4%.
H200_GRPO_AT_THEIR_PROMPTS = {
    "grpo": (48.45, 48.346),  # the first call's smoke: 3 steps of 4 prompts x 4 completions x 256 tokens
    "grpo-fsdp1": (126.46, 126.940),  # the second call's i40: 1 step of 8 x 8 x 256 under FSDP2 on one process
}


@pytest.mark.parametrize("run", sorted(H200_GRPO_AT_THEIR_PROMPTS))
def test_the_h200_grpo_steps_are_predicted_within_one_percent_at_the_prompts_they_drew(
        tmp_path, monkeypatch, gsm8k_prompt_lengths, run):
    import llmtrain.memory.estimate as estimate_module

    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)  # torch 2.11 on the H200
    measured, pinned = H200_GRPO_AT_THEIR_PROMPTS[run]
    recipe, strategy = smoke_recipe(tmp_path, run)
    est = estimate_for_recipe(recipe, strategy=strategy, prompt_lengths=gsm8k_prompt_lengths)
    allocated = round(est.per_gpu_peak_allocated_bytes / GIB, 3)
    assert allocated == pytest.approx(pinned, abs=0.002), "the estimate moved: update the table and docs/memory.md"
    assert abs(allocated / measured - 1) <= 0.01


# The sixth GPU call (one H200, 2026-12-04, `gpu_session.sh i52`): the modes first run on CUDA, Mistral-7B LoRA r16
# on a bf16 base, 3 steps on GSM8K (data.max_seq_len 1024, seed 1), summary.json max_memory_allocated, GiB. The
# estimate takes every sequence at data.max_seq_len (68.76 and 67.55 GiB: the worst case); these pin it at the
# heaviest micro-batch the runs drew (the same data, tokenizer and seed on the CPU: KTO's 1,546 completion tokens of 8
# and as many in their KL sequences, 193 a sequence; the reward model's 1,572 of 4 pairs, 197 a sequence).
# name: ((data's keys, (the mode's section, its keys)), micro_batch_size, tokens a sequence, measured, pinned)
H200_MODES = {
    "kto-lora": (({"format": "unpaired"}, ("kto", {"beta": 0.1})), 8, 193, 24.53, 24.628),
    "reward-lora": (({"format": "preference"}, ("reward_model", {"center_rewards_coefficient": 0.01})), 4, 197,
                    23.92, 24.137),
}


@pytest.mark.parametrize("name", sorted(H200_MODES))
def test_the_h200_kto_and_reward_model_steps_are_predicted_within_two_percent_at_their_lengths(
        tmp_path, monkeypatch, name):
    import llmtrain.memory.estimate as estimate_module

    monkeypatch.setattr(estimate_module, "varlen_repeats_kv", lambda: False)  # torch 2.11 on the H200
    (data, *sections), micro, seq, measured, pinned = H200_MODES[name]
    recipe = calibration_recipe(tmp_path, "lora", None, False, micro, seq, "auto").model_dump()
    recipe["data"].update(chat_template=True, **data)
    recipe = Recipe.model_validate({**recipe, **dict(sections)})
    allocated = round(estimate_for_recipe(recipe, strategy="single").per_gpu_peak_allocated_bytes / GIB, 3)
    assert allocated == pytest.approx(pinned, abs=0.002), "the estimate moved: update H200_MODES and docs/memory.md"
    assert abs(allocated / measured - 1) <= 0.02
