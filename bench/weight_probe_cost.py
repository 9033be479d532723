"""The weight check's cost: the same runs with actor_rollout_ref.rollout.weight_check on and off, at
trainer.async_.max_staleness 0 and 1, on two meshes of local processes (started once each, the runs one after
the other on it):

- ``local default``: the services and run of `coordctl start-run --local` (one trainer, one rollout with its
  default batch_size 256, one reward), its model and task;
- ``batch_size=1 mesh``: the same run on one trainer, ``--rollouts`` rollouts started with batch_size=1 (each
  sequence sampled alone: steps of about a second, a generation call in flight through most of each sync when
  generating a step ahead) and one reward service.

Neither validates (trainer.test_freq=-1) nor warm-starts: training alone is timed. A step's time is the mean
interval between the recorded steps past the first two (warm-up, the pipeline filling) and before the last
(the pipeline draining). Each pair of runs (check on, check off) runs ``--repeats`` times, on and off in turn,
so that a load that changes meanwhile falls on both.

Prints per mesh and max_staleness: the step time with the check on and off, the check's seconds per step
(timing_s/weight_probe: median and largest) and their share of the step with the check on; then, last, the
largest ratio of the step time on / off.

    python bench/weight_probe_cost.py [--steps N] [--repeats R] [--rollouts N] [--staleness 0 1] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Timed:
    """One run's figures over its steady steps."""

    step_s: float  # mean seconds from one recorded step to the next
    probe_s: list[float]  # timing_s/weight_probe of each step (none with the check off)


def steady(rows: list[dict]) -> list[dict]:
    """The steps timed: not the first two (warm-up; with max_staleness 1 the pipeline filling) nor the last (the
    pipeline draining: its batch was generated ahead)."""
    if len(rows) < 5:
        raise ValueError(f"timing a run needs at least 5 steps, it has {len(rows)}")
    return rows[2:-1]


def timed(rows: list[dict]) -> Timed:
    """A run's step time and check seconds, from its metrics.jsonl rows (the steps' rows: validations left out)."""
    steps = [row for row in rows if "timing_s/step" in row]
    kept = steady(steps)
    step_s = (kept[-1]["time"] - steps[1]["time"]) / len(kept)
    probe_s = [row["timing_s/weight_probe"] for row in kept if "timing_s/weight_probe" in row]
    return Timed(step_s=step_s, probe_s=probe_s)


def run_config(overrides: list[str], steps: int, max_staleness: int, check: bool) -> str:
    """The local default's run (its model and data built into coordctl's cache if missing), not validating, not
    warm-starting, with the check on or off."""
    import yaml

    from services.coordctl.resolve import resolve_config

    config, _ = resolve_config([
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=0", "actor_rollout_ref.actor.warm_start.steps=0",
        f"trainer.async_.max_staleness={max_staleness}", f"trainer.experiment_name=probe-{max_staleness}-{check}",
        f"actor_rollout_ref.rollout.weight_check.enable={str(check).lower()}", *overrides], local=True)
    return yaml.safe_dump(config.model_dump(mode="json"))


async def run_on(cluster, config_yaml: str) -> list[dict]:
    """Run ``config_yaml`` on ``cluster`` to its end; its metrics.jsonl rows (RuntimeError unless it finished)."""
    from services.coordctl.control import CoordinatorClient
    from services.coordctl.follow import read_metrics

    client = CoordinatorClient(cluster.coordinator)
    try:
        started = await client.start_run(config_yaml)
        async for _ in client.watch(started.run_id):
            pass
        final = await client.get_run(started.run_id)
    finally:
        await client.close()
    if final.state != "finished":
        raise RuntimeError(f"run {final.run_id} ended {final.state}: {final.error}")
    return read_metrics(final.run_dir)


async def measure(folder: Path, services: tuple, args: argparse.Namespace) -> dict[tuple[int, bool], list[Timed]]:
    """On one mesh of ``services``: each max_staleness's runs with the check on and off, ``args.repeats`` times in
    turn."""
    from services.coordctl.local import LocalCluster

    cluster = LocalCluster(folder, services)
    results: dict[tuple[int, bool], list[Timed]] = {}
    try:
        await cluster.start(timeout_s=180)
        for max_staleness in args.staleness:
            for _ in range(args.repeats):
                for check in (True, False):
                    rows = await run_on(cluster, run_config(args.overrides, args.steps, max_staleness, check))
                    results.setdefault((max_staleness, check), []).append(timed(rows))
    finally:
        cluster.stop()
    return results


def report(mesh: str, results: dict[tuple[int, bool], list[Timed]]) -> list[float]:
    """Print one line per max_staleness; the ratios step on / step off."""
    ratios = []
    for max_staleness in sorted({k for k, _ in results}):
        on, off = results[(max_staleness, True)], results[(max_staleness, False)]
        step_on, step_off = statistics.mean(t.step_s for t in on), statistics.mean(t.step_s for t in off)
        probes = [s for t in on for s in t.probe_s]
        median_probe = statistics.median(probes)
        ratios.append(step_on / step_off)
        print(f"{mesh:<18} max_staleness {max_staleness}   step {step_on:6.3f} s on, {step_off:6.3f} s off   "
              f"weight_probe median {median_probe * 1e3:6.1f} ms ({median_probe / step_on:6.1%} of the step), "
              f"max {max(probes) * 1e3:6.1f} ms   on/off {step_on / step_off:.3f}", flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--repeats", type=int, default=1, help="runs with the check on, and off, per case")
    parser.add_argument("--rollouts", type=int, default=2, help="batch_size=1 rollouts in the second mesh")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="trainer.async_.max_staleness")
    parser.add_argument("--meshes", nargs="+", default=["local", "batch1"], choices=["local", "batch1"])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    args = parser.parse_args()

    from services.coordctl.local import ONE_OF_EACH, ServiceSpec

    meshes = {"local": ("local default", ONE_OF_EACH),
              "batch1": (f"{args.rollouts} x batch_size=1", (
                  ServiceSpec(kind="trainer"), *[ServiceSpec(kind="rollout", settings=("batch_size=1",
                                                                                       ))] * args.rollouts,
                  ServiceSpec(kind="reward")))}
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        for key in args.meshes:
            name, services = meshes[key]
            ratios += report(name, asyncio.run(measure(Path(folder) / key, services, args)))
    print(f"step time, weight check on / off (the largest of the {len(ratios)} cases): {max(ratios):.3f}")


if __name__ == "__main__":
    main()
