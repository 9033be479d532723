"""The trainer's Prometheus metrics (besides every service's: ``services/common/telemetry.py``): how long each
phase of a step takes on the model (the ops rank 0 runs on every rank: compute_log_probs, compute_values,
update_actor, update_critic, broadcast_weights, save_checkpoint, ...), and the memory it holds."""

from __future__ import annotations

import resource

import torch
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.memory import memory_metrics, resident_bytes

OP_SECONDS = Histogram("meshrl_trainer_op_seconds", "Time of each op a step asks of the trainer, on every rank",
                       ["op"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))


def memory_bytes(device: torch.device) -> dict[str, int]:
    """What this rank holds on ``device``: on CUDA, the tensors allocated now and at their peak since the last
    step's metrics (torch's caching allocator; ``step_memory_metrics``); on the CPU, the process's resident set
    now and at its peak."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}
    resident = resident_bytes()
    # the kernel's peak lags the resident set by a few pages
    return {"allocated": resident, "peak": max(resident, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def step_memory_metrics(device: torch.device, prefix: str = "perf") -> dict[str, float]:
    """verl's memory metrics of a step (``common.memory.memory_metrics``: the device peaks start again), under
    ``prefix``."""
    return {f"{prefix}/{key}": value for key, value in memory_metrics(device).items()}


def release_cached_memory(device: torch.device) -> None:
    """Give the GPU memory torch's allocator caches but no tensor holds back to the device (for a rollout
    engine that wakes up on the same GPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Memory(Collector):
    """``meshrl_trainer_memory_bytes{device, measure}``, read at each scrape."""

    def __init__(self, device: torch.device):
        self.device = device

    def collect(self):
        family = GaugeMetricFamily("meshrl_trainer_memory_bytes", "Memory rank 0 holds on its device: allocated "
                                   "now and at its peak (on a CPU: the resident set)", labels=["device", "measure"])
        for measure, value in memory_bytes(self.device).items():
            family.add_metric([str(self.device), measure], value)
        yield family


def watch_memory(device: torch.device) -> None:
    REGISTRY.register(Memory(device))
