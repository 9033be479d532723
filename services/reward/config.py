"""Settings of a reward service process."""

from __future__ import annotations

from services.common.config import ServeConfig


class RewardServiceConfig(ServeConfig):
    pass
