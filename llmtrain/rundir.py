"""The run folder: refuse to clobber what is there, and find the checkpoint to resume from."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmtrain.checkpoint import resolve_resume
from llmtrain.errors import LLMTrainError


def prepare_output_dir(accelerator, out: Path, *, resume: str | None, overwrite: bool) -> Path | None:
    """Refuse to clobber an existing run; return the checkpoint to resume from, if any."""
    ckpt = resolve_resume(resume, out) if resume else None
    occupied = out.exists() and any(out.iterdir())
    if occupied and not resume and not overwrite:
        raise LLMTrainError(
            f"output_dir '{out}' already exists and is not empty. Continue it with --resume auto, "
            f"delete and start again with --overwrite, or set output_dir=<new path>."
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if occupied and overwrite and not resume:
            shutil.rmtree(out)
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        for tmp in (out / "checkpoints").glob(".tmp-*"):  # left by a run killed mid-save: never complete
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    return ckpt
