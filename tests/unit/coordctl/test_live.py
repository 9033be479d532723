"""coordctl watch's view of a run (services/coordctl/live.py): the lines it prints piped, the block it redraws in
a terminal."""

from __future__ import annotations

import io

from services.coordctl.control import RunUpdate, ServiceEntry
from services.coordctl.live import COLUMNS, Block, RunView, render, services_up

STEP = {"critic/score/mean": 0.6125, "timing_s/step": 1.5, "timing_s/gen": 0.7, "timing_s/reward": 0.02,
        "timing_s/old_log_prob": 0.3, "timing_s/ref": 0.4, "timing_s/update_actor": 0.9,
        "timing_s/update_weights": 0.05, "perf/throughput": 1234.4, "training/off_policy/staleness/max": 1.0}


def update(kind: str, step: int = 0, state: str = "", message: str = "", metrics: dict | None = None) -> RunUpdate:
    return RunUpdate(kind=kind, step=step, state=state, message=message, metrics=metrics or {})


def watched(steps: int) -> RunView:
    view = RunView(run_id="run-1", state="pending", step=0, total_steps=200)
    view.apply(update("state", state="running"))
    view.apply(update("validation", 0, message="validation of step 0: 0.371",
                      metrics={"val-core/r/acc/mean@1": 0.371, "val-core/r/reward/mean@1": 0.7}))
    for step in range(1, steps + 1):
        view.apply(update("step", step, metrics=STEP))
    return view


def test_piped_each_event_is_a_line_and_a_step_says_its_reward_time_split_throughput_and_staleness():
    view = RunView(run_id="run-1", state="pending", step=0, total_steps=200)
    assert view.apply(update("state", state="running")) == "run running"
    assert view.apply(update("step", 3, metrics=STEP)) == (
        "step 3/200  reward 0.613  step_s 1.50  gen_s 0.70  score_s 0.02  logp_s 0.40  update_s 0.90  sync_s 0.05  "
        "tok/s/dev 1234  stale 1")  # logprobs and values run together: the longest counts
    assert view.apply(update("log", 3, message="checkpoint of step 3 saved")) == "checkpoint of step 3 saved"
    assert (view.state, view.step) == ("running", 3)
    view.services = services_up([ServiceEntry(kind="rollout", address="a:1", group="default", state="up",
                                              last_seen_s=0.2, service_id="r1"),
                                 ServiceEntry(kind="rollout", address="a:2", group="default", state="down",
                                              last_seen_s=9.0, service_id="r2"),
                                 ServiceEntry(kind="reward", address="a:3", group="default", state="up",
                                              last_seen_s=0.1, service_id="w1")])
    assert view.services_line() == "services up  reward 1/1  rollout 1/2" and not view.all_up()


def test_the_block_shows_the_last_steps_that_fit_with_validation_on_its_step_and_no_line_wider_than_the_terminal():
    lines = render(watched(50), width=70, height=20, colour=False)
    assert lines[0] == "run-1  running  step 50/200"
    assert lines[1] == "services up  (asking the coordinator)"
    header = lines[3]
    assert header.split() == list(COLUMNS)[: len(header.split())] and len(header) == 69  # cut at the width
    rows = [line.split() for line in lines[4:] if line and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(39, 51))  # 20 lines: the last 12 steps, then the events
    assert len(lines) == 19 and all(len(line) < 70 for line in lines)
    assert lines[-3:] == ["", "run running", "validation of step 0: 0.371"]  # the last events
    early = render(watched(2), width=200, height=40, colour=False)
    assert [line.split()[:3] for line in early[4:7]] == [["0", "-", "0.371"], ["1", "0.613", "-"], ["2", "0.613", "-"]]
    assert "\x1b[" not in "".join(early) and "\x1b[1m" in render(watched(2), 200, 40, colour=True)[0]


def test_the_block_is_redrawn_over_itself():
    out = io.StringIO()
    block = Block(out)
    block.draw(["a", "b", "c"])
    block.draw(["a", "b"])
    block.draw(["a", "b"])  # nothing changed: nothing written
    assert out.getvalue() == "\x1b[J" + "a\nb\nc\n" + "\x1b[3F\x1b[J" + "a\nb\n"
