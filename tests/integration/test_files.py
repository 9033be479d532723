"""Paths and files from outside, on real processes: every path a request or run config names stays inside its
service's folder, a save replaces only a checkpoint of its own run, nothing in a checkpoint is unpickled before
its signed manifest is checked, a damaged last checkpoint gives way to the one before it, a save into a full disk
fails at once naming it, pickled model weights are refused unless the run allows them, and a checkpoint without
a manifest is refused until an operator trusts it."""

from __future__ import annotations

import asyncio
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from meshrl.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc import Connection
from services.coordctl.control import CoordinatorClient
from services.coordinator.fleet.clients import TrainerClient
from tests.integration.test_grpo_run import run_config
from tests.integration.test_resume import refusal, resume, run

RUN_ID = "files"


def addresses(cluster) -> dict[str, str]:
    async def go():
        client = CoordinatorClient(cluster.coordinator)
        try:
            return {s.kind: s.address for s in await client.list_services()}
        finally:
            await client.close()

    return asyncio.run(go())


async def call(address: str, stub_class, method: str, request, timeout: float = 60):
    """One unary call; the reply, or the AioRpcError it failed with."""
    connection = Connection(address)
    try:
        return await getattr(stub_class(connection.channel), method)(request, timeout=timeout)
    except grpc.aio.AioRpcError as error:
        return error
    finally:
        await connection.close()


def checkpoint_call(trainer: str, method: str, path: Path | str):
    request = trainer_pb2.CheckpointRequest(run_id=RUN_ID, path=str(path))
    return asyncio.run(call(trainer, trainer_pb2_grpc.TrainerStub, method, request))


def refused(reply, code: grpc.StatusCode, *named: str) -> str:
    assert isinstance(reply, grpc.aio.AioRpcError), f"answered {reply}"
    assert reply.code() == code, reply.details()
    for text in named:
        assert text in reply.details(), reply.details()
    return reply.details()


class MakesAFile:
    """Unpickled, it creates ``marker``: what a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def trainer(cluster, tiny_model, reverse_data) -> str:
    """The cluster's trainer with the tiny model loaded as run RUN_ID."""
    address = addresses(cluster)["trainer"]

    async def init():
        client = TrainerClient(address)
        try:
            await client.init_run(RUN_ID, run_config(tiny_model, reverse_data), ["actor"], seed=0, timeout=120)
        finally:
            await client.close()

    asyncio.run(init())
    return address


def test_a_save_stays_inside_the_state_folder_and_replaces_only_its_runs_checkpoints(cluster, trainer):
    root = cluster.state_dir
    unrelated = root / "runs" / "notes"
    unrelated.mkdir(parents=True)
    (unrelated / "keep.txt").write_text("mine")
    refused(checkpoint_call(trainer, "SaveCheckpoint", unrelated), grpc.StatusCode.INVALID_ARGUMENT,
            f"path: {unrelated} exists and is not a checkpoint of run {RUN_ID}")
    assert (unrelated / "keep.txt").read_text() == "mine" and sorted(unrelated.iterdir()) == [unrelated / "keep.txt"]

    escaping = root / "runs" / ".." / ".." / ".." / ".." / "escaped"
    refused(checkpoint_call(trainer, "SaveCheckpoint", escaping), grpc.StatusCode.INVALID_ARGUMENT,
            "path:", "is outside")
    assert not (root.parents[2] / "escaped").exists()

    ours = root / "runs" / RUN_ID / "step_000001" / "actor"
    for _ in range(2):  # the second save replaces the first: a checkpoint of the same run
        saved = checkpoint_call(trainer, "SaveCheckpoint", ours)
        assert saved.total_bytes > 0 and (ours / "meshrl_manifest.json").exists()
    assert checkpoint_call(trainer, "LoadCheckpoint", ours).weight_version == 0


def test_a_crafted_checkpoint_is_refused_naming_the_file_and_nothing_in_it_runs(cluster, trainer):
    root, marker = cluster.state_dir, cluster.state_dir.parent / "unpickled"
    crafted = pickle.dumps(MakesAFile(marker))
    by_hand = root / "runs" / "crafted" / "step_000001" / "actor"  # no manifest: pickled metadata and state
    by_hand.mkdir(parents=True)
    (by_hand / ".metadata").write_bytes(crafted)
    (by_hand / "trainer_state.pt").write_bytes(crafted)
    refused(checkpoint_call(trainer, "LoadCheckpoint", by_hand), grpc.StatusCode.INVALID_ARGUMENT,
            f"{by_hand}/meshrl_manifest.json does not exist")

    saved = root / "runs" / RUN_ID / "step_000002" / "actor"  # a real checkpoint, its metadata swapped afterwards
    checkpoint_call(trainer, "SaveCheckpoint", saved)
    (saved / ".metadata").write_bytes(crafted)
    refused(checkpoint_call(trainer, "LoadCheckpoint", saved), grpc.StatusCode.INVALID_ARGUMENT,
            f"{saved}/.metadata does not match the checkpoint's manifest")
    assert not marker.exists()
    refused(checkpoint_call(trainer, "LoadCheckpoint", "/etc"), grpc.StatusCode.INVALID_ARGUMENT, "path:", "outside")


def test_a_save_into_a_full_disk_fails_at_once_naming_it(cluster, trainer):
    """dcp.save raises torch's CheckpointException (a BaseException) there: the caller gets a status, not a
    deadline."""
    full = cluster.state_dir / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        (full / "filler").write_bytes(b"\0" * (1024 - 16) * 1024)  # 16 KiB left: less than a checkpoint
        started = time.monotonic()
        details = refused(checkpoint_call(trainer, "SaveCheckpoint", full / "step_000001" / "actor"),
                          grpc.StatusCode.FAILED_PRECONDITION, f"{full}/step_000001/actor", "No space left on device",
                          f"free on the disk of {full}")
        assert time.monotonic() - started < 10, details
        assert sorted(p.name for p in full.iterdir()) == ["filler", "step_000001"]
        assert not list((full / "step_000001").iterdir())  # the partial folder is gone
        assert checkpoint_call(trainer, "SaveCheckpoint", cluster.state_dir / "after" / "actor").total_bytes > 0
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_run_folders_and_checkpoint_folders_stay_inside_the_state_folder(cluster, tiny_model, reverse_data):
    outside = cluster.state_dir.parent
    for name in ("../../x", str(outside / "x")):
        error = refusal(cluster.coordinator, lambda client: client.start_run(
            run_config(tiny_model, reverse_data, trainer__experiment_name=name)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "trainer.experiment_name" in error.details()
    for key in ("default_local_dir", "rollout_data_dir"):
        error = refusal(cluster.coordinator, lambda client: client.start_run(
            run_config(tiny_model, reverse_data, **{f"trainer__{key}": "../../../elsewhere"})))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"trainer.{key}: " in error.details()
    assert not (outside / "x").exists() and not (outside / "elsewhere").exists()
    assert not list((cluster.state_dir / "runs").glob("*x-*"))


def test_pickled_model_weights_are_refused_unless_the_run_allows_them(cluster, tiny_model, reverse_data, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    from safetensors.torch import load_file

    torch.save(load_file(tiny_model / "model.safetensors"), pickled / "pytorch_model.bin")
    error = refusal(cluster.coordinator, lambda client: client.start_run(run_config(pickled, reverse_data)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"actor_rollout_ref.model.path: {pickled}/pytorch_model.bin holds pickled weights" in error.details()

    rollout = addresses(cluster)["rollout"]
    init = rollout_pb2.RolloutInitRequest(run_id=RUN_ID, model_path=str(pickled), dtype="float32")
    refused(asyncio.run(call(rollout, rollout_pb2_grpc.RolloutStub, "InitRun", init)),
            grpc.StatusCode.INVALID_ARGUMENT, f"model_path: {pickled}/pytorch_model.bin holds pickled weights")
    init.allow_pickle = True
    loaded = asyncio.run(call(rollout, rollout_pb2_grpc.RolloutStub, "InitRun", init, timeout=120))
    assert loaded.details["model_path"] == str(pickled)


def test_a_damaged_last_checkpoint_gives_way_to_the_one_before_it(cluster, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=4, trainer__save_freq=1)
    stopped = asyncio.run(run(cluster.coordinator, config, stop_after=2))
    assert stopped.state == "stopped" and stopped.step in (2, 3)  # a checkpoint at each step
    last = stopped.step
    state = Path(stopped.run_dir) / "checkpoints" / f"step_{last:06d}" / "actor" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # torn

    async def resume_and_read_events():
        await resume(cluster.coordinator, stopped.run_id)
        client = CoordinatorClient(cluster.coordinator)
        try:
            return [update.message async for update in client.watch(stopped.run_id)], \
                await client.get_run(stopped.run_id)
        finally:
            await client.close()

    messages, final = asyncio.run(resume_and_read_events())
    assert final.state == "finished" and final.step == 4, final.error
    assert (f"the checkpoint of step {last} cannot be loaded (DamagedCheckpoint: {state} does not match the "
            "checkpoint's manifest: 100 bytes where") in "\n".join(messages)
    assert f"going on from the checkpoint of step {last - 1} before it" in "\n".join(messages)
    assert f"resumed from the checkpoint of step {last - 1}" in messages


def coordctl(*args: str, answer: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.coordctl.cli", *args], input=answer, capture_output=True,
                          text=True, timeout=300)


def test_a_checkpoint_without_a_manifest_is_refused_until_an_operator_trusts_it(cluster, tiny_model, reverse_data,
                                                                               tmp_path):
    """As a checkpoint saved before meshrl signed them: refused by a resume and by coordctl export, accepted by
    both once `coordctl checkpoint trust` has shown its files and signed them."""
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=4)  # saves only at the stop
    stopped = asyncio.run(run(cluster.coordinator, config, stop_after=2))
    assert stopped.state == "stopped", stopped.error
    step_dir = Path(stopped.run_dir) / "checkpoints" / f"step_{stopped.step:06d}"
    [saved] = list(step_dir.iterdir())
    (saved / "meshrl_manifest.json").unlink()
    state_dir = str(cluster.state_dir)

    exported = coordctl("export", stopped.run_id, str(tmp_path / "before"), "--state-dir", state_dir)
    assert exported.returncode == 2 and "holds no complete checkpoint" in exported.stderr, exported.stderr
    _, failed = asyncio.run(resume(cluster.coordinator, stopped.run_id))
    assert failed.state == "failed" and f"{saved}/meshrl_manifest.json does not exist" in failed.error, failed.error

    declined = coordctl("checkpoint", "trust", str(step_dir), answer="n\n")
    assert declined.returncode == 1 and "not signed" in declined.stderr
    assert f"{saved} (" in declined.stdout and "trainer_state.pt" in declined.stdout and ".metadata" in declined.stdout
    assert f"signed as a checkpoint of run {stopped.run_id} with {state_dir}/checkpoint.key" in declined.stdout
    assert not (saved / "meshrl_manifest.json").exists()

    trusted = coordctl("checkpoint", "trust", str(step_dir), "--yes")
    assert trusted.returncode == 0 and f"signed {saved}" in trusted.stdout, trusted.stderr
    again = coordctl("checkpoint", "trust", str(step_dir), "--yes")  # signed already: nothing to do
    assert again.returncode == 2 and "is signed already" in again.stderr

    exported = coordctl("export", stopped.run_id, str(tmp_path / "after"), "--state-dir", state_dir)
    assert exported.returncode == 0, exported.stderr
    assert f"exported the actor of step {stopped.step}" in exported.stdout
    _, final = asyncio.run(resume(cluster.coordinator, stopped.run_id))
    assert (final.state, final.step) == ("finished", 4), final.error
