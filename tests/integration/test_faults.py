"""Services killed (kill -9) or stopped (SIGSTOP) under a running run, as real processes, and what a user
checks afterwards: the run finished, and its DB holds every step once, each with all its samples, each
generated with the weights of the step before."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import time

import pytest

from bench.faults import SERVICES, random_schedule, run_with_faults, service_address, serving, step_events
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.fleet.dispatch import split_by_speed
from services.coordinator.settings import Sampling
from services.coordctl.control import CoordinatorClient, RunStatus
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_grpo_run import run_config
from tests.integration.test_resume import comparable, run

BATCH = 8 * 4  # train_batch_size x rollout.n of run_config


@pytest.fixture(scope="module")
def replaced_services(tmp_path_factory):
    """bench/faults.py's services (a trainer, two rollouts generating one sequence at a time, two rewards) for
    the tests that kill some and start replacements, one after the other: each finds the ones serving when it
    begins, as a user would after the previous failures."""
    local = LocalCluster(tmp_path_factory.mktemp("replaced") / "state", SERVICES)
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


class LogTail:
    """The JSON events a service logs, read as they come."""

    def __init__(self, cluster: LocalCluster, name: str):
        self.path, self.offset, self.events = cluster.log_dir / f"{name}.log", 0, []

    def from_now(self) -> LogTail:
        """Leave out what the service has logged so far (for a service that earlier runs used)."""
        self.read()
        self.events = []
        return self

    def read(self) -> list[dict]:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.events += [json.loads(line) for line in complete.decode().splitlines() if line.startswith("{")]
        return self.events

    async def wait_for(self, event: str, count: int, timeout_s: float = 60) -> None:
        """Until the service has logged ``event`` ``count`` times."""
        deadline = time.monotonic() + timeout_s
        while sum(e["event"] == event for e in self.read()) < count:
            assert time.monotonic() < deadline, f"{self.path.name}: no {count} x {event} within {timeout_s} s"
            await asyncio.sleep(0.002)


def samples(metrics: dict[str, float], kind: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(f"{kind}/samples_by/"))


def check_nothing_lost(cluster: LocalCluster, final: RunStatus, steps: int,
                       max_staleness: int = 0) -> dict[int, dict[str, float]]:
    """The run finished with every step once, each with all its samples; returns the DB's step metrics."""
    assert final.state == "finished", final.error
    with sqlite3.connect(cluster.state_dir / "meshrl.db") as db:
        rows = {step: json.loads(m) for step, m in
                db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (final.run_id,))}
    assert sorted(rows) == list(range(1, steps + 1))
    for step, metrics in rows.items():
        assert samples(metrics, "rollout") == BATCH and samples(metrics, "reward") == BATCH, (step, metrics)
        # generated with the weights the step before trained (rollouts taken in late included), or up to
        # max_staleness versions older
        behind = metrics["training/weight_version"] - 1 - metrics["rollout/weight_version"]
        assert 0 <= behind <= max_staleness, step
    versions = [rows[step]["training/weight_version"] for step in range(1, steps + 1)]
    assert versions == list(range(int(versions[0]), int(versions[0]) + steps))  # each step trained once
    assert sorted(comparable(final.run_dir)) == list(range(1, steps + 1))  # metrics.jsonl: each step once
    return rows


def test_rollout_stopped_during_a_weight_broadcast_is_named_and_the_run_goes_on_without_it(
        make_cluster, tiny_model, reverse_data):
    steps, stop_at, deadline = 20, 3, 60  # the steps after it leave it the time to come back, even on a busy machine
    cluster = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"),
                           ServiceSpec(kind="rollout", settings=("batch_size=1",)), ServiceSpec(kind="reward"))
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps,
                        trainer__channel_timeout_s=deadline)
    stalled = service_address(cluster, "rollout-2")
    pid = cluster.processes["rollout-2"].pid
    messages = []

    async def scenario():
        client, busy = CoordinatorClient(cluster.coordinator), RolloutClient(stalled)
        try:
            started = await client.start_run(config)
            await LogTail(cluster, "rollout-2").wait_for("generating", stop_at)
            # a long Generate queued behind its share of step 3 keeps its engine busy, so the weight sync
            # after step 3 cannot finish on it; it is stopped as the actor's update of step 3 ends, so the
            # sync goes on the wire with a member that does not take it (it would land after the transfer if
            # stopped once the sync has begun: its receive runs beside the engine)
            busy_sampling = Sampling(n=16, temperature=1.0, top_p=1.0, max_new_tokens=16, stop_token_ids=())
            hold = asyncio.ensure_future(busy.generate([[5, 6, 7]] * 16, busy_sampling, 0, first_index=0, timeout=120))
            await LogTail(cluster, "trainer").wait_for("actor_updated", stop_at)
            os.kill(pid, signal.SIGSTOP)
            async for update in client.watch(started.run_id):
                messages.append(update.message)
                if update.message.startswith(f"rollout {stalled} left the run"):
                    os.kill(pid, signal.SIGCONT)  # resumed: it stays out until taken in at a boundary
            await asyncio.gather(hold, return_exceptions=True)
            return await client.get_run(started.run_id), await busy.info()
        finally:
            os.kill(pid, signal.SIGCONT)
            await asyncio.gather(client.close(), busy.close())

    final, info = asyncio.run(scenario())
    rows = check_nothing_lost(cluster, final, steps)
    failure = next(i for i, m in enumerate(messages) if m.startswith("weight sync of version"))
    assert stalled in messages[failure].partition("not serving it:")[2] and "sending version" in messages[failure]
    left = next(i for i, m in enumerate(messages) if m.startswith(f"rollout {stalled} left the run"))
    assert any(f"taken in: {stalled}" in message for message in messages[left:])
    assert rows[stop_at][f"rollout/samples_by/{stalled}"] > 0  # it was serving until the sync it stalled in
    # the sync goes on without it once it has missed its heartbeats (5 s), not at the channel's deadline: the
    # trainer abandons the broadcast waiting for it when it prepares the next channel
    assert rows[stop_at]["timing_s/update_weights"] < deadline / 2
    assert info.weight_version == rows[steps]["training/weight_version"]  # back, with the current weights


COORDINATOR_STEPS = 8


@pytest.fixture(scope="module")
def straight(cluster, tiny_model, reverse_data) -> dict[int, dict[str, float]]:
    """The comparable metrics of a COORDINATOR_STEPS-step run that nothing interrupted (checkpoints change no
    number: both cases below compare with it)."""
    final = asyncio.run(run(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=COORDINATOR_STEPS, trainer__channel_timeout_s=10)))
    assert final.state == "finished", final.error
    return comparable(final.run_dir)


@pytest.mark.parametrize("save_freq", [2, 0], ids=["from-its-checkpoint", "without-checkpoint-from-the-start"])
def test_coordinator_killed_mid_run_reloads_it_and_finishes(cluster, straight, tiny_model, reverse_data, save_freq):
    steps = COORDINATOR_STEPS
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps, trainer__save_freq=save_freq,
                        trainer__channel_timeout_s=10)

    async def kill_coordinator_at_step_5() -> str:
        client = CoordinatorClient(cluster.coordinator)
        try:
            started = await client.start_run(config)
            async for update in client.watch(started.run_id):
                if update.kind == "step" and update.step == 5:
                    cluster.processes["coordinator"].kill()
                    break
            return started.run_id
        finally:
            await client.close()

    async def follow_after_restart(run_id: str) -> tuple[RunStatus, list]:
        client = CoordinatorClient(cluster.coordinator)
        try:
            await client.wait_ready(60)
            deadline = time.monotonic() + 90
            while (final := await client.get_run(run_id)).state not in ("finished", "failed"):
                assert time.monotonic() < deadline, f"run still {final.state}"
                await asyncio.sleep(0.5)
            return final, [u async for u in client.watch(run_id)]
        finally:
            await client.close()

    run_id = asyncio.run(kill_coordinator_at_step_5())
    cluster.processes.pop("coordinator").wait()
    cluster.start_coordinator()
    final, history = asyncio.run(follow_after_restart(run_id))
    check_nothing_lost(cluster, final, steps)
    assert "interrupted" in [u.state for u in history if u.kind == "state"]
    resumed = "resumed from the checkpoint of step " if save_freq else "no checkpoint to resume from: running it again"
    assert any(u.message.startswith(resumed) for u in history)
    got = comparable(final.run_dir)
    for step in range(1, steps + 1):
        assert got[step] == straight[step], f"step {step} differs after the coordinator's restart"


def test_seeded_random_faults_on_the_coordinator_too_with_generation_ahead_lose_nothing(
        replaced_services, tiny_model, reverse_data):
    """bench/faults.py's schedule, one seed: kill -9 and SIGSTOP, the coordinator among the targets, generation a
    step ahead of training (max_staleness 1). Such runs stalled for good before: a ReceiveWeights cancelled at
    the wrong moment left a rollout's swap gate shut."""
    steps, rng = 12, random.Random(7)
    schedule = random_schedule(rng, 3, steps)
    assert [(f.kind, f.how) for f in schedule] == [("rollout", "kill"), ("coordinator", "stop"),
                                                   ("coordinator", "kill")]
    assert schedule[1].stop_s > 5  # longer than the services' heartbeat window
    cluster = replaced_services
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps, trainer__save_freq=2,
                        trainer__channel_timeout_s=10, trainer__async_={"max_staleness": 1})
    final, injected = asyncio.run(run_with_faults(cluster, config, schedule, rng))
    assert [fault.fault for fault in injected] == schedule
    last_step_at = step_events(cluster.state_dir, final.run_id)[-1]
    assert all(fault.at < last_step_at for fault in injected)  # every fault hit the running run
    check_nothing_lost(cluster, final, steps, max_staleness=1)
    with sqlite3.connect(cluster.state_dir / "meshrl.db") as db:
        messages = [m for (m,) in db.execute("SELECT message FROM events WHERE run_id = ?", (final.run_id,))]
    # the coordinator's own stop is not taken for its services' silence: no attempt failed, nothing rewound
    assert not any(message.startswith("a service failed") for message in messages)


def test_rollout_killed_mid_step_its_share_is_redone_and_a_restarted_one_is_taken_in(
        replaced_services, tiny_model, reverse_data):
    steps, kill_at = 30, 3
    # rollouts that generate one sequence at a time: the kill lands inside a share of the step, and the
    # steps leave a restarted rollout the time to come up before the run ends
    cluster = replaced_services
    (_, kept), (killed_name, killed) = sorted(asyncio.run(serving(cluster, "rollout")).items())
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps,
                        data__max_response_length=16)
    messages = []

    async def scenario():
        client = CoordinatorClient(cluster.coordinator)
        try:
            started = await client.start_run(config)
            # it holds its share of step 3
            await LogTail(cluster, killed_name).from_now().wait_for("generating", kill_at)
            victim = cluster.processes.pop(killed_name)
            victim.kill()
            victim.wait()
            cluster.add_service(ServiceSpec(kind="rollout"), "rollout-again")
            messages.extend([u.message async for u in client.watch(started.run_id)])
            final = await client.get_run(started.run_id)
        finally:
            await client.close()
        restarted = RolloutClient(service_address(cluster, "rollout-again"))
        try:
            return final, restarted.address, await restarted.info()
        finally:
            await restarted.close()

    final, again, info = asyncio.run(scenario())
    rows = check_nothing_lost(cluster, final, steps)
    assert rows[kill_at][f"rollout/samples_by/{kept}"] == BATCH  # the killed rollout's share, redone
    assert not any(f"rollout/samples_by/{killed}" in rows[step] for step in range(kill_at, steps + 1))
    assert any(f"rollout {killed} left the run" in message for message in messages)

    taken_in = [step for step in rows if f"rollout/samples_by/{again}" in rows[step]]
    assert taken_in and taken_in == list(range(taken_in[0], steps + 1)), "taken in at a boundary, then every step"
    assert any(f"taken in: {again}" in message for message in messages)
    assert info.run_id == final.run_id and info.weight_version == rows[steps]["training/weight_version"]
    check_shares_follow_speeds(rows, kept, again, taken_in)
    # the restarted rollout received the run's weights before its first Generate
    served = [e for e in LogTail(cluster, "rollout-again").read() if e["event"] in ("weights_received", "generating")]
    assert served[0]["event"] == "weights_received" and served[0]["weight_version"] > 0
    assert "generating" in [e["event"] for e in served]


def check_shares_follow_speeds(rows: dict[int, dict[str, float]], slow: str, fast: str, both: list[int]) -> None:
    """Over the steps ``both`` rollouts served: each step's prompts were split in proportion to the speeds
    measured up to the step before, and the rollout that generates a whole batch at once (``fast``) ends
    measured faster, with the larger share, than the one generating a sequence at a time (``slow``)."""
    prompts = BATCH // 4  # rollout.n of run_config
    for step in both[1:]:
        before, now = rows[step - 1], rows[step]
        speeds = [before[f"rollout/tokens_per_s/{slow}"], before[f"rollout/tokens_per_s/{fast}"]]
        shares = [round(now[f"rollout/share/{a}"] * prompts) for a in (slow, fast)]
        assert shares == split_by_speed(prompts, speeds), (step, shares, speeds)
    last = rows[both[-1]]
    assert last[f"rollout/tokens_per_s/{fast}"] > 2 * last[f"rollout/tokens_per_s/{slow}"], last
    assert last[f"rollout/share/{fast}"] > last[f"rollout/share/{slow}"] > 0, last


def test_every_reward_replica_killed_the_run_waits_for_one_and_goes_on_where_it_was(
        replaced_services, tiny_model, reverse_data):
    steps, kill_after = 12, 3
    cluster = replaced_services
    rewards = sorted(asyncio.run(serving(cluster, "reward")))
    assert len(rewards) == 2
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps)
    messages, states = [], []

    async def scenario():
        client = CoordinatorClient(cluster.coordinator)
        try:
            started = await client.start_run(config)
            async for update in client.watch(started.run_id):
                messages.append(update.message)
                if update.kind == "step" and update.step == kill_after:
                    for name in rewards:
                        victim = cluster.processes.pop(name)
                        victim.kill()
                        victim.wait()
                    break
            deadline = time.monotonic() + 30  # until the next batch finds no reward service
            while (state := (await client.get_run(started.run_id)).state) != "waiting" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            states.append(state)
            cluster.add_service(ServiceSpec(kind="reward"), "reward-again")
            messages.extend([u.message async for u in client.watch(started.run_id)])
            return await client.get_run(started.run_id)
        finally:
            await client.close()

    final = asyncio.run(scenario())
    rows = check_nothing_lost(cluster, final, steps)
    assert states == ["waiting"]
    assert any("scoring failed on every reward replica" in message for message in messages)
    assert not any("then going on from" in message for message in messages)  # nothing rewound: went on where it was
    scorers = {step: {k for k in rows[step] if k.startswith("reward/samples_by/")} for step in rows}
    assert len(scorers[1]) == 2 and not scorers[steps] & scorers[1]  # the last steps scored by the new one
