"""loss.png and `llmtrain plot`: metrics.jsonl files written by hand, the real CLI in a subprocess, the image
opened and measured, and the plotted data read back from the figure."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from helpers import ENV, LLMTRAIN, cli, invoke

from llmtrain.errors import LLMTrainError
from llmtrain.run.plot import default_plot_path, ema, plot_runs, read_curves, smoothing_weight, update_loss_plot

# figsize (13, 7.5) inches at 100 dpi
PNG_SIZE = (1300, 750)


def write_metrics(run, *, steps: int = 30, skipped=(7,), eval_every: int = 10, scale: float = 1.0, tail: str = ""):
    """A run folder whose metrics.jsonl holds `steps` train lines (loss null at `skipped`) and an eval line every
    `eval_every` steps, as the trainer writes them; returns the records."""
    run.mkdir(parents=True, exist_ok=True)
    lines, tokens = [], 0
    for step in range(1, steps + 1):
        tokens += 100 + step  # uneven tokens per step: the tokens axis is not the step axis scaled
        loss = None if step in skipped else scale * (1.0 + 2.0 / step)
        lines.append({"type": "train", "step": step, "loss": loss, "lr": 1e-3 * step / steps, "tokens_seen": tokens,
                      "grad_norm": 0.5, "skipped": step in skipped})
        if step % eval_every == 0:
            lines.append({"type": "eval", "step": step, "eval_loss": scale * (1.1 + 2.0 / step), "eval_ppl": 3.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + tail)
    return lines


def lines_by_label(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def png_size(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def test_plot_one_run_cli_writes_loss_png_in_the_run(tmp_path):
    run = tmp_path / "run"
    records = write_metrics(run)
    proc = invoke("plot", str(run))
    out = run / "loss.png"
    assert proc.stdout.strip() == str(out)  # the path alone for scripts; what it is on stderr (issue 53)
    assert f"wrote the curves of 1 run ({run}) to {out}" in proc.stderr
    assert png_size(out) == PNG_SIZE
    assert not list(run.glob(".*.tmp"))  # written under a temporary name, then renamed

    # The data drawn: raw loss with a gap at the skipped step, its EMA, eval loss, lr; against steps and tokens.
    fig = plot_runs([run], tmp_path / "again.png")
    loss_steps, loss_tokens, lr_steps, lr_tokens = fig.axes
    train = [r for r in records if r["type"] == "train"]
    tokens_at = {r["step"]: r["tokens_seen"] for r in train}
    drawn = lines_by_label(loss_steps)
    x, y = drawn["train loss"]
    assert x == list(range(1, 31))
    assert math.isnan(y[6]) and y[0] == pytest.approx(3.0) and y[29] == pytest.approx(1.0 + 2 / 30)
    weight = smoothing_weight(30)
    x, y = drawn[f"train loss (EMA {weight:.2g})"]
    assert 7 not in x and len(x) == 29  # the average runs through the skipped step
    assert y == pytest.approx([v for v in ema([r["loss"] for r in train], weight) if v is not None])
    assert drawn["eval loss"] == ([10, 20, 30], pytest.approx([1.1 + 2 / s for s in (10, 20, 30)]))
    x, _ = lines_by_label(loss_tokens)["eval loss"]
    assert x == [tokens_at[10], tokens_at[20], tokens_at[30]]
    x, _ = lines_by_label(loss_tokens)["train loss"]
    assert x == [tokens_at[s] for s in range(1, 31)]
    (x, y), = lines_by_label(lr_steps).values()
    assert x == list(range(1, 31)) and y == pytest.approx([1e-3 * s / 30 for s in range(1, 31)])
    (x, _), = lines_by_label(lr_tokens).values()
    assert x == [tokens_at[s] for s in range(1, 31)]
    assert loss_steps.get_yscale() == "linear"
    assert "best eval loss 1.167 at step 30" in fig._suptitle.get_text()


def test_plot_several_runs_overlaid(tmp_path):
    a, b = tmp_path / "lr1e-3", tmp_path / "lr3e-4"
    write_metrics(a)
    write_metrics(b, steps=20, scale=0.5, skipped=())
    out = tmp_path / "cmp" / "both.png"
    proc = invoke("plot", str(a), str(b), "--out", str(out))
    assert proc.stdout.strip() == str(out)
    assert png_size(out) == PNG_SIZE
    assert "replaced" not in proc.stderr
    again = invoke("plot", str(a), str(b), "--out", str(out))  # an image there already is said to be replaced
    assert "(it replaced the plot there; --out names another)" in " ".join(again.stderr.split())

    fig = plot_runs([a, b], out)
    drawn = lines_by_label(fig.axes[0])
    assert drawn["lr1e-3: eval loss"][0] == [10, 20, 30]
    assert drawn["lr3e-4: eval loss"] == ([10, 20], pytest.approx([0.5 * (1.1 + 2 / s) for s in (10, 20)]))
    assert drawn["lr3e-4: train loss"][0] == list(range(1, 21))
    assert set(lines_by_label(fig.axes[2])) == {"lr1e-3", "lr3e-4"}  # one lr curve per run, named

    # Without --out, several runs go to ./loss-compare.png (not into one run's own loss.png).
    proc = subprocess.run([*LLMTRAIN, "plot", str(a), str(b)], env=ENV, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert png_size(tmp_path / "loss-compare.png") == PNG_SIZE
    assert not (a / "loss.png").exists()


def test_plot_errors_are_one_paragraph_exit_2(tmp_path):
    missing = cli("plot", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2
    assert f"Run folder '{tmp_path / 'nope'}' does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr

    (tmp_path / "empty").mkdir()
    not_a_run = cli("plot", str(tmp_path / "empty"), check=False)
    assert not_a_run.returncode == 2
    assert "has no metrics.jsonl" in not_a_run.stderr and "output_dir" in not_a_run.stderr
    assert len(not_a_run.stderr.strip().splitlines()) <= 3  # one paragraph (wrapped by the terminal width)

    write_metrics(tmp_path / "run")
    bad_suffix = cli("plot", str(tmp_path / "run"), "--out", str(tmp_path / "x.docx"), check=False)
    assert bad_suffix.returncode == 2 and "'.docx' is not one matplotlib writes" in bad_suffix.stderr
    twice = cli("plot", str(tmp_path / "run"), str(tmp_path / "run") + "/", check=False)  # one label, twice drawn
    assert twice.returncode == 2 and f"'{tmp_path / 'run'}' is given twice: give each run once." in twice.stderr


def test_damaged_and_partial_lines(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, steps=3, eval_every=10, tail='{"type": "train", "st')  # being written right now: ignored
    assert read_curves(run).step == [1, 2, 3]

    with (run / "metrics.jsonl").open("a") as f:  # the cut line is now followed by others: damaged
        f.write("\n" + json.dumps({"type": "train", "step": 4, "loss": 1.0}) + "\n")
    with pytest.raises(LLMTrainError, match=r"metrics.jsonl, line 4: not a metrics line \(JSONDecodeError"):
        read_curves(run)

    (run / "metrics.jsonl").write_text('{"type": "eval", "step": 1, "eval_loss": 1.0}\n')
    with pytest.raises(LLMTrainError, match="holds no train lines yet"):
        read_curves(run)


def test_last_line_of_a_step_wins_and_eval_tokens_come_from_the_train_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"type": "train", "step": 1, "loss": 5.0, "lr": 1.0, "tokens_seen": 10},
            {"type": "train", "step": 2, "loss": 9.0, "lr": 1.0, "tokens_seen": 20},
            {"type": "train", "step": 2, "loss": 4.0, "lr": 1.0, "tokens_seen": 25},  # a re-run of step 2
            {"type": "eval", "step": 3, "eval_loss": 3.5},  # no train line at 3: the last one before it
            {"type": "train", "step": 4, "loss": float("nan"), "lr": 1.0, "tokens_seen": 40}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = read_curves(run)
    assert (c.step, c.loss, c.tokens) == ([1, 2, 4], [5.0, 4.0, None], [10, 25, 40])
    assert (c.eval_step, c.eval_loss, c.eval_tokens) == ([3], [3.5], [25])


def test_loss_axis_turns_logarithmic_for_a_wide_range(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"type": "train", "step": s, "loss": 10.0 / s ** 2, "lr": 1e-3, "tokens_seen": 10 * s}
            for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot_runs([run], run / "loss.png")
    assert fig.axes[0].get_yscale() == "log" and fig.axes[1].get_yscale() == "log"


def test_a_loss_at_or_below_zero_keeps_the_axis_linear_so_every_run_is_drawn(tmp_path):
    """An online-RL run's loss (often negative) overlaid on a supervised run's wide range: on a log axis the RL run's
    lines would be in the legend and nowhere on the plot."""
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    for run, losses in ((sft, [10.0 / s ** 2 for s in range(1, 21)]), (rl, [0.05 - 0.01 * s for s in range(1, 21)])):
        run.mkdir()
        run.joinpath("metrics.jsonl").write_text("".join(json.dumps({"type": "train", "step": s, "loss": v, "lr": 1e-3,
                                                                    "tokens_seen": 10 * s}) + "\n"
                                                         for s, v in enumerate(losses, start=1)))
    fig = plot_runs([sft, rl], tmp_path / "both.png")
    assert fig.axes[0].get_yscale() == "linear"
    low, _ = fig.axes[0].get_ylim()
    assert low < -0.1  # the RL run's last losses are on the plot


def test_a_short_run_draws_its_raw_loss_without_an_ema_0_line(tmp_path):
    """20 points or fewer are not smoothed: no "train loss (EMA 0)" copy of the raw curve; the raw one is solid."""
    run = tmp_path / "short"
    write_metrics(run, steps=12, skipped=())
    fig = plot_runs([run], run / "loss.png")
    (line,) = fig.axes[0].get_lines()[:1]
    assert [x.get_label() for x in fig.axes[0].get_lines()] == ["train loss", "eval loss"]
    assert line.get_alpha() == 1.0


def test_a_run_of_one_logged_step_draws_its_point(tmp_path):
    """A line of one point without a marker draws nothing: a 1-step run's plot had empty axes."""
    run = tmp_path / "one"
    write_metrics(run, steps=1, skipped=(), eval_every=10)
    fig = plot_runs([run], run / "loss.png")
    for ax in fig.axes[:4]:
        assert [line.get_marker() for line in ax.get_lines()] == ["o"], ax
    write_metrics(run, steps=2, skipped=(), eval_every=10)  # two points: a line, as before
    assert {line.get_marker() for line in plot_runs([run], run / "loss.png").axes[0].get_lines()} == {"None"}


def test_ema_and_smoothing_weight():
    assert ema([1.0, None, 3.0, float("nan")], 0.5) == [1.0, None, pytest.approx((0.25 + 1.5) / 0.75), None]
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards zero
    assert smoothing_weight(10) == 0.0 and smoothing_weight(20) == 0.0
    assert smoothing_weight(100) == pytest.approx(0.8) and smoothing_weight(1000) == pytest.approx(0.98)


def test_default_path_and_the_trainers_update(tmp_path):
    run = tmp_path / "run"
    write_metrics(run)
    assert default_plot_path([run]) == run / "loss.png"
    assert default_plot_path([run / "metrics.jsonl"]) == run / "loss.png"
    assert default_plot_path([run, run]).name == "loss-compare.png"
    assert update_loss_plot(run) is None and png_size(run / "loss.png") == PNG_SIZE
    # A run folder the plot cannot read gives a warning line, never an exception that would end training.
    note = update_loss_plot(tmp_path / "elsewhere")
    assert note.startswith("warning:") and "not updated" in note and "does not exist" in note


SEVEN = {"answer_match": (0.2, 0.003), "format": (0.6, 0.003), "tagged": (0.1, 0.005), "brevity": (-14.0, 0.05),
         "python_ok": (0.8, 0.001), "think": (0.3, -0.001), "lang": (0.95, 0.0)}  # name: (first value, slope)


def write_rl_metrics(run, *, steps: int = 20, kl: bool = True, functions=None):
    """An online RL run's metrics.jsonl as the trainer writes it: TRL's names on the train lines, eval lines from
    step 0 with the greedy answer accuracy. `functions`: {name: (value at step 0, change a step)}, by default
    answer_match rising and format flat."""
    functions = functions or {"answer_match": (0.05, 0.01), "format": (0.5, 0.0)}
    run.mkdir(parents=True, exist_ok=True)

    def means(prefix: str, step: int, offset: float = 0.0) -> dict:  # the train values wiggle, as sampled ones do
        wiggle = 0.0 if offset else 0.04 * math.sin(1.7 * step)
        return {f"{prefix}/{n}/mean": first + offset + slope * step + wiggle * max(1.0, abs(first))
                for n, (first, slope) in functions.items()}

    lines = [{"type": "eval", "step": 0, "eval_reward": 0.3, **means("eval_rewards", 0, 0.05),
              "eval_answer_accuracy": 0.3}]
    for step in range(1, steps + 1):
        lines.append({"type": "train", "step": step, "loss": 0.001 * (-1) ** step, "lr": 5e-5,
                      "tokens_seen": 1000 * step, "reward": 0.1 + 0.01 * step, **means("rewards", step),
                      "completions/mean_length": 10.0 - 0.1 * step, **({"kl": 0.001 * step} if kl else {})})
        if step % 10 == 0:
            lines.append({"type": "eval", "step": step, "eval_reward": 0.3 + 0.01 * step,
                          **means("eval_rewards", step, 0.05), "eval_answer_accuracy": 0.3 + 0.01 * step})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_an_rl_run_plots_reward_eval_accuracy_length_and_kl_against_steps(tmp_path):
    """loss.png of an online RL run: the reward (raw; 20 points are too few to smooth, and the label says so) with
    the eval reward, eval_answer_accuracy from step 0, the completions' mean length and the KL, each against
    steps; each of the two reward functions in a panel of its own; without beta the KL panel is the loss.
    `llmtrain plot` draws the same figure."""
    from llmtrain.run.rl_plot import rl_figure_size

    run = tmp_path / "rl"
    write_rl_metrics(run)
    fig = plot_runs([run], run / "loss.png")
    reward, evals, length, kl, answer_match, format_ = fig.axes
    drawn = lines_by_label(reward)
    assert list(drawn) == ["reward (raw)", "eval_reward"]  # no "EMA 0": nothing is smoothed
    assert drawn["reward (raw)"] == (list(range(1, 21)), pytest.approx([0.1 + 0.01 * s for s in range(1, 21)]))
    assert drawn["eval_reward"] == ([0, 10, 20], pytest.approx([0.3, 0.4, 0.5]))
    assert lines_by_label(evals)["eval_answer_accuracy"] == ([0, 10, 20], pytest.approx([0.3, 0.4, 0.5]))
    assert lines_by_label(length)["mean length"][1] == pytest.approx([10.0 - 0.1 * s for s in range(1, 21)])
    assert lines_by_label(kl)["kl"][1] == pytest.approx([0.001 * s for s in range(1, 21)])
    assert answer_match.get_title() == "rewards/answer_match/mean" and format_.get_title() == "rewards/format/mean"
    assert set(lines_by_label(format_)) == {"rewards/format/mean (raw)", "eval_rewards/format/mean"}
    assert "eval_answer_accuracy 0.3 at step 0 -> 0.5 at step 20" in fig._suptitle.get_text()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["train, each logged step (raw: too few points to smooth)",
                      "eval: greedy completions of the eval prompts"]
    assert png_size(run / "loss.png") == tuple(round(100 * x) for x in rl_figure_size(2))

    plain = tmp_path / "rl-no-kl"
    write_rl_metrics(plain, kl=False)
    fig = plot_runs([plain], plain / "loss.png")
    assert list(lines_by_label(fig.axes[3])) == ["loss (no kl: rl.beta is 0)"]
    # a run that logs the policy's entropy (GRPO and RLOO do) shows it there instead: a falling entropy is the
    # policy collapsing, which its loss (about 0) never shows
    lines = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        if line["type"] == "train":
            line["entropy"] = 2.0 - 0.05 * line["step"]
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = plot_runs([plain], plain / "loss.png")
    drawn = lines_by_label(fig.axes[3])
    assert list(drawn) == ["entropy (no kl: rl.beta is 0)"]
    assert fig.axes[3].get_title() == "entropy (rl.beta is 0: no kl)"
    assert drawn["entropy (no kl: rl.beta is 0)"][1] == pytest.approx([2.0 - 0.05 * s for s in range(1, 21)])

    invoke("plot", str(run), "--out", str(tmp_path / "cli.png"))
    assert png_size(tmp_path / "cli.png") == png_size(run / "loss.png")


def test_an_rl_run_with_rounds_draws_its_rewards_through_the_steps_that_sampled_nothing(tmp_path):
    """rl.num_iterations 2: the even steps reused their round's completions and log no reward, length or KL (RLOO
    logs its KL with the rollout). Their lines join the steps that sampled, rather than falling apart into points
    that draw nothing."""
    run = tmp_path / "rounds"
    write_rl_metrics(run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sampled = {"reward", "rewards/answer_match/mean", "rewards/format/mean", "completions/mean_length", "kl"}
    for line in lines:
        if line["type"] == "train" and line["step"] % 2 == 0:
            for key in sampled:
                del line[key]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    reward, _, length, kl, *_ = plot_runs([run], run / "loss.png").axes
    odd = list(range(1, 21, 2))
    assert lines_by_label(reward)["reward (raw)"] == (odd, pytest.approx([0.1 + 0.01 * s for s in odd]))
    assert lines_by_label(length)["mean length"][0] == odd
    assert lines_by_label(kl)["kl"][0] == odd


def test_seven_rewards_get_a_panel_a_scale_and_a_colour_each_and_the_legend_is_outside_the_data(tmp_path):
    """A length penalty near -14 beside 0-1 rewards: each on its own axis (its y-range its data's), in its own colour;
    100 steps are smoothed, and the legend (below the panels, overlapping none) says with what."""
    run = tmp_path / "rl7"
    write_rl_metrics(run, steps=100, functions=SEVEN)
    fig = plot_runs([run], run / "loss.png")
    panels = fig.axes[4:]
    assert [ax.get_title() for ax in panels] == [f"rewards/{n}/mean" for n in SEVEN]
    colours = []
    for ax, name in zip(panels, SEVEN):
        drawn = lines_by_label(ax)
        assert set(drawn) == {f"rewards/{name}/mean (raw)", f"rewards/{name}/mean (EMA 0.8)",
                              f"eval_rewards/{name}/mean"}
        low, high = ax.get_ylim()
        values = [*drawn[f"rewards/{name}/mean (raw)"][1], *drawn[f"eval_rewards/{name}/mean"][1]]
        assert low <= min(values) and max(values) <= high and high - low < 1.5 * (max(values) - min(values))
        colours.append(ax.get_lines()[0].get_color())
    assert len(set(colours)) == 7 and "C7" not in colours  # and none the legend's grey
    assert fig.axes[0].get_ylim()[0] > -1  # the weighted sum's axis is not stretched to -14 either
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    assert "train, smoothed (exponential moving average, weight 0.8)" in [t.get_text()
                                                                          for t in fig.legends[0].get_texts()]


def write_mode_metrics(run, train: dict, evals: dict, *, steps: int = 30, eval_every: int = 10):
    """A KTO, reward-model or distillation run's metrics.jsonl: a falling loss, and each of `train` / `evals` (name:
    value at step s) on the train / eval lines, as the trainer writes them."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        lines.append({"type": "train", "step": step, "loss": 0.7 - 0.01 * step, "lr": 1e-4, "tokens_seen": 100 * step,
                      **{k: f(step) for k, f in train.items()}})
        if step % eval_every == 0:
            lines.append({"type": "eval", "step": step, "eval_loss": 0.72 - 0.01 * step,
                          **{k: f(step) for k, f in evals.items()}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


MARGIN, RM_ACCURACY, RM_MARGIN = ("reward margin, chosen - rejected (DPO, KTO)",
                                  "reward model: pairs scored the right way round",
                                  "reward model: score margin, chosen - rejected")
AGREEMENT, ANSWERS = ("distillation: the student's top token is the teacher's",
                      "answer accuracy (greedy completions of the eval prompts)")
BALANCE = "routers' load-balancing loss (model.router_aux_loss_coef; top_k when balanced)"
REWARD = "online RL: reward (train: the sampled completions'; eval: greedy)"
KL = "KL to the reference (KTO: the baseline its rewards are measured from; online RL)"


@pytest.mark.parametrize("mode, train, evals, panels", [
    ("kto", {"rewards/margins": lambda s: 0.1 * s, "kl": lambda s: 0.02 * s},  # its KL, the console's first (audit 40)
     {"eval_rewards/margins": lambda s: 0.09 * s, "eval_kl": lambda s: 0.015 * s},
     [(MARGIN, "rewards/margins", "eval_rewards/margins"), (KL, "kl", "eval_kl")]),
    ("reward", {"accuracy": lambda s: 0.5 + s / 100, "margin": lambda s: 0.2 * s},
     {"eval_accuracy": lambda s: 0.5 + s / 120, "eval_margin": lambda s: 0.15 * s},
     [(RM_ACCURACY, "accuracy", "eval_accuracy"), (RM_MARGIN, "margin", "eval_margin")]),
    ("distill", {"teacher_agreement": lambda s: 0.3 + s / 100},
     {"eval_teacher_agreement": lambda s: 0.3 + s / 110, "eval_answer_accuracy": lambda s: 0.2 + s / 200},
     [(AGREEMENT, "teacher_agreement", "eval_teacher_agreement"), (ANSWERS, None, "eval_answer_accuracy")]),
    ("moe-dpo", {"rewards/margins": lambda s: 0.1 * s, "aux_loss": lambda s: 2.2 - s / 100},
     {"eval_rewards/margins": lambda s: 0.09 * s},
     [(MARGIN, "rewards/margins", "eval_rewards/margins"), (BALANCE, "aux_loss", None)]),
])
def test_each_mode_plots_its_own_measure_under_the_loss(tmp_path, mode, train, evals, panels):
    """KTO's reward margin, a reward model's accuracy and margin, distillation's teacher agreement and answer accuracy,
    a mixture of experts' load-balancing loss (aux_loss, train lines only): a panel each under the loss, the train
    values and the eval values as logged (issue 53, item 9)."""
    run = tmp_path / mode
    write_mode_metrics(run, train, evals)
    fig = plot_runs([run], run / "loss.png")
    assert [ax.get_title() for ax in fig.axes[4:]] == [title for title, _, _ in panels]
    for ax, (_, train_key, eval_key) in zip(fig.axes[4:], panels):
        drawn = lines_by_label(ax)
        assert set(drawn) == {k for k, key in (("train", train_key), ("eval", eval_key)) if key}
        if train_key:
            assert drawn["train"] == (list(range(1, 31)), [train[train_key](s) for s in range(1, 31)])
        if eval_key:
            assert drawn["eval"] == ([10, 20, 30], [evals[eval_key](s) for s in (10, 20, 30)])
    assert png_size(run / "loss.png") == (1300, 1050)


def test_sft_beside_an_rl_run_keeps_a_linear_axis_and_no_eval_loss_it_has_not(tmp_path):
    """RLOO's loss (about 3e-9) beside an SFT run falling from 10: no log axis stretched over ten decades, the RL run's
    loss said to be about 0 by construction, and no "eval loss" for a run whose eval lines carry none (issue 53,
    item 9)."""
    sft, rl = tmp_path / "sft", tmp_path / "rloo"
    sft.mkdir()
    sft.joinpath("metrics.jsonl").write_text("".join(json.dumps({"type": "train", "step": s, "loss": 10.0 / s ** 2,
                                                                 "lr": 1e-3, "tokens_seen": 10 * s}) + "\n"
                                                     for s in range(1, 21)))
    write_rl_metrics(rl, steps=20)
    text = rl.joinpath("metrics.jsonl").read_text().replace('"loss": 0.001', '"loss": 3e-09').replace(
        '"loss": -0.001', '"loss": 3e-09')
    rl.joinpath("metrics.jsonl").write_text(text)
    fig = plot_runs([sft, rl], tmp_path / "both.png")
    assert fig.axes[0].get_yscale() == "linear"
    labels = list(lines_by_label(fig.axes[0]))
    assert "rloo: train loss (online RL: about 0 by construction)" in labels
    assert not any(label.startswith("rloo: eval loss") for label in labels)
    # the RL run's own measures under the loss, as a DPO run's are (it had none: its reward was not drawn at all)
    assert [ax.get_title() for ax in fig.axes[4:]] == [KL, ANSWERS, REWARD]
    assert lines_by_label(fig.axes[4]) == {"rloo: train": (list(range(1, 21)),
                                                           pytest.approx([0.001 * s for s in range(1, 21)]))}
    assert lines_by_label(fig.axes[5]) == {"rloo: eval": ([0, 10, 20], [0.3, 0.4, 0.5])}
    reward = lines_by_label(fig.axes[6])
    assert set(reward) == {"rloo: train", "rloo: eval"} and reward["rloo: eval"] == ([0, 10, 20], [0.3, 0.4, 0.5])
    assert reward["rloo: train"] == (list(range(1, 21)), pytest.approx([0.1 + 0.01 * s for s in range(1, 21)]))


def test_an_out_that_is_not_a_plot_of_llmtrains_is_never_replaced(tmp_path):
    """`plot --out report.pdf` had replaced any file of an image's suffix (a JSON file named .png became a PNG), and a
    folder ended in a traceback with a temporary image left (audit 46). A plot llmtrain drew is still replaced (said),
    whatever its format."""
    write_metrics(tmp_path / "run")
    mine = tmp_path / "report.pdf"
    mine.write_bytes(b"%PDF-1.4 my report")
    refused = cli("plot", str(tmp_path / "run"), "--out", str(mine), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"--out '{mine}' already exists and is not a plot llmtrain drew" in " ".join(refused.stderr.split())
    assert mine.read_bytes() == b"%PDF-1.4 my report"
    (tmp_path / "dir.png").mkdir()
    folder = cli("plot", str(tmp_path / "run"), "--out", str(tmp_path / "dir.png"), check=False)
    assert folder.returncode == 2 and "is a folder" in folder.stderr and "Traceback" not in folder.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "report.pdf", "run"]
    for name in ("curves.pdf", "curves.svg", "curves.png", "curves.eps", "curves.jpg"):  # (jpg holds no mark)
        invoke("plot", str(tmp_path / "run"), "--out", str(tmp_path / name))
        again = invoke("plot", str(tmp_path / "run"), "--out", str(tmp_path / name))
        assert "(it replaced the plot there" in " ".join(again.stderr.split())
