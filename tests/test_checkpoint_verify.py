"""A checkpoint is verified before it is published, by reading back what was written: keys match, every
shard is on disk, and LoRA B matrices are not all zero. Both formats: model.safetensors (one process, DDP)
and FSDP's sharded DCP folder (here written by one process; tests/test_fsdp.py writes it with two)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from llmtrain.errors import LLMTrainError
from llmtrain.run.checkpoint import FSDP_MODEL_DIR, verify_saved

BASE = {"m.q.base_layer.weight": torch.randn(4, 4)}
LORA = {"m.q.lora_A.default.weight": torch.randn(2, 4), "m.q.lora_B.default.weight": torch.zeros(4, 2)}
TRAINED = {**LORA, "m.q.lora_B.default.weight": torch.full((4, 2), 1e-3)}


def _sharded(path, state_dict: dict) -> None:
    """A sharded checkpoint as Accelerate's save_fsdp_model writes it: {"model": state_dict} through DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state_dict}, storage_writer=dcp.FileSystemWriter(str(path / FSDP_MODEL_DIR)), no_dist=True)


def test_zero_lora_b_is_refused(tmp_path):
    save_file(LORA, str(tmp_path / "model.safetensors"))
    with pytest.raises(LLMTrainError, match="every LoRA B matrix is zero"):
        verify_saved(tmp_path, model_keys={*BASE, *LORA}, trainable=set(LORA))


def test_trained_lora_passes_and_key_mismatch_fails(tmp_path):
    save_file(TRAINED, str(tmp_path / "model.safetensors"))
    verify_saved(tmp_path, model_keys={*BASE, *TRAINED}, trainable=set(TRAINED))
    with pytest.raises(LLMTrainError, match="saved keys do not match"):
        verify_saved(tmp_path, model_keys={*BASE, *TRAINED, "m.k.lora_A.default.weight"},
                     trainable=set(TRAINED) | {"m.k.lora_A.default.weight"})


def test_full_model_may_store_tied_weights_once(tmp_path):
    save_file({"embed.weight": torch.ones(3, 2)}, str(tmp_path / "model.safetensors"))
    verify_saved(tmp_path, model_keys={"embed.weight", "lm_head.weight"}, trainable=None)
    with pytest.raises(LLMTrainError, match="saved keys do not match"):
        verify_saved(tmp_path, model_keys={"other.weight"}, trainable=None)


def test_no_weights_at_all_is_refused(tmp_path):
    with pytest.raises(LLMTrainError, match="holds no model weights"):
        verify_saved(tmp_path, model_keys={"embed.weight"}, trainable=None)


def test_sharded_lora_reads_b_back_from_the_shards(tmp_path):
    """Under FSDP the whole model is saved (frozen base too); B is loaded back from disk and checked."""
    _sharded(tmp_path / "zero", {**BASE, **LORA})
    with pytest.raises(LLMTrainError, match="every LoRA B matrix is zero"):
        verify_saved(tmp_path / "zero", model_keys={*BASE, *LORA}, trainable=set(LORA))
    # an adapter that has not moved (every gradient so far 0, the model in memory's B zero too) is saved as it is;
    # the same zeros where the model in memory has moved are a broken save
    verify_saved(tmp_path / "zero", model_keys={*BASE, *LORA}, trainable=set(LORA), adapter_moved=False)
    with pytest.raises(LLMTrainError, match="where the adapter in memory has moved"):
        verify_saved(tmp_path / "zero", model_keys={*BASE, *LORA}, trainable=set(LORA), adapter_moved=True)
    _sharded(tmp_path / "ok", {**BASE, **TRAINED})
    verify_saved(tmp_path / "ok", model_keys={*BASE, *TRAINED}, trainable=set(TRAINED))
    with pytest.raises(LLMTrainError, match="saved keys do not match"):  # an adapter the model does not have
        verify_saved(tmp_path / "ok", model_keys={*BASE, *TRAINED, "m.k.lora_B.default.weight"},
                     trainable={*TRAINED, "m.k.lora_B.default.weight"})


def test_truncated_shard_is_refused(tmp_path):
    _sharded(tmp_path, {**BASE, **TRAINED})
    verify_saved(tmp_path, model_keys={*BASE, *TRAINED}, trainable=None)
    shard = next((tmp_path / FSDP_MODEL_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # as if the disk filled up mid-save
    with pytest.raises(LLMTrainError, match="missing or truncated"):
        verify_saved(tmp_path, model_keys={*BASE, *TRAINED}, trainable=None)


def test_the_only_checkpoint_damaged_is_said_without_a_checkpoint_before_it(tmp_path):
    """With one checkpoint, damaged: no "skipping it for the one before" (there is none) and no "--resume auto to
    continue from the newest intact checkpoint" (there is none either); start again instead (audit 11)."""
    from llmtrain.run.checkpoint import resolve_resume, write_manifest

    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text('{"step": 2}')
    (step / "optimizer.bin").write_bytes(b"x" * 100)
    write_manifest(step, step=2)
    (step / "optimizer.bin").write_bytes(b"y" * 100)  # the same size, other bytes
    warned = []
    with pytest.raises(LLMTrainError, match="every checkpoint under") as auto:
        resolve_resume("auto", tmp_path, warn=warned.append)
    assert warned == [] and "Start again with --overwrite" in str(auto.value)
    with pytest.raises(LLMTrainError) as named:
        resolve_resume(str(step), tmp_path, warn=warned.append)
    said = str(named.value)
    assert "is damaged (optimizer.bin does not match its checksum" in said and "--resume auto" not in said
    assert "It is the only checkpoint under" in said and "--overwrite" in said
