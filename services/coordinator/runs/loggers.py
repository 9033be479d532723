"""A run's experiment loggers (verl's ``trainer.logger``): every metric of every step and of every validation,
under verl's names, written where TensorBoard, W&B and MLflow read them. metrics.jsonl and the run DB are
written whatever is listed (``RunReporter``); ``console`` needs nothing here (coordctl shows each step and the
coordinator logs it).

- ``tensorboard``: event files in ``<run folder>/tensorboard/`` (torch's SummaryWriter), flushed every step.
  An attempt that goes on from a checkpoint marks the steps after it as replaced (TensorBoard's purge step),
  as metrics.jsonl and the run DB forget them.
- ``wandb``: one W&B run per meshrl run in project trainer.project_name, named trainer.experiment_name, its id
  the run's (an attempt that goes on resumes it), its files in ``<run folder>/wandb/``. With
  ``WANDB_MODE=offline`` in the coordinator's environment nothing leaves the machine (``wandb sync`` uploads
  the folder later). W&B keeps the first value of a step: the steps an attempt runs again keep their old ones.
- ``mlflow``: one MLflow run per meshrl run (tagged ``meshrl.run_id``, found again by an attempt that goes on)
  in the experiment trainer.project_name, named trainer.experiment_name, in the store the coordinator's
  ``MLFLOW_TRACKING_URI`` names, or else a SQLite store ``<run folder>/mlflow.db`` (MLflow refuses its old
  file store unless told otherwise). MLflow takes no ``@`` in a name: it is written ``_at_``, as verl does.

Each is opened (in a worker thread: W&B starts a process) when an attempt starts and closed when it ends.
A logger that fails to write a step is logged and the run goes on: the step is in metrics.jsonl and the DB.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

log = structlog.get_logger()


@dataclass(frozen=True, kw_only=True)
class RunNames:
    """What the loggers name a run by, and the config they record with it."""

    run_id: str
    project: str  # trainer.project_name
    experiment: str  # trainer.experiment_name
    config: dict  # the run's resolved config


class ExperimentLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Called once per step, and once per validation (at the step whose weights it measured)."""

    def close(self) -> None:
        """Called when the attempt ends (the run finished, stopped or failed, or goes on after a recovery)."""


class TensorBoardLogger:
    def __init__(self, folder: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=first_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        wall_time = time.time()
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, folder: Path, names: RunNames):
        import wandb

        quiet = wandb.Settings(console="off", silent=True)  # the coordinator's output is its own
        self.run = wandb.init(project=names.project, name=names.experiment, id=names.run_id, resume="allow",
                              dir=str(folder), config=names.config, reinit="create_new", settings=quiet)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(name: str) -> str:
    """A metric name as MLflow takes it: ``@`` (as in ``val-core/.../mean@4``) written ``_at_``, as verl does."""
    return name.replace("@", "_at_")


class MlflowLogger:
    def __init__(self, run_dir: Path, names: RunNames):
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines are not the coordinator's JSON log
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(names.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(names.project)
        earlier = self.client.search_runs([experiment_id], f"tags.`meshrl.run_id` = '{names.run_id}'")
        self.run_id = earlier[0].info.run_id if earlier else self.client.create_run(
            experiment_id, run_name=names.experiment, tags={"meshrl.run_id": names.run_id}).info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, [Metric(mlflow_name(name), value, now, step)
                                            for name, value in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Loggers:
    """The experiment loggers a run lists, written together."""

    def __init__(self, loggers: dict[str, ExperimentLogger]):
        self.loggers = loggers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, logger in self.loggers.items():
            try:
                logger.log(step, metrics)
            except Exception as error:  # noqa: BLE001 - the step is in metrics.jsonl and the run DB all the same
                log.warning("experiment_logger_failed", logger=name, step=step, error=str(error))

    def close(self) -> None:
        for name, logger in self.loggers.items():
            try:
                logger.close()
            except Exception as error:  # noqa: BLE001 - the others are closed all the same
                log.warning("experiment_logger_not_closed", logger=name, error=str(error))


def open_loggers(listed: Sequence[str], run_dir: Path, names: RunNames, *, first_step: int) -> Loggers:
    """The loggers ``listed`` (trainer.logger) for an attempt whose first step is ``first_step`` (0: from the
    start, validation before training included); RuntimeError naming the one that could not start."""
    openers: dict[str, Callable[[], ExperimentLogger]] = {
               "tensorboard": lambda: TensorBoardLogger(run_dir / "tensorboard", first_step),
               "wandb": lambda: WandbLogger(run_dir, names), "mlflow": lambda: MlflowLogger(run_dir, names)}
    opened = Loggers({})
    for name in (name for name in openers if name in listed):
        try:
            opened.loggers[name] = openers[name]()
        except Exception as error:
            opened.close()
            raise RuntimeError(f"trainer.logger: {name} could not start ({type(error).__name__}: {error})") from error
    return opened
