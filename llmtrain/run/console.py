"""What a run says: start-up lines, the progress bar, eval results, and the summary at the end.

Printed on the main process only; a copy goes to <output_dir>/train.log (lines said before the folder is
claimed are kept and written first). On a terminal the progress bar shows the latest step; elsewhere (`| tee`,
nohup, SLURM logs) a plain line is printed for every logged step instead, so such a log is never silent.
"""

from __future__ import annotations

import math
from pathlib import Path

from llmtrain.errors import LLMTrainError, Stopped


class RunConsole:
    def __init__(self, *, enabled: bool, progress: bool, device: str = "cuda"):
        from rich.console import Console

        self.enabled = enabled
        self.screen = Console(highlight=False)
        self.plain = not self.screen.is_terminal  # no live bar: print a line per logged step
        self.show_bar = enabled and progress and not self.plain
        self._log = None
        self._pending: list = []
        self.unit = unit_of(device)

    def progress(self, *, total: int, completed: int):
        from llmtrain.run.metrics import progress_bar

        progress, task = progress_bar(enabled=self.show_bar, total=total, completed=completed, console=self.screen)
        return progress, task

    def say(self, what, *, markup: bool = False) -> None:
        """Print a line (or a rich renderable) and keep it for train.log. Text is never read as markup unless
        asked: a message with [brackets] prints as written."""
        if not self.enabled:
            return
        self.screen.print(what, markup=markup, highlight=False, soft_wrap=isinstance(what, str))
        if self._log is None:
            self._pending.append((what, markup))
        else:
            self._log.print(what, markup=markup, highlight=False, soft_wrap=isinstance(what, str))

    def keep_log(self, path: Path) -> None:
        """From now on, also append to `path` (train.log), starting with what was said before."""
        from rich.console import Console

        if not self.enabled:
            return
        self._file = path.open("a")
        self._log = Console(file=self._file, width=120, color_system=None, highlight=False)
        for what, markup in self._pending:
            self._log.print(what, markup=markup, highlight=False, soft_wrap=isinstance(what, str))
        self._pending = []

    def record_error(self, error: BaseException) -> None:
        """The paragraph the run ends with (the command line prints it on the screen) into train.log too, if it is
        open: a failed run's folder says why it failed."""
        if self._log is None:
            return
        if isinstance(error, LLMTrainError):
            text = f"{'stopped' if isinstance(error, Stopped) else 'error'}: {error}"
        else:  # a bug: its traceback is on the screen
            text = f"error: {type(error).__name__}: {error} (the traceback is printed on the console)"
        self._log.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, rec: dict, *, total: int) -> None:
        if self.plain:
            self.say(f"step {rec['step']}/{total}  {step_text(rec, unit=self.unit)}  elapsed {rec['elapsed_s']:.0f}s")

    def close(self) -> None:
        if self._log is not None:
            self._file.close()
            self._log = None


def unit_of(device: str) -> str:
    """What a speed is per: a GPU, or (on a CPU, where one process may use several cores) a process."""
    return "gpu" if device == "cuda" else "process"


def step_text(rec: dict, *, unit: str = "gpu") -> str:
    loss = rec.get("loss")
    if loss is None or not math.isfinite(loss):
        return f"loss {loss}  (update skipped)"
    mfu = f"  MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
    pairs = (f"  acc {rec['rewards/accuracies']:.0%} margin {rec['rewards/margins']:.3f}"
             if "rewards/accuracies" in rec else "")  # preference runs
    if "accuracy" in rec and "margin" in rec:  # a reward model: its pairwise accuracy and score margin
        pairs = f"  acc {rec['accuracy']:.0%} margin {rec['margin']:.3f}"
    if "kl" in rec and "rewards/accuracies" not in rec:  # KTO: the KL estimate, and the margin where both sides are
        margin = f" margin {rec['rewards/margins']:.3f}" if "rewards/margins" in rec else ""
        pairs = f"  kl {rec['kl']:.3f}{margin}"
    if "teacher_agreement" in rec:  # distillation: the share of tokens whose argmax is the teacher's
        pairs = f"  agree {rec['teacher_agreement']:.0%}"
    if "frac_reward_zero_std" in rec:  # online RL: the step's mean reward first (a step no reward function scored
        # has none: "-")
        reward = f"{rec['reward']:.3f}" if "reward" in rec else "-"
        pairs = f"  reward {reward}  length {rec['completions/mean_length']:.1f}"
        return f"{pairs.strip()}  loss {loss:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s_per_gpu']:,.0f} tok/s/{unit}"
    return f"loss {loss:.4f}{pairs}  lr {rec['lr']:.2e}  {rec['tokens_per_s_per_gpu']:,.0f} tok/s/{unit}{mfu}"


def summary_table(summary: dict, *, out: Path, evals: list[dict], unit: str = "gpu", logged_every: int = 1,
                  online_rl: bool = False):
    """The end-of-run table: steps, tokens, time, speed, the best eval, peak GPU memory, and where final/ is."""
    from rich.table import Table

    table = Table(title=f"llmtrain: {out}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{summary['steps']:,}")
    table.add_row("tokens", f"{summary['tokens_seen']:,}")
    # the run's clock: this process's loop, and what came before it (earlier processes of a resumed run, a preference
    # run's reference pass), each named
    before = [(int(seconds), what) for seconds, what in ((summary.get("resumed_time_s", 0.0), "before the resume"),
              (summary.get("setup_time_s", 0.0), "the reference log-probabilities")) if seconds >= 1]
    parts = [f"{_clock(seconds)} {what}" for seconds, what in before]
    # whole seconds that add up to the total shown (each floored alone, 26.57 = 18.94 + 7.63 had read 26 = 18 + 7)
    loop = int(summary["train_time_s"]) - sum(seconds for seconds, _ in before)
    this = f" (this process's loop {_clock(loop)}; {'; '.join(parts)})" if parts else ""
    table.add_row("time", _clock(summary["train_time_s"]) + this)
    speeds = (f"{summary['tokens_per_s_per_gpu']:,.0f} training, {summary['wall_tokens_per_s_per_gpu']:,.0f} with "
              f"eval and checkpoints{' (this process)' if parts else ''}" if summary["tokens_per_s_per_gpu"] is not None
              else "none: this process trained no step")
    table.add_row(f"tokens/s per {'GPU' if unit == 'gpu' else unit}", speeds)
    if summary.get("final_loss") is not None:
        table.add_row("final train loss", f"{summary['final_loss']:.4f}" + (
            " (online RL: about 0 by construction, each prompt's advantages average 0, or below 0 where the rewarded "
            "completions are the longer ones under loss_type dapo (each token weighs the same); the reward is the "
            "measure)"
            if online_rl else ""))
    if evals and "eval_reward" in evals[-1]:  # online RL: the best mean reward of greedy completions
        best = max(evals, key=lambda e: e["eval_reward"])
        accuracy = (f", answer accuracy {best['eval_answer_accuracy']:.1%}" if "eval_answer_accuracy" in best else "")
        if best is not evals[0]:
            since = f"; first {evals[0]['eval_reward']:.4f} at step {evals[0]['step']}"
        else:  # it had said "-0.0764 (step 0; first -0.0764 at step 0)"
            later = len(evals) - 1
            since = f"; none of the {later} later evals higher" if later > 1 else "; the later eval no higher" \
                if later else ""
        table.add_row("best eval reward", f"{best['eval_reward']:.4f} (step {best['step']}{accuracy}{since})")
    elif evals:
        best = min(evals, key=lambda e: e["eval_loss"])
        margin = best.get("eval_rewards/margins")
        # the mode's own measure, then the generated samples' answer accuracy beside it (it had replaced KTO's and
        # distillation's); supervised fine-tuning: the answer accuracy, else the teacher-forced match
        measure = (f"reward accuracy {best['eval_rewards/accuracies']:.1%}" if "eval_rewards/accuracies" in best else
                   # a reward model: pairs whose chosen answer scores higher
                   f"pairwise accuracy {best['eval_accuracy']:.1%}, margin {best['eval_margin']:.3f}"
                   if "eval_accuracy" in best else
                   # distillation: the loss is the divergence to the teacher
                   f"argmax as the teacher's {best['eval_teacher_agreement']:.1%}"
                   if "eval_teacher_agreement" in best else
                   f"kl {best['eval_kl']:.3f}" + (f", reward margin {margin:.3f}" if margin is not None else "")
                   if "eval_kl" in best else None)  # KTO
        answers = (f"answer accuracy {best['eval_answer_accuracy']:.1%} of generated samples"
                   if best.get("eval_answer_accuracy") is not None else None)
        what = ", ".join(x for x in (measure, answers) if x) or \
            f"teacher-forced match {best['eval_teacher_forced_match']:.1%}"
        table.add_row("best eval loss", f"{best['eval_loss']:.4f} (step {best['step']}, {what})")
    if summary.get("max_memory_allocated"):
        table.add_row("peak GPU memory", f"{summary['max_memory_allocated'] / 2**30:.2f} GiB allocated, "
                                         f"{summary['max_memory_reserved'] / 2**30:.2f} GiB reserved")
    if summary.get("final"):
        adapter = summary.get("method") in ("lora", "qlora")
        table.add_row("final model", summary["final"] + (
            " (the LoRA adapter of a random base, never saved: no model to merge it into)"
            if adapter and summary.get("random_init") else
            f" (the LoRA adapter: `llmtrain export {out} --merge` writes a whole model)" if adapter else ""))
    steps = "every step" if logged_every == 1 else f"every {logged_every} steps (logging.every_steps)"
    table.add_row("logged", f"{out}/metrics.jsonl ({steps} and every eval) and train.log; `llmtrain plot {out}` "
                            "draws the curves (several runs: overlaid)")
    return table


def _clock(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
