"""CPU tests of services/coordctl/resolve.py: the run config coordctl start-run resolves from what is typed, and
the services --local starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from services.common.config import ConfigError, validate
from services.run.config import RunConfig
from services.coordctl.cli import app
from services.coordctl.config import LocalConfig
from services.coordctl.local import ServiceSpec
from services.coordctl.resolve import (hydra_config_file, local_services, resolve_config, start_notices,
                                      unregistered_algorithms)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_the_every_gpu_example_starts_a_rollout_beside_the_trainer_and_one_on_the_other_gpu():
    example = yaml.safe_load((EXAMPLES / "every_gpu_generating.yaml").read_text())
    local = validate(LocalConfig, example.pop("local"), "local")
    config = validate(RunConfig, example)
    assert config.actor_rollout_ref.rollout.free_cache_engine and config.trainer.async_.max_staleness == 0
    assert local_services(local, config) == (
        ServiceSpec(kind="trainer", settings=("device=cuda",)),
        ServiceSpec(kind="rollout", settings=("engine=vllm", "enable_sleep_mode=true", "gpu_memory_utilization=0.25"),
                    env=(("CUDA_VISIBLE_DEVICES", "0"),)),
        ServiceSpec(kind="rollout", settings=("engine=vllm", "gpu_memory_utilization=0.8"),
                    env=(("CUDA_VISIBLE_DEVICES", "1"),)),
        ServiceSpec(kind="reward"),
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


def test_overrides_with_no_config_file_apply_to_meshrls_defaults():
    """As verl's main_ppo applies a script's overrides to its default config: every key not given is RunConfig's."""
    config, local = resolve_config(["actor_rollout_ref.model.path=/models/m", "data.train_files=/data/train.parquet",
                                    "actor_rollout_ref.rollout.n=5"], local=False)
    assert local is None
    expected = RunConfig().model_dump()
    expected["actor_rollout_ref"]["model"]["path"] = "/models/m"
    expected["actor_rollout_ref"]["rollout"]["n"] = 5
    expected["data"]["train_files"] = ["/data/train.parquet"]
    assert config.model_dump() == expected
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path: no model folder given"):
        resolve_config(["data.train_files=/data/train.parquet"], local=False)


@pytest.mark.parametrize("name", ["mine", "mine.yaml"])
def test_hydras_config_path_and_name_name_the_file_as_the_positional_argument_does(tmp_path, name):
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "mine.yaml").write_text("actor_rollout_ref: {model: {path: /models/m}}\n"
                                      "data: {train_files: [/data/train.parquet], train_batch_size: 16}\n")
    config_file = hydra_config_file(str(folder), name)
    assert config_file == str(folder / "mine.yaml")
    named, _ = resolve_config(["data.max_prompt_length=64"], local=False, config_file=config_file)
    positional, _ = resolve_config([str(folder / "mine.yaml"), "data.max_prompt_length=64"], local=False)
    assert named == positional
    assert (named.data.train_batch_size, named.data.max_prompt_length) == (16, 64)
    with pytest.raises(ConfigError, match="one config file at most"):
        resolve_config([str(folder / "mine.yaml")], local=False, config_file=config_file)


def test_a_config_name_that_is_not_there_names_the_file_it_looked_for(tmp_path):
    with pytest.raises(ConfigError, match=rf"--config-name ppo: there is no config file {tmp_path}/ppo.yaml"):
        hydra_config_file(str(tmp_path), "ppo")
    with pytest.raises(ConfigError, match=f"--config-path {tmp_path} names the folder of a --config-name"):
        hydra_config_file(str(tmp_path), None)
    assert hydra_config_file(None, None) is None


def test_the_local_tools_example_starts_an_env_service_hosting_its_tool_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))
    monkeypatch.chdir(EXAMPLES.parent)
    config, local = resolve_config(["examples/local_tools.yaml", "local.lookup_task.rows=100"], local=True)
    assert config.actor_rollout_ref.rollout.multi_turn.enable and local.task == "lookup" and local.tiny_model.chat
    tool_config = EXAMPLES / "local_tools" / "tools.yaml"
    assert local_services(local, config) == (
        ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"),
        ServiceSpec(kind="env", settings=(f"environments.tools.tool_config_path={tool_config}", "workers=32")))
    # an environment of another name, and the env service's own settings from local.services.env
    other = validate(RunConfig, {"actor_rollout_ref": {"rollout": {"multi_turn": {
        "enable": True, "tool_config_path": str(tool_config), "environment": "lookup"}}}})
    own = validate(LocalConfig, {"services": {"env": ["workers=2"]}}, "local")
    assert local_services(own, other)[-1] == ServiceSpec(kind="env", settings=(
        f"environments.lookup.tool_config_path={tool_config}", "workers=2"))
    assert [spec.kind for spec in local_services(own, RunConfig())] == ["trainer", "rollout", "reward"]


def test_a_multi_turn_run_without_its_tool_config_file_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["start-run", "--local", "--dry-run", str(EXAMPLES / "local_tools.yaml"),
                                      "local.lookup_task.rows=100",
                                      "actor_rollout_ref.rollout.multi_turn.tool_config_path=mine/tools.yaml"])
    assert result.exit_code == 2
    assert ("actor_rollout_ref.rollout.multi_turn.tool_config_path: no tool config file at "
            f"{tmp_path / 'mine' / 'tools.yaml'}") in result.output
    assert not (tmp_path / "meshrl-runs").exists()
    none = validate(RunConfig, {"actor_rollout_ref": {"rollout": {"multi_turn": {"enable": True}}}})
    with pytest.raises(ValueError, match=r"multi_turn\.tool_config_path: a multi-turn run started with --local"):
        local_services(LocalConfig(), none)


def test_an_example_runs_from_another_folder_with_the_tools_beside_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["start-run", "--local", "--dry-run", str(EXAMPLES / "local_tools.yaml"),
                                      "local.lookup_task.rows=100"])
    assert result.exit_code == 0, result.output
    assert f"environments.tools.tool_config_path={EXAMPLES / 'local_tools' / 'tools.yaml'} " in result.output
    assert not (tmp_path / "meshrl-runs").exists()


def test_relative_paths_in_a_file_are_taken_from_its_folder_and_on_the_command_line_from_the_current_one(
        tmp_path, monkeypatch):
    configs, here = tmp_path / "configs", tmp_path / "here"
    configs.mkdir()
    here.mkdir()
    (configs / "run.yaml").write_text(yaml.safe_dump({
        "actor_rollout_ref": {"model": {"path": "../models/m", "lora_rank": 8, "lora_adapter_path": "adapters/a"},
                              "rollout": {"multi_turn": {"enable": True, "tool_config_path": "tools.yaml"}}},
        "critic": {"model": {"path": "/models/critic"}},
        "data": {"train_files": ["data/train.parquet", "/data/other.parquet"], "val_files": "data/val.parquet"}}))
    monkeypatch.chdir(here)
    config, _ = resolve_config([str(Path("..") / "configs" / "run.yaml")], local=False)
    model, rollout = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    assert Path(model.path).resolve() == tmp_path / "models" / "m"
    assert (model.lora_adapter_path, rollout.multi_turn.tool_config_path) == (
        str(configs / "adapters" / "a"), str(configs / "tools.yaml"))
    assert config.critic.model.path == "/models/critic"  # an absolute path stays as it is
    assert config.data.train_files == [str(configs / "data" / "train.parquet"), "/data/other.parquet"]
    assert config.data.val_files == [str(configs / "data" / "val.parquet")]

    overridden, _ = resolve_config([str(configs / "run.yaml"), "data.train_files=[mine.parquet]",
                                    "+actor_rollout_ref.model.path=models/m", "critic.model.path=~/critic"],
                                   local=False)
    assert overridden.data.train_files == [str(here / "mine.parquet")]
    assert overridden.actor_rollout_ref.model.path == str(here / "models" / "m")
    assert overridden.critic.model.path == str(Path.home() / "critic")
    assert overridden.data.val_files == [str(configs / "data" / "val.parquet")]  # not overridden: the file's


def test_a_multi_turn_run_on_vllm_gets_prefix_caching_and_an_env_worker_per_trajectory_up_to_256(tmp_path):
    tool_config = tmp_path / "tools.yaml"
    tool_config.write_text("tools: []\n")
    small = validate(RunConfig, {"data": {"train_batch_size": 2}, "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 2}, "rollout": {
        "name": "vllm", "n": 4, "multi_turn": {"enable": True, "tool_config_path": str(tool_config)}}}})
    specs = {spec.kind: spec.settings for spec in local_services(LocalConfig(), small)}
    assert "enable_prefix_caching=true" in specs["rollout"] and "workers=8" in specs["env"]
    single = validate(RunConfig, {"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    assert not any(s.startswith("enable_prefix_caching") for s in local_services(LocalConfig(), single)[1].settings)
    said = start_notices(small, local_services(LocalConfig(), small))
    assert not any("episodes at once" in notice for notice in said)


def test_env_workers_fewer_than_a_steps_trajectories_are_said_before_the_run_starts(tmp_path):
    tool_config = tmp_path / "tools.yaml"
    tool_config.write_text("tools: []\n")
    multi_turn = {"enable": True, "tool_config_path": str(tool_config)}
    large = {"data": {"train_batch_size": 64}, "actor_rollout_ref": {"rollout": {"n": 8, "multi_turn": multi_turn}}}
    on_hf = validate(RunConfig, large)
    on_vllm = validate(RunConfig, {**large, "actor_rollout_ref": {"rollout": {"name": "vllm", "n": 8,
                                                                              "multi_turn": multi_turn}}})
    hf_services, vllm_services = local_services(LocalConfig(), on_hf), local_services(LocalConfig(), on_vllm)
    assert "workers=32" in hf_services[-1].settings and "workers=256" in vllm_services[-1].settings
    assert start_notices(on_vllm, vllm_services)[-1] == (
        "the env services hold 256 episodes at once, fewer than a step's 512 trajectories: the rest wait for one to "
        "end (local.services.env as a list of 2 services of workers=256, the most one holds (examples/gpu_tools.yaml) "
        "runs them all together, about 60 MB each)")
    two = [{"settings": ["workers=256"]}, {"settings": ["workers=256"]}]
    told = local_services(validate(LocalConfig, {"services": {"env": two}}, "local"), on_vllm)
    assert not any("episodes at once" in notice for notice in start_notices(on_vllm, told))


def test_the_env_service_of_local_runs_unsandboxed_only_where_this_host_cannot_sandbox(tmp_path, monkeypatch):
    import services.coordctl.resolve as resolve

    tool_config = tmp_path / "tools.yaml"
    tool_config.write_text("tools: []\n")
    run = validate(RunConfig, {"actor_rollout_ref": {"rollout": {
        "multi_turn": {"enable": True, "tool_config_path": str(tool_config)}}}})
    monkeypatch.setattr(resolve, "unsandboxed_here", lambda: "you are not root")
    assert "sandbox=false" in local_services(LocalConfig(), run)[-1].settings
    told = validate(LocalConfig, {"services": {"env": ["sandbox=true"]}}, "local")
    assert "sandbox=false" not in local_services(told, run)[-1].settings
    monkeypatch.setattr(resolve, "unsandboxed_here", lambda: None)
    assert not any(s.startswith("sandbox=") for s in local_services(LocalConfig(), run)[-1].settings)


def test_an_algorithm_no_local_service_can_register_is_refused_and_a_remote_ones_is_said():
    local = local_services(LocalConfig(), RunConfig())
    estimator = validate(RunConfig, {"algorithm": {"adv_estimator": "range_norm"}})
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator=range_norm: not one of meshrl's \(gae, grpo, "
                                         r".*the local coordinator registers meshrl's only"):
        unregistered_algorithms(estimator, local)
    loss = validate(RunConfig, {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "trust_region_pg"}}}})
    with pytest.raises(ValueError, match=r"loss_mode=trust_region_pg: not one of meshrl's \(vanilla, .*the local "
                                         r"trainer registers no losses of its own"):
        unregistered_algorithms(loss, local)
    own_losses = local_services(validate(LocalConfig, {"services": {"trainer": ["policy_loss_modules=[l.py]"]}},
                                         "local"), loss)
    [said] = unregistered_algorithms(loss, own_losses)
    assert said.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=trust_region_pg: not one of meshrl's")
    assert [line.split(":")[0] for line in unregistered_algorithms(estimator, None)] == [
        "algorithm.adv_estimator=range_norm"]
    assert unregistered_algorithms(RunConfig(), local) == []


def test_the_services_a_local_run_started_are_kept_for_its_resume_and_a_garbled_list_is_named(tmp_path):
    from services.coordctl.local import SERVICES_FILE, ServiceSpec, save_services, saved_services

    started = (ServiceSpec(kind="trainer", env=(("CUDA_VISIBLE_DEVICES", "0"),)),
               ServiceSpec(kind="rollout", settings=("engine=vllm", "enable_prefix_caching=true")),
               ServiceSpec(kind="env", group="tools", settings=("workers=64",)), ServiceSpec(kind="trainer", ranks=2))
    assert saved_services(tmp_path) is None  # a state_dir from before they were kept
    save_services(tmp_path, started)
    assert saved_services(tmp_path) == started
    (tmp_path / SERVICES_FILE).write_text('[{"kind": "trainer"}]')
    with pytest.raises(ValueError, match=f"{tmp_path / SERVICES_FILE} does not list the services of a --local run"):
        saved_services(tmp_path)
