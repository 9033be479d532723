"""What a service says about itself besides its address: the meshrl version it runs and the GPUs it computes on.

Both travel in its ServiceIdentity (registration, Info) and show in ``coordctl services``. Describing a GPU
imports torch and asks CUDA for the device's name, which needs no memory on it; a service on the CPU
never imports torch for this.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version


def meshrl_version() -> str:
    """The installed meshrl package's version, or "" when it runs from a checkout that is not installed."""
    try:
        return version("meshrl")
    except PackageNotFoundError:
        return ""


def summarize_gpus(gpus: list[tuple[str, str]]) -> str:
    """One line for GPUs given as (index, name), indices as the host numbers them: "cpu" for none,
    "cuda:1 NVIDIA H200" for one, and each model once with its indices, "cuda:0,1 NVIDIA H200, cuda:2 NVIDIA A100"."""
    if not gpus:
        return "cpu"
    indices: dict[str, list[str]] = {}
    for index, name in gpus:
        indices.setdefault(name, []).append(index)
    return ", ".join(f"cuda:{','.join(numbers)} {name}" for name, numbers in indices.items())


def describe_gpus(devices: tuple[str, ...]) -> str:
    """The GPUs among the torch ``devices`` a service computes on ("cpu", "cuda", "cuda:1"), summarized: a
    device without an index is the current one; indices as the host numbers them, through
    CUDA_VISIBLE_DEVICES (under CUDA_VISIBLE_DEVICES=1 cuda:0 is the host's cuda:1), so that services on one
    host that share a GPU show the same one. A GPU CUDA cannot see is named as such, not an error."""
    cuda = [device for device in devices if device.split(":")[0] == "cuda"]
    if not cuda:
        return "cpu"
    import torch

    try:
        ordinals = [torch.device(device).index for device in cuda]
        ordinals = [torch.cuda.current_device() if ordinal is None else ordinal for ordinal in ordinals]
        names = [torch.cuda.get_device_name(ordinal) for ordinal in ordinals]
    except (AssertionError, RuntimeError) as error:  # no CUDA build, no GPU, an index past the last
        return f"{','.join(cuda)} (not available: {str(error).splitlines()[0][:80]})"
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    host = [visible[ordinal] if ordinal < len(visible) else str(ordinal) for ordinal in ordinals]
    return summarize_gpus(list(zip(host, names)))
