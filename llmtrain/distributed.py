"""Everything distributed lives here: building the Accelerator and reducing across processes.

Code elsewhere asks the Accelerator (`num_processes`, `process_index`, `is_main_process`) and never
reads RANK or WORLD_SIZE itself.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from llmtrain.config import Recipe


def build_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    # The recipe is the source of truth for precision; passing it explicitly overrides the launch config.
    accelerator = Accelerator(
        # Without an accelerator, processes started by torchrun (`accelerate launch` with a multi-process
        # config) must be told they are CPU workers, or each one silently trains alone; with cpu=True
        # Accelerate joins them into one gloo process group (MULTI_CPU).
        cpu=not torch.accelerator.is_available(),
        mixed_precision=recipe.train.mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.train.timeout_s))],
    )
    if launched and launched != recipe.train.mixed_precision and accelerator.is_main_process:
        accelerator.print(
            f"warning: the launch config asks for mixed_precision={launched} but the recipe sets "
            f"train.mixed_precision={recipe.train.mixed_precision}; using the recipe's."
        )
    return accelerator


def global_sum(accelerator, *values: float | int) -> list[float]:
    """Sum numbers over all processes in one collective."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t.tolist()


def use_fused_adamw(accelerator) -> bool:
    return accelerator.device.type == "cuda"
