"""A run's checkpoints (services/coordinator/step/checkpointer.py) through its real records: the run DB and the step
folders on disk. Trainers that write a folder for each save stand in for the trainer service (tests/integration
saves through real ones): a save one trainer's disk refuses is tried again backing off, asking only that trainer,
while the last complete checkpoint stays as it was; after each save only the newest trainer.max_*_ckpt_to_keep
checkpoints stay."""

from __future__ import annotations

import asyncio
import errno
import itertools
import time
from pathlib import Path

import grpc
import pytest

from services.coordinator.step import checkpointer
from services.coordinator.step.checkpointer import Checkpointer
from services.coordinator.runs.records import RunRecords
from services.coordinator.runs.reporter import RunReporter
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.step.sampler import PromptSampler
from services.coordinator.settings import checkpoints_kept
from services.coordinator.store import RunStore
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.waiting import backoff_s

RUN = "run"


class FolderTrainer:
    """Saves by writing <path>/state holding the step's name; refuses (ENOSPC, as a trainer's full disk does)
    the first ``refusals`` saves, noting when each save was asked and what the run DB held then."""

    def __init__(self, address: str, store: RunStore, refusals: int = 0):
        self.address, self.store, self.refusals = address, store, refusals
        self.asked: list[tuple[str, float, int | None]] = []  # path, time, the last recorded checkpoint's step

    async def save_checkpoint(self, run_id, path, timeout):
        recorded = self.store.last_checkpoint(run_id)
        self.asked.append((path, time.monotonic(), recorded.step if recorded else None))
        if self.refusals:
            self.refusals -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(("meshrl-errno", str(errno.ENOSPC))),
                                       f"CheckpointNotWritten: the checkpoint was not written to {path}: No space "
                                       "left on device")
        write_state(Path(path))
        return 1


def write_state(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "state").write_text(folder.parent.name)


class Saving:
    """A Checkpointer of run RUN over ``trainers`` (client -> roles), recording into a real run DB."""

    def __init__(self, tmp_path: Path, trainers: dict, keep: int | None = None):
        self.store = RunStore(tmp_path / "meshrl.db")
        self.store.create_run(RUN, "it", "", run_dir=str(tmp_path / "runs" / RUN), total_steps=10)
        self.folder = tmp_path / "runs" / RUN / "checkpoints"
        self.trainers, self.keep = trainers, keep

    def save(self, *steps: int) -> None:
        async def go():
            records = RunRecords(self.store)
            records.open(RUN)
            reporter = RunReporter(records=records, run_id=RUN, run_dir=self.folder.parent, samples_dir=None)
            sampler = PromptSampler(8, 4, False, seed=0)
            reward_set = RewardSet(ServiceTarget("group", "default"), lambda target: [], reporter,
                                   should_stop=lambda: False, timeout_s=1.0)
            saving = Checkpointer(run_id=RUN, roles=self.trainers, actor=next(iter(self.trainers)), sampler=sampler,
                                  reward_set=reward_set, env_set=None, notices=reporter, should_stop=lambda: False,
                                  folder=self.folder, keep=self.keep, timeout_s=1.0)
            for step in steps:
                saving.drawn(step, saving.data_state())
                await saving.save(step, kl_coef=0.0)
            await records.close(RUN)

        asyncio.run(go())

    def recorded(self) -> list[int]:
        return [checkpoint.step for checkpoint in self.store.checkpoints_by_age(RUN)]

    def on_disk(self) -> list[str]:
        return sorted(path.name for path in self.folder.iterdir())

    def events(self) -> list[str]:
        return [event.message for event in self.store.events_after(RUN, 0) if event.kind == "checkpoint"]


def test_the_wait_between_refused_saves_doubles_up_to_its_cap():
    assert [backoff_s(failures, 2.0, 30.0) for failures in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]


def test_a_refused_part_is_tried_again_alone_backing_off_and_the_last_checkpoint_stays_as_it_was(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setattr(checkpointer, "SAVE_RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(checkpointer, "SAVE_RETRY_MOST_S", 0.1)
    mesh = Saving(tmp_path, {})
    actor, critic = FolderTrainer("actor:1", mesh.store), FolderTrainer("critic:1", mesh.store)
    mesh.trainers = {actor: ["actor"], critic: ["critic"]}
    mesh.save(1)
    step_1 = {path.relative_to(mesh.folder): path.read_bytes() for path in mesh.folder.rglob("*") if path.is_file()}

    critic.refusals = 4
    mesh.save(2)
    assert [path for path, _, _ in actor.asked] == [f"{mesh.folder}/step_000001/actor",
                                                    f"{mesh.folder}/step_000002/actor"]  # saved once, not again
    tries = critic.asked[1:]
    assert [path for path, _, _ in tries] == [f"{mesh.folder}/step_000002/critic"] * 5
    gaps = [later - earlier for (_, earlier, _), (_, later, _) in itertools.pairwise(tries)]
    assert [gap >= wait for gap, wait in zip(gaps, [0.05, 0.1, 0.1, 0.1])] == [True] * 4, gaps  # 0.05, doubled, capped
    assert {recorded for _, _, recorded in tries} == {1}  # step 1 stayed the last complete one throughout
    assert {path.relative_to(mesh.folder): path.read_bytes() for path in mesh.folder.rglob("*")
            if path.is_file() and path.parts[-3] == "step_000001"} == step_1  # and its files as they were
    assert mesh.recorded() == [1, 2] and (mesh.folder / "step_000002" / "critic" / "state").read_text() == "step_000002"


def test_only_the_newest_checkpoints_stay_and_the_one_just_saved_is_never_removed(tmp_path):
    mesh = Saving(tmp_path, {}, keep=2)
    mesh.trainers = {FolderTrainer("trainer:1", mesh.store): ["actor", "critic"]}
    mesh.save(1, 2, 3, 4)
    assert mesh.recorded() == [3, 4] and mesh.on_disk() == ["step_000003", "step_000004"]
    assert [m for m in mesh.events() if "removed" in m] == [
        f"checkpoint of step {step} removed from {mesh.folder}/step_{step:06d} (the run keeps its 2 newest)"
        for step in (1, 2)]

    mesh.keep = 1  # step 2 saved again (as after a resume from an earlier checkpoint): below 4, but saved last
    mesh.save(2)
    assert mesh.recorded() == [2] and mesh.on_disk() == ["step_000002"]


def test_without_a_bound_every_checkpoint_stays(tmp_path):
    mesh = Saving(tmp_path, {})
    mesh.trainers = {FolderTrainer("trainer:1", mesh.store): ["actor"]}
    mesh.save(1, 2, 3)
    assert mesh.recorded() == [1, 2, 3] and len(mesh.on_disk()) == 3


@pytest.mark.parametrize("actor, critic, has_critic, kept", [
    (2, None, False, 2),  # GRPO: the actor's bound alone
    (None, 3, False, None),
    (2, None, True, None),  # the critic keeps all, and a step folder holds both
    (2, 3, True, 3),
    (4, 3, True, 4),
    (None, None, True, None),
])
def test_a_step_folder_goes_once_both_roles_bounds_let_it(actor, critic, has_critic, kept):
    assert checkpoints_kept(actor, critic, has_critic=has_critic) == kept
