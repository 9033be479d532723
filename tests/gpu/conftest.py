"""GPU tests: run on the device machine (one or two H200s), skipped where no GPU is present."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.coordctl.local import ServiceSpec
from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(gpu_count: int, vllm: bool = True):
    reasons = []
    if gpus() < gpu_count:
        reasons.append(f"needs {gpu_count} CUDA GPU(s), found {gpus()}")
    if vllm and importlib.util.find_spec("vllm") is None:
        reasons.append("needs vllm installed")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))


def on_gpu(gpu: int) -> tuple[tuple[str, str], ...]:
    return (("CUDA_VISIBLE_DEVICES", str(gpu)),)


def cuda_trainer(gpu: int = 0) -> ServiceSpec:
    return ServiceSpec(kind="trainer", settings=("device=cuda",), env=on_gpu(gpu))


def vllm_rollout(gpu: int, memory_share: float, *settings: str) -> ServiceSpec:
    """A vLLM rollout on GPU ``gpu`` taking ``memory_share`` of it, started without CUDA graphs (about 23 s
    instead of 70)."""
    settings = ("engine=vllm", "enforce_eager=true", f"gpu_memory_utilization={memory_share}", *settings)
    return ServiceSpec(kind="rollout", settings=settings, env=on_gpu(gpu))


@pytest.fixture(scope="session")
def qwen_05b(tmp_path_factory):
    """A random-init bf16 model of Qwen2.5-0.5B's shape, with the character tokenizer."""
    return build_random_model(tmp_path_factory.mktemp("qwen") / "qwen2.5-0.5b-random", QWEN25_SHAPES["0.5b"],
                              "bfloat16", seed=0)
