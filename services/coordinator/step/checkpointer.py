"""A run's checkpoints as its loop saves and restores them: each trainer's roles, which the trainers save under
checkpoints/step_N/<roles>, and the loop's own state, which the run DB records with the checkpoint.

Choices:
- The loop's state after step s is the data sampler as it was right after step s's batch was drawn (generation
  may have run ahead since), the KL coefficient and the reward target (and a multi-turn run's env target): a run
  resumed from it draws the batches it would have drawn, on the services it had. A checkpoint of step 0 saved
  by a stop in the warm start also records how far the warm start went (``WarmStartProgress``).
- A save a trainer's disk refuses (full, read-only) makes the run wait, saying so, and is tried again until the
  disk takes it (or the run is stopped): after SAVE_RETRY_FIRST_S, then twice as long after each further refusal,
  never more than SAVE_RETRY_MOST_S, so a disk that stays full is not written to the brim every few seconds. A
  retry asks only the trainers whose part was refused: a part already saved is not written again. Nothing older
  is touched meanwhile: each trainer writes the new step's folder aside and renames it into place once complete,
  and the run DB records the step only once every part is saved, so the last complete checkpoint stays the one
  a resume goes on from.
- After a save is recorded, the run keeps only its ``keep`` newest checkpoints (trainer.max_actor_ckpt_to_keep,
  max_critic_ckpt_to_keep): the records remove the oldest (``records.RunRecords.checkpoint``), never the one just
  saved.
- A checkpoint a trainer refuses to load (damaged: its manifest does not match its files) gives way to the one
  before it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

from services.coordinator.fleet.clients import CheckpointRefused, TrainerClient
from services.coordinator.disk import DiskRefused, trainer_disk_fault
from services.coordinator.fleet.env_set import EnvSet
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.step.sampler import PromptSampler
from services.coordinator.store import Checkpoint
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.waiting import retry_while
from services.coordinator.fleet.weight_probe import WeightProbe
from services.coordinator.step.warm_start import WarmStartProgress

SAVE_RETRY_FIRST_S = 2.0  # a checkpoint save its disk refused is first tried again after this long
SAVE_RETRY_MOST_S = 30.0  # and, backing off, never waits longer than this (each try writes until refused)


class CheckpointNotices(Protocol):
    def log(self, message: str, kind: str = "log") -> None:
        """Something a person watching the run should see."""

    def checkpoint(self, step: int, path: str, loop_state: dict, *, keep: int | None) -> None:
        """Every trainer has saved step ``step`` under ``path``; ``loop_state`` is the coordinator's part. Then
        only the ``keep`` newest checkpoints of the run stay (None: all)."""

    def damaged(self, checkpoint: Checkpoint, reason: str) -> Checkpoint | None:
        """A trainer refused to load ``checkpoint`` (``reason``): say so, and give the run's newest checkpoint
        before it, its later steps forgotten (None: there is none)."""

    def disk_waiting(self, cause: str | None) -> None:
        """A checkpoint's disk refuses it (``cause``): the run waits for it (state waiting, shown at once);
        None: it goes on."""


class Restored(NamedTuple):
    """What a restored checkpoint gives the loop back."""

    version: int  # the actor's weight version
    kl_coef: float
    warm_start: WarmStartProgress | None  # how far the warm start went, in a checkpoint saved during it


class Checkpointer:
    def __init__(self, *, run_id: str, roles: dict[TrainerClient, list[str]], actor: TrainerClient,
                 sampler: PromptSampler, reward_set: RewardSet, env_set: EnvSet | None, notices: CheckpointNotices,
                 should_stop: Callable[[], bool], folder: Path, keep: int | None, timeout_s: float,
                 probe: WeightProbe | None = None):
        """``roles``: each trainer's roles (none for a run that only validates, which saves nothing); ``env_set``:
        a multi-turn run's (None: a single-turn run); ``folder``: where the run's checkpoints go; ``keep``: how
        many of them the run keeps (None: all); ``probe``: the weight check's, kept in each checkpoint (None: the
        run has no weight check)."""
        self.run_id, self.roles, self.actor, self.sampler, self.reward_set = run_id, roles, actor, sampler, reward_set
        self.probe = probe
        self.env_set = env_set
        self.notices, self.should_stop, self.folder, self.timeout_s = notices, should_stop, folder, timeout_s
        self.keep = keep
        self.saved_step = 0  # last step checkpointed (or resumed from)
        self.data_after: dict[int, dict] = {}  # step -> the data sampler's state right after its batch was drawn

    def data_state(self) -> dict:
        return {"epoch": self.sampler.epoch, "position": self.sampler.position}

    def drawn(self, step: int, data_state: dict) -> None:
        """Step ``step``'s batch was drawn with the data sampler in ``data_state`` right after."""
        self.data_after[step] = data_state

    def loop_state(self, step: int, kl_coef: float, warm_start: WarmStartProgress | None = None) -> dict:
        """What the coordinator must keep to go on after step ``step``: the data sampler as it was right after
        that step's batch was drawn (it may have run ahead since), the KL coefficient, the reward target, a
        multi-turn run's env target, and ``warm_start``'s progress where given (a stop in the warm start)."""
        target = self.reward_set.target
        state = {**self.data_after[step], "kl_coef": kl_coef, "reward_target": [target.kind, target.name]}
        if warm_start is not None:
            state["warm_start"] = warm_start._asdict()
        if self.env_set is not None:
            state["env_target"] = [self.env_set.target.kind, self.env_set.target.name]
        if self.probe is not None:
            state["weight_probe"] = self.probe.state()
        return state

    async def save(self, step: int, kl_coef: float, warm_start: WarmStartProgress | None = None) -> None:
        """Each trainer saves its roles under checkpoints/step_N/<roles> (the actor part way through its warm
        start: with the warm start's optimizer and schedule); then the run DB records the step (``warm_start``:
        with the warm start's progress), and
        checkpoints beyond the run's ``keep`` newest go. A save a trainer's disk refuses (full, read-only) makes
        the run wait, saying so, and is tried again, backing off, until the disk takes it (or the run is
        stopped); each retry asks only the trainers not saved yet."""
        folder = self.folder / f"step_{step:06d}"
        unsaved = dict(self.roles)

        async def save_unsaved() -> None:
            trainers = list(unsaved)
            outcomes = await asyncio.gather(*(trainer.save_checkpoint(self.run_id, str(folder / "-".join(unsaved[
                trainer])), self.timeout_s) for trainer in trainers), return_exceptions=True)
            failures = []
            for trainer, outcome in zip(trainers, outcomes):
                if isinstance(outcome, BaseException):
                    failures.append((trainer, outcome, trainer_disk_fault(outcome, trainer.address)))
                else:
                    del unsaved[trainer]
            for _, failure, cause in failures:  # a failure that is not the disk's fails the run
                if cause is None:
                    raise failure
            if failures:
                raise DiskRefused(failures[0][2])

        await retry_while(save_unsaved, lambda error: str(error) if isinstance(error, DiskRefused) else None,
                          self.notices.disk_waiting, should_stop=self.should_stop, first_s=SAVE_RETRY_FIRST_S,
                          most_s=SAVE_RETRY_MOST_S)
        self.notices.checkpoint(step, str(folder), self.loop_state(step, kl_coef, warm_start), keep=self.keep)
        self.saved_step = step
        self.data_after = {later: state for later, state in self.data_after.items() if later > step}

    async def restore(self, resume: Checkpoint) -> Restored:
        """Load every trainer's roles and the loop's own state. A checkpoint a trainer refuses (damaged: its
        manifest does not match its files) gives way to the one before it."""
        roles = self.roles
        while True:
            folder = Path(resume.path)
            try:
                versions = await asyncio.gather(*(trainer.load_checkpoint(
                    self.run_id, str(folder / "-".join(names)), self.timeout_s) for trainer, names in roles.items()))
                break
            except CheckpointRefused as refused:
                earlier = self.notices.damaged(resume, str(refused))
                if earlier is None:
                    raise ValueError(f"no checkpoint of run {self.run_id} can be loaded: the checkpoint of step "
                                     f"{resume.step} is refused ({refused}) and none is older") from None
                resume = earlier
        state = resume.loop_state
        self.sampler.epoch, self.sampler.position = state["epoch"], state["position"]
        self.reward_set.restore(ServiceTarget(*state["reward_target"]))
        if self.env_set is not None and "env_target" in state:  # a checkpoint from before env swaps has none
            self.env_set.restore(ServiceTarget(*state["env_target"]))
        if self.probe is not None:  # (a checkpoint from before the weight check has none: it is drawn anew)
            self.probe.restore(state.get("weight_probe"))
        self.saved_step = resume.step
        self.notices.log(f"resumed from the checkpoint of step {resume.step}")
        return Restored(version=versions[list(roles).index(self.actor)], kl_coef=state["kl_coef"],
                        warm_start=WarmStartProgress.of_state(state.get("warm_start")))
