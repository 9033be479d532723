"""CPU tests of bench/grpo_step.py: what a step's time and split come to on each side, the report of results
gathered from several invocations, and that every meshrl run it would start on a GPU passes the checks
StartRun makes (so a config error shows here, not on the device)."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.grpo_step import (PROMPT_TOKENS, RUNS, StepRecorder, load_results, meshrl_config, meshrl_services,
                             meshrl_steps, prepare_assets, report, summary, trl_stages, unavailable)
from services.common.config import load_config
from services.run.checks import load_run_data
from services.coordinator.runs.manager import parse_run_config
from services.coordinator.settings import check_within_rollout_limits, loop_settings, rollout_set_settings
from services.rollout.config import RolloutServiceConfig
from services.trainer.config import TrainerServiceConfig


def test_a_trl_step_splits_into_its_profiled_blocks():
    blocks = [("_prepare_inputs", 0.0, 4.0), ("sync_weights", 0.1, 0.2), ("vLLM.generate", 0.3, 3.0),
              ("_calculate_rewards", 3.3, 0.1), ("_get_per_token_logps_and_entropies", 3.4, 0.4),  # old logprobs
              ("_get_per_token_logps_and_entropies", 4.5, 0.3),  # the loss's, outside _prepare_inputs
              ("_prepare_inputs", 5.0, 0.01)]  # a later micro-batch's: taken from the buffer
    stages = trl_stages(blocks, seconds=5.5)
    assert stages == pytest.approx({"gen": 3.0, "update_weights": 0.2, "reward": 0.1, "old_log_prob": 0.4,
                                    "batch_prep": 4.01 - 3.7, "update_actor": 5.5 - 4.01})


def test_a_trl_step_lasts_from_the_end_of_the_one_before():
    recorder = StepRecorder()
    recorder.begin(10.0)
    recorder.profiled("GRPOTrainer.vLLM.generate", 10.5, 2.0)
    recorder.end(15.0, {"trainer_allocated": 3.0})
    recorder.begin(15.5)  # after the trainer's logging: counted in this step
    recorder.end(19.0, {"trainer_allocated": 4.0})
    first, second = recorder.steps
    assert (first["step"], first["seconds"], first["stages"]["gen"]) == (1, 5.0, 2.0)
    assert (second["step"], second["seconds"], second["stages"]["gen"]) == (2, 4.0, 0.0)  # blocks start afresh
    assert second["memory"] == {"trainer_allocated": 4.0}


def test_a_meshrl_step_lasts_from_the_end_of_the_one_before():
    rows = [{"step": 1, "time": 100.0, "timing_s/step": 9.0, "timing_s/gen": 4.0, "perf/max_memory_allocated_gb": 30.0,
             "perf/rollout/max_memory_allocated_gb": 40.0},
            {"step": 1, "time": 100.5, "val/weight_version": 1.0, "timing_s/testing": 0.5},  # a validation's line
            {"step": 2, "time": 106.0, "timing_s/step": 5.5, "timing_s/gen": 3.0, "timing_s/update_actor": 1.5,
             "perf/max_memory_allocated_gb": 20.0}]
    first, second = meshrl_steps(rows)
    assert (first["seconds"], first["stages"], first["memory"]) == (
        9.0, {"gen": 4.0}, {"trainer_allocated": 30.0, "rollout_allocated": 40.0})
    assert (second["step"], second["seconds"], second["stages"]) == (2, 6.0, {"gen": 3.0, "update_actor": 1.5})


def steps(seconds: list[float], gen: list[float], allocated: list[float]) -> list[dict]:
    return [{"step": i + 1, "seconds": s, "stages": {"gen": g}, "memory": {"trainer_allocated": a}}
            for i, (s, g, a) in enumerate(zip(seconds, gen, allocated))]


def test_medians_are_over_steps_3_and_later_and_peaks_over_all():
    result = {"max_staleness": 0, "steps": steps([30, 9, 5, 7, 6, 4], [20, 5, 3, 4, 9, 3], [50, 10, 10, 12, 11, 10]),
              "memory": {"gpu0": 70.0}}
    assert summary(result) == {"timed": 4, "seconds": 5.5, "stages": {"gen": 3.5},
                               "memory": {"trainer_allocated": 50, "gpu0": 70.0}}
    drained = {**result, "max_staleness": 1}  # its last step trained a batch generated ahead
    assert summary(drained)["seconds"] == 6.0 and summary(drained)["timed"] == 3


def result(name: str, seconds: list[float], host: str = "h200-a", status: str = "ok", error: str = "") -> dict:
    return {"run": name, "max_staleness": 0, "machine": f"1x NVIDIA H200 ({host})", "host": host,
            "date": "2026-12-01 22:00 UTC", "status": status, "error": error,
            "steps": steps(seconds, [1.0] * len(seconds), [10.0] * len(seconds)), "memory": {"gpu0": 75.0}}


def test_the_report_gathers_several_invocations_and_ends_with_the_ratios_to_trl(tmp_path):
    for name, run in [("colocated", result("colocated", [9, 9, 4, 4, 4])),
                      ("trl", result("trl", [9, 9, 5, 5, 5]))]:  # two invocations, one folder
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    (tmp_path / "colocated-sleep.json").write_text(json.dumps(
        result("colocated-sleep", [], status="failed", error="run ended failed:\nCUDA out of memory")))
    padding_free = ["actor_rollout_ref.model.use_remove_padding=true"]
    (tmp_path / "split-k1.json").write_text(json.dumps(
        {**result("split-k1", [9, 9, 3, 3, 3, 3], host="h200x2-b"), "overrides": padding_free}))
    results = load_results(tmp_path)
    assert list(results) == ["trl", "colocated", "colocated-sleep", "split-k1"]  # RUNS' order
    lines = report(results).splitlines()
    ratios = lines[lines.index("s/step over TRL's 5.00 s (1x NVIDIA H200 (h200-a)):"):]
    assert ratios[1:] == ["  colocated       0.80x", "  split-k1        0.60x (NOT the same host: h200x2-b)"]
    assert next(line for line in lines if line.startswith("split-k1")).endswith(
        "1x NVIDIA H200 (h200x2-b), 2026-12-01 22:00 UTC, actor_rollout_ref.model.use_remove_padding=true")
    failed = next(line for line in lines if line.startswith("colocated-sleep"))
    assert "failed: run ended failed: | CUDA out of memory" in failed
    trl_row = next(line for line in lines if line.startswith("trl "))
    # steps, s/step, tokens/s per GPU (32 x 8 x 320 = 81,920 tokens in 5 s on one GPU), sync (no update_weights
    # stage here), trainer, vLLM (none), GPU 0
    assert trl_row.split()[1:8] == ["5", "5.00", "16384", "-", "10.0", "-", "75.0"]
    split_row = next(line for line in lines if line.startswith("split-k1"))
    assert split_row.split()[1:4] == ["6", "3.00", "13653"]  # 81,920 tokens in 3 s on two GPUs
    assert report({"colocated": results["colocated"]}).splitlines()[-1].startswith("no TRL result here")


def lora_result(name: str, seconds: float, trainer_gib: float, sync_s: float) -> dict:
    steps_done = [{"step": step, "seconds": seconds, "stages": {"update_weights": sync_s},
                   "memory": {"trainer_allocated": trainer_gib}} for step in range(1, 5)]
    return {**result(name, []), "steps": steps_done}


def test_the_report_sets_each_lora_run_against_its_full_fine_tune(tmp_path):
    for run in (lora_result("colocated", 6.0, 20.0, 0.4), lora_result("colocated-lora", 4.5, 9.0, 0.003),
                lora_result("trl-lora", 8.0, 12.0, 0.5)):  # no trl beside trl-lora: no line for it
        (tmp_path / f"{run['run']}.json").write_text(json.dumps(run))
    lines = report(load_results(tmp_path)).splitlines()
    assert lines[-2:] == [
        "LoRA against full fine-tuning (goals: trainer peak <= 0.6x, s/step <= 1.0x, sync < 5 ms):",
        "  colocated-lora  trainer peak 0.45x, s/step 0.75x, sync 3.0 ms against 400.0 ms (colocated)"]
    lora_row = next(line for line in lines if line.startswith("colocated-lora"))
    assert lora_row.split()[1:5] == ["4", "4.50", "18204", "3.0"]  # steps, s/step, tokens/s per GPU, sync ms
    alone = {"colocated-lora": load_results(tmp_path)["colocated-lora"]}
    assert report(alone).splitlines()[-1].startswith("no LoRA run beside its full fine-tune")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny model of the bench's kind (the character tokenizer, 4096 positions; wide enough for the LoRA runs'
    rank 64) and the bench's prompts."""
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2)
    return prepare_assets(tmp_path_factory.mktemp("grpo-step"), tiny)


@pytest.mark.parametrize("name", [name for name in RUNS if RUNS[name].layout])
def test_each_meshrl_run_passes_the_checks_start_run_makes(assets, name):
    model, data = assets
    assert unavailable(name, gpus=2) is None
    config = parse_run_config(yaml.safe_dump(meshrl_config(name, model, data, steps=8)))
    specs = meshrl_services(RUNS[name].layout)
    settings = {kind: [load_config(model_type, None, list(spec.settings)) for spec in specs if spec.kind == kind]
                for kind, model_type in (("rollout", RolloutServiceConfig), ("trainer", TrainerServiceConfig))}
    check_within_rollout_limits(config, {str(i): rollout.request_limits() for i, rollout in
                                         enumerate(settings["rollout"])})
    loop = loop_settings(config)
    read = load_run_data(config)
    assert {len(prompt.token_ids) for prompt in read.prompts} == {PROMPT_TOKENS}
    assert (loop.batch_size, loop.sampling.n, loop.sampling.max_new_tokens) == (32, 8, 256)
    actor = config.actor_rollout_ref.actor
    assert (actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.optim.lr) == (32, 64, 1e-6)
    assert not config.use_reference and loop.max_staleness == RUNS[name].max_staleness
    assert loop.sleep_rollouts == any(rollout.enable_sleep_mode for rollout in settings["rollout"])
    assert [trainer.device for trainer in settings["trainer"]] == ["cuda"]
    rollouts = rollout_set_settings(config)  # a LoRA run's rollouts start vLLM for its adapters, unless merged
    served_as_adapters = RUNS[name].lora and not RUNS[name].merge
    assert (rollouts.lora_rank, rollouts.adapter_versions) == ((64, 1) if served_as_adapters else (0, 0))
    model_keys = config.actor_rollout_ref.model
    assert (model_keys.lora.merge, model_keys.enable_gradient_checkpointing) == (RUNS[name].merge,
                                                                                RUNS[name].checkpointing)


def test_a_run_needing_more_gpus_than_there_are_is_skipped_saying_so():
    assert unavailable("split-k1", gpus=1) == "needs 2 GPUs, this machine has 1"
    assert unavailable("colocated", gpus=1) is None
