"""Settings of a rollout service process."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt

from services.common.config import ServeConfig


class RolloutServiceConfig(ServeConfig):
    engine: Literal["hf"] = "hf"
    """Inference engine: hf (transformers, CPU or GPU)."""
    batch_size: PositiveInt = 256
    """Sequences sampled together in one forward pass (hf engine)."""
    device: str = "cpu"
    """torch device of the hf engine."""
