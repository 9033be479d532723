"""Faults: kill -9 random services under running runs and count what was lost.

A seeded schedule kills a random kind of service (trainer, rollout, reward)
after a random number of recorded steps, a random fraction of a second later
(so that kills land in every stage of a step), and starts a replacement of
the same kind at once. The cluster: a coordinator, one trainer, two rollout
and two reward replicas, as local processes; runs of the tiny reverse task
with a checkpoint every 2 steps, one after the other on the same cluster.

Prints the faults injected, the runs completed, and per kind the time to
detect a dead member (kill -> the first coordinator log line naming its
address) and to recover (kill -> the next step recorded), then the samples
lost (steps missing or short of train_batch_size x n samples), which must
be 0, last.

    python bench/faults.py [--runs 4] [--faults 4] [--steps 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import sqlite3
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from services.coordctl.control import CoordinatorClient, RunStatus
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import build_tiny_model

KINDS = ("trainer", "rollout", "reward")
ROLLOUT = ServiceSpec("rollout", settings=("batch_size=1",))  # one sequence at a time: steps of ~0.3 s, not 0.05
SERVICES = (ServiceSpec("trainer"), ROLLOUT, ROLLOUT, ServiceSpec("reward"), ServiceSpec("reward"))


@dataclass(frozen=True)
class Fault:
    kind: str  # trainer, rollout or reward
    after_steps: int  # step events of the run seen before it (steps run again after a rewind count again)
    delay_s: float  # then this long


@dataclass
class Injected:
    fault: Fault
    name: str  # the process killed
    address: str
    killed_at: float  # time.time()


def random_schedule(rng: random.Random, faults: int, steps: int) -> list[Fault]:
    """``faults`` kills spread over a ``steps``-step run: one at a random point of each of ``faults`` equal
    stretches between the first step and the last three."""
    stretch = (steps - 3) // faults
    if stretch < 1:
        raise ValueError(f"{faults} faults do not fit in {steps} steps")
    return [Fault(rng.choice(KINDS), 1 + index * stretch + rng.randrange(stretch), round(rng.uniform(0.0, 0.2), 2))
            for index in range(faults)]


def service_address(cluster: LocalCluster, name: str) -> str | None:
    """Where a local service listens, from the ``serving`` line of its log (None before it serves)."""
    for line in (cluster.log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return json.loads(line)["address"]
    return None


async def kill_and_replace(cluster: LocalCluster, kind: str, rng: random.Random) -> tuple[str, str]:
    """SIGKILL a random ``kind`` process that serves (waiting for one, if all of them are still starting) and
    start another; returns (name, address) of the one killed."""
    while True:
        live = [name for name, process in cluster.processes.items()
                if name.split("-")[0] == kind and process.poll() is None]
        serving = {name: address for name in live if (address := service_address(cluster, name))}
        if serving:
            break
        await asyncio.sleep(0.1)
    name = rng.choice(sorted(serving))
    process = cluster.processes.pop(name)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    names = (f"{kind}-again-{i}" for i in itertools.count())
    spec = ROLLOUT if kind == "rollout" else ServiceSpec(kind)
    cluster.add_service(spec, next(n for n in names if not (cluster.log_dir / f"{n}.log").exists()))
    return name, serving[name]


async def run_with_faults(cluster: LocalCluster, config_yaml: str, schedule: list[Fault],
                          rng: random.Random) -> tuple[RunStatus, list[Injected]]:
    """Start a run, inject ``schedule`` into it, follow it to its end."""
    client = CoordinatorClient(cluster.coordinator)
    injected: list[Injected] = []
    pending, seen, tasks = list(schedule), 0, []

    async def inject(fault: Fault) -> None:
        await asyncio.sleep(fault.delay_s)
        name, address = await kill_and_replace(cluster, fault.kind, rng)
        injected.append(Injected(fault, name, address, time.time()))

    try:
        run = await client.start_run(config_yaml)
        async for update in client.watch(run.run_id):
            seen += update.kind == "step"
            while pending and pending[0].after_steps <= seen:
                tasks.append(asyncio.create_task(inject(pending.pop(0))))
        await asyncio.gather(*tasks)
        return await client.get_run(run.run_id), injected
    finally:
        await client.close()


def step_events(state_dir: Path, run_id: str) -> list[float]:
    """Times of the run's step events (steps run again after a rewind included)."""
    with sqlite3.connect(state_dir / "meshrl.db") as db:
        return [t for (t,) in db.execute("SELECT time FROM events WHERE run_id = ? AND kind = 'step' ORDER BY id",
                                         (run_id,))]


def samples_lost(state_dir: Path, run_id: str, steps: int, batch: int) -> int:
    """Samples missing from the run DB: a step without a row counts whole, a row by the shortfall of its
    rollout or reward sample counts (metrics rollout/samples_by/* and reward/samples_by/*)."""
    with sqlite3.connect(state_dir / "meshrl.db") as db:
        rows = dict(db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (run_id,)).fetchall())
    lost = 0
    for step in range(1, steps + 1):
        metrics = json.loads(rows.get(step, "{}"))
        counts = [sum(v for k, v in metrics.items() if k.startswith(f"{kind}/samples_by/"))
                  for kind in ("rollout", "reward")]
        lost += max(0, batch - int(min(counts)))
    return lost


def detection_s(coordinator_log: Path, fault: Injected) -> float | None:
    """Kill -> the first coordinator log line after it that names the dead member's address."""
    named = re.compile(re.escape(fault.address) + r"(?!\d)")
    for line in coordinator_log.read_text(errors="replace").splitlines():
        if not line.startswith("{") or not named.search(line):
            continue
        at = datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
        if at >= fault.killed_at:
            return at - fault.killed_at
    return None


def run_config(model: Path, data: Path, steps: int) -> str:
    return yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 16},
        "actor_rollout_ref": {"model": {"path": str(model)}, "rollout": {"n": 4},
                              "actor": {"optim": {"lr": 1e-3}, "ppo_mini_batch_size": 4,
                                        "ppo_micro_batch_size_per_gpu": 8}},
        "trainer": {"total_training_steps": steps, "experiment_name": "faults", "save_freq": 2,
                    "channel_timeout_s": 10, "max_recoveries": 10},
    })


def median(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s" if values else "     -  "


async def bench(args: argparse.Namespace, folder: Path) -> None:
    rng = random.Random(args.seed)
    model = build_tiny_model(folder / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    data = write_jsonl(reverse_task_rows(64, 2, 4, seed=3), folder / "reverse.jsonl")
    config = run_config(model, data, args.steps)
    cluster = LocalCluster(folder / "state", SERVICES)
    await cluster.start(timeout_s=120)
    completed, lost, faults = 0, 0, []
    try:
        for _ in range(args.runs):
            final, injected = await run_with_faults(cluster, config, random_schedule(rng, args.faults, args.steps), rng)
            completed += final.state == "finished"
            lost += samples_lost(cluster.state_dir, final.run_id, args.steps, 8 * 4)
            events = step_events(cluster.state_dir, final.run_id)
            for fault in injected:
                recovered = next((t - fault.killed_at for t in events if t > fault.killed_at), None)
                faults.append((fault, detection_s(cluster.log_dir / "coordinator.log", fault), recovered))
    finally:
        cluster.stop()
    print(f"runs completed    {completed} of {args.runs} ({args.steps} steps each)")
    print(f"faults injected   {len(faults)} (" + ", ".join(
        f"{kind} {sum(f.fault.kind == kind for f, _, _ in faults)}" for kind in KINDS) + ")")
    for kind in KINDS:
        detect = [d for f, d, _ in faults if f.fault.kind == kind and d is not None]
        recover = [r for f, _, r in faults if f.fault.kind == kind and r is not None]
        print(f"{kind:<8}  detect (median) {median(detect)}   recover (median) {median(recover)}   "
              f"over {len(recover)} kills")
    print(f"samples lost: {lost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--faults", type=int, default=4, help="kills per run")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(bench(args, Path(folder)))


if __name__ == "__main__":
    main()
