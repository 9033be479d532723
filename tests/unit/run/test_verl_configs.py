"""verl's example scripts run unchanged: their overrides, as the shell hands them over, give a valid run config
with the settings they mean, and what meshrl does not use is said, not refused.

The two scripts' arguments are quoted from verl's repository (volcengine/verl, 2025): the GRPO GSM8K example
(examples/grpo_trainer/run_qwen2-7b.sh) and the PPO GSM8K example (examples/ppo_trainer/run_deepseek7b_llm.sh).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from services.common.config import ConfigError, apply_overrides, load_config
from services.run.config import RunConfig
from services.coordinator.settings import loop_settings

GRPO_SCRIPT = r"""
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

PPO_SCRIPT = r"""
    algorithm.adv_estimator=gae \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    critic.optim.lr=1e-5 \
    critic.model.use_remove_padding=False \
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat \
    critic.model.enable_gradient_checkpointing=True \
    critic.ppo_micro_batch_size_per_gpu=32 \
    critic.model.fsdp_config.param_offload=False \
    critic.model.fsdp_config.optimizer_offload=False \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console'] \
    trainer.project_name='verl_example_gsm8k' \
    trainer.experiment_name='deepseek_llm_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_training_steps=2 \
    trainer.use_legacy_worker_impl=False \
    trainer.total_epochs=15 $@
"""


def as_the_shell_passes(script: str, home: str = "/home/user") -> list[str]:
    """The script's arguments as the program receives them: $HOME expanded, quotes removed, no arguments for $@."""
    return shlex.split(script.replace("\\\n", " ").replace("$HOME", home).replace("$@", ""))


def test_verl_grpo_gsm8k_script_runs_unchanged_with_its_meaning():
    config = load_config(RunConfig, None, as_the_shell_passes(GRPO_SCRIPT))
    data, actor_rollout_ref, trainer = config.data, config.actor_rollout_ref, config.trainer
    assert config.algorithm.adv_estimator == "grpo" and not config.algorithm.use_kl_in_reward
    assert data.train_files == ["/home/user/data/gsm8k/train.parquet"]  # one path, as verl takes it
    assert data.val_files == ["/home/user/data/gsm8k/test.parquet"]
    assert (data.train_batch_size, data.max_prompt_length, data.max_response_length) == (1024, 512, 1024)
    assert data.filter_overlong_prompts and data.truncation == "error"
    actor = actor_rollout_ref.actor
    assert (actor.optim.lr, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu) == (1e-6, 256, 40)
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type, actor.entropy_coeff) == (
        True, 0.001, "low_var_kl", 0.0)
    assert actor_rollout_ref.model.use_remove_padding and actor_rollout_ref.model.enable_gradient_checkpointing
    rollout, ref = actor_rollout_ref.rollout, actor_rollout_ref.ref
    assert (rollout.name, rollout.n, rollout.log_prob_micro_batch_size_per_gpu) == ("vllm", 5, 40)
    assert ref.log_prob_micro_batch_size_per_gpu == 40 and ref.fsdp_config.param_offload
    assert config.use_reference and not config.use_critic
    assert trainer.logger == ["console", "wandb"] and (trainer.save_freq, trainer.test_freq) == (20, 5)
    assert trainer.experiment_name == "qwen2_7b_function_rm"
    # 15 epochs of GSM8K's 7,473 training rows in batches of 1,024: 7 steps an epoch, as verl counts them
    assert trainer.total_training_steps is None and config.steps_for(7473).trainer.total_training_steps == 105
    notices = " | ".join(config.notices())
    for said in ("trainer.n_gpus_per_node=8, trainer.nnodes=1",
                 "rollout.gpu_memory_utilization=0.6", "rollout.tensor_model_parallel_size=2"):
        assert said in notices
    assert "trainer.logger" not in notices  # the console and W&B are both written


def test_verl_ppo_gsm8k_script_runs_unchanged_with_its_meaning():
    config = load_config(RunConfig, None, as_the_shell_passes(PPO_SCRIPT))
    assert config.algorithm.adv_estimator == "gae" and config.use_critic and not config.use_reference
    critic = config.critic
    assert (critic.optim.lr, critic.ppo_micro_batch_size_per_gpu) == (1e-5, 32)
    assert critic.model.path == "deepseek-ai/deepseek-llm-7b-chat" and not critic.model.use_remove_padding
    assert critic.model.enable_gradient_checkpointing and not critic.model.fsdp_config.param_offload
    assert config.trainer.logger == ["console"]
    # total_training_steps wins over total_epochs, as in verl
    assert config.steps_for(7473).trainer.total_training_steps == 2
    assert any("use_legacy_worker_impl" in notice for notice in config.notices())
    assert not any("trainer.logger" in notice for notice in config.notices())


def test_hydra_add_remove_and_interpolation():
    data = {"data": {"max_prompt_length": 256}, "trainer": {"test_freq": 5}}
    result = apply_overrides(data, ["+trainer.val_before_train=False", "++data.shuffle=false", "~trainer.test_freq",
                                    "data.max_response_length=${data.max_prompt_length}"])
    assert result == {"data": {"max_prompt_length": 256, "shuffle": False, "max_response_length": 256},
                      "trainer": {"val_before_train": False}}
    with pytest.raises(ConfigError, match=r"there is no key trainer\.nothing to remove"):
        apply_overrides(data, ["~trainer.nothing"])
    with pytest.raises(ConfigError, match=r"^data\.max_response_length: .*data\.no_such_key"):
        apply_overrides(data, ["data.max_response_length=${data.no_such_key}"])


def test_verls_never_saving_is_only_at_a_stop_here():
    config = load_config(RunConfig, None, ["trainer.save_freq=-1"])
    assert loop_settings(config).save_freq == 0


@pytest.mark.parametrize("engine", ["sglang", "sglang_async"])
def test_verls_sglang_and_hybrid_engine_are_accepted_and_each_said_once_as_not_used(engine):
    """verl's multi-turn scripts choose SGLang and say hybrid_engine=True; meshrl samples with its rollout services'
    engine and runs them as services of their own, and says so once each."""
    config = load_config(RunConfig, None, [f"actor_rollout_ref.rollout.name={engine}",
                                           "actor_rollout_ref.hybrid_engine=True"])
    assert config.actor_rollout_ref.rollout.name == engine and config.actor_rollout_ref.hybrid_engine
    notices = config.notices()
    [named] = [notice for notice in notices if "rollout.name" in notice]
    assert named.startswith(f"actor_rollout_ref.rollout.name={engine}: meshrl has no SGLang engine; the run samples "
                            "with the engine of its rollout services")
    [hybrid] = [notice for notice in notices if "hybrid_engine" in notice]
    assert hybrid.startswith("actor_rollout_ref.hybrid_engine=True: verl's actor and rollout in one process")
    assert not any("rollout.name" in notice or "hybrid_engine" in notice
                   for notice in load_config(RunConfig, None, ["actor_rollout_ref.rollout.name=vllm"]).notices())
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.name: Input should be 'hf', 'vllm', 'sglang' "
                                          r"or 'sglang_async'"):
        load_config(RunConfig, None, ["actor_rollout_ref.rollout.name=trtllm"])


def test_verls_checkpoint_bounds_set_how_many_step_folders_a_run_keeps():
    grpo = load_config(RunConfig, None, ["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=5"])
    assert loop_settings(grpo).checkpoints_kept == 2  # no critic: the actor's bound
    ppo = ["algorithm.adv_estimator=gae", "trainer.max_actor_ckpt_to_keep=2"]
    assert loop_settings(load_config(RunConfig, None, ppo)).checkpoints_kept is None  # the critic keeps all
    both = load_config(RunConfig, None, [*ppo, "trainer.max_critic_ckpt_to_keep=3"])
    assert loop_settings(both).checkpoints_kept == 3
    assert loop_settings(load_config(RunConfig, None, [])).checkpoints_kept is None  # verl's default: all
    with pytest.raises(ConfigError, match="trainer.max_actor_ckpt_to_keep"):
        load_config(RunConfig, None, ["trainer.max_actor_ckpt_to_keep=0"])


def test_verls_multi_turn_gsm8k_recipe_is_taken_with_its_meaning(tmp_path):
    """verl's examples/sglang_multiturn recipe: its named config (Hydra defaults on verl's base config) and the
    overrides of its script that choose the multi-turn rollout and its tools."""
    from services.coordctl.resolve import hydra_config_file, resolve_config

    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\ndefaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  return_raw_chat: True\nactor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    name: sglang\n"
        "    multi_turn:\n      enable: True\n      max_assistant_turns: 5\n")
    config, _ = resolve_config([
        "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=config/tool_config/gsm8k_tool_config.yaml",
        "data.return_raw_chat=True", "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
        "data.train_files=gsm8k/train.parquet"], local=False,
        config_file=hydra_config_file(str(tmp_path), "gsm8k_multiturn_grpo"))
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.max_assistant_turns == 5 and multi_turn.format == "hermes"
    # from the folder the script runs in, as verl's scripts expect
    assert multi_turn.tool_config_path == str(Path.cwd() / "config/tool_config/gsm8k_tool_config.yaml")
    assert multi_turn.tool_response_truncate_side == "middle" and multi_turn.max_tool_response_length == 256
    notices = " ".join(config.notices())
    assert "rollout.name=sglang" in notices and "the env services host the tools" in notices

    (tmp_path / "other.yaml").write_text("defaults:\n  - ppo_trainer\n  - override actor: megatron_actor\n")
    with pytest.raises(ConfigError, match="defaults: {'override actor': 'megatron_actor'} is a Hydra config meshrl"):
        resolve_config(["actor_rollout_ref.model.path=m"], local=False, config_file=str(tmp_path / "other.yaml"))
