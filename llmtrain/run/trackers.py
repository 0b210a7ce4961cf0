"""Experiment trackers (`logging.report_to`): TensorBoard, Weights & Biases and MLflow, each through its own
library, imported only when asked for.

A tracker receives every metrics line that MetricsLog writes to metrics.jsonl (which stays the record of the
run) and, when it opens, the run's resolved recipe as its config. Trackers run on the main process only.
Numbers are logged as `<type>/<name>`: `train/loss`, `train/lr`, `eval/loss`, `eval/teacher_forced_match`, ...

- tensorboard: event files in <output_dir>/tb; the recipe as a text entry; a resume purges the events past its
  checkpoint (the steps that run again), for good: metrics.jsonl sets their lines aside until the resume's first
  checkpoint and puts them back where a later resume returns to the checkpoints they belong to, TensorBoard cannot.
- wandb: the run files in <output_dir>/wandb. WANDB_MODE=offline needs no account and no network (sync
  later with `wandb sync`); WANDB_PROJECT, WANDB_ENTITY and the other WANDB_* variables apply as usual.
- mlflow: wherever MLFLOW_TRACKING_URI points (a server, or mlflow's own default, ./mlflow.db); the recipe
  as the run's parameters (dotted keys) and as the artifact recipe.yaml.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Protocol

import yaml

from llmtrain.errors import LLMTrainError

# name in logging.report_to -> (module to import, pip extra of llmtrain)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class Tracker(Protocol):
    def log(self, record: dict, step: int) -> None:
        """One metrics line (a dict as in metrics.jsonl) at optimizer step `step`."""

    def close(self) -> None:
        """Flush and end the tracker's run."""


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a metrics line under tracker names: {"type": "eval", "eval_loss": x} -> eval/loss."""
    kind = record.get("type", "train")
    return {f"{kind}/{k.removeprefix(kind + '_')}": float(v) for k, v in record.items()
            if k not in ("type", "step") and isinstance(v, (int, float)) and math.isfinite(v)}


# characters wandb refuses in a project's name (its settings' project check)
WANDB_PROJECT_REFUSES = "/\\#?%:"


def check_trackers(names: list[str], project: str | None = None) -> None:
    """Import each asked-for tracker's library now (start-up), so a missing one fails before the model loads, and
    for wandb check its project's name (logging.project, else WANDB_PROJECT) and that it has an account to log to
    (or is offline): wandb.init had refused them once the run folder was claimed, after --overwrite had emptied it
    (audit 46)."""
    for name in dict.fromkeys(names):
        module = _require(name)
        if name == "wandb":
            _check_wandb_project(project)
            _check_wandb_account(module)


def _check_wandb_project(project: str | None) -> None:
    where = "logging.project" if project else "WANDB_PROJECT"
    project = project or os.environ.get("WANDB_PROJECT")
    if project and (bad := sorted(set(project) & set(WANDB_PROJECT_REFUSES))):
        entity = (" A team or user is wandb's entity: set WANDB_ENTITY to it and the project to the name alone "
                  f"(e.g. WANDB_ENTITY={project.split('/')[0]} with {where}={project.split('/')[-1]})."
                  if "/" in project and project.count("/") == 1 else "")
        raise LLMTrainError(f"{where} '{project}' is not a name wandb takes for a project (it refuses {' '.join(bad)} "
                            f"in one): give a name without them.{entity}")


def _check_wandb_account(wandb) -> None:
    """wandb.init with no API key and no terminal to ask in fails (UsageError): say so before the run folder is
    written and the model loads. A terminal is left to wandb's own prompt; offline and disabled need no account.
    Read through wandb's own credential lookup (environment, ~/.netrc, its settings); a wandb without it is left to
    wandb.init, whose failure WandbTracker reports."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
        settings = wandb_setup.singleton().settings
        if settings.mode in ("offline", "dryrun", "disabled") or sys.stdin is not None and sys.stdin.isatty():
            return
        found = wbauth.authenticate_session(host=settings.base_url, source="llmtrain", prompt=False,
                                            update_session=False)
    except (ImportError, AttributeError, TypeError):  # another wandb version: wandb.init decides
        return
    except Exception as e:  # noqa: BLE001 - wandb's AuthenticationError: a key set but malformed
        found, problem = None, f"its credentials were refused ({e})"
    else:
        problem = f"no API key is configured for {settings.base_url} and there is no terminal to ask for one in"
    if found is None:
        raise LLMTrainError(
            f"logging.report_to includes wandb, but {problem}. Log in with `wandb login` (or set WANDB_API_KEY), "
            "or run without an account or network with WANDB_MODE=offline and upload later with `wandb sync`; or "
            "remove wandb from logging.report_to.")


def open_trackers(names: list[str], *, output_dir: Path, config: dict, project: str | None = None,
                  run_name: str | None = None, resume_step: int | None = None) -> list[Tracker]:
    """Open the trackers of logging.report_to (duplicates ignored), each given `config` (the resolved recipe).

    project: the wandb project / mlflow experiment (default: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else
    'llmtrain'); run_name: the tracker run's name (default: the output_dir folder name); resume_step: the step a
    resume continues from, past which TensorBoard's event files are purged (wandb and mlflow start a run of their own
    at each resume).
    """
    output_dir = Path(output_dir)
    run_name = run_name or output_dir.resolve().name
    opened: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            _require(name)  # an unknown name or a missing library fails here
            if name == "tensorboard":
                opened.append(TensorBoardTracker(output_dir / "tb", config=config, resume_step=resume_step))
            elif name == "wandb":
                opened.append(WandbTracker(output_dir, config=config, project=project, run_name=run_name))
            else:
                opened.append(MlflowTracker(config=config, project=project, run_name=run_name))
    except BaseException:
        for tracker in opened:  # a later one failed: end the runs already started
            tracker.close()
        raise
    return opened


def _require(name: str):
    """The tracker's library, or an error naming the pip extra that installs it."""
    if name not in TRACKERS:
        raise LLMTrainError(f"logging.report_to: unknown tracker '{name}'; choose from {', '.join(TRACKERS)}.")
    module, extra = TRACKERS[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        also = " (logging.tensorboard: true asks for it too)" if name == "tensorboard" else ""
        raise LLMTrainError(f"logging.report_to includes {name}{also}, but the {module} package is not installed: "
                            f"pip install 'llmtrain[{extra}]', or remove {name} from logging.report_to.") from None


class TensorBoardTracker:
    def __init__(self, log_dir: Path, *, config: dict, resume_step: int | None = None):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # A resume appends to the same folder: TensorBoard drops the earlier files' events at and after purge_step
        # (the steps that run again; MetricsLog sets metrics.jsonl's aside); at step 0 it starts again, all of them
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else
                                    resume_step + 1 if resume_step > 0 else 0)
        if config:  # TensorBoard renders text as markdown: indent four spaces for a code block
            self.writer.add_text("recipe", "    " + yaml.safe_dump(config, sort_keys=False).replace("\n", "\n    "))

    def log(self, record: dict, step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: Path, *, config: dict, project: str | None, run_name: str):
        wandb = _require("wandb")
        try:
            self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "llmtrain", name=run_name,
                                  dir=os.environ.get("WANDB_DIR") or str(output_dir), config=config)
        except Exception as e:  # noqa: BLE001 - wandb's own types: no API key, no network, a bad project
            account = any(w in str(e).lower() for w in ("api key", "api_key", "login", "authenticat", "network",
                                                        "connect", "timed out"))
            raise LLMTrainError(
                f"logging.report_to includes wandb, but wandb could not start a run ({type(e).__name__}: {e}). "
                + ("Log in with `wandb login` (or set WANDB_API_KEY), or run without an account or network with "
                   "WANDB_MODE=offline and upload later with `wandb sync`; or remove wandb from logging.report_to."
                   if account else "Fix what wandb names (its WANDB_* variables, logging.project, logging.run_name), "
                   "or remove wandb from logging.report_to.")
            ) from None

    def log(self, record: dict, step: int) -> None:
        # Lines of the same step (train, then eval) are merged by wandb into one history row.
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


# mlflow refuses longer parameter values; the whole recipe is in the artifact recipe.yaml anyway.
MLFLOW_PARAM_CHARS = 500


class MlflowTracker:
    def __init__(self, *, config: dict, project: str | None, run_name: str):
        _require("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        experiment = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "llmtrain"
        try:
            # MlflowClient, not the fluent mlflow.start_run: no process-global active run.
            self.client = MlflowClient()  # MLFLOW_TRACKING_URI, or mlflow's default
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        except Exception as e:  # noqa: BLE001 - a server that does not answer, a store mlflow cannot open
            raise LLMTrainError(
                f"logging.report_to includes mlflow, but mlflow could not start a run in experiment '{experiment}' "
                f"({type(e).__name__}: {e}). Set MLFLOW_TRACKING_URI to a server or a store it can write (e.g. "
                "sqlite:///mlflow.db), or remove mlflow from logging.report_to.") from None
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in _flatten(config).items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "recipe.yaml")

    def log(self, record: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
