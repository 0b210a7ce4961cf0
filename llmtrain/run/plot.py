"""loss.png: train loss (raw and smoothed), eval loss and learning rate against steps and tokens seen, and below them
each mode's own measure where its metrics carry one (MEASURES: the reward margin of DPO and KTO, KTO's KL, a reward
model's accuracy, distillation's agreement with its teacher, the greedy answer accuracy); for an
online RL run (train lines with `reward`), rl_plot.py's panels: the reward and each reward function's on its own
y-scale, the eval answer accuracy (greedy), the completions' mean length and the KL to the reference (without one
the entropy, or the loss) against steps: the GRPO loss alone (about 0 by construction) shows nothing.

`plot_runs(runs, out)` reads each run's metrics.jsonl and writes one image; several runs are overlaid in
one colour each, for comparison (`llmtrain plot RUN [RUN ...]`). The trainer rewrites `<output_dir>/loss.png`
at each evaluation and at the end (`update_loss_plot`).

matplotlib is used through its object API (`Figure`, no pyplot): no global figure state and no display,
so it works headless (on a cluster node, under nohup) whatever backend the environment asks for.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.run.curves import Curves, _nan, _points, ema, smoothing_weight  # noqa: F401  (re-exported)
from llmtrain.run.rundir import cannot_create
from llmtrain.run.metrics import complete_lines

# The loss axis turns logarithmic when the curves span more than this factor (a model learning from scratch
# falls from ~10 to ~0.1: on a linear axis everything after the first steps is a flat line).
LOG_SCALE_RATIO = 20.0
# Each mode's own measure, drawn in a panel of its own under the loss where a run logs it: (the train lines' key, the
# eval lines' key, the panel's title). The loss alone does not say whether a preference or reward model ranks the
# pairs right, or whether a student agrees with its teacher.
MEASURES = (
    ("rewards/margins", "eval_rewards/margins", "reward margin, chosen - rejected (DPO, KTO)"),
    ("rewards/accuracies", "eval_rewards/accuracies", "pairs whose chosen reply is rewarded higher (DPO)"),
    # KTO's baseline, which its console line and summary name first (audit 40); online RL's where drawn beside others
    ("kl", "eval_kl", "KL to the reference (KTO: the baseline its rewards are measured from; online RL)"),
    ("accuracy", "eval_accuracy", "reward model: pairs scored the right way round"),
    ("margin", "eval_margin", "reward model: score margin, chosen - rejected"),
    ("teacher_agreement", "eval_teacher_agreement", "distillation: the student's top token is the teacher's"),
    (None, "eval_answer_accuracy", "answer accuracy (greedy completions of the eval prompts)"),
    # online RL's measure where its run is drawn beside others (alone, or with RL runs only: rl_plot's panels)
    ("reward", "eval_reward", "online RL: reward (train: the sampled completions'; eval: greedy)"),
    ("aux_loss", None, "routers' load-balancing loss (model.router_aux_loss_coef; top_k when balanced)"),
)


def _rl_key(key: str, *, eval_line: bool) -> bool:
    """The RL metrics a figure draws: reward, rewards/<name>/mean, completions/mean_length, kl, entropy; on eval lines
    eval_reward, eval_answer_accuracy, eval_rewards/<name>/mean."""
    if eval_line:
        return key in ("eval_reward", "eval_answer_accuracy") or (key.startswith("eval_rewards/")
                                                                  and key.endswith("/mean"))
    return key in ("reward", "completions/mean_length", "kl", "entropy") or (key.startswith("rewards/")
                                                                            and key.endswith("/mean"))


def metrics_file(run: Path) -> Path:
    """The metrics.jsonl of a run folder (or the file itself), or a clear error."""
    run = Path(run)
    if run.is_file() and run.name == "metrics.jsonl":
        return run
    if not run.exists():
        raise LLMTrainError(f"Run folder '{run}' does not exist. Pass the output_dir of a finetune run (the folder "
                            "that holds metrics.jsonl).")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise LLMTrainError(f"'{run}' has no metrics.jsonl, so it is not a run folder, or its run has not logged a "
                            "step yet (the first line is written after logging.every_steps steps). Pass the "
                            "output_dir of a finetune run.")
    return path


def read_curves(run: Path, name: str | None = None) -> Curves:
    """The train and eval lines of one run, by step. The last line of a step wins; a last line without its
    newline (the trainer is writing it right now) is ignored."""
    path = metrics_file(run)
    lines = complete_lines(path)
    train, evals = {}, {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            kind, step = rec.get("type", "train"), int(rec["step"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LLMTrainError(f"{path}, line {n}: not a metrics line ({type(e).__name__}: {e}). Each line must be "
                                "a JSON object with 'type' and 'step', as llmtrain finetune writes them; remove or "
                                "repair the damaged line.") from None
        if kind == "train":
            train[step] = rec
        elif kind == "eval":
            evals[step] = rec
    if not train:
        raise LLMTrainError(f"{path} holds no train lines yet, so there is nothing to plot. Wait for the run's first "
                            "logging step (logging.every_steps), or pass another run.")
    c = Curves(name=name or Path(run).name)
    for lines_, into, eval_line in ((train, c.rl, False), (evals, c.eval_rl, True)):
        # in the lines' order: the reward functions as the recipe lists them
        names = list(dict.fromkeys(k for rec in lines_.values() for k in rec if _rl_key(k, eval_line=eval_line)))
        into.update({k: [_finite(lines_[step].get(k)) for step in sorted(lines_)] for k in names})
    for train_key, eval_key, _ in MEASURES:  # an RL run's too: drawn where it is beside a run of another mode
        for key, lines_, into in ((train_key, train, c.measures), (eval_key, evals, c.eval_measures)):
            if key is not None and any(key in rec for rec in lines_.values()):
                into[key] = [_finite(lines_[step].get(key)) for step in sorted(lines_)]
    for step in sorted(train):
        rec = train[step]
        c.step.append(step)
        c.tokens.append(rec.get("tokens_seen"))
        c.loss.append(_finite(rec.get("loss")))
        c.lr.append(_finite(rec.get("lr")))
    # Eval lines carry no token count: take the train line of the same step (the trainer always writes one
    # before it evaluates), else the nearest earlier one.
    for step in sorted(evals):
        c.eval_step.append(step)
        c.eval_loss.append(_finite(evals[step].get("eval_loss")))
        at = bisect.bisect_right(c.step, step)  # train lines up to and including this step
        c.eval_tokens.append(c.tokens[at - 1] if at else None)
    return c


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _run_names(runs: list[Path]) -> list[str]:
    """Folder names, or whole paths where two runs share a folder name (a/run and b/run)."""
    folders = [metrics_file(r).parent for r in runs]
    if len({f.resolve() for f in folders}) < len(folders):  # (drawn twice under one label, which could not be told)
        twice = next(f for k, f in enumerate(folders) if f.resolve() in {g.resolve() for g in folders[:k]})
        raise LLMTrainError(f"'{twice}' is given twice: give each run once.")
    names = [f.resolve().name for f in folders]
    return names if len(set(names)) == len(names) else [str(f) for f in folders]


def default_plot_path(runs: list[Path]) -> Path:
    """<run>/loss.png for one run (where the trainer writes it); loss-compare.png here for several."""
    return metrics_file(runs[0]).parent / "loss.png" if len(runs) == 1 else Path("loss-compare.png")


def plot_runs(runs: list[Path], out: Path, *, smoothing: float | None = None):
    """Write the loss / lr figure of one or several runs to `out` (.png, or any format matplotlib writes, by its
    suffix) and return the matplotlib Figure. `smoothing`: the EMA weight (default: smoothing_weight of each
    run's length). The file is written under a temporary name and renamed, so a viewer never reads half an
    image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    if not runs:
        raise LLMTrainError("No run to plot: pass one or several run folders (output_dir of llmtrain finetune).")
    out = Path(out)
    if problem := cannot_create(out, "--out"):
        raise LLMTrainError(problem)
    if out.is_dir():
        raise LLMTrainError(f"--out '{out}' is a folder: give the image's file name (e.g. {out / 'loss.png'}).")
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise LLMTrainError(f"Cannot write '{out}': the image format comes from the suffix, and '.{suffix}' is not "
                            f"one matplotlib writes ({', '.join('.' + f for f in sorted(formats))}). Use a .png name.")
    curves = [read_curves(r, n) for r, n in zip(runs, _run_names(runs))]

    if all(c.is_rl for c in curves):
        from llmtrain.run.rl_plot import draw_rl, reward_functions, rl_figure_size

        fig = Figure(figsize=rl_figure_size(len(reward_functions(curves))), layout="constrained")
        FigureCanvasAgg(fig)
        draw_rl(fig, curves, smoothing)
        return _save(fig, out, suffix)
    panels = [m for m in MEASURES if any(m[0] in c.measures or m[1] in c.eval_measures for c in curves)]
    fig = Figure(figsize=(13, 10.5 if panels else 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3 if panels else 2, 2, height_ratios=[3, 1, 1.6] if panels else [3, 1])
    loss_s = fig.add_subplot(grid[0, 0])
    loss_t = fig.add_subplot(grid[0, 1], sharey=loss_s)
    lr_s = fig.add_subplot(grid[1, 0], sharex=loss_s)
    lr_t = fig.add_subplot(grid[1, 1], sharex=loss_t, sharey=lr_s)
    single = len(curves) == 1
    for i, c in enumerate(curves):
        colour = f"C{i}"
        label = "" if single else f"{c.name}: "
        weight = smoothing_weight(len(c.step)) if smoothing is None else smoothing
        smoothed = ema(c.loss, weight)
        # beside supervised runs, an online-RL run's loss is about 0 by construction (each prompt's advantages average
        # 0): drawn, and said in its label
        about_zero = " (online RL: about 0 by construction)" if c.is_rl else ""
        for ax, x, ex in ((loss_s, c.step, c.eval_step), (loss_t, c.tokens, c.eval_tokens)):
            # The raw loss has a gap at a skipped update; the average and the eval line run through it.
            # 20 points or fewer are not smoothed (weight 0): the raw curve is drawn as the one to read
            ax.plot(_nan(x), _nan(c.loss), color=colour, alpha=0.3 if weight > 0 else 1.0,
                    linewidth=0.8 if weight > 0 else 1.5, label=f"{label}train loss{about_zero}",
                    marker="o" if len(c.loss) == 1 else None)  # one point: a line of one point draws nothing
            if weight > 0:
                ax.plot(*_points(x, smoothed), color=colour, linewidth=1.8,
                        label=f"{label}train loss (EMA {weight:.2g})")
            if any(v is not None for v in c.eval_loss):  # an online-RL run's eval lines have no loss
                ax.plot(*_points(ex, c.eval_loss), color=colour, linestyle="--", marker="o", markersize=4,
                        label=f"{label}eval loss")
        one = "o" if len(c.lr) == 1 else None
        lr_s.plot(c.step, _nan(c.lr), color=colour, label=c.name, marker=one)
        lr_t.plot(_nan(c.tokens), _nan(c.lr), color=colour, label=c.name, marker=one)
    if panels:
        _draw_measures(fig, grid[2, :], panels, curves)

    values = [v for c in curves for v in (*c.loss, *c.eval_loss) if v is not None and not math.isnan(v)]
    # a loss at or below 0, or an online-RL run's about 0 (RLOO's 1e-9 would stretch a log axis over ten decades),
    # has no place on a log axis: linear then, every run on it
    if (values and min(values) > 0 and max(values) / min(values) > LOG_SCALE_RATIO
            and not any(c.is_rl for c in curves)):
        loss_s.set_yscale("log")
    loss_s.set_ylabel("loss (log scale)" if loss_s.get_yscale() == "log" else "loss")
    lr_s.set_ylabel("learning rate")
    lr_s.set_xlabel("step")
    lr_t.set_xlabel("tokens seen")
    lr_t.xaxis.set_major_formatter(EngFormatter())
    lr_s.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    loss_s.set_title("against optimizer steps")
    loss_t.set_title("against tokens seen")
    for ax in (loss_s, loss_t, lr_s, lr_t):
        ax.grid(True, alpha=0.3)
    if not any(t is not None for c in curves for t in c.tokens):
        loss_t.text(0.5, 0.5, "no tokens_seen in metrics.jsonl", transform=loss_t.transAxes, ha="center")
    loss_s.legend(fontsize="small")
    if not single:
        lr_s.legend(fontsize="small")
    fig.suptitle(_title(curves))
    return _save(fig, out, suffix)


def _draw_measures(fig, cell, panels, curves: list[Curves]) -> None:
    """One panel a measure (MEASURES) against steps: each run's train values (a thin line) and eval values (dashed,
    with markers), in the run's colour."""
    row = cell.subgridspec(1, len(panels))
    for j, (train_key, eval_key, title) in enumerate(panels):
        ax = fig.add_subplot(row[0, j])
        for i, c in enumerate(curves):
            label = "" if len(curves) == 1 else f"{c.name}: "
            if train_key in c.measures:
                ax.plot(*_points(c.step, c.measures[train_key]), color=f"C{i}", linewidth=1.0, alpha=0.8,
                        label=f"{label}train")
            if eval_key in c.eval_measures:
                ax.plot(*_points(c.eval_step, c.eval_measures[eval_key]), color=f"C{i}", linestyle="--",
                        marker="o", markersize=4, label=f"{label}eval")
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")


# Written into every plot whose format holds it (its Creator: PNG's text, PDF's info, SVG's, PostScript's header):
# what `plot --out` may replace
MARK = "llmtrain plot"
MARKED = ("png", "pdf", "svg", "eps", "ps")


def drawn_here(path: Path) -> bool:
    """Whether `plot --out` may replace the file: a plot llmtrain drew (its MARK, in the first or, a PDF's info, the
    last 64 KiB), or one of a format that holds no mark (jpg, tif, ...: replaced as before, said)."""
    if path.suffix.lstrip(".").lower() not in MARKED:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            f.seek(max(0, path.stat().st_size - (1 << 16)))
            return MARK.encode() in head + f.read()
    except OSError:
        return False


def _save(fig, out: Path, suffix: str):
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, format=suffix, dpi=100, metadata={"Creator": MARK} if suffix in MARKED else None)
        tmp.replace(out)
    except OSError as e:  # a full disk, a folder where the image goes: nothing half-written is left
        tmp.unlink(missing_ok=True)
        raise LLMTrainError(f"could not write the plot to '{out}' ({e.strerror or e}); nothing was written. Give "
                            "--out a writable file path with room for it.") from None
    return fig


def _title(curves: list[Curves]) -> str:
    parts = []
    for c in curves:
        last = next((v for v in reversed(c.loss) if v is not None), None)
        text = f"{c.name}: step {c.step[-1]}"
        if last is not None:
            text += f", last train loss {last:.4g}"
        evals = [(v, s) for v, s in zip(c.eval_loss, c.eval_step) if v is not None]
        if evals:
            best, at = min(evals)
            text += f", best eval loss {best:.4g} at step {at}"
        parts.append(text)
    return "\n".join(parts)


def update_loss_plot(run_dir: Path) -> str | None:
    """Rewrite <run_dir>/loss.png from its metrics.jsonl (main process, at each eval and at the end).

    Returns None, or a one-line warning: a picture must never end a training run that is otherwise fine, so
    any failure here is reported and training goes on.
    """
    try:
        plot_runs([run_dir], Path(run_dir) / "loss.png")
    except Exception as e:  # noqa: BLE001 - see the docstring
        return f"warning: {Path(run_dir) / 'loss.png'} not updated ({type(e).__name__}: {e})"
    return None
