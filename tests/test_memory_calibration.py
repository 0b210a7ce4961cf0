"""The estimator's predictions for the configurations the GPU calibration runs (benchmarks/gpu_session.sh calibrate),
pinned: a change to the memory model that moves any of them fails here and must update the table in
docs/memory.md, where each prediction stands beside its measured peak on the H100.

The recipes are the ones the calibration writes: GSM8K as chat messages with max_seq_len 1024, Mistral-7B LoRA r16
(all linear layers) on a bf16 base, and a ~1B Llama (Mistral's config and tokenizer, hidden 2048, 16 layers) in
fp32 with bf16 autocast, both random init; token budgets 2k-32k, gradient checkpointing off/on, padded
micro-batches of 1-32 examples of up to 512 tokens with SDPA, and FSDP2 on one process.
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
    "cal-fsdp1-lora-4096": (("lora", 4096, False, 1, 1024, "auto", "fsdp"), (42.296, 46.526, 47.014)),
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
