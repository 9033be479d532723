"""The trainer's memory as it exports it, on a CPU: the process's resident set, now and at its peak."""

import pytest
import torch

from services.trainer.telemetry import memory_bytes, step_memory_metrics


def test_on_a_cpu_the_memory_is_the_resident_set_now_and_at_its_peak():
    before = memory_bytes(torch.device("cpu"))
    held = torch.ones(64 * 2 ** 20, dtype=torch.uint8)  # 64 MiB, touched
    after = memory_bytes(torch.device("cpu"))
    assert after["allocated"] - before["allocated"] > 60 * 2 ** 20
    assert after["peak"] >= after["allocated"] > 0
    del held


def test_a_cpu_trainer_reports_its_resident_set_and_no_device_peaks():
    resident = memory_bytes(torch.device("cpu"))["allocated"] / 2**30
    metrics = step_memory_metrics(torch.device("cpu"), "perf/critic")
    assert list(metrics) == ["perf/critic/cpu_memory_used_gb"]
    assert metrics["perf/critic/cpu_memory_used_gb"] == pytest.approx(resident, rel=0.05)
