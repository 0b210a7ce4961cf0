"""Resumable checkpoints: Accelerate's state plus an explicit TrainState, written atomically.

Layout: <output_dir>/checkpoints/step_000200/ holds the model (or only the LoRA weights), optimizer,
scheduler, the RNG state of every rank, `train_state.json` and the resolved `recipe.yaml`. A checkpoint
is written as `.tmp-step_000200` and renamed when every rank has finished, so a folder named
`step_*` is always complete; resume never reads a folder that is not.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from llmtrain.distributed import uses_fsdp
from llmtrain.errors import LLMTrainError


@dataclass
class TrainState:
    """Where training is. Saved with every checkpoint; resume continues from exactly here."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch
    micro_in_epoch: int = 0  # global micro-batches of the current epoch already trained on
    examples_per_micro: int = 0  # micro_batch_size x processes when saved: fixes the data order
    processes: int = 0  # processes of the run that saved it
    tokens_seen: int = 0  # input tokens (all ranks) processed so far
    trained_tokens_seen: int = 0  # tokens that carried loss so far
    micro_batch_tokens: int = 0  # token budget of a micro-batch (train.micro_batch_tokens); 0: by examples

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)

    def check_layout(self, *, examples_per_micro: int, accum: int, micro_batch_tokens: int, processes: int) -> None:
        """Resume may change the number of processes, as long as the data order stays the same.

        By examples, a global micro-batch is micro_batch_size x processes examples; keeping that product
        keeps every step's examples identical (2 processes x 2 resume as 1 process x 4). By tokens, the
        bins do not depend on the process count: the position (bins trained so far this epoch) carries
        over to any number of processes that divides it, and is converted here.
        """
        if self.micro_batch_tokens != micro_batch_tokens:
            raise LLMTrainError(
                f"the checkpoint was written with train.micro_batch_tokens={self.micro_batch_tokens or None}, this "
                f"run has {micro_batch_tokens or None}; the data order depends on it. Resume with the value it was "
                "written with."
            )
        if micro_batch_tokens:
            bins = self.micro_in_epoch * self.processes
            if bins % processes:
                raise LLMTrainError(
                    f"the checkpoint stopped after {bins} token bins of its epoch, which {processes} processes cannot "
                    f"split evenly; resume on a number of processes that divides {bins} (it was written by "
                    f"{self.processes})."
                )
            self.micro_in_epoch = bins // processes
        elif self.examples_per_micro != examples_per_micro:
            raise LLMTrainError(
                f"the checkpoint was written with micro_batch_size x processes = {self.examples_per_micro}, "
                f"this run has {examples_per_micro}. Set train.micro_batch_size so that the product is "
                f"{self.examples_per_micro} (e.g. {self.examples_per_micro} on 1 process) to resume it."
            )
        if self.micro_in_epoch % accum:
            raise LLMTrainError(
                f"the checkpoint stopped {self.micro_in_epoch} micro-batches into an epoch, which is not a whole "
                f"number of train.grad_accum_steps={accum} windows; resume with the grad_accum_steps it was "
                "written with."
            )


def _step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    found = []
    for d in ckpt_root.glob("step_*"):
        meta = d / "train_state.json"
        if d.is_dir() and meta.is_file():
            found.append((json.loads(meta.read_text())["step"], d))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = _step_dirs(output_dir / "checkpoints")
    return found[-1][1] if found else None


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """Map --resume auto|PATH to a complete checkpoint folder (None: auto found nothing)."""
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / "train_state.json").is_file():
        raise LLMTrainError(
            f"--resume {resume}: '{path}' is not a complete checkpoint (no train_state.json). "
            f"Use --resume auto, or one of the step_* folders under {output_dir / 'checkpoints'}."
        )
    return path


def lora_only_hooks(accelerator, trainable_names: set[str]) -> None:
    """Save only trainable weights (the adapter) for LoRA runs instead of the frozen 7B base every time.

    Under FSDP Accelerate saves the model through save_fsdp_model (every rank writes its shard of the
    whole model, frozen base included) and hands this hook no weights, so there it changes nothing.
    """

    def save_hook(models, weights, output_dir):
        for i in range(len(weights)):
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable_names}

    accelerator.register_save_state_pre_hook(save_hook)


FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # where Accelerate writes a sharded (DCP) model: one .distcp file per rank


def verify_saved(path: Path, *, model_keys: set[str], trainable: set[str] | None) -> None:
    """Check a checkpoint before it is published, by reading back what was written.

    Its weights must hold the model's keys (only the adapter's, `trainable`, for LoRA outside FSDP) and,
    for LoRA, the B matrices must not all be zero: an adapter saved as zeros is silently a no-op. A
    sharded (FSDP) checkpoint is read through its DCP metadata: every shard's bytes must be on disk, and
    the LoRA B matrices are loaded back from the shards in this one process.
    """
    weights, sharded = path / "model.safetensors", path / FSDP_MODEL_DIR
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            saved = set(f.keys())
            lora_b = {k: f.get_tensor(k) for k in saved if "lora_B" in k}
        expected = trainable or model_keys
    elif sharded.is_dir():
        saved, lora_b = _read_sharded(sharded, path, lora=trainable is not None)
        expected = model_keys  # FSDP saves the whole model, frozen base included, as shards
    else:
        raise LLMTrainError(f"checkpoint {path} failed verification: it holds no model weights "
                            f"(model.safetensors or {FSDP_MODEL_DIR}/). It was not published.")
    # Tied weights are stored once, so a full model may save fewer keys than its state dict has.
    if not saved or not saved <= expected or (trainable is not None and not trainable <= saved):
        raise LLMTrainError(f"checkpoint {path} failed verification: saved keys do not match the model "
                            f"({len(saved)} saved, {len(expected)} expected). It was not published.")
    if trainable is not None and not any(t.any() for t in lora_b.values()):
        raise LLMTrainError(f"checkpoint {path} failed verification: every LoRA B matrix is zero, so the adapter "
                            "would do nothing. It was not published; check train.lr and the LoRA settings.")


def _read_sharded(folder: Path, path: Path, *, lora: bool) -> tuple[set[str], dict]:
    """Keys of a DCP model checkpoint (Accelerate nests them under "model."), and its LoRA B matrices."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata()
    for item in meta.storage_data.values():
        shard = folder / item.relative_path
        if not shard.is_file() or shard.stat().st_size < item.offset + item.length:
            raise LLMTrainError(f"checkpoint {path} failed verification: shard {shard.name} is missing or "
                                "truncated. It was not published.")
    saved = {k.removeprefix("model.") for k in meta.state_dict_metadata}
    lora_b = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()
              if lora and "lora_B" in k}
    if lora_b:  # the whole tensors, assembled from every rank's shard, in this process alone
        loaded = {"model": {k.removeprefix("model."): t for k, t in lora_b.items()}}
        dcp.load(loaded, storage_reader=reader, no_dist=True)
        lora_b = loaded["model"]
    return saved, lora_b


def save_checkpoint(accelerator, *, output_dir: Path, state: TrainState, recipe_yaml: str, keep_last: int,
                    model_keys: set[str], trainable: set[str] | None) -> Path:
    root = output_dir / "checkpoints"
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's RNG and shards are on disk before the rename
    if accelerator.is_main_process:
        verify_saved(tmp, model_keys=model_keys, trainable=trainable)
        (tmp / "train_state.json").write_text(json.dumps(state.state_dict(), indent=1))
        (tmp / "recipe.yaml").write_text(recipe_yaml)
        if final.exists():  # only possible when resuming from an older step with --resume PATH
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in _step_dirs(root)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, *, trainable_names: set[str] | None) -> None:
    """Restore model, optimizer, scheduler, RNG and registered objects (TrainState) from `path`.

    For LoRA only the adapter was saved, so loading is non-strict; the saved keys are then checked
    against the trainable parameters so that a mismatch can never pass silently.
    """
    sharded, fsdp = (path / FSDP_MODEL_DIR).is_dir(), uses_fsdp(accelerator)
    if sharded and not fsdp:
        raise LLMTrainError(
            f"checkpoint {path} holds FSDP shards ({FSDP_MODEL_DIR}/) and this run does not use FSDP. Resume it "
            "under FSDP, on any number of processes (the shards are redistributed on load): accelerate launch "
            "--config_file accelerate_configs/fsdp.yaml [--num_processes N] -m llmtrain finetune RECIPE --resume "
            "..., keeping train.micro_batch_size x processes."
        )
    if fsdp and not sharded:
        raise LLMTrainError(
            f"checkpoint {path} was written without FSDP (model.safetensors) and this run uses FSDP. Resume it "
            "without FSDP (`llmtrain finetune` on one process, or a DDP launch config such as "
            "accelerate_configs/ddp.yaml, any number of processes), keeping train.micro_batch_size x processes."
        )
    if trainable_names is None:
        accelerator.load_state(str(path))
        return
    from safetensors import safe_open

    weights = path / "model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            saved = set(f.keys())
        if saved != trainable_names:
            raise LLMTrainError(
                f"checkpoint {path} does not match this run's trainable parameters "
                f"({len(saved)} saved, {len(trainable_names)} expected; e.g. missing "
                f"{sorted(trainable_names - saved)[:2]}). Resume with the recipe that wrote it ({path}/recipe.yaml)."
            )
    accelerator.load_state(str(path), strict=False)
