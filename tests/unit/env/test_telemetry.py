"""CPU tests of services/env/telemetry.py: each tool call counted by tool and outcome, a hung tool as timed_out."""

from __future__ import annotations

from services.env import telemetry
from services.env.environment import StepResult


def count(tool: str, outcome: str) -> float:
    return telemetry.TOOL_CALLS.labels(tool, outcome)._value.get()


def test_calls_and_failed_steps_are_counted():
    before = (count("check", "ok"), count("", "error"), count("hangs", "timed_out"),
              telemetry.STEP_FAILURES._value.get())
    telemetry.count_step(StepResult(messages=[], info={"calls": [{"tool": "check", "outcome": "ok"},
                                                        {"tool": "", "outcome": "error"}]}))
    telemetry.count_step(StepResult(messages=[], info={"error": "tool hangs did not return", "timed_out": True,
                                              "tool": "hangs", "restarted": True}))
    after = (count("check", "ok"), count("", "error"), count("hangs", "timed_out"),
             telemetry.STEP_FAILURES._value.get())
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1, 1]
