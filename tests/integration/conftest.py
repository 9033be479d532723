"""Real services as subprocesses on loopback ports, and a tiny model and dataset to run them on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)


@pytest.fixture(scope="session")
def local_cache(tmp_path_factory) -> Path:
    """A MESHRL_CACHE for the tests' --local runs: the first builds the tiny model and synthetic data it names
    there, the later ones find them, as a user's second run does (the quick start's own test starts from
    none)."""
    return tmp_path_factory.mktemp("meshrl-cache")


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> Path:
    return write_jsonl(reverse_task_rows(64, 2, 4, seed=3), tmp_path_factory.mktemp("data") / "reverse.jsonl")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}A:{% endif %}")


def with_chat_template(model: Path, folder: Path, template: str) -> Path:
    """A copy of the model folder ``model`` in ``folder`` whose tokenizer has the chat template ``template``."""
    from transformers import AutoTokenizer

    folder.mkdir()
    for item in model.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a chat template over its alphabet (for multi-turn runs)."""
    return with_chat_template(tiny_model, tmp_path_factory.mktemp("chat") / "tiny-chat", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Coordinator, trainer, rollout and reward as real processes, one cluster for a test module: its tests run
    on it one after the other, as long-running services serve run after run. Stopped (and checked gone)
    after the module."""
    local = LocalCluster(tmp_path_factory.mktemp("cluster") / "state")
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


@pytest.fixture
def make_cluster(tmp_path):
    """A LocalCluster of the given services, started (one test may make several); stopped afterwards."""
    clusters = []

    def make(*services: ServiceSpec) -> LocalCluster:
        cluster = LocalCluster(tmp_path / "state", services)
        clusters.append(cluster)
        asyncio.run(cluster.start(timeout_s=120))
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
