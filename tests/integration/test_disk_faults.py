"""Disk faults under the coordinator's state directory, on real processes: a full and then a read-only state
directory (a small tmpfs; CI runs as root) make the run wait, saying why, and it goes on when the disk
recovers, nothing lost (its records and its samples files); meanwhile StartRun and ResumeRun are refused
naming the file; a full checkpoint disk (a second tmpfs) makes the run wait for the trainer's save; a torn
last line of metrics.jsonl does not block a resume; a damaged run DB stops the coordinator at start with a
message naming the file and what to do."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.cli import REFUSED_EXIT_CODE
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster
from services.coordinator.store import RunStore
from tests.integration.test_grpo_run import run_config

STEPS = 12  # stopped after about step 6 (a full disk, a read-only one, a full checkpoint disk, a stop, a step apart);
# the steps beyond leave room for a test slowed by a busy machine (at 8 the run once finished before the stop)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def cluster_on_tmpfs(tmp_path_factory):
    """The four services, the coordinator's state directory (run DB, run folders, logs) on a 64 MB tmpfs, and
    its ckpt folder on an 8 MB one of its own."""
    state = tmp_path_factory.mktemp("state")
    try:
        mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state))
    except (subprocess.CalledProcessError, FileNotFoundError) as refused:
        pytest.skip(f"cannot mount a tmpfs (needs root): {getattr(refused, 'stderr', refused)}")
    (state / "ckpt").mkdir()
    mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", str(state / "ckpt"))
    local = LocalCluster(state)
    try:
        asyncio.run(local.start(timeout_s=120))
        yield local
    finally:
        local.stop()
        subprocess.run(["umount", "--lazy", str(state / "ckpt")], check=False)
        subprocess.run(["umount", "--lazy", str(state)], check=False)  # twice if a read-only layer stayed
        subprocess.run(["umount", "--lazy", str(state)], check=False, capture_output=True)


def fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until its file system has no space left."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12):
            try:
                while True:
                    out.write(bytes(chunk))
            except OSError as full:
                assert full.errno == errno.ENOSPC
    return filler


async def wait_for_state(client: CoordinatorClient, run_id: str, state: str, timeout_s: float = 60.0):
    """The run as GetRun and ListRuns show it once it is in ``state``."""
    deadline = time.monotonic() + timeout_s
    while (run := await client.get_run(run_id)).state != state:
        assert time.monotonic() < deadline, f"the run is {run.state} ({run.error}), not {state}"
        await asyncio.sleep(0.2)
    [listed] = [r for r in await client.list_runs() if r.run_id == run_id]
    return run, listed


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


def read_only(folder: Path) -> None:
    """``folder`` read-only (its submounts not): files open already stay writable, new ones are not."""
    mount("--rbind", str(folder), str(folder))
    mount("-o", "remount,bind,ro", str(folder))


def test_full_then_read_only_state_dir_the_run_waits_says_why_and_loses_nothing(cluster_on_tmpfs, tiny_model,
                                                                                reverse_data):
    state = cluster_on_tmpfs.state_dir
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=1,
                        trainer__default_local_dir=str(state / "ckpt"), trainer__rollout_data_dir="rollout_data")
    seen = {}

    async def run_through_faults():
        client = CoordinatorClient(cluster_on_tmpfs.coordinator)
        try:
            started = await client.start_run(config)
            events = []
            async for update in client.watch(started.run_id):  # each fault after the step following the last
                events.append(update)
                if update.kind != "step" or update.step == 0:
                    continue
                if "full" not in seen:
                    filler = fill(state)
                    seen["full"] = await wait_for_state(client, started.run_id, "waiting")
                    seen["start refused"] = await refusal(client.start_run(run_config(tiny_model, reverse_data)))
                    filler.unlink()
                    await wait_for_state(client, started.run_id, "running")
                elif "read-only" not in seen:
                    read_only(state)
                    try:
                        seen["read-only"] = await wait_for_state(client, started.run_id, "waiting")
                    finally:
                        subprocess.run(["umount", "--lazy", str(state)], check=True)
                    await wait_for_state(client, started.run_id, "running")
                elif "checkpoint disk full" not in seen:
                    filler = fill(state / "ckpt")
                    seen["checkpoint disk full"] = await wait_for_state(client, started.run_id, "waiting")
                    filler.unlink()
                    await wait_for_state(client, started.run_id, "running")
                elif "stop" not in seen:
                    seen["stop"] = await client.stop_run(started.run_id)
            stopped = await client.get_run(started.run_id)
            read_only(state)
            try:
                seen["resume refused"] = await refusal(client.resume_run(started.run_id))
            finally:
                subprocess.run(["umount", "--lazy", str(state)], check=True)
            return stopped, events
        finally:
            await client.close()

    stopped, events = asyncio.run(run_through_faults())
    for fault, words in (("full", "No space left on device"), ("read-only", "Read-only file system"),
                         ("checkpoint disk full", "No space left on device")):
        run, listed = seen[fault]
        named = f"cannot write {state}/" if fault != "checkpoint disk full" else "cannot save the checkpoint"
        assert words in run.error and named in run.error and str(state) in run.error, run.error  # names the file
        assert (listed.state, listed.error) == ("waiting", run.error)  # coordctl runs says so too
        waits = [e for e in events if e.kind == "state" and e.state == "waiting" and words in e.message
                 and named in e.message]
        assert waits, f"no waiting event for the {fault} disk"
        after = events[events.index(waits[0]) + 1:]
        assert any(e.kind == "state" and e.state == "running" for e in after)  # and it went on
    assert stopped.state == "stopped", stopped.error
    start_refused, resume_refused = seen["start refused"], seen["resume refused"]
    assert start_refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, start_refused.details()
    assert f"cannot write {state}/" in start_refused.details() and "No space left on device" in start_refused.details()
    assert resume_refused.code() == grpc.StatusCode.FAILED_PRECONDITION, resume_refused.details()
    assert f"cannot write {state}/" in resume_refused.details() and "Read-only" in resume_refused.details()

    metrics_file = Path(stopped.run_dir) / "metrics.jsonl"
    whole = metrics_file.read_bytes()
    torn = len(whole.splitlines()[-1]) // 2 + 1  # a crash tore the last line: its second half and newline lost
    metrics_file.write_bytes(whole[:-torn])
    resumed = subprocess.run([sys.executable, "-m", "services.coordctl.cli", "resume", stopped.run_id,
                              "--coordinator", cluster_on_tmpfs.coordinator], capture_output=True, text=True,
                             timeout=300, env=os.environ)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = asyncio.run(final_run(cluster_on_tmpfs.coordinator, stopped.run_id))
    assert (final.state, final.step) == ("finished", STEPS), final.error
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))  # every step, once
    assert all("critic/score/mean" in line for line in lines)
    samples_dir = Path(stopped.run_dir) / "rollout_data"  # every step's samples, none lost to a fault
    assert sorted(int(path.stem) for path in samples_dir.glob("*.jsonl")) == list(range(1, STEPS + 1))
    assert all(len((samples_dir / f"{step}.jsonl").read_text().splitlines()) == 8 * 4 for step in range(1, STEPS + 1))


def test_a_refused_start_run_leaves_no_run_folder_and_no_run_record(cluster_on_tmpfs, tiny_model, reverse_data):
    """Refused for a full state directory (the run folder can be made, its config.yaml not) or for a bad config."""
    state = cluster_on_tmpfs.state_dir

    async def refused_starts():
        client = CoordinatorClient(cluster_on_tmpfs.coordinator)
        try:
            before = ({r.run_id for r in await client.list_runs()}, set((state / "runs").glob("*")))
            filler = fill(state)
            try:
                full = await refusal(client.start_run(run_config(tiny_model, reverse_data)))
            finally:
                filler.unlink()
            bad = await refusal(client.start_run(run_config(tiny_model, reverse_data, data__train_batch_size=0)))
            after = ({r.run_id for r in await client.list_runs()}, set((state / "runs").glob("*")))
            return full, bad, before, after
        finally:
            await client.close()

    full, bad, before, after = asyncio.run(refused_starts())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "No space left on device" in full.details()
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "data.train_batch_size" in bad.details()
    assert after == before  # no run listed, no runs/<id> folder, by either refusal


async def final_run(coordinator: str, run_id: str):
    client = CoordinatorClient(coordinator)
    try:
        return await client.get_run(run_id)
    finally:
        await client.close()


def test_a_damaged_run_db_stops_the_coordinator_naming_the_file_and_what_to_do(tmp_path):
    """Its header overwritten (tests/unit/coordinator/test_store.py: truncated too)."""
    db_path = tmp_path / "meshrl.db"
    store = RunStore(db_path)
    store.create_run("r1", "it", "", run_dir=str(tmp_path / "runs" / "r1"), total_steps=10)
    store.close()
    with db_path.open("r+b") as db:
        db.write(b"\xff" * 100)

    started = subprocess.run([sys.executable, "-m", "services.coordinator", "host=127.0.0.1", "port=0",
                              f"state_dir={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert started.returncode == REFUSED_EXIT_CODE
    assert f"coordinator: cannot start: the run DB {db_path} is damaged" in started.stderr
    assert f"mv {db_path} {db_path}.damaged" in started.stderr and "Traceback" not in started.stderr
