"""CPU tests of services/run/config.py and its sections: defaults, the checks within and across sections, and
what a run may ask of the services (loading and overrides themselves: tests/unit/common/test_config.py)."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from services.common.config import ConfigError, load_config, validate
from services.coordctl.config import LocalConfig
from services.coordctl.resolve import resolve_config
from services.run.config import RunConfig


def test_partial_rollout_keeps_by_default_and_may_finish_or_restart():
    assert RunConfig().actor_rollout_ref.rollout.partial_rollout == "keep"
    for mode in ("finish", "restart"):
        config = load_config(RunConfig, None, [f"actor_rollout_ref.rollout.partial_rollout={mode}"])
        assert config.actor_rollout_ref.rollout.partial_rollout == mode
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.partial_rollout: .*'keep', 'finish' or 'restart'"):
        load_config(RunConfig, None, ["actor_rollout_ref.rollout.partial_rollout=resume"])


def test_batch_size_not_a_multiple_of_mini_batch_names_both_keys():
    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, None, ["data.train_batch_size=48", "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    message = str(caught.value)
    assert "data.train_batch_size (48)" in message
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (32)" in message


@pytest.mark.parametrize(("overrides", "why"), [
    (["actor_rollout_ref.actor.ppo_mini_batch_size=8"],
     r"ppo_mini_batch_size \(8\) is below data\.train_batch_size \(16\)"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], r"ppo_epochs is 2"),
    (["algorithm.use_kl_in_reward=true"], r"algorithm\.use_kl_in_reward"),
])
def test_old_logprobs_are_skipped_only_where_the_update_is_one_optimizer_step(overrides, why):
    base = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    one_step = load_config(RunConfig, None, base)
    assert not one_step.recomputes_old_log_prob  # null: skipped where safe
    assert load_config(RunConfig, None, [*base, "actor_rollout_ref.actor.recompute_old_log_prob=true"]
                       ).recomputes_old_log_prob
    assert load_config(RunConfig, None, [*base, *overrides]).recomputes_old_log_prob
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.recompute_old_log_prob=false, but the update "
                                          rf"needs the old logprobs: .*{why}"):
        load_config(RunConfig, None, [*base, *overrides, "actor_rollout_ref.actor.recompute_old_log_prob=false"])


def test_grpo_with_one_response_per_prompt_names_the_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.n >= 2"):
        load_config(RunConfig, None, ["actor_rollout_ref.rollout.n=1"])
    assert load_config(RunConfig, None, ["actor_rollout_ref.rollout.n=2"]).actor_rollout_ref.rollout.n == 2


def test_require_paths_names_the_missing_key():
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.model\.path: "):
        RunConfig().require_paths()
    with pytest.raises(ValueError, match=r"^data\.train_files: "):
        load_config(RunConfig, None, ["actor_rollout_ref.model.path=/m"]).require_paths()
    load_config(RunConfig, None, ["actor_rollout_ref.model.path=/m", "data.train_files=[x.jsonl]"]).require_paths()


def test_embedded_local_default_is_a_run_config_and_a_local_section():
    default = yaml.safe_load(resources.files("services.coordctl").joinpath("defaults/local.yaml").read_text())
    local = validate(LocalConfig, default.pop("local"), "local")
    config = validate(RunConfig, default)
    assert config.algorithm.adv_estimator == "grpo"
    assert config.data.train_batch_size % config.actor_rollout_ref.actor.ppo_mini_batch_size == 0
    assert config.actor_rollout_ref.rollout.n >= 2
    assert config.actor_rollout_ref.actor.optim.lr == 3.0e-4
    assert local.synthetic_task.max_digits == 4


def test_the_local_section_is_coordctls_alone(tmp_path, monkeypatch):
    """--local takes the local section off (errors named from local.); without --local it is refused, and the
    run config the services parse has no such key."""
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"^local\.tiny_model\.num_layer: unknown key"):
        resolve_config(["local.tiny_model.num_layer=3"], local=True)
    with pytest.raises(ConfigError, match=r"^local\.tiny_model: .*multiple of num_heads \(3\)"):
        resolve_config(["local.tiny_model.num_heads=3"], local=True)
    config_file = tmp_path / "run.yaml"
    config_file.write_text("local: {synthetic_task: {rows: 10}}\n")
    with pytest.raises(ConfigError, match=r"^local: only `coordctl start-run --local`"):
        resolve_config([str(config_file), "actor_rollout_ref.model.path=/m", "data.train_files=[/d]"], local=False)
    with pytest.raises(ConfigError, match=r"^local: unknown key"):
        validate(RunConfig, {"local": {}})


@pytest.mark.parametrize(("overrides", "on"), [
    ([], False),
    (["trainer.async_.max_staleness=1"], True),
    (["algorithm.rollout_correction.enable=true"], True),
    (["algorithm.rollout_correction.enable=false", "trainer.async_.max_staleness=2"], False),
    (["algorithm.rollout_correction.enable=auto", "trainer.async_.max_staleness=0"], False),
])
def test_rollout_correction_is_on_with_staleness_unless_forced(overrides, on):
    assert load_config(RunConfig, None, overrides).use_rollout_correction is on


def test_rollout_correction_enable_refuses_other_words():
    with pytest.raises(ConfigError, match=r"^algorithm\.rollout_correction\.enable"):
        load_config(RunConfig, None, ["algorithm.rollout_correction.enable=sometimes"])


@pytest.mark.parametrize("key, value", [("actor_rollout_ref.rollout.temperature", "1e-300"),
                                        ("actor_rollout_ref.rollout.val_kwargs.temperature", "1e-5"),
                                        ("actor_rollout_ref.rollout.val_kwargs.temperature", ".inf"),
                                        ("trainer.rpc_timeout_s", ".inf"), ("trainer.channel_timeout_s", ".inf"),
                                        ("trainer.services_wait_s", "1e9")])
def test_a_run_config_asks_the_services_for_nothing_they_refuse(key, value):
    """What a run sends the services is within their limits (temperature, timeouts), or refused at StartRun."""
    with pytest.raises(ConfigError, match=key):
        load_config(RunConfig, None, [f"{key}={value}"])


def test_routing_replay_takes_verls_keys_and_is_refused_where_routes_cannot_travel():
    assert not load_config(RunConfig, None, []).records_routes
    r3 = load_config(RunConfig, None, ["actor_rollout_ref.actor.router_replay.mode=R3"])
    assert r3.records_routes and r3.actor_rollout_ref.actor.router_replay.mode == "R3"
    assert load_config(RunConfig, None, ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]).records_routes
    with pytest.raises(ConfigError, match=r"router_replay\.mode.*'disabled' or 'R3'"):
        load_config(RunConfig, None, ["actor_rollout_ref.actor.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match="multi-turn trajectory"):
        load_config(RunConfig, None, ["actor_rollout_ref.actor.router_replay.mode=R3",
                                      "actor_rollout_ref.rollout.multi_turn.enable=true"])
    on_vllm = load_config(RunConfig, None, ["actor_rollout_ref.actor.router_replay.mode=R3",
                                            "actor_rollout_ref.rollout.name=vllm"])
    assert on_vllm.records_routes  # vLLM returns them (enable_return_routed_experts)
