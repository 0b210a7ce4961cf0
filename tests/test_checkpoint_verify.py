"""A checkpoint is verified before it is published: keys match, and LoRA B matrices are not all zero."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from llmtrain.checkpoint import verify_saved
from llmtrain.errors import LLMTrainError

LORA = {"m.q.lora_A.default.weight": torch.randn(2, 4), "m.q.lora_B.default.weight": torch.zeros(4, 2)}


def test_zero_lora_b_is_refused(tmp_path):
    save_file(LORA, str(tmp_path / "model.safetensors"))
    with pytest.raises(LLMTrainError, match="every LoRA B matrix is zero"):
        verify_saved(tmp_path, expected_keys=set(LORA), lora=True)


def test_trained_lora_passes_and_key_mismatch_fails(tmp_path):
    trained = {**LORA, "m.q.lora_B.default.weight": torch.full((4, 2), 1e-3)}
    save_file(trained, str(tmp_path / "model.safetensors"))
    verify_saved(tmp_path, expected_keys=set(trained), lora=True)
    with pytest.raises(LLMTrainError, match="saved keys do not match"):
        verify_saved(tmp_path, expected_keys=set(trained) | {"m.k.lora_A.default.weight"}, lora=True)


def test_full_model_may_store_tied_weights_once(tmp_path):
    save_file({"embed.weight": torch.ones(3, 2)}, str(tmp_path / "model.safetensors"))
    verify_saved(tmp_path, expected_keys={"embed.weight", "lm_head.weight"}, lora=False)
    with pytest.raises(LLMTrainError, match="saved keys do not match"):
        verify_saved(tmp_path, expected_keys={"other.weight"}, lora=False)
