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


@pytest.fixture
def cluster(tmp_path):
    """Coordinator, trainer, rollout and reward as real processes; stopped (and checked gone) afterwards."""
    local = LocalCluster(tmp_path / "state")
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()
