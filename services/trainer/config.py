"""Settings of a trainer service process (every rank of a torchrun group reads the same)."""

from __future__ import annotations

from pydantic import PositiveFloat

from services.common.config import StreamingServeConfig


class TrainerServiceConfig(StreamingServeConfig):
    device: str = "cpu"
    """torch device of the models: cpu, or cuda (under torchrun each rank takes cuda:LOCAL_RANK)."""
    checkpoint_root: str = "meshrl-state"
    """The folder SaveCheckpoint and LoadCheckpoint work in: a path outside it is refused (INVALID_ARGUMENT), a
    relative one is under it. Each run's checkpoints must land in it: set it to the coordinator's state_dir (the
    default is the coordinator's default), or to a folder holding every run's trainer.default_local_dir. Checkpoint
    manifests are signed with its checkpoint.key (made, 0600, by the first save)."""
    policy_loss_modules: list[str] = []
    """Python files (path/to/file.py) or modules (package.module) to import at start, whose
    @register_policy_loss functions this trainer then offers besides the built-ins (services/policy_losses.py);
    runs choose one by actor_rollout_ref.actor.policy_loss.loss_mode. One that fails to import, or reuses a
    registered name, stops the trainer at start with the module and the error. Every rank imports them."""
    collective_timeout_s: PositiveFloat = 600.0
    """Under torchrun: deadline of each collective among the ranks (a rank that does not take part in time
    ends the group)."""

    def compute_devices(self) -> tuple[str, ...]:
        return (self.device,)  # rank 0's: the process that registers
