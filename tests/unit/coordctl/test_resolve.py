"""CPU tests of the services ``coordctl start-run --local`` starts (services/coordctl/resolve.py local_services)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, validate
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig
from services.coordctl.local import ServiceSpec
from services.coordctl.resolve import local_services, resolve_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_the_every_gpu_example_starts_a_rollout_beside_the_trainer_and_one_on_the_other_gpu():
    example = yaml.safe_load((EXAMPLES / "every_gpu_generating.yaml").read_text())
    local = validate(LocalConfig, example.pop("local"), "local")
    config = validate(RunConfig, example)
    assert config.actor_rollout_ref.rollout.free_cache_engine and config.trainer.async_.max_staleness == 0
    assert local_services(local, config) == (
        ServiceSpec("trainer", settings=("device=cuda",)),
        ServiceSpec("rollout", settings=("engine=vllm", "enable_sleep_mode=true", "gpu_memory_utilization=0.25"),
                    env=(("CUDA_VISIBLE_DEVICES", "0"),)),
        ServiceSpec("rollout", settings=("engine=vllm", "gpu_memory_utilization=0.8"),
                    env=(("CUDA_VISIBLE_DEVICES", "1"),)),
        ServiceSpec("reward"),
    )


def test_a_list_of_settings_is_one_service_and_a_mixed_list_is_refused_naming_the_kind():
    local = validate(LocalConfig, {"services": {"rollout": ["engine=vllm", "device=cuda"]}}, "local")
    assert [spec.settings for spec in local_services(local, RunConfig()) if spec.kind == "rollout"] == [
        ("engine=vllm", "device=cuda")]
    with pytest.raises(ConfigError, match=r"local\.services\.rollout"):
        validate(LocalConfig, {"services": {"rollout": ["engine=vllm", {"settings": ["device=cuda"]}]}}, "local")


@pytest.mark.parametrize(("args", "save_freq"), [([], 200), (["trainer.total_training_steps=5"], 5),
                                                 (["trainer.save_freq=0"], 0), (["trainer.save_freq=2"], 2)])
def test_the_local_default_saves_its_last_step_unless_told_otherwise(tmp_path, monkeypatch, args, save_freq):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))
    config, _ = resolve_config(args, local=True)
    assert config.trainer.save_freq == save_freq
