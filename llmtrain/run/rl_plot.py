"""loss.png of an online RL run (plot.py draws it when every run's train lines carry `reward`): one panel per
quantity, each with its own y-scale, against steps.

The first row: the reward (the weighted sum, train and eval), eval_answer_accuracy, the completions' mean length,
and the KL to the reference (where rl.beta is 0, the policy's entropy: a fall is the policy collapsing onto few
completions; the loss for runs that logged none). With several reward functions, one panel each below
(rewards/<name>/mean, train and eval): a length penalty near -14 and a 0-1 accuracy never share a y-axis, where one
would flatten the other. Curves are told apart by colour (each reward function its own; with several runs, each
run its own) and the legend sits below the panels, outside the data. A train curve is drawn raw (each logged
step), and smoothed beside it where the run has enough points to smooth (plot.smoothing_weight); the legend says
which.
"""

from __future__ import annotations

import math

from llmtrain.run.curves import Curves, _nan, _points, ema, smoothing_weight

COLUMNS = 4  # panels in a row
ROW_INCHES = 3.0  # the height of a row of panels
MARGIN_INCHES = 1.6  # the title above and the legend below
# The curves' colours: matplotlib's cycle without its grey (C7), which the legend's line-style samples use
COLOURS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")


def rl_figure_size(functions: int) -> tuple[float, float]:
    """(width, height) in inches for a figure with `functions` reward-function panels below the first row."""
    return 13.0, MARGIN_INCHES + ROW_INCHES * (1 + math.ceil(functions / COLUMNS))


def reward_functions(curves: list[Curves]) -> list[str]:
    """The reward functions that get a panel of their own: every one the runs log, where there are several (one
    function's mean is the reward itself, divided by its weight)."""
    names = list(dict.fromkeys(k.split("/")[1] for c in curves for k in c.rl if k.startswith("rewards/")))
    return names if len(names) > 1 else []


def draw_rl(fig, curves: list[Curves], smoothing: float | None) -> None:
    """The panels, the legend and the title of an RL run's figure (sized by rl_figure_size)."""
    functions = reward_functions(curves)
    grid = fig.add_gridspec(1 + math.ceil(len(functions) / COLUMNS), COLUMNS)
    reward = fig.add_subplot(grid[0, 0])
    evals, length, kl = (fig.add_subplot(grid[0, k], sharex=reward) for k in (1, 2, 3))
    panels = [fig.add_subplot(grid[1 + j // COLUMNS, j % COLUMNS], sharex=reward) for j in range(len(functions))]
    single = len(curves) == 1
    weights = []
    for i, c in enumerate(curves):
        prefix = "" if single else f"{c.name}: "
        weight = smoothing_weight(len(c.step)) if smoothing is None else smoothing
        weights.append(weight)
        _train_and_eval(reward, c, "reward", "eval_reward", weight, _colour(i), prefix)
        if "eval_answer_accuracy" in c.eval_rl:
            evals.plot(*_points(c.eval_step, c.eval_rl["eval_answer_accuracy"]), color=_colour(i), marker="o",
                       markersize=4, linestyle="--", label=f"{prefix}eval_answer_accuracy")
        # (points where known: a step that reused its round's completions, rl.num_iterations, sampled none)
        length.plot(*_points(c.step, c.rl.get("completions/mean_length", [])), color=_colour(i),
                    label=f"{prefix}mean length")
        if "kl" in c.rl:
            kl.plot(*_points(c.step, c.rl["kl"]), color=_colour(i), label=f"{prefix}kl")
        elif "entropy" in c.rl:
            kl.plot(*_points(c.step, c.rl["entropy"]), color=_colour(i), label=f"{prefix}entropy (no kl: rl.beta is 0)")
        else:
            kl.plot(c.step, _nan(c.loss), color=_colour(i), alpha=0.6, label=f"{prefix}loss (no kl: rl.beta is 0)")
        for j, (ax, name) in enumerate(zip(panels, functions)):
            colour = _colour(j + 1 if single else i)  # one run: each function its own colour
            _train_and_eval(ax, c, f"rewards/{name}/mean", f"eval_rewards/{name}/mean", weight, colour, prefix)
    reward.set_title("reward: the weighted sum")
    evals.set_title("eval_answer_accuracy (greedy)")
    length.set_title("completions/mean_length (tokens)")
    kl.set_title("kl to the reference" if any("kl" in c.rl for c in curves) else
                 "entropy (rl.beta is 0: no kl)" if any("entropy" in c.rl for c in curves) else
                 "loss (rl.beta is 0: no kl)")
    for ax, name in zip(panels, functions):
        ax.set_title(f"rewards/{name}/mean")
    for ax in (reward, evals, length, kl, *panels):
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("step")
    if not any(c.eval_rl.get("eval_answer_accuracy") for c in curves):
        evals.text(0.5, 0.5, "no eval lines (set data.eval_split)" if not any(c.eval_step for c in curves)
                   else "no answer_match reward", transform=evals.transAxes, ha="center")
    _legend(fig, curves, weights)
    fig.suptitle("\n".join(_title(c) for c in curves))


def _colour(k: int) -> str:
    return COLOURS[k % len(COLOURS)]


def _train_and_eval(ax, c: Curves, key: str, eval_key: str, weight: float, colour: str, prefix: str) -> None:
    """One quantity in its panel: the train values raw (faint where a smoothed curve is drawn over them), smoothed
    where `weight` > 0, and the eval values (greedy completions) as points joined by a dashed line."""
    values = c.rl.get(key, [])
    if weight > 0:
        ax.plot(*_points(c.step, values), color=colour, alpha=0.3, linewidth=0.8, label=f"{prefix}{key} (raw)")
        ax.plot(*_points(c.step, ema(values, weight)), color=colour, linewidth=1.8,
                label=f"{prefix}{key} (EMA {weight:.2g})")
    else:  # too few points to smooth: the raw curve is the one to read
        ax.plot(*_points(c.step, values), color=colour, linewidth=1.5, label=f"{prefix}{key} (raw)")
    if eval_key in c.eval_rl:
        ax.plot(*_points(c.eval_step, c.eval_rl[eval_key]), color=colour, marker="o", markersize=4, linestyle="--",
                label=f"{prefix}{eval_key}")


def _legend(fig, curves: list[Curves], weights: list[float]) -> None:
    """One legend below the panels, outside the data: what each line style means (and each colour, for several
    runs)."""
    from matplotlib.lines import Line2D

    handles = []
    if any(w > 0 for w in weights):
        shown = sorted({f"{w:.2g}" for w in weights if w > 0})
        handles += [Line2D([], [], color="grey", alpha=0.4, linewidth=0.8, label="train, each logged step (raw)"),
                    Line2D([], [], color="grey", linewidth=1.8,
                           label=f"train, smoothed (exponential moving average, weight {'/'.join(shown)})")]
    if any(w == 0 for w in weights):
        handles.append(Line2D([], [], color="grey", linewidth=1.5,
                              label="train, each logged step (raw: too few points to smooth)"))
    handles.append(Line2D([], [], color="grey", marker="o", markersize=4, linestyle="--",
                          label="eval: greedy completions of the eval prompts"))
    if len(curves) > 1:
        handles += [Line2D([], [], color=_colour(i), linewidth=3, label=c.name) for i, c in enumerate(curves)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize="small")


def _title(c: Curves) -> str:
    last = next((v for v in reversed(c.rl["reward"]) if v is not None), None)
    text = f"{c.name}: step {c.step[-1]}" + (f", last reward {last:.3g}" if last is not None else "")
    for key in ("eval_answer_accuracy", "eval_reward"):
        known = [(v, s) for v, s in zip(c.eval_rl.get(key, []), c.eval_step) if v is not None]
        if known:
            text += f", {key} {known[0][0]:.3g} at step {known[0][1]} -> {known[-1][0]:.3g} at step {known[-1][1]}"
            break
    return text
