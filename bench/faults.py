"""Faults: kill -9 and SIGSTOP random services, the coordinator among them, under running runs, and count what
was lost.

A seeded schedule picks, after a random number of recorded steps and a random fraction of a second later (so
that faults land in every stage of a step), a kind of service (coordinator, trainer, rollout, reward) and a
fault: ``kill`` (SIGKILL; a replacement of the same kind is started at once, the coordinator again on its state
dir) or ``stop`` (SIGSTOP, then SIGCONT a random 1-12 s later). The cluster: a coordinator, one trainer, two
rollout and two reward replicas, as local processes; runs of the tiny reverse task with a checkpoint every 2
steps, one after the other on the same cluster, each schedule once with trainer.async_.max_staleness 0 and once
with 1. The runs are followed in the run DB, so a coordinator that is dead or stopped does not stop the count.

Prints the runs completed and the faults injected, then per kind and fault the time to detect (the fault -> the
first coordinator log line after it that names the service's address; none for the coordinator itself) and to
recover (the fault -> the next step recorded), then the samples lost (steps missing or short of
train_batch_size x n samples), which must be 0, last.

    python bench/faults.py [--seeds 0 1 2] [--faults 4] [--steps 40] [--staleness 0 1]
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

KINDS = ("coordinator", "trainer", "rollout", "reward")
FAULTS = ("kill", "stop")
ROLLOUT = ServiceSpec(kind="rollout", settings=("batch_size=1",))  # one sequence at a time: steps of ~0.3 s, not 0.05
SERVICES = (ServiceSpec(kind="trainer"), ROLLOUT, ROLLOUT, ServiceSpec(kind="reward"), ServiceSpec(kind="reward"))
ENDED = ("finished", "stopped", "failed")
RUN_LIMIT_S = 900.0  # a run that has not ended by then counts as not completed


@dataclass(frozen=True)
class Fault:
    kind: str  # coordinator, trainer, rollout or reward
    how: str  # kill (-9, a replacement started at once) or stop (SIGSTOP, SIGCONT stop_s later)
    after_steps: int  # step events of the run seen before it (steps run again after a rewind count again)
    delay_s: float  # then this long
    stop_s: float  # of a stop


@dataclass
class Injected:
    fault: Fault
    name: str  # the process killed or stopped
    address: str
    at: float  # time.time() of the SIGKILL or SIGSTOP


def random_schedule(rng: random.Random, faults: int, steps: int, kinds: tuple[str, ...] = KINDS,
                    hows: tuple[str, ...] = FAULTS) -> list[Fault]:
    """``faults`` faults spread over a ``steps``-step run: one at a random point of each of ``faults`` equal
    stretches between the first step and the last three."""
    stretch = (steps - 3) // faults
    if stretch < 1:
        raise ValueError(f"{faults} faults do not fit in {steps} steps")
    return [Fault(rng.choice(kinds), rng.choice(hows), 1 + index * stretch + rng.randrange(stretch),
                  round(rng.uniform(0.0, 0.2), 2), round(rng.uniform(1.0, 12.0), 1))
            for index in range(faults)]


def service_address(cluster: LocalCluster, name: str) -> str | None:
    """Where a local service listens, from the ``serving`` line of its log (None before it serves)."""
    for line in (cluster.log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return json.loads(line)["address"]
    return None


async def serving(cluster: LocalCluster, kind: str) -> dict[str, str]:
    """name -> address of each live ``kind`` process that serves (waiting for one, if all are still starting)."""
    while True:
        live = [name for name, process in cluster.processes.items()
                if name.split("-")[0] == kind and process.poll() is None]
        found = {name: address for name in live if (address := service_address(cluster, name))}
        if found:
            return found
        await asyncio.sleep(0.1)


def kill_and_replace(cluster: LocalCluster, kind: str, name: str) -> None:
    """SIGKILL the process ``name`` and start another of its kind (the coordinator again, on its state dir)."""
    process = cluster.processes.pop(name)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    if kind == "coordinator":
        cluster.start_coordinator()
        return
    names = (f"{kind}-again-{i}" for i in itertools.count())
    spec = ROLLOUT if kind == "rollout" else ServiceSpec(kind=kind)
    cluster.add_service(spec, next(n for n in names if not (cluster.log_dir / f"{n}.log").exists()))


async def inject(cluster: LocalCluster, fault: Fault, rng: random.Random) -> Injected:
    """The fault, on a random serving process of its kind; a stop lasts until its SIGCONT."""
    await asyncio.sleep(fault.delay_s)
    found = await serving(cluster, fault.kind)
    name = rng.choice(sorted(found))
    injected = Injected(fault, name, found[name], time.time())
    if fault.how == "kill":
        kill_and_replace(cluster, fault.kind, name)
        return injected
    pid = cluster.processes[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(fault.stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return injected


async def run_with_faults(cluster: LocalCluster, config_yaml: str, schedule: list[Fault],
                          rng: random.Random) -> tuple[RunStatus, list[Injected]]:
    """Start a run, inject ``schedule`` into it (counting its steps in the run DB), follow it to its end."""
    run_id = (await call_coordinator(cluster, lambda client: client.start_run(config_yaml))).run_id
    pending, injecting = list(schedule), []
    deadline = time.monotonic() + RUN_LIMIT_S
    while run_state(cluster.state_dir, run_id) not in ENDED or not all(task.done() for task in injecting):
        if time.monotonic() > deadline:
            break
        seen = len(step_events(cluster.state_dir, run_id))
        while pending and pending[0].after_steps <= seen:
            injecting.append(asyncio.create_task(inject(cluster, pending.pop(0), rng)))
        await asyncio.sleep(0.05)
    injected = await asyncio.gather(*injecting)
    return await call_coordinator(cluster, lambda client: client.get_run(run_id)), list(injected)


async def call_coordinator(cluster: LocalCluster, call):
    """``call(client)`` once the coordinator answers (it may be starting again after a kill)."""
    client = CoordinatorClient(cluster.coordinator)
    try:
        await client.wait_ready(120)
        return await call(client)
    finally:
        await client.close()


def run_state(state_dir: Path, run_id: str) -> str:
    with sqlite3.connect(state_dir / "meshrl.db") as db:
        return db.execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]


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
    """The fault -> the first coordinator log line after it that names the service's address (none for the
    coordinator itself)."""
    if fault.fault.kind == "coordinator":
        return None
    named = re.compile(re.escape(fault.address) + r"(?!\d)")
    for line in coordinator_log.read_text(errors="replace").splitlines():
        if not line.startswith("{") or not named.search(line):
            continue
        at = datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
        if at >= fault.at:
            return at - fault.at
    return None


def run_config(model: Path, data: Path, steps: int, max_staleness: int = 0) -> str:
    return yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 16},
        "actor_rollout_ref": {"model": {"path": str(model)}, "rollout": {"n": 4},
                              "actor": {"optim": {"lr": 1e-3}, "ppo_mini_batch_size": 4,
                                        "ppo_micro_batch_size_per_gpu": 8}},
        "trainer": {"total_training_steps": steps, "experiment_name": "faults", "save_freq": 2,
                    "channel_timeout_s": 10, "max_recoveries": 10, "async_": {"max_staleness": max_staleness}},
    })


def median(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s" if values else "     -  "


async def bench(args: argparse.Namespace, folder: Path) -> None:
    model = build_tiny_model(folder / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    data = write_jsonl(reverse_task_rows(64, 2, 4, seed=3), folder / "reverse.jsonl")
    cluster = LocalCluster(folder / "state", SERVICES)
    await cluster.start(timeout_s=120)
    runs, completed, lost, faults = 0, 0, 0, []
    try:
        for seed, staleness in itertools.product(args.seeds, args.staleness):
            rng = random.Random(seed)
            config = run_config(model, data, args.steps, staleness)
            final, injected = await run_with_faults(cluster, config, random_schedule(rng, args.faults, args.steps),
                                                    rng)
            runs += 1
            completed += final.state == "finished"
            run_lost = samples_lost(cluster.state_dir, final.run_id, args.steps, 8 * 4)
            lost += run_lost
            events = step_events(cluster.state_dir, final.run_id)
            print(f"seed {seed} max_staleness {staleness}: {final.state} at step {final.step}, {run_lost} samples "
                  f"lost; " + ", ".join(f"{f.fault.kind} {f.fault.how}" for f in injected), flush=True)
            for fault in injected:
                recovered = next((t - fault.at for t in events if t > fault.at), None)
                faults.append((fault, detection_s(cluster.log_dir / "coordinator.log", fault), recovered))
    finally:
        cluster.stop()
    print(f"runs completed    {completed} of {runs} ({args.steps} steps each; seeds {args.seeds}, max_staleness "
          f"{args.staleness})")
    print(f"faults injected   {len(faults)}")
    for kind, how in itertools.product(KINDS, FAULTS):
        these = [(d, r) for f, d, r in faults if (f.fault.kind, f.fault.how) == (kind, how)]
        detect, recover = [d for d, _ in these if d is not None], [r for _, r in these if r is not None]
        print(f"{kind:<11} {how:<4}  {len(these):2d} x   detect (median) {median(detect)}   "
              f"recover (median) {median(recover)}")
    print(f"samples lost: {lost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--faults", type=int, default=4, help="faults per run")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="trainer.async_.max_staleness")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(bench(args, Path(folder)))


if __name__ == "__main__":
    main()
