"""Run outputs that people read: metrics.jsonl, the optional TensorBoard log and the progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmtrain.errors import LLMTrainError


class MetricsLog:
    """Append one JSON object per line to <output_dir>/metrics.jsonl (main process only)."""

    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int | None):
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            # Lines after the checkpoint belong to steps that will run again; drop them so each step
            # appears once. Written to a temporary file first so a crash cannot truncate the log.
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            tmp.replace(self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise LLMTrainError("logging.tensorboard is true but tensorboard is not installed: "
                                    "pip install 'llmtrain[tensorboard]', or set logging.tensorboard=false.") from None

            self.tb = SummaryWriter(str(output_dir / "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(f"{record.get('type', 'train')}/{k}", v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def progress_bar(*, enabled: bool, total: int, completed: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        disable=not enabled,
    )
    task = progress.add_task("train", total=total, completed=completed, info="")
    return progress, task


def step_info(rec: dict) -> str:
    return f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s"
