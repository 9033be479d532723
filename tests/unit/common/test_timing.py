"""CPU tests of services/common/timing.py."""

from __future__ import annotations

import time

import pytest

from services.common.timing import StageTimer


def test_stage_timer_adds_up_repeated_stages():
    timer = StageTimer()
    for _ in range(2):
        with timer("gen"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("train"):
        raise RuntimeError("the stage fails; its time still counts")
    metrics = timer.metrics()
    assert metrics.keys() == {"timing_s/gen", "timing_s/train", "timing_s/step"}
    assert 0.02 <= metrics["timing_s/gen"] <= metrics["timing_s/step"]
