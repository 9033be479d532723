"""Checkpoint and exact resume: a run stopped mid-way and resumed ends with the metrics of a run that never
stopped (bit for bit: on one CPU thread every step's math is deterministic).

One cluster for the module, as long-running services are: its trainer is killed and replaced, its rollout
stopped and continued, and each run after goes on with the services there are. The uninterrupted run is run
once, and each interrupted one is compared with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from services.coordctl.control import CoordinatorClient
from services.coordctl.local import ServiceSpec
from tests.integration.test_grpo_run import run_config

STEPS = 6
NOT_COMPARED = ("timing_s/", "perf/", "reward/samples_by/", "rollout/tokens_per_s/")  # wall times, service ids


async def run(coordinator: str, config_yaml: str, stop_after: int | None = None):
    client = CoordinatorClient(coordinator)
    try:
        started = await client.start_run(config_yaml)
        async for update in client.watch(started.run_id):
            if update.kind == "step" and update.step == stop_after:
                await client.stop_run(started.run_id)
        return await client.get_run(started.run_id)
    finally:
        await client.close()


async def resume(coordinator: str, run_id: str):
    client = CoordinatorClient(coordinator)
    try:
        resumed = await client.resume_run(run_id)
        async for _ in client.watch(run_id):
            pass
        return resumed, await client.get_run(run_id)
    finally:
        await client.close()


def comparable(run_dir: str) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and not k.startswith(NOT_COMPARED)}
            for r in rows}


def refusal(coordinator: str, call) -> grpc.aio.AioRpcError:
    """The error the coordinator answers ``call(client)`` with (the test fails if it answers)."""
    async def go():
        client = CoordinatorClient(coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call(client)
            return error.value
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def straight(cluster, tiny_model, reverse_data) -> dict[int, dict[str, float]]:
    """The comparable metrics of a STEPS-step run (saving every 2 steps) that nothing interrupted."""
    final = asyncio.run(run(cluster.coordinator, run_config(tiny_model, reverse_data,
                                                            trainer__total_training_steps=STEPS, trainer__save_freq=2)))
    assert final.state == "finished", final.error
    return comparable(final.run_dir)


def test_stopped_and_resumed_run_equals_an_uninterrupted_one(cluster, straight, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2)
    stopped = asyncio.run(run(cluster.coordinator, config, stop_after=3))
    assert stopped.state == "stopped"
    assert 3 <= stopped.step < STEPS
    checkpoints = sorted(p.name for p in (Path(stopped.run_dir) / "checkpoints").iterdir())
    assert f"step_{stopped.step:06d}" in checkpoints and not [c for c in checkpoints if c.endswith(".tmp")]

    resumed, final = asyncio.run(resume(cluster.coordinator, stopped.run_id))
    assert resumed.step == stopped.step  # it continues from the checkpoint of the step it stopped after
    assert final.state == "finished" and final.step == STEPS
    got = comparable(final.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # no step lost or counted twice
    for step in range(1, STEPS + 1):
        assert got[step] == straight[step], f"step {step} differs after the resume"


def test_a_run_without_checkpoint_or_still_running_is_not_resumed(cluster, tiny_model, reverse_data):
    finished = asyncio.run(run(cluster.coordinator, run_config(tiny_model, reverse_data,
                                                               trainer__total_training_steps=1)))

    error = refusal(cluster.coordinator, lambda client: client.resume_run(finished.run_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "is finished" in error.details()


def test_trainer_killed_mid_run_the_run_waits_then_goes_on_and_loses_nothing(cluster, straight, tiny_model,
                                                                              reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2)
    states = []

    async def kill_trainer_then_replace_it():
        client = CoordinatorClient(cluster.coordinator)
        try:
            started = await client.start_run(config)
            async for update in client.watch(started.run_id):
                if update.kind == "step" and update.step == 3 and "trainer" in cluster.processes:
                    os.kill(cluster.processes.pop("trainer").pid, signal.SIGKILL)
                if update.kind == "state":
                    states.append(update.state)
                    if update.state == "waiting":
                        cluster.add_service(ServiceSpec(kind="trainer"), "trainer-again")
            return await client.get_run(started.run_id)
        finally:
            await client.close()

    final = asyncio.run(kill_trainer_then_replace_it())
    assert final.state == "finished", final.error
    assert "waiting" in states and states[-1] == "finished"
    got = comparable(final.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # every step once: nothing lost, nothing counted twice
    for step in range(1, STEPS + 1):
        assert got[step] == straight[step], f"step {step} differs after the recovery"


def test_rollout_stopped_with_sigstop_is_detected_and_the_run_goes_on(cluster, straight, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2,
                        trainer__channel_timeout_s=10)  # a deadline changes no number: compared with straight's
    rollout = cluster.processes["rollout"].pid
    events: list[tuple[str, float]] = []

    async def stop_rollout_then_continue_it():
        client = CoordinatorClient(cluster.coordinator)
        try:
            started = await client.start_run(config)
            async for update in client.watch(started.run_id):
                if update.kind == "step" and update.step == 3 and not events:
                    os.kill(rollout, signal.SIGSTOP)
                    events.append(("stopped", time.monotonic()))
                if update.kind == "state" and update.state == "waiting":
                    events.append(("waiting", time.monotonic()))
                    os.kill(rollout, signal.SIGCONT)
            return await client.get_run(started.run_id)
        finally:
            await client.close()

    try:
        final = asyncio.run(stop_rollout_then_continue_it())
    finally:
        os.kill(rollout, signal.SIGCONT)
    assert final.state == "finished", final.error
    (_, stopped_at), (_, detected_at) = events[:2]
    assert detected_at - stopped_at < 15  # missed heartbeats (5 s) plus a step, not the 600 s RPC deadline
    got = comparable(final.run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == straight[step], f"step {step} differs after the recovery"


def test_verls_resume_modes_go_on_from_a_checkpoint_of_an_earlier_run(cluster, tiny_model, reverse_data):
    """trainer.resume_mode (verl's key): resume_path goes on from the checkpoint named, auto from the latest one
    in default_local_dir when its run stopped; a finished run does not go on. A new run (auto after a finished
    one, or disable) does not save into a folder holding another run's checkpoints: it is refused, naming it."""
    shared = str(cluster.state_dir / "checkpoints")
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2,
                        trainer__default_local_dir=shared)
    first = asyncio.run(run(cluster.coordinator, config, stop_after=3))
    assert first.state == "stopped" and first.step >= 3

    from_two = run_config(tiny_model, reverse_data, trainer__resume_mode="resume_path",
                          trainer__resume_from_path=f"{shared}/step_000002")
    resumed = asyncio.run(run(cluster.coordinator, from_two))  # goes on from step 2, not from its last checkpoint
    assert resumed.run_id == first.run_id and resumed.state == "finished" and resumed.step == STEPS
    assert sorted(comparable(resumed.run_dir)) == list(range(1, STEPS + 1))  # each step once

    error = refusal(cluster.coordinator, lambda client: client.start_run(from_two))  # that run finished since
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "finished" in error.details()

    error = refusal(cluster.coordinator, lambda client: client.start_run(config))  # auto: its latest run finished
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"trainer.default_local_dir: {shared} holds the checkpoints of run {first.run_id} (finished)" in error.details()

    elsewhere = config.replace(shared, shared + "-2")
    second = asyncio.run(run(cluster.coordinator, elsewhere, stop_after=3))
    assert second.run_id != first.run_id and second.state == "stopped"
    disabled = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2,
                          trainer__default_local_dir=shared + "-2", trainer__resume_mode="disable")
    error = refusal(cluster.coordinator, lambda client: client.start_run(disabled))
    assert f"holds the checkpoints of run {second.run_id} (stopped)" in error.details()
    again = asyncio.run(run(cluster.coordinator, elsewhere))  # the same script again: auto finds the stopped run
    assert again.run_id == second.run_id and again.state == "finished"


def test_a_run_keeps_its_newest_checkpoints_and_goes_on_from_the_last(cluster, straight, tiny_model, reverse_data):
    """trainer.max_actor_ckpt_to_keep (verl's key): after each save the oldest step folders go, the run DB
    forgetting them, and a resume goes on from the newest as ever."""
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=1,
                        trainer__max_actor_ckpt_to_keep=2)
    stopped = asyncio.run(run(cluster.coordinator, config, stop_after=3))
    assert stopped.state == "stopped", stopped.error
    folder = Path(stopped.run_dir) / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [f"step_{step:06d}" for step in (stopped.step - 1, stopped.step)]

    resumed, final = asyncio.run(resume(cluster.coordinator, stopped.run_id))
    assert (resumed.step, final.state, final.step) == (stopped.step, "finished", STEPS), final.error
    assert sorted(p.name for p in folder.iterdir()) == ["step_000005", "step_000006"]
    got = comparable(final.run_dir)
    assert all(got[step] == straight[step] for step in range(1, STEPS + 1))  # as if it had kept them all

    async def removals():
        client = CoordinatorClient(cluster.coordinator)
        try:
            return [u.message for u in [u async for u in client.watch(stopped.run_id)] if "removed" in u.message]
        finally:
            await client.close()

    assert [message.split(" removed from ")[0] for message in asyncio.run(removals())] == [
        f"checkpoint of step {step}" for step in range(1, STEPS - 1)]
