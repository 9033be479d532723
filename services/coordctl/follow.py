"""Following a run from coordctl: its progress, Ctrl-C, and what it did.

Choices:
- Ctrl-C, SIGTERM and a closed output (the ``tee`` of ``coordctl ... | tee log`` killed by the same Ctrl-C)
  all ask the run to stop at its next step boundary (in the warm start, a warm-start step's), where it saves a
  checkpoint: no step is lost. A second
  signal stops at once and says which steps a resume will redo. A run on a cluster is not coordctl's to
  stop: there a signal detaches, and the run goes on.
- Output outlives its reader: once the pipe it went to is closed, what follows goes to the terminal if
  coordctl has one, else nowhere, and the run is stopped as after Ctrl-C; nothing fails on a write.
- The progress bar starts at the step the run is at (a resumed run's), and follows the run's events from
  the one it was at when coordctl began it.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import typer
from tqdm import tqdm

from services.coordctl.control import CoordinatorClient, RunStatus
from services.coordctl.samples import kept_samples_dir

VALIDATION_KEY = re.compile(r"^val-(core|aux)/(?P<source>.+)/(?P<variable>reward|acc)/(?P<metric>[^/]+(/[^/]+)?)$")


class SurvivingStream(io.TextIOBase):
    """A text stream that outlives its reader: once a write fails (EPIPE), later writes go to the terminal,
    if coordctl has one, else nowhere, and ``on_closed`` is called once."""

    def __init__(self, stream, on_closed: Callable[[], None]):
        self.stream, self.on_closed, self.lost = stream, on_closed, False

    def write(self, text: str) -> int:
        try:
            written = self.stream.write(text)
            self.stream.flush()
            return written
        except (BrokenPipeError, ValueError, OSError):
            self._lose()
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                pass
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._lose()

    def isatty(self) -> bool:
        return not self.lost and self.stream.isatty()

    def _lose(self) -> None:
        if self.lost:
            return
        self.lost = True
        try:
            self.stream = open("/dev/tty", "w")  # noqa: SIM115 - kept for the rest of the process
        except OSError:
            self.stream = open("/dev/null", "w")  # noqa: SIM115
        self.on_closed()


class Interrupts:
    """Ctrl-C, SIGTERM and a closed output, as the events a follower waits on."""

    def __init__(self) -> None:
        self.signals = 0
        self.changed = asyncio.Event()
        self.output_closed = False

    def __enter__(self) -> Interrupts:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._signal)
        sys.stdout = SurvivingStream(sys.stdout, self._closed)
        sys.stderr = SurvivingStream(sys.stderr, self._closed)
        return self

    def __exit__(self, *exc) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)

    def _signal(self) -> None:
        self.signals += 1
        self.changed.set()

    def _closed(self) -> None:
        self.output_closed = True
        asyncio.get_running_loop().call_soon_threadsafe(self.changed.set)

    @property
    def asked(self) -> int:
        """How many stops were asked: each signal, and a closed output counting as the first."""
        return max(self.signals, 1 if self.output_closed else 0)

    async def until(self, task: asyncio.Future, asked: int) -> bool:
        """Wait for ``task``; False as soon as at least ``asked`` stops have been asked."""
        while not task.done() and self.asked < asked:
            self.changed.clear()
            waiter = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return task.done()


@dataclass
class Progress:
    """What following a run has seen."""

    checkpoint: int | None = None  # step of the last checkpoint saved


async def follow(client: CoordinatorClient, run: RunStatus, after_event_id: int = 0,
                 *, progress: Progress | None = None, said: Collection[str] = ()) -> RunStatus:
    """Show the run's progress (step, reward, step time) from its events after ``after_event_id`` until it ends;
    return its final status. ``progress`` gets the last checkpoint seen. A log event whose words are in ``said``
    (the notes start-run printed before the run began, which the run records as its first events) is not shown
    again."""
    progress = progress or Progress()
    with tqdm(total=run.total_steps, initial=run.step, desc=run.run_id, unit="step", dynamic_ncols=True) as bar:
        async for update in client.watch(run.run_id, after_event_id):
            if update.kind == "step":
                bar.update(update.step - bar.n)
                bar.set_postfix(reward=f"{update.metrics.get('critic/score/mean', float('nan')):.3f}",
                                step_s=f"{update.metrics.get('timing_s/step', float('nan')):.2f}")
            elif update.kind == "checkpoint":
                progress.checkpoint = update.step
                bar.write(update.message)
            elif update.kind == "state":
                bar.write(f"run {update.state}" + (f": {update.message}" if update.message else ""))
            elif update.message and not (update.kind == "log" and update.message in said):
                bar.write(update.message)  # log, reward, env, validation, warning: what befell the run, in words
    return await client.get_run(run.run_id)


async def begin_and_follow(coordinator: str, begin: Callable[[CoordinatorClient], Awaitable[RunStatus]],
                           detach: bool, *, stop_on_interrupt: bool, resume_hint: str = "",
                           said: Collection[str] = ()) -> RunStatus:
    """Start (or resume) a run with ``begin(client)`` and follow it. Ctrl-C, SIGTERM or a closed output: with
    ``stop_on_interrupt`` the run stops at its next step boundary (a second signal stops following at once,
    saying what ``resume_hint`` will redo); otherwise coordctl detaches. ``said``: as ``follow``'s."""
    client = CoordinatorClient(coordinator)
    try:
        with Interrupts() as interrupts:
            run = await begin(client)
            typer.echo(f"run {run.run_id} {run.state}, from step {run.step}")
            if detach:
                return run
            progress = Progress()
            watching = asyncio.ensure_future(follow(client, run, run.last_event_id, progress=progress, said=said))
            if await interrupts.until(watching, 1):
                return watching.result()
            if not stop_on_interrupt:
                watching.cancel()
                typer.echo(f"\ndetached; the run goes on (coordctl stop {run.run_id} stops it)")
                return await client.get_run(run.run_id)
            why = "the output was closed" if interrupts.output_closed and not interrupts.signals else "interrupted"
            typer.echo(f"\n{why}: stopping the run at its next step boundary (in its warm start, the next "
                       "warm-start step's), where it saves a checkpoint (Ctrl-C again to stop now)")
            await client.stop_run(run.run_id)
            if await interrupts.until(watching, 2):
                return watching.result()
            watching.cancel()
            saved = progress.checkpoint
            since = "the start" if saved is None else f"the last checkpoint (step {saved})"
            typer.echo(f"\nstopping now: the run goes on from {since} with {resume_hint or 'coordctl resume'} "
                       f"{run.run_id}; the steps after that will be redone")
            return await client.get_run(run.run_id)
    finally:
        await client.close()


async def run_local(begin, state_dir: Path, services: tuple, *, said: Collection[str] = ()) -> RunStatus:
    """Start the coordinator and ``services`` (ServiceSpecs) on ``state_dir``, begin the run there and follow it
    (``said``: as ``follow``'s); stop them all after (the coordinator first, so that no service it still watches
    is seen to go)."""
    from services.coordctl.local import LocalCluster, save_services

    save_services(state_dir, services)
    cluster = LocalCluster(state_dir, services)
    try:
        typer.echo(f"starting the local services (logs in {cluster.log_dir})")
        await cluster.start()
        typer.echo(how_to_reach(cluster.coordinator, cluster.targets_file))
        return await begin_and_follow(cluster.coordinator, begin, detach=False, stop_on_interrupt=True,
                                      resume_hint=f"coordctl resume --local --state-dir {state_dir}", said=said)
    finally:
        cluster.stop()


def how_to_reach(coordinator: str, targets_file: Path) -> str:
    """How another terminal reaches the local cluster: its address and its token file (or the user's token), and
    where Prometheus finds the services' /metrics."""
    token_file = os.environ.get("MESHRL_TOKEN_FILE")
    token = f"MESHRL_TOKEN_FILE={token_file}" if token_file else "MESHRL_TOKEN (yours)"
    return (f"coordinator at {coordinator}; from another terminal, with {token}:\n"
            f"    coordctl runs --coordinator {coordinator}                      # and watch, status, stop RUN\n"
            f"    python -m services.reward --coordinator {coordinator} group=b  # one more service joins\n"
            f"each service's Prometheus /metrics (with that token as its authorization), for file_sd_configs: "
            f"{targets_file}")


def print_summary(run: RunStatus, lines: list[dict], seconds: float, *, state_dir: Path | None) -> None:
    """What the run did, from its metrics.jsonl ``lines``: reward over the steps, validation before and after,
    and the files it left (those that are there)."""
    typer.echo("")
    typer.echo(f"run        {run.run_id}  ({run.state}, {run.step}/{run.total_steps} steps in {seconds:.0f} s)")
    rewards = [line["critic/score/mean"] for line in lines if "critic/score/mean" in line]
    if rewards:
        head, tail = rewards[: min(5, len(rewards))], rewards[-min(5, len(rewards)):]
        typer.echo(f"reward     first steps {sum(head) / len(head):.3f} -> last steps {sum(tail) / len(tail):.3f}"
                   f" (best step {max(rewards):.3f})")
    validations = [line for line in lines if "val/weight_version" in line]
    if validations:
        first, last = validations[0], validations[-1]
        for key in sorted(k for k in last if k.startswith("val-core/") and "/mean@" in k):
            name = key.removeprefix("val-core/")
            before = f"{first[key]:.3f} at step {first['step']} -> " if len(validations) > 1 and key in first else ""
            best = max((line for line in validations if key in line), key=lambda line: line[key])
            typer.echo(f"validation {name}: {before}{last[key]:.3f} at step {last['step']} "
                       f"(best {best[key]:.3f} at step {best['step']}; held-out)")
    run_dir = Path(run.run_dir)
    files = [("run folder", run_dir, ""), ("  metrics ", run_dir / "metrics.jsonl", ""),
             ("  config  ", run_dir / "config.yaml", ""), ("  plot    ", run_dir / "reward.png", ""),
             ("  curves  ", run_dir / "tensorboard", f" (tensorboard --logdir {run_dir.parent})"),
             ("  samples ", run_dir / "validation", " (every validation's responses and scores)")]
    kept = kept_samples_dir(run_dir)
    if kept is not None:
        files.append(("  rollouts", kept, f" (each step's responses and their lineage: coordctl samples "
                                          f"{run.run_id} --step N)"))
    if state_dir is not None:
        files += [("  run DB  ", state_dir / "meshrl.db", ""), ("  logs    ", state_dir / "logs", "")]
    for label, path, note in files:
        if path.exists():
            typer.echo(f"{label} {path}{note}")
    if run.error:
        typer.echo(f"{'waiting   ' if run.state == 'waiting' else 'error     '} {run.error}")


def read_metrics(run_dir: str) -> list[dict]:
    """The lines of a run's metrics.jsonl (none when the file is not here: a coordinator on another host)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def print_eval(metrics: dict[str, float]) -> None:
    """Per data source: each variable's mean@n, and pass@k where the scorer judges answers."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        named = VALIDATION_KEY.match(key)  # a data source's name may hold "/" (openai/gsm8k)
        if named and named["metric"].startswith(("mean@", "pass@")):
            rows.setdefault(named["source"], {})[f"{named['variable']}/{named['metric']}"] = value
    typer.echo("")
    for source, values in sorted(rows.items()):
        typer.echo(f"{source}: " + "  ".join(f"{name} {value:.3f}" for name, value in sorted(
            values.items(),
            key=lambda item: (item[0].split("/")[0], item[0].split("@")[0], int(item[0].split("@")[1])))))
