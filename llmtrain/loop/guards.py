"""Guards against divergence: a step whose gradient is not finite, and weights that are not finite.

The training loop skips the update of a step whose global gradient norm is NaN or infinite (every rank sees
the same norm), stops once more such steps came than train.max_bad_steps allows, and never publishes a
checkpoint or final/ holding a NaN or infinite weight.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.errors import TrainingDiverged
from llmtrain.parallel.collectives import global_sum


def diverged(accelerator, out: Path, step: int, grad_norm: float, tc) -> None:
    from llmtrain.run.checkpoint import step_dirs

    good = (step_dirs(out / "checkpoints") or [None])[-1]
    raise TrainingDiverged(
        f"step {step}: the gradient norm is {grad_norm} (the loss or a gradient is not finite); the weights were not "
        f"updated and the run stopped. "
        + (f"The last checkpoint, {good}, is intact: " if good else "No checkpoint was written yet: ")
        + f"lower train.lr (now {tc.lr:g})"
        + ("" if tc.max_grad_norm else " or set train.max_grad_norm (now null)")
        + (" and continue with --resume auto" if good else "")
        + f", or allow skipping such steps with train.max_bad_steps=N (now {tc.max_bad_steps})."
    )


def adapter_moved(accelerator, model) -> bool:
    """Whether any LoRA B matrix of the model in memory is nonzero, over every process (their FSDP shards or pipeline
    stages): a checkpoint whose B matrices are all zero is then a broken save, not an adapter that has not moved yet
    (every gradient so far exactly 0, as online RL's while no group's rewards have varied)."""
    with torch.no_grad():
        flags = [(p.to_local() if hasattr(p, "to_local") else p).ne(0).any()
                 for name, p in model.named_parameters() if "lora_B" in name]
        moved = int(torch.stack(flags).any()) if flags else 0
    (moved,) = global_sum(accelerator, moved)
    return bool(moved)


def check_finite_weights(accelerator, model, step: int) -> None:
    """No checkpoint or export is ever published with a NaN or infinite weight (an update can overflow)."""
    # Trained weights only: a frozen one never changes, and a 4-bit base's packed bytes (stored as bf16 so that FSDP
    # can shard them) are not numbers of that dtype at all.
    with torch.no_grad():
        flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
                 for p in model.parameters() if p.requires_grad]
        bad = int((~torch.stack(flags)).sum())  # p.to_local(): an FSDP shard; one host read for all
    (bad,) = global_sum(accelerator, bad)
    if bad:
        raise TrainingDiverged(f"step {step}: {int(bad)} weight tensors hold NaN or infinite values after the update; "
                               "nothing was saved and the run stopped. Lower train.lr, set train.max_grad_norm, and "
                               "continue from the last checkpoint with --resume auto.")
