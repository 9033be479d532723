"""CPU tests of services/common/about.py: the meshrl version and the GPU column of a service."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from services.common.about import describe_gpus, meshrl_version, summarize_gpus
from services.coordinator.config import CoordinatorServiceConfig
from services.reward.config import RewardServiceConfig
from services.rollout.config import RolloutServiceConfig
from services.trainer.config import TrainerServiceConfig


def test_the_version_is_the_installed_packages():
    assert meshrl_version() == version("meshrl") != ""


@pytest.mark.parametrize(("gpus", "line"), [
    ([], "cpu"),
    ([("1", "NVIDIA H200")], "cuda:1 NVIDIA H200"),
    ([("0", "NVIDIA H200"), ("1", "NVIDIA H200")], "cuda:0,1 NVIDIA H200"),
    ([("0", "NVIDIA H200"), ("1", "NVIDIA A100"), ("2", "NVIDIA H200")], "cuda:0,2 NVIDIA H200, cuda:1 NVIDIA A100"),
])
def test_gpus_are_summarized_one_model_at_a_time(gpus, line):
    assert summarize_gpus(gpus) == line


def test_a_service_on_the_cpu_says_cpu():
    assert describe_gpus(()) == "cpu" and describe_gpus(("cpu",)) == "cpu"


@pytest.fixture
def two_gpus(monkeypatch):
    """torch sees two GPUs, an H200 and an A100, the first current."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: ["NVIDIA H200", "NVIDIA A100"][index])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def test_a_gpu_is_named_with_its_index_and_cuda_alone_is_the_current_one(two_gpus):
    assert describe_gpus(("cuda",)) == "cuda:0 NVIDIA H200"
    assert describe_gpus(("cuda:1",)) == "cuda:1 NVIDIA A100"
    assert describe_gpus(("cuda:0", "cuda:1")) == "cuda:0 NVIDIA H200, cuda:1 NVIDIA A100"


def test_indices_are_the_hosts_through_cuda_visible_devices(two_gpus):
    two_gpus.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert describe_gpus(("cuda:0",)) == "cuda:3 NVIDIA H200"  # what nvidia-smi calls it, as a neighbour would
    assert describe_gpus(("cuda:1",)) == "cuda:5 NVIDIA A100"


def test_a_gpu_cuda_cannot_see_is_named_so(monkeypatch):
    def no_gpu(index):
        raise RuntimeError("No CUDA GPUs are available\nmore")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    assert describe_gpus(("cuda:0",)) == "cuda:0 (not available: No CUDA GPUs are available)"


def test_each_service_names_the_devices_it_computes_on():
    assert CoordinatorServiceConfig().compute_devices() == ()
    assert TrainerServiceConfig(device="cuda").compute_devices() == ("cuda",)
    assert RewardServiceConfig().compute_devices() == ("cpu",)
    assert RolloutServiceConfig(device="cuda:1").compute_devices() == ("cuda:1",)
    vllm = RolloutServiceConfig(engine="vllm", tensor_parallel_size=2, device="cpu")  # vLLM takes the GPUs it sees
    assert vllm.compute_devices() == ("cuda:0", "cuda:1")
