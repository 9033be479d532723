"""Benchmark of the embedded default: `coordctl start-run --local`, as a user runs it.

Prints, from the run's metrics:
- the time from the run's start to the first step whose 10-step moving
  average of the mean reward reaches 0.9 (the reward's maximum is 1.0);
- steps per second;
- the share of each step spent outside generate / update / weight sync,
  which is the control plane's cost (gRPC, batching, scoring, bookkeeping);
- as a reference measured in the same run: the same GRPO step (same model,
  engine, actor, batch) called in one process without any service, and the
  ratio of the service step time to it.

    python bench/local_default.py [key=value overrides for the run]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WINDOW = 10
TARGET = 0.9


def run_local(state_dir: Path, overrides: list[str]) -> tuple[list[dict], float, float]:
    """Run coordctl start-run --local; returns the step metrics, run start time and total wall time."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "services.coordctl.cli", "start-run", "--local",
                    "--state-dir", str(state_dir), *overrides], check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - started
    [metrics_file] = state_dir.glob("runs/*/metrics.jsonl")
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    rows = [line for line in lines if "critic/score/mean" in line]  # the steps (the validations' lines left out)
    import sqlite3

    db = sqlite3.connect(state_dir / "meshrl.db")
    (run_started,) = db.execute("SELECT MIN(time) FROM events WHERE kind = 'state' AND state = 'running'").fetchone()
    return rows, run_started, wall


def in_process_step_seconds(config_path: Path, steps: int) -> float:
    """Mean time of a GRPO step with engine, actor and scorer called directly in this process."""
    import yaml

    from services import algos, estimators
    from services.common.config import validate
    from services.common.sequences import SequenceBatch
    from services.coordinator.step.sampler import PromptSampler
    from services.reward.rules import score_sample
    from services.rollout.hf_engine import HFEngine
    from services.rollout.sampling import SamplingSettings
    from services.run.config import RunConfig
    from services.run.data import load_prompts
    from services.run.models import load_causal_lm, load_tokenizer
    from services.trainer.actor import UpdateInputs
    from services.trainer.batching import MicroBatching
    from services.trainer.ranks import Ranks
    from services.trainer.settings import actor_settings
    from services.trainer.setup import build_actor

    torch.set_num_threads(1)
    config = validate(RunConfig, yaml.safe_load(config_path.read_text()))
    model_path, data, rollout = config.actor_rollout_ref.model.path, config.data, config.actor_rollout_ref.rollout
    tokenizer = load_tokenizer(model_path)
    prompts, _ = load_prompts(data.train_files, data.prompt_key, data.reward_fn_key, tokenizer=tokenizer,
                              max_len=data.max_prompt_length)
    actor = build_actor(config, config.trainer.seed, Ranks.single("cpu"))
    engine = HFEngine(load_causal_lm(model_path), actor.pad_id, (tokenizer.eos_token_id,), batch_size=256)
    sampler = PromptSampler(len(prompts), data.train_batch_size, True, seed=config.trainer.seed)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        chosen = [prompts[i] for i in sampler.next_batch()]
        sampling = SamplingSettings(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                                    max_new_tokens=data.max_response_length, seed=step, stop_token_ids=())
        completions = engine.generate([p.token_ids for p in chosen], sampling)
        responses = [c.token_ids for group in completions for c in group]
        scores = torch.tensor([score_sample(p.data_source, tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                            p.ground_truth) for p, group in zip(chosen, completions) for c in group])
        batch = SequenceBatch.of_lists([p.token_ids for p in chosen for _ in range(rollout.n)], responses)
        old = actor.compute_log_probs(batch, rollout.temperature, MicroBatching(size=256))
        groups = torch.arange(len(chosen)).repeat_interleave(rollout.n)
        advantages = algos.expand_per_token(estimators.grpo_advantages(scores, groups), batch.response_lens)
        actor.update(batch, UpdateInputs(old_logprobs=old, advantages=advantages, ref_logprobs=None),
                     actor_settings(config, torch.device("cpu")))
        engine.load_weights(actor.named_weights())
        times.append(time.perf_counter() - started)
    return sum(times[1:]) / len(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the run")
    overrides = parser.parse_args().overrides
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp) / "state"
        rows, run_started, wall = run_local(state_dir, overrides)
        [config_path] = state_dir.glob("runs/*/config.yaml")
        reference = in_process_step_seconds(config_path, 20)
    rewards = [r["critic/score/mean"] for r in rows]
    moving = [sum(rewards[max(0, i - WINDOW + 1): i + 1]) / len(rewards[max(0, i - WINDOW + 1): i + 1])
              for i in range(len(rewards))]
    reached = next((i for i, value in enumerate(moving) if value >= TARGET and i >= WINDOW - 1), None)
    time_to_target = rows[reached]["time"] - run_started if reached is not None else float("nan")
    loop_seconds = rows[-1]["time"] - rows[0]["time"] + rows[0]["timing_s/step"]
    step_s = sum(r["timing_s/step"] for r in rows) / len(rows)
    stages = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")
    compute = sum(r["timing_s/gen"] + r["timing_s/update_actor"] + r["timing_s/update_weights"] for r in rows)
    overhead = 1 - compute / sum(r["timing_s/step"] for r in rows)

    print(f"steps                       {len(rows)}  (coordctl wall time {wall:.0f} s, incl. start-up and warm start)")
    print(f"reward                      {rewards[0]:.3f} at step 1 -> {moving[-1]:.3f} ({WINDOW}-step average at the end)")
    print(f"steps per second            {len(rows) / loop_seconds:.2f}")
    print("mean stage time (s)         " + "  ".join(f"{s} {sum(r[f'timing_s/{s}'] for r in rows) / len(rows):.3f}"
                                              for s in stages))
    print(f"control-plane share         {overhead:.1%} of each step outside generate/update/sync")
    print(f"in-process step (reference) {reference:.3f} s; service step {step_s:.3f} s; "
          f"ratio {step_s / reference:.2f}x")
    step_text = f"step {reached + 1}" if reached is not None else "not reached"
    print(f"time to {TARGET} mean reward ({WINDOW}-step average): {time_to_target:.1f} s ({step_text})")


if __name__ == "__main__":
    main()
