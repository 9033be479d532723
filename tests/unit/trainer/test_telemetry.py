"""The trainer's memory as it exports it, on a CPU: the process's resident set, now and at its peak."""

import torch

from services.trainer.telemetry import memory_bytes


def test_on_a_cpu_the_memory_is_the_resident_set_now_and_at_its_peak():
    before = memory_bytes(torch.device("cpu"))
    held = torch.ones(64 * 2 ** 20, dtype=torch.uint8)  # 64 MiB, touched
    after = memory_bytes(torch.device("cpu"))
    assert after["allocated"] - before["allocated"] > 60 * 2 ** 20
    assert after["peak"] >= after["allocated"] > 0
    del held
