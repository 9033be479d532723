"""The experiment loggers (services/coordinator/runs/loggers.py) as their own readers see them, trainer.logger's checks."""

from __future__ import annotations

import pytest

from services.run import checks
from services.common.config import ConfigError, validate
from services.run.checks import check_loggers_installed
from services.run.config import RunConfig
from services.coordinator.runs.loggers import RunNames, mlflow_name, open_loggers
from tests.logger_files import tensorboard_scalars

NAMES = RunNames(run_id="grpo-20261201-120000-ab12", project="meshrl", experiment="grpo",
                 config={"trainer": {"seed": 0}})


def write(run_dir, listed, first_step, steps, offset):
    loggers = open_loggers(listed, run_dir, NAMES, first_step=first_step)
    for step in steps:
        loggers.log(step, {"critic/score/mean": step / 10 + offset, "val-core/task/acc/mean@4": offset})
    loggers.close()


def test_tensorboard_has_every_step_and_an_attempt_from_a_checkpoint_replaces_the_steps_after_it(tmp_path):
    write(tmp_path, ["console", "tensorboard"], 0, range(0, 6), offset=0.0)
    write(tmp_path, ["console", "tensorboard"], 4, range(4, 7), offset=1.0)  # resumed from step 3's checkpoint
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"critic/score/mean", "val-core/task/acc/mean@4"}  # verl's names as they are
    assert scalars["critic/score/mean"] == pytest.approx({0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3, 4: 1.4, 5: 1.5, 6: 1.6})
    assert scalars["val-core/task/acc/mean@4"] == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 1.0, 6: 1.0}


def test_mlflow_keeps_one_run_per_meshrl_run_across_attempts(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    write(tmp_path, ["mlflow"], 0, range(1, 3), offset=0.0)
    write(tmp_path, ["mlflow"], 3, range(3, 5), offset=0.0)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("meshrl").experiment_id])
    assert run.info.run_name == "grpo" and run.data.tags["meshrl.run_id"] == NAMES.run_id
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert {point.step: point.value for point in history} == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    assert [point.step for point in client.get_metric_history(run.info.run_id, "val-core/task/acc/mean_at_4")] != []


def test_mlflow_names_have_no_at_sign():
    assert mlflow_name("val-core/openai/gsm8k/acc/mean@4") == "val-core/openai/gsm8k/acc/mean_at_4"
    assert mlflow_name("actor/pg_loss") == "actor/pg_loss"


def test_a_listed_logger_not_installed_is_refused_naming_the_key_and_the_install(monkeypatch):
    monkeypatch.setitem(checks.LOGGER_NEEDS, "wandb", (("no_such_module_here",), "'meshrl[wandb]'"))
    with pytest.raises(ValueError) as refused:
        check_loggers_installed(["console", "tensorboard", "wandb"])
    assert str(refused.value) == ("trainer.logger: not installed where the coordinator runs: wandb (pip install "
                                  "'meshrl[wandb]', or take it off the list)")
    check_loggers_installed(["console", "tensorboard", "swanlab"])  # verl's others need nothing: not written


def test_the_default_is_the_console_and_tensorboard_and_a_misspelt_logger_is_named():
    assert validate(RunConfig, {}).trainer.logger == ["console", "tensorboard"]
    with pytest.raises(ConfigError, match=r"trainer\.logger\.1: Input should be 'console', 'tensorboard', 'wandb'"):
        validate(RunConfig, {"trainer": {"logger": ["console", "tensorbord"]}})
    notices = validate(RunConfig, {"trainer": {"logger": ["console", "swanlab"]}}).notices()
    assert any(notice.startswith("trainer.logger=['console', 'swanlab']: swanlab not written") for notice in notices)
