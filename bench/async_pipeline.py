"""The asynchronous pipeline against the synchronous loop: the same GRPO run with trainer.async_.max_staleness
K=1 and K=0, same seed, same model, same batch, one after the other.

On CPU (default) it is the embedded default (`coordctl start-run --local`,
each service on one thread); with --gpu it is a GRPO run shaped like verl's
GRPO examples (a KL loss against a reference model, four optimizer steps per
batch) on two GPUs (trainer with actor and reference on GPU 0, vLLM rollout on
GPU 1, a random Qwen2.5-0.5B-shaped model, 64 prompts x 8 samples of 128
tokens; vLLM with CUDA graphs unless --eager), both runs on the same
services, started once. Prints the mean seconds of each stage per K, then
per K: steps per second,
tokens per second, the mean reward over the last 10 steps (equal steps), the
mean reward of the steps the slower run had finished by the time the faster
one ended (equal wall time), the rollout fleet's idle fraction, the largest
staleness seen; then the bound the synchronous step's split puts on the
gain (step time over the larger of generation and the rest); and last the
throughput ratio K=1 / K=0.

    python bench/async_pipeline.py [--gpu [--eager]] [--steps N] [--metrics-dir DIR] [key=value overrides]
    python bench/async_pipeline.py --from-metrics DIR [--gpu]   (the report of runs kept with --metrics-dir)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def run_cpu(state_dir: Path, overrides: list[str]) -> list[dict]:
    """The embedded default's steps, without its validation (training alone is compared)."""
    subprocess.run([sys.executable, "-m", "services.coordctl.cli", "start-run", "--local", "--state-dir",
                    str(state_dir), "trainer.test_freq=-1", "trainer.val_before_train=false", *overrides],
                   check=True, stdout=subprocess.DEVNULL)
    [metrics] = state_dir.glob("runs/*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def run_gpu(state_dir: Path, steps: int, eager: bool, overrides: list[str]) -> dict[int, list[dict]]:
    """Both runs (K=1, then K=0) one after the other on the same services, started once: the rollout's
    start-up (vLLM, its CUDA graphs) is paid once and both runs meet the same warm processes."""
    from services.common.config import apply_overrides
    from services.coordctl.control import CoordinatorClient
    from services.coordctl.local import LocalCluster, ServiceSpec
    from services.coordctl.synthetic import reverse_task_rows, write_jsonl
    from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model

    model = build_random_model(state_dir / "model", QWEN25_SHAPES["0.5b"], "bfloat16", seed=0)
    data = write_jsonl(reverse_task_rows(4096, 2, 6, seed=3), state_dir / "reverse.jsonl")

    def config(max_staleness: int) -> dict:
        return apply_overrides({
            "data": {"train_files": [str(data)], "train_batch_size": 64, "max_prompt_length": 16,
                     "max_response_length": 128},
            "actor_rollout_ref": {
                "model": {"path": str(model), "dtype": "bfloat16"},
                "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 64,
                          "use_kl_loss": True},
                "rollout": {"name": "vllm", "n": 8},
            },
            "trainer": {"total_training_steps": steps, "experiment_name": f"async-k{max_staleness}",
                        "async_": {"max_staleness": max_staleness}},
        }, overrides)

    services = (
        ServiceSpec(kind="trainer", settings=("device=cuda",), env=(("CUDA_VISIBLE_DEVICES", "0"),)),
        ServiceSpec(kind="rollout", settings=("engine=vllm", f"enforce_eager={str(eager).lower()}",
                                         "gpu_memory_utilization=0.6"), env=(("CUDA_VISIBLE_DEVICES", "1"),)),
        ServiceSpec(kind="reward"),
    )
    cluster = LocalCluster(state_dir / "state", services)

    async def run(client: CoordinatorClient, max_staleness: int) -> list[dict]:
        started = await client.start_run(yaml.safe_dump(config(max_staleness)))
        async for _ in client.watch(started.run_id):
            pass
        final = await client.get_run(started.run_id)
        if final.state != "finished":
            raise RuntimeError(f"run {final.run_id} ended {final.state}: {final.error}")
        return [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]

    async def both() -> dict[int, list[dict]]:
        await cluster.start(timeout_s=300)
        client = CoordinatorClient(cluster.coordinator)
        try:
            return {k: await run(client, k) for k in (1, 0)}
        finally:
            await client.close()

    try:
        return asyncio.run(both())
    finally:
        cluster.stop()


def steady(rows: list[dict]) -> list[dict]:
    """The steps a rate is taken over: not the first two (warm-up: CUDA, allocator, first compiles; and with K > 0
    the pipeline filling: step 2's batch was generated while step 1 trained) nor the last (with K > 0 its batch
    was generated ahead, so it trains without waiting for generation: the pipeline draining). What is left is
    what a long run repeats."""
    if len(rows) < 4:
        raise ValueError(f"a rate needs at least 4 steps, the run has {len(rows)}")
    return rows[2:-1]


def summary(rows: list[dict]) -> dict:
    timed = steady(rows)
    wall = timed[-1]["time"] - rows[1]["time"]
    tokens = sum(r["perf/total_num_tokens"] for r in timed)
    last = rows[-10:]
    return {"steps": len(rows), "wall": rows[-1]["time"] - rows[0]["time"] + rows[0]["timing_s/step"],
            "start": rows[0]["time"] - rows[0]["timing_s/step"],
            "steps_per_s": len(timed) / wall, "tokens_per_s": tokens / wall,
            "reward_last10": sum(r["critic/score/mean"] for r in last) / len(last),
            "idle": sum(r["perf/rollout_idle_fraction"] for r in timed) / len(timed),
            "staleness_max": max(r.get("training/off_policy/staleness/max", 0.0) for r in rows)}


STAGES = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights", "weight_probe", "rollout_pause",
          "step")


def stage_means(rows: list[dict]) -> dict[str, float]:
    """Mean seconds of each stage over the steady steps (stages a run does not have are left out); with K > 0,
    gen and reward of a step ran while earlier steps trained."""
    timed = steady(rows)
    return {stage: sum(r[f"timing_s/{stage}"] for r in timed) / len(timed)
            for stage in STAGES if all(f"timing_s/{stage}" in r for r in timed)}


def reward_by(rows: list[dict], start: float, seconds: float) -> float:
    """Mean reward of the steps finished within ``seconds`` of the run's first step starting."""
    done = [r["critic/score/mean"] for r in rows if r["time"] - start <= seconds]
    return sum(done) / len(done) if done else float("nan")


def report(results: dict[int, list[dict]], where: str) -> None:
    summaries = {k: summary(rows) for k, rows in results.items()}
    means = {k: stage_means(rows) for k, rows in results.items()}
    shown = [stage for stage in STAGES if all(stage in m for m in means.values())]
    print("mean s  " + " ".join(f"{stage:>14}" for stage in shown))
    for k, m in means.items():
        print(f"K={k:<5} " + " ".join(f"{m[stage]:>14.3f}" for stage in shown))
    horizon = min(s["wall"] for s in summaries.values())
    print(f"{'K':>2} {'steps':>6} {'wall s':>8} {'steps/s':>8} {'tokens/s':>10} {'reward last 10':>15} "
          f"{'reward by ' + format(horizon, '.0f') + ' s':>16} {'rollout idle':>13} {'staleness max':>14}")
    for k, s in summaries.items():
        print(f"{k:>2} {s['steps']:>6} {s['wall']:>8.1f} {s['steps_per_s']:>8.3f} {s['tokens_per_s']:>10.0f} "
              f"{s['reward_last10']:>15.3f} {reward_by(results[k], s['start'], horizon):>16.3f} {s['idle']:>13.1%} "
              f"{s['staleness_max']:>14.0f}")
    synchronous = means[0]
    rest = synchronous["step"] - synchronous["gen"]
    print(f"K=0 step {synchronous['step']:.2f} s = generation {synchronous['gen']:.2f} s + the rest (score, "
          f"logprobs, update, sync) {rest:.2f} s: overlapping the two bounds K=1 at "
          f"{synchronous['step'] / max(synchronous['gen'], rest):.2f}x")
    print(f"throughput K=1 / K=0: {summaries[1]['tokens_per_s'] / summaries[0]['tokens_per_s']:.2f}x ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--eager", action="store_true", help="--gpu: vLLM without CUDA graphs (starts faster)")
    parser.add_argument("--metrics-dir", type=Path, help="keep each run's per-step metrics here (k1.jsonl, k0.jsonl)")
    parser.add_argument("--from-metrics", type=Path, help="run nothing: report the runs a --metrics-dir kept")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.from_metrics:
        results = {k: [json.loads(line) for line in (args.from_metrics / f"k{k}.jsonl").read_text().splitlines()]
                   for k in (1, 0)}
        report(results, f"{'GPU' if args.gpu else 'CPU'}, from {args.from_metrics}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu:
            results = run_gpu(Path(tmp), args.steps or 12, args.eager, args.overrides)
        else:
            steps = [f"trainer.total_training_steps={args.steps}"] if args.steps else []
            results = {}
            for k in (1, 0):
                (Path(tmp) / f"k{k}").mkdir()
                results[k] = run_cpu(Path(tmp) / f"k{k}", [f"trainer.async_.max_staleness={k}", *steps,
                                                           *args.overrides])
    if args.metrics_dir:
        args.metrics_dir.mkdir(parents=True, exist_ok=True)
        for k, rows in results.items():
            (args.metrics_dir / f"k{k}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report(results, "GPU" if args.gpu else "CPU")


if __name__ == "__main__":
    main()
