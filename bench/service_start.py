"""Service start-up: CPU-seconds and wall from spawn to serving, per service, as the tests and --local start them.

Starts a coordinator, then each other service once per repeat, one at a time, with the command line and
environment ``LocalCluster`` gives them (one torch thread, loopback, port 0). A service writes its ports file
once its gRPC health says SERVING: the time from spawn to that file is its start-up, and the CPU time its
processes have used by then (user + system, the whole process tree) is what the start cost the machine before
it served. Some go on starting worker processes (the reward service's scoring workers, the env service's
workers) once they serve: the CPU time of the tree once it is idle (less than 0.05 CPU-s in a second) is the
whole start's cost. Each service is stopped before the next starts. Prints the median of each, per service,
and the range.

    python bench/service_start.py [--repeats 3] [--kinds coordinator,trainer,rollout,reward,env]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from services.coordctl.local import CHILD_ENV, LocalCluster, terminate

KINDS = ("coordinator", "trainer", "rollout", "reward", "env")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` and every live descendant (reaped children included)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(value) for value in fields[11:15]) / TICKS_PER_S
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(times.get(member, 0.0) for member in tree)


def idle_cpu_s(pid: int, deadline: float) -> float:
    """The CPU-seconds of ``pid``'s tree once it used less than 0.05 CPU-s in a second (or at ``deadline``)."""
    used = tree_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        used, before = tree_cpu_s(pid), used
        if used - before < 0.05:
            break
    return used


def start_once(cluster: LocalCluster, kind: str, *, name: str, extra: tuple[str, ...],
               timeout_s: float) -> tuple[float, float, float]:
    """Spawn service ``kind`` as ``name``, wait for its ports file; (CPU-seconds, wall seconds) until then, and the
    CPU-seconds once its tree is idle. Stops it."""
    ports_file = cluster.ports_dir / f"{name}.json"
    ports_file.unlink(missing_ok=True)
    log = (cluster.log_dir / f"{name}.log").open("ab")
    started = time.monotonic()
    process = subprocess.Popen(cluster.command(name, kind, ("port=0", "metrics_port=0", f"ports_file={ports_file}",
                                                            *extra), ranks=1),
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, **CHILD_ENV, "MESHRL_PARENT_PID": str(os.getpid())},
                               start_new_session=True)
    try:
        while not ports_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}; see {cluster.log_dir}/{name}.log")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{name} did not serve within {timeout_s} s")
            time.sleep(0.01)
        serving_cpu, serving_wall = tree_cpu_s(process.pid), time.monotonic() - started
        return serving_cpu, serving_wall, idle_cpu_s(process.pid, deadline=started + timeout_s)
    finally:
        terminate([process], grace_s=15)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "state", ())
        cluster.log_dir.mkdir(parents=True)
        cluster.ports_dir.mkdir(parents=True)
        cluster.start_coordinator(timeout_s=120)  # the one the other services register with
        try:
            results = {kind: [] for kind in kinds}
            for repeat in range(args.repeats):
                for kind in kinds:
                    extra = ((f"state_dir={Path(tmp) / f'coordinator-{repeat}'}",) if kind == "coordinator" else
                             (f"coordinator={cluster.coordinator}", "torch_threads=1",
                              *([f"checkpoint_root={tmp}"] if kind == "trainer" else [])))
                    results[kind].append(start_once(cluster, kind, name=f"{kind}-{repeat}", extra=extra, timeout_s=120))
        finally:
            cluster.stop()
    load = os.getloadavg()[0]
    print(f"load {load:.1f} at the end, {args.repeats} starts each; median (min-max)")
    print(f"{'service':<12} {'CPU-s to serving':>20} {'wall s to serving':>20} {'CPU-s once idle':>20}")
    for kind, runs in results.items():
        print(f"{kind:<12}" + "".join(f"{spread([run[column] for run in runs]):>21}" for column in range(3)))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
