"""How much memory a process holds, as verl names it in a step's metrics (``perf/max_memory_allocated_gb``,
``perf/max_memory_reserved_gb``, ``perf/cpu_memory_used_gb``): the trainer reports its ranks' and the rollout
its engine's, once a step."""

from __future__ import annotations

import resource

import torch


def resident_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's memory metrics (GiB) since the previous call: the process's resident set (``cpu_memory_used_gb``)
    and, on CUDA, the peaks torch's allocator reached on ``device`` (``max_memory_allocated_gb``,
    ``max_memory_reserved_gb``), which start again here; on a CPU the device peaks are omitted."""
    metrics = {"cpu_memory_used_gb": resident_bytes() / 2**30}
    if device.type == "cuda":
        metrics["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return metrics
