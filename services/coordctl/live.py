"""coordctl watch: a run as a live table in a terminal, or as plain lines where the output is not one.

Choices:
- In a terminal the view is one block (the run and its state, the services up by kind, the last steps as a
  table, the last events) redrawn in place: the cursor goes back to the block's first line and the block is
  written again, at most a few times a second. Lines are cut to the terminal's width, so that none wraps and
  the block keeps its height; the table keeps the last steps that fit the terminal's height.
- Piped or redirected (a log file, a Slurm job's output, ``| head``), each event is one plain line as it
  comes, and the services up are a line when they change (after the run's first line): nothing to redraw,
  nothing lost.
- A step's time is split the way the loop spends it: generating and scoring (ahead of training when the run
  is asynchronous), logprobs and values, the updates, the weight sync; concurrent stages count as their
  longest.
- The services are asked of the coordinator every few seconds: those up, and those registered, by kind.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from services.coordctl.control import CoordinatorClient, RunUpdate, ServiceEntry
from services.coordctl.tables import aligned

REDRAW_S = 0.25
SERVICES_EVERY_S = 2.0
EVENTS_SHOWN = 4
COLUMNS = ("STEP", "REWARD", "VAL", "STEP_S", "GEN_S", "SCORE_S", "LOGP_S", "UPDATE_S", "SYNC_S", "TOK/S/DEV", "STALE")
BOLD, DIM, GREEN, YELLOW, RED, RESET = "\x1b[1m", "\x1b[2m", "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[0m"
STATE_COLOURS = {"running": GREEN, "finished": GREEN, "waiting": YELLOW, "pending": YELLOW, "failed": RED,
                 "stopped": YELLOW, "interrupted": RED}


def validation_value(metrics: dict[str, float]) -> float | None:
    """The held-out number of a validation's metrics: the first data source's accuracy (mean@n), else its mean
    reward; None when the metrics hold no validation."""
    means = sorted(key for key in metrics if key.startswith("val-core/") and "/mean@" in key)
    chosen = next((key for key in means if "/acc/" in key), means[0] if means else None)
    return None if chosen is None else metrics[chosen]


def step_cells(step: int, metrics: dict[str, float]) -> tuple[str, ...]:
    """One row of COLUMNS: a step's reward, validation, time split, throughput and staleness ("-": none)."""
    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    def longest(*stages: str) -> float | None:
        times = [metrics[f"timing_s/{stage}"] for stage in stages if f"timing_s/{stage}" in metrics]
        return max(times) if times else None

    return (str(step), cell(metrics.get("critic/score/mean"), ".3f"), cell(validation_value(metrics), ".3f"),
            cell(metrics.get("timing_s/step"), ".2f"), cell(longest("gen"), ".2f"), cell(longest("reward"), ".2f"),
            cell(longest("old_log_prob", "ref", "values"), ".2f"),
            cell(longest("update_actor", "update_critic"), ".2f"),
            cell(longest("update_weights"), ".2f"), cell(metrics.get("perf/throughput"), ".0f"),
            cell(metrics.get("training/off_policy/staleness/max"), ".0f"))


def services_up(entries: list[ServiceEntry]) -> dict[str, tuple[int, int]]:
    """Kind -> (services up, services registered)."""
    counts: dict[str, tuple[int, int]] = {}
    for entry in entries:
        up, known = counts.get(entry.kind, (0, 0))
        counts[entry.kind] = (up + (entry.state == "up"), known + 1)
    return dict(sorted(counts.items()))


@dataclass(kw_only=True)
class RunView:
    """What the watch has seen of a run: its state, each step's metrics (validations merged in), the services
    up, the last events."""

    run_id: str
    state: str
    step: int
    total_steps: int
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    services: dict[str, tuple[int, int]] | None = None  # None: not asked yet
    events: deque[str] = field(default_factory=lambda: deque(maxlen=EVENTS_SHOWN))

    def apply(self, update: RunUpdate) -> str:
        """Take in one of the run's events; the plain line that tells it."""
        if update.kind == "step":
            self.step = update.step
            self.steps[update.step] = {**self.steps.get(update.step, {}), **update.metrics}
            return self.step_line(update.step)
        if update.kind == "validation":
            self.steps[update.step] = {**self.steps.get(update.step, {}), **update.metrics}
        if update.kind == "state":
            self.state = update.state
            line = f"run {update.state}" + (f": {update.message}" if update.message else "")
        else:
            line = update.message
        self.events.append(line)
        return line

    def step_line(self, step: int) -> str:
        """A step as one plain line: the name and value of each column it has a value for."""
        cells = step_cells(step, self.steps[step])
        return f"step {step}/{self.total_steps}  " + "  ".join(
            f"{name.lower()} {value}" for name, value in zip(COLUMNS[1:], cells[1:]) if value != "-")

    def services_line(self) -> str:
        if self.services is None:
            return "services up  (asking the coordinator)"
        if not self.services:
            return "services up  none registered"
        return "services up  " + "  ".join(f"{kind} {up}/{known}" for kind, (up, known) in self.services.items())

    def all_up(self) -> bool:
        if not self.services:
            return False
        return all(up == known for up, known in self.services.values())


def render(view: RunView, width: int, height: int, *, colour: bool) -> list[str]:
    """The view as the lines of one block for a terminal of ``width`` x ``height``: each line cut to the width,
    the table holding the last steps that fit; ANSI colours when ``colour``."""
    def paint(code: str, line: str) -> str:
        return f"{code}{line}{RESET}" if colour and code else line

    events = list(view.events)
    room = max(1, height - 6 - len(events))  # title, services, blank, header, blank line before events, prompt
    shown = sorted(view.steps)[-room:]
    table = aligned(COLUMNS, [step_cells(step, view.steps[step]) for step in shown], right=COLUMNS)
    def cut(line: str) -> str:
        return line[: max(1, width - 1)]  # the last column stays free: no line wraps
    title = f"{view.run_id}  {view.state}  step {view.step}/{view.total_steps}"
    lines = [paint(BOLD + STATE_COLOURS.get(view.state, ""), cut(title)),
             paint(GREEN if view.all_up() else YELLOW, cut(view.services_line())), "",
             paint(BOLD, cut(table[0])), *(cut(line) for line in table[1:])]
    if not shown:
        lines.append(paint(DIM, cut("(no step yet)")))
    if events:
        lines += ["", *(paint(DIM, cut(event)) for event in events)]
    return lines


class Block:
    """A block of lines redrawn in place on a terminal."""

    def __init__(self, out: TextIO):
        self.out = out
        self.drawn: list[str] = []

    def draw(self, lines: list[str]) -> None:
        """Write ``lines`` over the block drawn last (nothing when they are the same)."""
        if lines == self.drawn:
            return
        back = f"\x1b[{len(self.drawn)}F" if self.drawn else ""  # to the first column of the block's first line
        self.out.write(back + "\x1b[J" + "".join(line + "\n" for line in lines))
        self.out.flush()
        self.drawn = lines


async def watch_run(client: CoordinatorClient, run_id: str, out: TextIO, *, live: bool) -> None:
    """Follow the run until it ends: a live block on ``out`` when ``live`` (a terminal), else plain lines."""
    run = await client.get_run(run_id)
    view = RunView(run_id=run.run_id, state=run.state, step=run.step, total_steps=run.total_steps)

    told = 0  # piped: the lines written

    def tell(line: str) -> None:
        nonlocal told
        out.write(line + "\n")
        out.flush()
        told += 1

    async def read_events() -> None:
        async for update in client.watch(run_id):
            line = view.apply(update)
            if not live:
                tell(line)

    async def ask_services() -> None:
        said = None  # piped: the services up last written, after the run's first line and as they change
        while True:
            view.services = services_up(await client.list_services())
            if not live and told and view.services != said:
                said = view.services
                tell(view.services_line())
            await asyncio.sleep(SERVICES_EVERY_S)

    events, services = asyncio.ensure_future(read_events()), asyncio.ensure_future(ask_services())
    block = Block(out) if live else None
    try:
        while not events.done():
            await asyncio.wait({events}, timeout=REDRAW_S)
            if block is not None:
                size = shutil.get_terminal_size()
                block.draw(render(view, size.columns, size.lines, colour=True))
        events.result()
    finally:
        for task in (events, services):
            task.cancel()
        await asyncio.gather(events, services, return_exceptions=True)
