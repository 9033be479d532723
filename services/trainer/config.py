"""Settings of a trainer service process (every rank of a torchrun group reads the same)."""

from __future__ import annotations

from pydantic import PositiveFloat

from services.common.config import StreamingServeConfig


class TrainerServiceConfig(StreamingServeConfig):
    device: str = "cpu"
    """torch device of the models: cpu, or cuda (under torchrun each rank takes cuda:LOCAL_RANK)."""
    collective_timeout_s: PositiveFloat = 600.0
    """Under torchrun: deadline of each collective among the ranks (a rank that does not take part in time
    ends the group)."""

    def compute_devices(self) -> tuple[str, ...]:
        return (self.device,)  # rank 0's: the process that registers
