"""Accelerate's fp16 as it runs on a GPU, on this CPU: its GradScaler (the dynamic loss scale) and its autocast and
unscale, which Accelerate switches on for GPUs only. At INIT_SCALE the tiny models' fp16 gradients overflow for their
first steps, so the scale's halving runs. `patch` switches it on in this process (a test's monkeypatch); `site` in
the processes `accelerate launch` starts (a sitecustomize on their PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path

INIT_SCALE = 2.0**24


def patch(set_attribute=setattr) -> None:
    import accelerate
    import torch

    made = accelerate.Accelerator.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16":
            self.native_amp = True
            self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

    set_attribute(accelerate.Accelerator, "__init__", init)


def site(folder: Path, env: dict) -> dict:
    """`env` for launched processes that each patch themselves at start-up."""
    folder.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).parent)
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {here!r})\nimport fp16_on_cpu\n"
                                             "fp16_on_cpu.patch()\n")
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)}
