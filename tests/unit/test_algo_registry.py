"""The registries of advantage estimators and policy losses: built-ins, a user's module loaded by a service's
config, names refused with the list of those registered, and the check a coordinator makes at StartRun."""

from __future__ import annotations

import textwrap

import pytest
import torch
import yaml

from services.algo_registry import ADV_ESTIMATORS, POLICY_LOSSES
from services.common.plugins import import_modules
from services.common.config import validate
from services.coordctl.control import ServiceEntry
from services.coordctl.tables import algorithm_lines
from services.coordinator.settings import check_algorithms_registered, loop_settings
from services.run.config import RunConfig

BUILT_IN_ESTIMATORS = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg",
                       "grpo_passk", "remax"}
BUILT_IN_LOSSES = {"vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg"}


def run_config(estimator: str = "grpo", loss: str = "vanilla", loss_agg_mode: str | None = None) -> RunConfig:
    return validate(RunConfig, yaml.safe_load(f"""
        data: {{train_files: [x.jsonl]}}
        algorithm: {{adv_estimator: {estimator}}}
        actor_rollout_ref:
          model: {{path: m}}
          rollout: {{n: 2}}
          actor: {{policy_loss: {{loss_mode: {loss}}}, loss_agg_mode: {loss_agg_mode or 'null'}}}
    """))


def test_built_ins_are_registered_with_their_papers_aggregation():
    assert set(ADV_ESTIMATORS.names()) >= BUILT_IN_ESTIMATORS
    assert set(POLICY_LOSSES.names()) >= BUILT_IN_LOSSES
    modes = {name: POLICY_LOSSES.get(name).loss_agg_mode for name in BUILT_IN_LOSSES}
    assert modes == {"vanilla": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean",
                     "geo_mean": "seq-mean-token-mean", "clip_cov": "token-mean", "kl_cov": "token-mean",
                     "gpg": "token-mean"}
    assert ADV_ESTIMATORS.get("remax").greedy_baseline and not ADV_ESTIMATORS.get("grpo").greedy_baseline


def test_an_unknown_name_is_refused_with_the_key_and_the_registered_names():
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator='nope'.*registered: gae, grpo, rloo"):
        ADV_ESTIMATORS.get("nope")
    with pytest.raises(ValueError, match=r"policy_loss\.loss_mode='nope'.*vanilla, gspo, cispo, geo_mean"):
        POLICY_LOSSES.get("nope")


def test_a_users_module_registers_by_path_and_a_clash_or_broken_module_is_refused(tmp_path):
    ADV_ESTIMATORS.load_builtins(), POLICY_LOSSES.load_builtins()  # as a service does before its users' modules
    plugin = tmp_path / "my_algos.py"
    plugin.write_text(textwrap.dedent("""
        from services.algo_registry import register_adv_est, register_policy_loss
        from services.estimators import grpo
        from services.policy_losses import gpg

        @register_adv_est("test_registry_twice_grpo")
        def twice(inputs, params):
            return grpo(inputs, params)

        @register_policy_loss("test_registry_gpg_sum", loss_agg_mode="seq-mean-token-sum")
        def gpg_sum(inputs, params):
            return gpg(inputs, params)
    """))
    import_modules([str(plugin)], "adv_estimator_modules")
    assert "test_registry_twice_grpo" in ADV_ESTIMATORS.names()
    assert POLICY_LOSSES.get("test_registry_gpg_sum").loss_agg_mode == "seq-mean-token-sum"

    clash = tmp_path / "clash.py"
    clash.write_text("from services.algo_registry import register_policy_loss\n"
                     "@register_policy_loss('gspo')\ndef mine(inputs, params):\n    return None\n")
    with pytest.raises(ValueError, match=r"policy_loss_modules .*clash\.py.*'gspo' is registered already"):
        import_modules([str(clash)], "policy_loss_modules")
    with pytest.raises(ValueError, match=r"adv_estimator_modules .*missing\.py failed to import.*no such file"):
        import_modules([str(tmp_path / "missing.py")], "adv_estimator_modules")
    with pytest.raises(ValueError, match="loss_agg_mode 'token-sum' is not one of"):
        from services.algo_registry import register_policy_loss

        register_policy_loss("bad_mode", loss_agg_mode="token-sum")


def test_start_run_check_names_the_estimator_and_each_trainers_losses():
    check_algorithms_registered(run_config("opo", "gspo"), {"t:1": ("vanilla", "gspo"), "t:2": ()})
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator='mine'.*registered: gae"):
        check_algorithms_registered(run_config("mine"), {})
    with pytest.raises(ValueError, match=r"loss_mode='cispo': trainer t:1 has no policy loss of that name; "
                                         r"registered there: vanilla, gspo"):
        check_algorithms_registered(run_config(loss="cispo"), {"t:1": ("vanilla", "gspo")})


def test_remax_runs_generate_greedy_baselines_and_not_on_multi_turn_runs():
    assert loop_settings(run_config("remax")).estimator.greedy_baseline
    assert not loop_settings(run_config("grpo")).estimator.greedy_baseline
    multi_turn = run_config("remax").model_dump()
    multi_turn["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"] = True
    with pytest.raises(ValueError, match=r"adv_estimator=remax .*rollout\.multi_turn\.enable"):
        check_algorithms_registered(validate(RunConfig, multi_turn), {})


def test_a_name_that_could_name_code_is_refused_by_the_run_config():
    with pytest.raises(ValueError, match="adv_estimator"):
        run_config("'os.system'")


def test_coordctl_services_lists_what_each_service_registered():
    trainer = ServiceEntry(kind="trainer", address="h:2", group="default", state="up", last_seen_s=0.1,
                           service_id="t", policy_losses=("vanilla", "gspo"))
    rollout = ServiceEntry(kind="rollout", address="h:3", group="default", state="up", last_seen_s=0.1,
                           service_id="r")
    assert algorithm_lines("h:1", ["grpo", "opo"], [rollout, trainer]) == [
        "advantage estimators (coordinator h:1): grpo, opo", "policy losses (trainer h:2): vanilla, gspo"]


def test_the_trainer_resolves_the_losss_own_aggregation_unless_the_run_names_one():
    from services.trainer.settings import actor_settings

    cpu = torch.device("cpu")
    assert actor_settings(run_config(loss="gspo"), cpu).loss_agg_mode == "seq-mean-token-mean"
    assert actor_settings(run_config(loss="cispo"), cpu).loss_agg_mode == "token-mean"
    settings = actor_settings(run_config(loss="gspo", loss_agg_mode="seq-mean-token-sum-norm"), cpu)
    assert (settings.loss_mode, settings.loss_agg_mode) == ("gspo", "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"loss_mode='mine': no policy loss of that name is registered"):
        actor_settings(run_config(loss="mine"), cpu)
