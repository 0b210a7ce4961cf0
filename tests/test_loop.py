"""The loop's parts, in-process and pure: the cadence (when to log, evaluate, save), the meter (speed and the
metrics line), TrainState.advance, the data plan (built once per epoch), and the objective's counts."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from llmtrain.data.batching import Counts, DataPlan, StandIn, Window
from llmtrain.loop.cadence import Cadence
from llmtrain.loop.meter import Meter
from llmtrain.loop.step import StepResult
from llmtrain.objectives.objective import CausalLM
from llmtrain.run.metrics import FlopModel
from llmtrain.run.state import TrainState


def cadence(**kw) -> Cadence:
    return Cadence(**{"total_steps": 20, "log_every": 5, "eval_every": None, "save_every": None, "has_eval": True,
                      **kw})


def test_cadence_logs_every_n_and_the_last_step():
    c = cadence(log_every=5, has_eval=False)
    assert [s for s in range(1, 21) if c.at(s).log] == [5, 10, 15, 20]
    assert not any(c.at(s).eval or c.at(s).save for s in range(1, 21))


def test_cadence_evaluates_every_n_and_always_at_the_end_when_there_is_eval_data():
    assert [s for s in range(1, 21) if cadence(eval_every=6).at(s).eval] == [6, 12, 18, 20]
    assert [s for s in range(1, 21) if cadence(eval_every=None).at(s).eval] == [20]
    assert not any(cadence(eval_every=6, has_eval=False).at(s).eval for s in range(1, 21))


def test_cadence_saves_every_n_and_on_a_stop_request():
    c = cadence(save_every=3, log_every=7)
    assert [s for s in range(1, 21) if c.at(s).save] == [3, 6, 9, 12, 15, 18]
    assert c.at(4, stop=True).save and c.at(4, stop=True).log
    assert not cadence(save_every=None).at(4).save


@pytest.mark.parametrize("log_every, eval_every, save_every",
                         list(itertools.product([1, 3, 7], [None, 2, 5], [None, 3, 4])))
def test_every_save_eval_and_skipped_step_is_a_logged_step(log_every, eval_every, save_every):
    """Why (cadence.py): a resume re-meters from the checkpoint, so the last line before it must end at its step;
    an eval line follows its step's train line; a skipped update is on record before the guard can stop."""
    c = cadence(total_steps=23, log_every=log_every, eval_every=eval_every, save_every=save_every)
    for step in range(1, 24):
        for stop, skipped in itertools.product([False, True], repeat=2):
            due = c.at(step, stop=stop, skipped=skipped)
            assert not (due.save or due.eval or skipped) or due.log, (step, stop, skipped, due)


class FakeAccelerator:
    num_processes = 2
    device = torch.device("cpu")


def result(loss_sum: float, counts: Counts, *, lr=1e-3, grad_norm=1.0, skipped=False) -> StepResult:
    return StepResult(loss_sum=torch.tensor(loss_sum), stats_sum=torch.zeros(0), counts=counts, grad_norm=grad_norm,
                      lr=lr, skipped=skipped, stop_voted=False)


def test_meter_line_reports_the_last_step_and_the_speed_since_the_last_line(monkeypatch):
    clock = iter([100.0, 104.0, 105.0, 110.0, 112.0]).__next__
    monkeypatch.setattr("llmtrain.loop.meter.time.perf_counter", clock)
    monkeypatch.setattr("llmtrain.loop.meter.data_sum", lambda acc, *v: [x * 2 for x in v])  # two data ranks, alike
    meter = Meter(FakeAccelerator(), flops=FlopModel(1.0, 10.0, 0.5), peak=100.0, resumed_s=40.0,
                  setup_s=10.0)  # t=100: 40 s before the resume, a 10 s reference pass
    state = TrainState(step=2, tokens_seen=700)
    meter.add(result(3.0, Counts(units=10, trained=10, tokens=300, squares=900)), epoch=0)
    meter.add(result(4.0, Counts(units=20, trained=20, tokens=400, squares=1600), lr=5e-4), epoch=1)
    with meter.paused():  # t=104 -> 105: an eval, left out of the speed
        pass
    line = meter.line(state)  # t=110: 10 s since the start, 1 of them paused
    assert line["loss"] == pytest.approx(2 * 4.0 / 20)  # the last step's summed loss over both ranks / its units
    assert line["lr"] == 5e-4 and line["epoch"] == 1 and line["tokens"] == 400 and line["trained_tokens"] == 20
    assert line["tokens_per_s"] == pytest.approx(700 / 9) and line["tokens_per_s_per_gpu"] == pytest.approx(700 / 18)
    flops = 700 * 1.0 + 30 * 10.0 + 2500 * 0.5
    assert line["mfu"] == pytest.approx(flops / 9 / 2 / 100.0)
    assert line["elapsed_s"] == pytest.approx(60.0) and line["tokens_seen"] == 700  # the run's clock continues
    assert meter.pending == []
    summary = meter.summary()  # t=112: 12 s in this process, 1 s of it eval
    assert summary["train_time_s"] == pytest.approx(62.0) and summary["process_time_s"] == pytest.approx(12.0)
    assert summary["resumed_time_s"] == 40.0 and summary["setup_time_s"] == 10.0
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(700 / 2 / 11)
    assert summary["wall_tokens_per_s_per_gpu"] == pytest.approx(700 / 2 / 12)
    assert summary["final_loss"] == line["loss"]


def test_a_summarys_time_parts_add_up_and_a_process_that_trained_nothing_has_no_speed(monkeypatch, tmp_path):
    """Each part floored alone had read '0:00:26 (loop 0:00:18; 0:00:07 before the resume)' for 26.57 = 18.94 +
    7.63; a resume that only finishes a run (final/ and the summary) wrote a speed of 0.0."""
    from rich.console import Console

    from llmtrain.run.console import summary_table

    summary = {"steps": 3, "tokens_seen": 100, "train_time_s": 26.57, "process_time_s": 18.94,
               "resumed_time_s": 7.63, "tokens_per_s_per_gpu": 50.0, "wall_tokens_per_s_per_gpu": 40.0}
    console = Console(record=True, width=300)
    console.print(summary_table(summary, out=tmp_path, evals=[]))
    assert "0:00:26 (this process's loop 0:00:19; 0:00:07 before the resume)" in console.export_text()
    clock = iter([100.0, 103.0]).__next__
    monkeypatch.setattr("llmtrain.loop.meter.time.perf_counter", clock)
    finished = Meter(FakeAccelerator(), flops=FlopModel(1.0, 10.0, 0.5), peak=None, resumed_s=40.0).summary()
    assert finished["tokens_per_s_per_gpu"] is None and finished["wall_tokens_per_s_per_gpu"] is None
    console.print(summary_table({**summary, **finished}, out=tmp_path, evals=[]))
    assert "none: this process trained no step" in console.export_text()


def test_meter_line_averages_the_objectives_statistics_over_the_steps_since_the_last_line(monkeypatch):
    """A preference run's rewards/accuracies with 4 pairs a step and logging.every_steps 2: the mean over the 8
    pairs of both steps (3 + 1 right of 8), not the last step's 1 of 4."""
    from llmtrain.config import PreferenceConfig
    from llmtrain.objectives.preference import Preference

    monkeypatch.setattr("llmtrain.loop.meter.data_sum", lambda acc, *v: list(v))
    meter = Meter(FakeAccelerator(), flops=FlopModel(1.0, 10.0, 0.5), peak=None,
                  objective=Preference(PreferenceConfig(), pad_id=0, packing=True, reference="none"))
    pairs = Counts(units=4, trained=40, tokens=80, squares=800)
    for right in (3.0, 1.0):  # the stats: rewards chosen, rejected, accuracies (pairs right), margins, two logps,
        # then the token metrics' sums and the answers' tokens (preference.TOKEN_STATS, TOKEN_COUNTS)
        stats = torch.tensor([0.0, 0.0, right, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 20.0, 20.0])
        meter.add(dataclasses.replace(result(2.0, pairs), stats_sum=stats), epoch=0)
    assert meter.line(TrainState(step=2))["rewards/accuracies"] == pytest.approx(4 / 8)


def test_train_state_advances_tokens_every_step_and_rolls_the_epoch_over():
    state = TrainState()
    counts = Counts(units=5, trained=5, tokens=40, squares=400)
    state.advance(Window(epoch=0, end=4, epoch_done=False, batches=[], counts=counts), result(1.0, counts))
    got = (state.step, state.epoch, state.micro_in_epoch, state.tokens_seen, state.trained_tokens_seen)
    assert got == (1, 0, 4, 40, 5)
    state.advance(Window(epoch=0, end=8, epoch_done=True, batches=[], counts=counts),
                  result(1.0, counts, skipped=True, grad_norm=float("nan")))
    assert (state.step, state.epoch, state.micro_in_epoch, state.tokens_seen, state.bad_steps) == (2, 1, 0, 80, 1)


def test_data_plan_is_built_once_per_epoch_for_every_view(monkeypatch):
    import llmtrain.data.batching as B

    calls = []
    real = B.global_micro_batches
    monkeypatch.setattr(B, "global_micro_batches", lambda *a, **k: calls.append(k["epoch"]) or real(*a, **k))
    lengths = [5, 9, 3, 7, 2, 8, 4, 6, 1, 10]
    plan = DataPlan(lengths, seed=3, world=2, micro_batch_size=1, micro_batch_tokens=12)
    ranks = [plan.for_rank(r) for r in range(2)]
    assert plan.steps_per_epoch(0, 2) == -(-len(plan.epoch(0)) // 2)
    interleaved = [b for pair in zip(ranks[0](0), ranks[1](0)) for b in pair]
    assert [g[r] or g[0] for g in plan.epoch(0) for r in range(2)] == interleaved  # an empty place: rank 0's
    assert sorted(i for r in ranks for b in r(0) if not isinstance(b, StandIn) for i in b) == list(range(10))
    assert 0 < plan.packing_efficiency() <= 1 and plan.packing_efficiency() == sum(lengths) / (plan.bins() * 12)
    ranks[1](1)
    assert calls == [0, 1]  # the global plan and both ranks' views: one build per epoch


def test_a_run_of_very_many_epochs_or_steps_is_counted_without_planning_each_epoch(monkeypatch):
    """train.epochs=10**20 (train until stopped) had planned every epoch to count the steps before the first one
    (a hang), and a precomputed reference walked every step of the run to find the rows it trains."""
    import llmtrain.data.batching as B

    calls = []
    real = B.global_micro_batches
    monkeypatch.setattr(B, "global_micro_batches", lambda *a, **k: calls.append(k["epoch"]) or real(*a, **k))
    lengths = [5, 9, 3, 7, 2, 8, 4, 6, 1, 10, 3]
    rows = DataPlan(lengths, seed=3, world=2, micro_batch_size=2, micro_batch_tokens=None)
    assert rows.steps_in(3, 2) == sum(rows.steps_per_epoch(e, 2) for e in range(3)) == 3 * 2  # 3 global / epoch
    calls.clear()
    rows.epoch.cache_clear()
    assert rows.steps_in(10**20, 2) == 2 * 10**20 and calls == [0]
    assert rows.examples_in(10**18, 2) == list(range(11)) and calls == [0]  # every row is in the first epoch
    tokens = DataPlan(lengths, seed=3, world=2, micro_batch_size=1, micro_batch_tokens=12)
    assert tokens.steps_in(4, 1) == sum(tokens.steps_per_epoch(e, 1) for e in range(4))  # bins differ by epoch


def test_an_idle_ranks_stand_in_is_the_first_ranks_examples_with_weight_0_and_no_counts():
    """21 examples, global micro-batch 4 on 2 ranks: the epoch's last global micro-batch has one example, rank 1's
    place is empty. Rank 1 runs rank 0's example as a stand-in: the same tensors, batch_weight 0, Counts none; rank 0
    counts it. The loop (train_step) multiplies a stand-in's loss and statistics by its weight."""
    from llmtrain.data.batching import batch_weight, global_micro_batches, rank_view, windows

    rows = [{"input_ids": [1, 2, 3 + i % 5], "labels": [-100, 2, 3 + i % 5]} for i in range(21)]
    dataset = {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}

    class Rows:  # dataset[indices] as a datasets.Dataset answers it: columns of the selected rows
        def __getitem__(self, idx):
            return {c: [dataset[c][i] for i in idx] for c in dataset}

    plan = global_micro_batches(21, seed=0, epoch=0, world_size=2, micro_batch_size=2)
    assert plan[-1][1] == [] and len(plan[-1][0]) == 1
    objective = CausalLM(pad_id=0, packing=False)
    last = []
    for rank in range(2):
        *_, window = windows(Rows(), lambda epoch, r=rank: rank_view(plan, r), epoch=0, micro=0, steps=len(plan),
                             accum=1, collate=objective.collate, pin=False)
        last.append(window)
    (mine, counted), (stand_in, none) = [(w.batches[0], w.counts) for w in last]
    assert isinstance(rank_view(plan, 1)[-1], StandIn) and rank_view(plan, 1)[-1] == plan[-1][0]
    assert torch.equal(stand_in["input_ids"], mine["input_ids"]) and counted.units == 2
    assert (batch_weight(mine), batch_weight(stand_in)) == (1.0, 0.0) and none == Counts.none()


def test_causal_lm_counts_trained_and_real_tokens_and_nothing_for_an_idle_rank():
    objective = CausalLM(pad_id=0, packing=False)
    examples = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}, {"input_ids": [5, 6], "labels": [-100, 6]}]
    batch, counts = objective.collate(examples)
    # labels shift by one: 3 and 4 of the first example, 6 of the second are trained
    assert counts == Counts(units=3, trained=3, tokens=6, squares=16 + 4)
    assert batch["loss_targets"].tolist() == [3, 4, 6]
    assert objective.collate([])[1] == Counts(0, 0, 0, 0)
    assert counts.plus(counts) == Counts(6, 6, 12, 40)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_the_summary_says_where_the_logs_are_and_how_a_lora_adapter_becomes_a_model(method, tmp_path):
    from rich.console import Console

    from llmtrain.run.console import summary_table

    summary = {"steps": 3, "tokens_seen": 100, "train_time_s": 2.0, "process_time_s": 2.0,
               "tokens_per_s_per_gpu": 50.0, "wall_tokens_per_s_per_gpu": 40.0, "final_loss": 1.0,
               "method": method, "final": str(tmp_path / "final")}
    console = Console(record=True, width=300)
    console.print(summary_table(summary, out=tmp_path, evals=[]))
    text = " ".join(console.export_text().split())
    assert f"{tmp_path}/metrics.jsonl" in text and f"`llmtrain plot {tmp_path}`" in text
    assert (f"`llmtrain export {tmp_path} --merge`" in text) == (method != "full")
    assert "metrics.jsonl (every step and every eval)" in text
    console.print(summary_table(summary, out=tmp_path, evals=[], logged_every=10))  # not "every step" (issue 53)
    text = " ".join(console.export_text().split())
    assert "metrics.jsonl (every 10 steps (logging.every_steps) and every eval)" in text
    assert "about 0 by construction" not in text
    console.print(summary_table({**summary, "final_loss": 0.0}, out=tmp_path, evals=[], online_rl=True))
    text = " ".join(console.export_text().split())  # an online-RL run's 0.0000 says why (issue 53, item 9)
    assert ("0.0000 (online RL: about 0 by construction, each prompt's advantages average 0, or below 0 where the "
            "rewarded completions are the longer ones under loss_type dapo (each token weighs the same); the reward is "
            "the measure)") in text


def test_the_summarys_time_names_what_came_before_this_processs_loop():
    """A DPO run that was never resumed said "(this process 0:00:09; the rest before the resume)": the 2 s were its
    reference pass."""
    from rich.console import Console

    from llmtrain.run.console import summary_table

    def time_row(**times) -> str:
        summary = {"steps": 3, "tokens_seen": 100, "tokens_per_s_per_gpu": 50.0, "wall_tokens_per_s_per_gpu": 40.0,
                   "final_loss": 1.0, "method": "full", **times}
        console = Console(record=True, width=300)
        console.print(summary_table(summary, out=Path("runs/x"), evals=[]))
        rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in console.export_text().splitlines()
                if line.count("│") == 3}
        return rows["time"] + " | " + rows["tokens/s per GPU"]

    assert time_row(train_time_s=9.5, process_time_s=9.5) == "0:00:09 | 50 training, 40 with eval and checkpoints"
    assert time_row(train_time_s=11.4, process_time_s=9.2, setup_time_s=2.2) == (
        "0:00:11 (this process's loop 0:00:09; 0:00:02 the reference log-probabilities) | 50 training, 40 with eval "
        "and checkpoints (this process)")
    assert time_row(train_time_s=62.0, process_time_s=12.0, resumed_time_s=40.0, setup_time_s=10.0).startswith(
        "0:01:02 (this process's loop 0:00:12; 0:00:40 before the resume; 0:00:10 the reference log-probabilities)")


def test_the_summarys_best_eval_reward_says_where_it_was_and_what_came_after():
    """An online-RL run whose starting policy's eval stayed the best had said "-0.0764 (step 0; first -0.0764 at step
    0)"."""
    from rich.console import Console

    from llmtrain.run.console import summary_table

    summary = {"steps": 3, "tokens_seen": 100, "train_time_s": 2.0, "process_time_s": 2.0,
               "tokens_per_s_per_gpu": 50.0, "wall_tokens_per_s_per_gpu": 40.0, "final_loss": 0.0, "method": "lora"}

    def best(*rewards: float) -> str:
        console = Console(record=True, width=300)
        evals = [{"step": 10 * i, "eval_reward": r} for i, r in enumerate(rewards)]
        console.print(summary_table(summary, out=Path("runs/x"), evals=evals, online_rl=True))
        return next(line.split("│")[2].strip() for line in console.export_text().splitlines()
                    if "best eval reward" in line)

    assert best(0.2, 0.5, 0.4) == "0.5000 (step 10; first 0.2000 at step 0)"
    assert best(0.5, 0.2, 0.4) == "0.5000 (step 0; none of the 2 later evals higher)"
    assert best(0.5, 0.2) == "0.5000 (step 0; the later eval no higher)"
    assert best(0.5) == "0.5000 (step 0)"


def test_each_modes_console_line_shows_its_own_measure():
    """The step line names each mode's measure: a preference run's accuracy and margin, KTO's KL, distillation's
    agreement with its teacher (it had shown nothing of its own; audit 40), RL's reward."""
    from llmtrain.run.console import step_text

    base = {"loss": 0.5, "lr": 1e-4, "tokens_per_s_per_gpu": 1000.0}
    assert "acc 75% margin 0.250" in step_text({**base, "rewards/accuracies": 0.75, "rewards/margins": 0.25})
    assert "kl 0.100 margin 0.300" in step_text({**base, "kl": 0.1, "rewards/margins": 0.3})
    distill = step_text({**base, "entropy": 2.0, "token_accuracy": 0.4, "teacher_agreement": 0.625})
    assert "agree 62%" in distill and distill.startswith("loss 0.5000")
    rl = step_text({**base, "kl": 0.01, "frac_reward_zero_std": 0.0, "reward": 0.5, "completions/mean_length": 7.0})
    assert rl.startswith("reward 0.500  length 7.0")
