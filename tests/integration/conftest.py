"""Real services as subprocesses on loopback ports, and a tiny model and dataset to run them on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.coordctl.local import LocalCluster
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> Path:
    return write_jsonl(reverse_task_rows(64, 2, 4, seed=3), tmp_path_factory.mktemp("data") / "reverse.jsonl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Coordinator, trainer, rollout and reward as real processes, one cluster for a test module: its tests run
    on it one after the other, as long-running services serve run after run. Stopped (and checked gone)
    after the module."""
    local = LocalCluster(tmp_path_factory.mktemp("cluster") / "state")
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()
