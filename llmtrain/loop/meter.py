"""Metering: the metrics line of a logging step, and the run's speed for the summary.

The steps since the last line wait here with their loss still on the device; `line()` reads them back (the
host sync of a logging step) and reports the last step's loss, the objective's statistics (a preference run's
rewards and accuracies) as the mean over all of them, as TRL logs them, and the speed over all of them. Time spent in
evaluation and checkpoints (`with meter.paused():`) is left out of the lines' tokens/s and of the summary's
training speed; the summary's wall speed keeps it. The run's clock continues across resumes: `elapsed()`
starts from the checkpoint's TrainState.elapsed_s (`resumed_s`), plus this process's set-up that is run time
(`setup_s`: a preference run's reference pass); the summary keeps the parts apart, to say which is which.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from llmtrain.parallel.collectives import data_sum


class Meter:
    def __init__(self, accelerator, *, flops, peak: float | None, resumed_s: float = 0.0, setup_s: float = 0.0,
                 objective=None):
        self.accelerator, self.flops, self.peak, self.objective = accelerator, flops, peak, objective
        self.world = accelerator.num_processes
        self.on_gpu = accelerator.device.type == "cuda"
        self.resumed_s, self.setup_s = resumed_s, setup_s
        self.elapsed_before = resumed_s + setup_s
        self.start = self.line_start = time.perf_counter()
        self.paused_s = 0.0  # eval and checkpoint time of this process
        self.tokens = 0.0  # input tokens (all ranks) trained by this process: the summary's speed
        self.pending: list = []  # (step.StepResult, epoch) of the steps since the last line
        self.last: dict = {}  # the last metrics line

    def add(self, result, *, epoch: int) -> None:
        self.pending.append((result, epoch))
        self.tokens += result.counts.tokens

    @contextmanager
    def paused(self):
        """Time spent in this block (eval, a checkpoint) is not training time."""
        t = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t
            self.paused_s += spent
            self.line_start += spent

    def elapsed(self) -> float:
        """Wall seconds of the whole run so far, resumed parts included."""
        return self.elapsed_before + time.perf_counter() - self.start

    def line(self, state) -> dict:
        """The metrics line of the steps since the last one (every rank calls it: the loss is summed over them)."""
        result, epoch = self.pending[-1]
        # the statistics of every step since the last line, summed on the device (a preference metric averaged over
        # 4 pairs of one step jumps between 0, 25, 50 and 75%)
        stats_sum = torch.stack([r.stats_sum.double() for r, _ in self.pending]).sum(0)
        # host sync: the logging step's one read (the loss and the objective's statistics, in one collective)
        loss_sum, *stats = data_sum(self.accelerator, *torch.cat([result.loss_sum.reshape(1).double(),
                                                                     stats_sum]).tolist())
        window = [sum(c) for c in zip(*(r.counts for r, _ in self.pending))]  # units, trained, tokens, squares
        now = time.perf_counter()
        dt = now - self.line_start
        self.line_start, self.pending = now, []
        tokens_per_s = window[2] / dt
        model_flops = self.flops.step(tokens=window[2], trained=window[1], squares=window[3])
        c = result.counts
        self.last = {
            "type": "train", "step": state.step, "epoch": epoch, "loss": loss_sum / max(c.units, 1),
            "lr": result.lr, "grad_norm": result.grad_norm, "skipped": result.skipped,
            "tokens": int(c.tokens), "trained_tokens": int(c.trained),
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / self.world,
            "tflops_per_gpu": model_flops / dt / self.world / 1e12,
            "mfu": model_flops / dt / self.world / self.peak if self.peak else None,
            "tokens_seen": state.tokens_seen, "elapsed_s": self.elapsed_before + now - self.start,
            **(self.objective.step_metrics(stats, window[0]) if self.objective is not None else {})}
        if result.loss_scale is not None:  # fp16's dynamic loss scale after the step (halved by an overflow)
            self.last["loss_scale"] = result.loss_scale
        if "generation_s" in self.last:  # online RL: sampling and scoring are not the policy update's time (a slow
            # reward function had read as a slow update)
            rollout = self.last["generation_s"] + self.last.get("reward_s", 0.0)
            self.last["policy_tokens_per_s"] = tokens_per_s * dt / max(dt - rollout, 1e-9)
        if self.on_gpu:
            self.last.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                             max_memory_reserved=torch.cuda.max_memory_reserved())
        return self.last

    def summary(self) -> dict:
        """The speed of what this process trained: over training time only (as the step lines), and over the
        wall time (eval and checkpoints included); the run's time over every resumed part."""
        wall = time.perf_counter() - self.start
        per_gpu = self.tokens / self.world
        trained = self.tokens > 0  # a resume that only finishes the run (final/, the summary) trains nothing: no
        # speed (it had been 0.0)
        return {"final_loss": self.last.get("loss"), "train_time_s": self.elapsed_before + wall, "process_time_s": wall,
                "resumed_time_s": self.resumed_s, "setup_time_s": self.setup_s,
                "tokens_per_s_per_gpu": per_gpu / max(wall - self.paused_s, 1e-9) if trained else None,
                "wall_tokens_per_s_per_gpu": per_gpu / max(wall, 1e-9) if trained else None}
