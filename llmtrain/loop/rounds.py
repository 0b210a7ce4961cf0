"""Online RL's generation rounds (rl.num_iterations, TRL's num_iterations): which step samples and which reuse.

A round is one window of prompts: its first step rolls it out (samples, scores and packs the completions, and takes
their log-probabilities under the policy that sampled them: objectives/grpo.py), then that step and the next
num_iterations - 1 update the policy on the same completions, in the same passes and order (as TRL's buffered
inputs). The data position moves with the round's first step only (TrainState.advance is given the same window
again), so a round costs one window of the data plan however many updates it makes.

A checkpoint saved within a round keeps the round (each process's rolled-out window, `rounds/process_N.pt`) and a
resume continues it: the same completions, advantages and old log-probabilities, on the same processes, so a run
stopped mid-round equals the one that was not. With num_iterations 1 every step samples and nothing is kept.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from llmtrain.data.batching import Counts, Window

FOLDER = "rounds"  # in a checkpoint: the round in progress, one file a process


class Rounds:
    """The round in progress of a run with rl.num_iterations = `every` (1: none), on process `process` of
    `processes`."""

    def __init__(self, every: int, *, process: int = 0, processes: int = 1):
        self.every, self.process, self.processes = every, process, processes
        self.kept: Window | None = None  # the round's rolled-out window, for its later updates

    def new_windows(self, step: int, total: int) -> int:
        """How many windows the data plan gives from step `step` to `total`: one a round that starts in between."""
        return -(-total // self.every) - -(-step // self.every)

    def windows(self, stream, *, step: int, total: int):
        """Each step's window from `step` to `total`: a new one from `stream` where a round starts, else the round's
        (kept by `trained` from the step that rolled it out, or restored from a checkpoint)."""
        for at in range(step, total):
            if at % self.every == 0:
                yield next(stream)
            else:
                if self.kept is None:  # the loop keeps every rolled-out window: a bug, not the user's
                    raise RuntimeError(f"step {at} is within a generation round whose completions were not kept")
                yield self.kept

    def trained(self, window: Window) -> None:
        """After a step: a round's first step leaves its window, rolled out, for the later updates (its rollout
        statistics and records zeroed: they are counted once, in the step that sampled)."""
        if self.every == 1 or window.sampled:
            return
        self.kept = dataclasses.replace(
            window, sampled=True, rollouts=[],
            batches=[{**b, "rollout_stats": torch.zeros_like(b["rollout_stats"])} if "rollout_stats" in b else b
                     for b in window.batches])

    # ---- checkpoints: the round in progress, each process's

    def write(self, folder: Path, *, step: int) -> None:
        """Save the round a checkpoint at `step` is within (nothing at a round's end)."""
        if step % self.every == 0 or self.kept is None:
            return
        w = self.kept
        (folder / FOLDER).mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "every": self.every, "processes": self.processes,
                    "window": {"epoch": w.epoch, "end": w.end, "epoch_done": w.epoch_done, "batches": w.batches,
                               "counts": [float(c) for c in w.counts]}},
                   folder / FOLDER / f"process_{self.process}.pt")

    def restore(self, checkpoint: Path | None, *, step: int) -> None:
        """Take the round back from a checkpoint saved within one (round_problem has checked it fits this run)."""
        if checkpoint is None or step % self.every == 0:
            return
        saved = torch.load(checkpoint / FOLDER / f"process_{self.process}.pt", weights_only=True)
        w = saved["window"]
        self.kept = Window(epoch=w["epoch"], end=w["end"], epoch_done=w["epoch_done"], batches=w["batches"],
                           counts=Counts(*w["counts"]), sampled=True)


def round_problem(checkpoint: Path, *, every: int, processes: int) -> str | None:
    """Why this run (rl.num_iterations = `every`, 1 without online RL) cannot continue the generation round its
    checkpoint was saved within (None: it can, or the checkpoint is at a round's end). Read before anything is
    written."""
    import json

    step = int(json.loads((checkpoint / "train_state.json").read_text())["step"])
    files = sorted((checkpoint / FOLDER).glob("process_*.pt")) if (checkpoint / FOLDER).is_dir() else []
    if not files:
        if every > 1 and step % every:
            return (f"checkpoint {checkpoint} is at step {step}, within a generation round of rl.num_iterations="
                    f"{every}, and holds no round ({FOLDER}/): it was written with another rl.num_iterations. Resume "
                    "it with the recipe that wrote it (its recipe.yaml).")
        return None
    saved = torch.load(files[0], weights_only=True)
    if saved["every"] != every:
        return (f"checkpoint {checkpoint} was saved within a generation round of rl.num_iterations={saved['every']} "
                f"(step {step}) and this recipe has rl.num_iterations={every}: the round's remaining updates need "
                f"the same setting. Resume with rl.num_iterations={saved['every']}, or from a checkpoint at a round's "
                f"end (a step that is a multiple of {saved['every']}).")
    if saved["processes"] != processes or len(files) != processes:
        n = saved["processes"]
        were = f"{n} process{'es' * (n != 1)}"
        return (f"checkpoint {checkpoint} was saved within a generation round (step {step}, rounds of {every} "
                f"steps) by {were}, each keeping its own completions, and this launch has {processes}: resume it on "
                f"{were}, or from a checkpoint at a round's end (a step that is a multiple of {every}).")
    return None
