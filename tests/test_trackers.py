"""logging.report_to: MetricsLog passes every metrics line to the trackers, and each tracker's own library
records it (wandb offline for real; TensorBoard and MLflow where installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import cli
from llmtrain.errors import LLMTrainError
from llmtrain.run.metrics import MetricsLog
from llmtrain.run.trackers import check_trackers, open_trackers, scalars

RECIPE = {"model": {"name_or_path": "assets/tiny/model"}, "train": {"lr": 0.001, "max_steps": 3},
          "logging": {"report_to": ["wandb"]}, "output_dir": "runs/tiny"}
LINES = [{"type": "train", "step": 1, "loss": 2.5, "lr": 1e-3, "tokens_seen": 100, "skipped": False, "mfu": None},
         {"type": "train", "step": 2, "loss": None, "lr": 1e-3, "tokens_seen": 200, "skipped": True},
         {"type": "train", "step": 3, "loss": 1.5, "lr": 5e-4, "tokens_seen": 300, "skipped": False},
         {"type": "eval", "step": 3, "eval_loss": 1.75, "eval_teacher_forced_match": 0.25}]


class Recorder:
    """A Tracker that remembers what it was given."""

    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, record: dict, step: int) -> None:
        self.logged.append((step, record))

    def close(self) -> None:
        self.closed = True


def test_metrics_log_passes_every_line_to_its_trackers(tmp_path):
    rec = Recorder()
    log = MetricsLog(tmp_path, enabled=True, trackers=[rec], resume_step=None)
    for line in LINES:
        log.write(line)
    log.close()
    assert [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == LINES
    assert rec.logged == [(r["step"], r) for r in LINES] and rec.closed

    other = Recorder()  # a process that is not the main one writes nothing and tells no tracker
    quiet = MetricsLog(tmp_path / "rank1", enabled=False, trackers=[other], resume_step=None)
    quiet.write(LINES[0])
    quiet.close()
    assert other.logged == [] and not other.closed and not (tmp_path / "rank1").exists()


def test_scalars_are_the_finite_numbers_under_type_slash_name():
    assert scalars(LINES[0]) == {"train/loss": 2.5, "train/lr": 1e-3, "train/tokens_seen": 100.0, "train/skipped": 0.0}
    assert scalars(LINES[1]) == {"train/lr": 1e-3, "train/tokens_seen": 200.0, "train/skipped": 1.0}
    assert scalars(LINES[3]) == {"eval/loss": 1.75, "eval/teacher_forced_match": 0.25}
    assert scalars({"type": "train", "step": 4, "grad_norm": float("inf")}) == {}


def test_a_missing_library_names_the_pip_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(LLMTrainError) as err:
        check_trackers(["wandb"])
    assert "logging.report_to includes wandb" in str(err.value)
    assert "pip install 'llmtrain[wandb]'" in str(err.value) and "remove wandb from logging.report_to" in str(err.value)
    with pytest.raises(LLMTrainError, match=r"pip install 'llmtrain\[wandb\]'"):
        open_trackers(["wandb"], output_dir=tmp_path, config=RECIPE)

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(LLMTrainError, match=r"logging.tensorboard: true asks for it too.*llmtrain\[tensorboard\]"):
        check_trackers(["tensorboard"])
    with pytest.raises(LLMTrainError, match="unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        check_trackers(["comet"])



@pytest.fixture
def no_wandb_account(monkeypatch, tmp_path):
    """wandb with no API key anywhere (a fresh HOME, no WANDB_* variables) and no terminal on stdin."""
    import io

    pytest.importorskip("wandb")
    import wandb

    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    wandb.teardown()  # wandb reads its settings once a process: forget those of an earlier test
    yield
    wandb.teardown()


def test_wandb_without_an_account_is_refused_at_start_up(no_wandb_account, monkeypatch):
    with pytest.raises(LLMTrainError) as err:  # wandb.init would fail only after the model had loaded
        check_trackers(["wandb"])
    assert "no API key is configured" in str(err.value) and "no terminal to ask for one in" in str(err.value)
    assert "`wandb login`" in str(err.value) and "WANDB_MODE=offline" in str(err.value)

    monkeypatch.setenv("WANDB_API_KEY", "short")  # a key wandb itself would refuse
    with pytest.raises(LLMTrainError, match=r"its credentials were refused \(WANDB_API_KEY invalid"):
        check_trackers(["wandb"])

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a key: whether the server takes it is wandb.init's business
    check_trackers(["wandb"])
    for mode in ("offline", "disabled"):  # no account needed
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
        monkeypatch.setenv("WANDB_MODE", mode)
        import wandb

        wandb.teardown()
        check_trackers(["wandb"])


def test_finetune_with_wandb_and_no_account_writes_nothing(no_wandb_account, tiny_assets, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = cli("finetune", "recipes/tiny.yaml", f"model.name_or_path={tiny_assets}/model",
               f"data.path={tiny_assets}/data/train.jsonl", f"data.eval_split={tiny_assets}/data/eval.jsonl",
               "logging.report_to=[wandb]", f"output_dir={out}", "train.max_steps=2", check=False,
               stdin=subprocess.DEVNULL, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr  # a user error
    assert "wandb, but no API key is configured" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()  # refused before the run folder, the data's cache or the model


# --------------------------------------------------------------------------- the real libraries


def wandb_records(path):
    """The records of a wandb run file (run-<id>.wandb): W&B's header, then LevelDB-log framed protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768  # records never straddle a 32 KiB block header; the tail is padding
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pos += 7
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


def wandb_flushed() -> None:
    """Wait until wandb's service has written the run file: run.finish() returns before it has (wandb 0.31,
    offline), and the file is complete once the service shuts down, as it does when the process exits."""
    import wandb

    wandb.teardown()


def wandb_items(items) -> dict:
    """History or config items as a dict: wandb stores a user key in `nested_key`, its own (_step) in `key`."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_offline_run_holds_the_config_and_the_logged_values(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    log = MetricsLog(run_dir, enabled=True, resume_step=None,
                     trackers=open_trackers(["wandb", "wandb"], output_dir=run_dir, config=RECIPE))
    assert len(log.trackers) == 1  # a name given twice opens one run
    for line in LINES:
        log.write(line)
    log.close()
    wandb_flushed()

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # under the run folder
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "my-run" and run.project == "llmtrain"
    config = wandb_items(run.config.update)
    assert {k: v for k, v in config.items() if k != "_wandb"} == RECIPE
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = wandb_items(r.history.item)
            history[row["_step"]] = row
    assert sorted(history) == [1, 2, 3]
    assert history[1]["train/loss"] == 2.5 and history[1]["train/tokens_seen"] == 100
    assert "train/loss" not in history[2] and history[2]["train/skipped"] == 1  # a skipped step has no loss
    # train and eval lines of step 3 are one history row
    assert history[3]["train/loss"] == 1.5 and history[3]["eval/loss"] == 1.75 and history[3]["train/lr"] == 5e-4


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, enabled=True, resume_step=None,
                     trackers=open_trackers(["tensorboard"], output_dir=tmp_path, config={}))
    for line in LINES:
        log.write(line)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(3, 1.75)]

    # With a config (the resolved recipe), it is stored as text.
    tracker, = open_trackers(["tensorboard"], output_dir=tmp_path / "second", config=RECIPE)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "second" / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "name_or_path: assets/tiny/model" in text and "lr: 0.001" in text


def test_mlflow_run_holds_params_artifact_and_metrics(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # mlflow's local store (sqlite); a tracking server needs neither
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)  # mlflow's artifacts go to ./mlruns
    log = MetricsLog(tmp_path, enabled=True, resume_step=None,
                     trackers=open_trackers(["mlflow"], output_dir=tmp_path / "run-a", config=RECIPE, project="exp"))
    for line in LINES:
        log.write(line)
    log.close()

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001" and run.data.params["logging.report_to"] == "['wandb']"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(1, 2.5), (3, 1.5)]
    history = client.get_metric_history(run.info.run_id, "eval/teacher_forced_match")
    assert [(m.step, m.value) for m in history] == [(3, 0.25)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["recipe.yaml"]


# --------------------------------------------------------------------------- the recipe keys (config.py)


def test_tensorboard_key_maps_to_report_to():
    from llmtrain.config import LoggingConfig

    assert LoggingConfig(tensorboard=True).report_to == ["tensorboard"]
    assert LoggingConfig(report_to="wandb", tensorboard=True).report_to == ["wandb", "tensorboard"]
    assert LoggingConfig(report_to=["tensorboard"], tensorboard=True).report_to == ["tensorboard"]


@pytest.mark.slow
def test_finetune_reports_to_wandb_offline(monkeypatch, tmp_path, tiny_assets):
    pytest.importorskip("wandb")
    from helpers import run_train, write_recipe

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3},
                          logging={"progress": False, "report_to": ["wandb"], "run_name": "tiny-wandb"})
    run_train(recipe)
    wandb_flushed()
    (run_file,) = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = wandb_items(run.config.update)
    assert run.display_name == "tiny-wandb"
    assert config["output_dir"] == str(tmp_path / "run") and config["train"]["max_steps"] == 3
    assert config["logging"]["report_to"] == ["wandb"]
    history = [wandb_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["train/loss"] for row in history] == pytest.approx([r["loss"] for r in logged])


def test_a_resumed_runs_tensorboard_holds_each_step_once(tmp_path):
    """A run stopped at step 3 had logged steps 1-3 past its checkpoint at step 1; the resume logs steps 2-3 again.
    metrics.jsonl drops the lines after the checkpoint (MetricsLog) and TensorBoard purges its events past it (its
    SummaryWriter's purge_step): each step once, the resumed values (it had drawn both, a zigzag in every panel)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(lines, resume_step):
        log = MetricsLog(tmp_path, enabled=True, resume_step=resume_step,
                         trackers=open_trackers(["tensorboard"], output_dir=tmp_path, config={},
                                                resume_step=resume_step))
        for line in lines:
            log.write(line)
        log.close()

    run(LINES, None)
    again = [{**line, "loss": line["loss"] and 9.0} for line in LINES if line["step"] > 1 and line["type"] == "train"]
    run(again, 1)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (3, 9.0)]
    assert [e.step for e in events.Scalars("train/lr")] == [1, 2, 3]
    assert events.Scalars("eval/loss") == []  # step 3's eval was after the checkpoint and not run again
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_project_name_wandb_refuses_is_said_before_the_run_folder_is_touched(monkeypatch, tmp_path, tiny_assets):
    """`logging.project=myteam/llm` had been refused by wandb.init once the run folder was claimed (after --overwrite
    had emptied it), with advice to log in (audit 46): said at start-up, naming WANDB_ENTITY."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(LLMTrainError, match=r"logging.project 'myteam/llm' is not a name wandb takes for a project "
                                            r"\(it refuses /.*WANDB_ENTITY=myteam with logging.project=llm"):
        check_trackers(["wandb"], "myteam/llm")
    monkeypatch.setenv("WANDB_PROJECT", "a:b")
    with pytest.raises(LLMTrainError, match="WANDB_PROJECT 'a:b' is not a name wandb takes") as e:
        check_trackers(["wandb"])
    assert "WANDB_ENTITY" not in str(e.value)  # (it had advised WANDB_ENTITY=a:b)
    monkeypatch.delenv("WANDB_PROJECT")
    check_trackers(["wandb"], "llm")  # a plain name passes
    out = tmp_path / "run"
    proc = cli("finetune", "recipes/tiny.yaml", f"model.name_or_path={tiny_assets}/model",
               f"data.path={tiny_assets}/data/train.jsonl", "data.eval_split=null", "logging.report_to=[wandb]",
               "logging.project=myteam/llm", f"output_dir={out}", "train.max_steps=2", check=False,
               env={**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "is not a name wandb takes" in " ".join(proc.stderr.split())
    assert not out.exists()


def test_a_set_aside_file_a_stop_cut_short_does_not_block_the_next_resume(tmp_path):
    """A resume stopped while it wrote metrics.jsonl.after-step_N left its .tmp, which the next resume read as a set-
    aside file of step 'N.tmp': a ValueError at every `--resume auto` (the review of audit 46's change)."""
    lines = [{"type": "train", "step": s, "loss": float(s)} for s in range(1, 7)]
    MetricsLog(tmp_path, enabled=True, resume_step=None).close()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "metrics.jsonl.after-step_000002.tmp").write_text('{"type": "train", "st')
    MetricsLog(tmp_path, enabled=True, resume_step=4).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.glob("metrics.jsonl.*")) == ["metrics.jsonl.after-step_000004"]
    MetricsLog(tmp_path, enabled=True, resume_step=6).close()  # back to the later checkpoint: every line again
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
