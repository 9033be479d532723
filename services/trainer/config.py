"""Settings of a trainer service process."""

from __future__ import annotations

from services.common.config import ServeConfig


class TrainerServiceConfig(ServeConfig):
    device: str = "cpu"
    """torch device of the models (one rank)."""
