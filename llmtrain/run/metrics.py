"""Run outputs that people read: metrics.jsonl, samples.jsonl, the experiment trackers and the progress bar."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import LLMTrainError


def complete_lines(path: Path) -> list[str]:
    """The lines of a JSON-lines log that were written whole: what follows the last newline is a write the stop cut
    short (kill -9, a full disk) or one under way, and is left out."""
    return path.read_text().split("\n")[:-1]


def logged(output_dir: Path, kind: str) -> list[dict]:
    """The lines of `kind` ("train", "eval") in a run's metrics.jsonl, over every part of a resumed run."""
    path = output_dir / "metrics.jsonl"
    lines = complete_lines(path) if path.is_file() else []
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("type", "train") == kind]


class MetricsLog:
    """The run's logs, written by the main process only (enabled=False elsewhere): metrics.jsonl, one JSON object
    per line; samples.jsonl, the eval generations (train.eval_samples); and every metrics line passed on to the
    experiment trackers of logging.report_to (opened on the main process: trackers.open_trackers).
    """

    def __init__(self, output_dir: Path, *, enabled: bool, resume_step: int | None, trackers: Sequence = ()):
        self.path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        self.rollouts_path = output_dir / "rollouts.jsonl"
        self.enabled = enabled
        self.trackers = list(trackers) if enabled else []
        if not enabled:
            return
        if resume_step is not None:
            # Lines after the checkpoint belong to steps that will run again: set aside, so that each step appears
            # once, until this run's first checkpoint (the later checkpoints they belong to are removed then)
            for path in (self.path, self.samples_path, self.rollouts_path):
                self._set_aside_after(path, resume_step)

    def owed_eval(self, step: int) -> None:
        """Before the eval a checkpoint owes: the eval line (and samples) of `step` that an earlier resume wrote, and
        then lost its next checkpoint to (kill -9 before it), are dropped, so that the eval appears once (the set-aside
        keeps every line up to the checkpoint's step; audit 59)."""
        if not self.enabled:
            return
        for path, kind in ((self.path, "eval"), (self.samples_path, None)):  # samples.jsonl: the eval's alone
            if path.exists():
                lines = _steps(path)
                kept = [ln for s, ln in lines if s != step or (kind and json.loads(ln).get("type") != kind)]
                if len(kept) != len(lines):
                    _write_lines(path, kept)

    @staticmethod
    def _set_aside_after(path: Path, step: int) -> None:
        """Keep the lines of steps up to `step` in `path` and move the later ones to PATH.after-step_N (N: `step`).
        They are of the run this resume goes back on, whose later checkpoints stay until this run's first: a stop
        before it had lost them for good, and `--resume auto` then went back to a later checkpoint with a summary of
        the older step (audit 46). A resume finding a set-aside file (the last resume stopped before its first
        checkpoint) puts its lines back after the ones it was set aside from first, dropping that resume's own lines
        past it, which no checkpoint holds. None are kept at step 0 (`--resume auto` that found no checkpoint starts
        the run again, its step-0 eval too). A last line without its newline is a write the stop cut short (kill -9,
        a full disk): dropped, as `llmtrain plot` ignores it."""
        asides = []
        for found in sorted(path.parent.glob(f"{path.name}.after-step_*")):
            if found.name.rsplit("_", 1)[1].isdigit():
                asides.append(found)
            else:  # a write a stop cut short (.tmp): its lines are still in the file it was made from
                found.unlink(missing_ok=True)
        if not path.exists() and not asides:
            return
        lines = _steps(path) if path.exists() else []
        for aside in asides:  # one at most; back after the lines it was set aside from
            base = int(aside.name.rsplit("_", 1)[1])
            lines = [(s, ln) for s, ln in lines if s <= base] + _steps(aside)
        keep = [ln for s, ln in lines if s <= step and step > 0]
        later = [ln for s, ln in lines if not (s <= step and step > 0)]
        target = path.with_name(f"{path.name}.after-step_{step:06d}")
        if later:
            _write_lines(target, later)
        _write_lines(path, keep)  # a crash while rewriting cannot truncate the log
        for aside in asides:
            if aside != target or not later:
                aside.unlink(missing_ok=True)

    def checkpointed(self) -> None:
        """This run's first checkpoint (or its end) has replaced the later ones of the run a resume went back on: the
        lines set aside with them go too."""
        if self.enabled:
            for path in (self.path, self.samples_path, self.rollouts_path):
                for aside in path.parent.glob(f"{path.name}.after-step_*"):
                    aside.unlink(missing_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        for tracker in self.trackers:
            tracker.log(record, record["step"])

    def write_samples(self, samples: list[dict]) -> None:
        """Append eval generations (samples.generate_samples: step, prompt, expected, generated) to samples.jsonl."""
        if not self.enabled or not samples:
            return
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)

    def write_rollouts(self, records: list[dict]) -> None:
        """Append online RL's completions (one record each: step, prompt, completion, ids, rewards, advantage) to
        rollouts.jsonl; `step` is the optimizer step that trained on them, as in metrics.jsonl."""
        if not self.enabled or not records:
            return
        with self.rollouts_path.open("a") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)

    def close(self) -> None:
        """End every tracker's run, once: train() calls it however the run ends (finish, stop, divergence)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def _steps(path: Path) -> list[tuple[int, str]]:
    """(step, line) of each complete line of a JSON-lines log; a line that is not JSON is named (a resume cannot tell
    which step it records)."""
    out = []
    for number, line in enumerate(complete_lines(path), 1):
        if not line:
            continue
        try:
            out.append((int(json.loads(line)["step"]), line))
        except (ValueError, KeyError, TypeError):
            raise LLMTrainError(f"{path}, line {number}, is not JSON ({line[:60]!r}) with a step, so the resume "
                                "cannot tell which steps it records: remove that line (or the file) and resume "
                                "again") from None
    return out


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(ln + "\n" for ln in lines))
        tmp.replace(path)
    except OSError as e:  # a full disk: the file as it was
        tmp.unlink(missing_ok=True)
        raise LLMTrainError(f"cannot rewrite {path} for the resume ({e.strerror or e}); it is as it was. Free space "
                            "there and resume again.") from None


def strict_json(record: dict) -> dict:
    """NaN and infinities become null: bare NaN is not JSON, and strict readers reject the whole file."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def progress_bar(*, enabled: bool, total: int, completed: int, console=None):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"), MofNCompleteColumn(), BarColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        disable=not enabled, console=console,
    )
    task = progress.add_task("step", total=total, completed=completed, info="")
    return progress, task


# --------------------------------------------------------------------------- speed: FLOPs and MFU

# Peak dense bf16 tensor-core FLOP/s of one device, by a substring of torch.cuda.get_device_name() (first
# match wins). logging.peak_tflops overrides it. Vendor data sheets, dense (not sparse) figures.
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12), ("B200", 2250e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12), ("A6000", 155e12), ("L4", 121e12),
]


def peak_flops(device, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU, or None where unknown (CPU without logging.peak_tflops)."""
    import torch

    if override_tflops:
        return override_tflops * 1e12
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


@dataclass
class FlopModel:
    """Model FLOPs of one step: body x input tokens + head x trained tokens + attention x sum(l_i^2).

    A matmul weight costs 2 FLOPs per token forward and 2 for the gradient of its input; a trained weight 2
    more for its own gradient: 6 per parameter for full fine-tuning, 4 for a frozen LoRA base plus 6 for
    the adapter. The LM head runs on trained tokens only (loss.py). Causal attention (QK^T and AV) costs
    2 x 2 x l^2 x d / 2 per layer forward for an example of l tokens, 3 times that with backward. Recomputed
    activations (gradient checkpointing) are not model FLOPs and are not counted.
    """

    body_per_token: float
    head_per_token: float
    attn_per_square: float

    def step(self, tokens: float, trained: float, squares: float) -> float:
        return self.body_per_token * tokens + self.head_per_token * trained + self.attn_per_square * squares

    def plus(self, other: FlopModel) -> FlopModel:
        """Both models' FLOPs on the same tokens (distillation: the student's step and the teacher's forward)."""
        return FlopModel(self.body_per_token + other.body_per_token, self.head_per_token + other.head_per_token,
                         self.attn_per_square + other.attn_per_square)


def flop_model(model, *, forward_only: bool = False) -> FlopModel:
    """The FlopModel of a training step of `model`; forward_only: of a frozen model's forward alone (distillation's
    teacher, under no_grad): 2 FLOPs per weight per token, attention a third of a trained step's."""
    from llmtrain.capabilities import experts, experts_per_token, layer_values
    from llmtrain.model.loss import causal_lm, decoder_layers

    lm = causal_lm(model)
    cfg = lm.config
    from llmtrain.model.modeling import numel

    def per_weight(p) -> int:
        return 2 if forward_only else 6 if p.requires_grad else 4

    # a mixture of experts' experts (and peft's adapters of them): a token goes through top_k of them
    routed = experts_per_token(cfg) / experts(cfg) if experts(cfg) else 1.0
    body = round(sum(per_weight(p) * numel(p) * (routed if ".experts." in f".{name}" else 1)
                     for name, p in decoder_layers(lm).named_parameters()
                     if p.ndim >= 2 or getattr(p, "quant_state", None) is not None))
    if hasattr(lm, "lm_head"):
        head = lm.lm_head.weight
    else:  # a reward model: its score head, on one token per sequence (Counts.trained)
        from llmtrain.model.score import head_weight

        head = head_weight(lm)
    # each layer's head size (Gemma 4's global layers have their own)
    head_dims = layer_values(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    return FlopModel(body_per_token=body, head_per_token=per_weight(head) * head.numel(),
                     attn_per_square=(2.0 if forward_only else 6.0) * cfg.num_attention_heads * sum(head_dims))
