"""Faults under a multi-turn run, and hostile tools on a running env service, on real processes.

- An env service killed (kill -9) mid-episode, a rollout killed mid-trajectory, an env service shared by two runs
  that is full of one's episodes when the other starts; what a user checks afterwards:
  the run finished, and every step's samples file holds all its samples (train_batch_size x n), each
  trajectory whole. Each kill lands where the test needs it every time, whatever the machine's speed: the user's
  environment (tests/integration/plugins/user_env.py) holds the trajectories at the point of the fault until the
  test has killed the service, and the test waits for files the environment writes, never for a time.
- Tools (tests/integration/plugins/hostile_tools.py) that loop forever, fork (thousands), fill memory, look for
  the cluster's credentials, read the token file, write outside their /tmp, open a socket, or forge a pickled
  answer to their service; a call to an unknown tool; a 10 MB call: each answered (the model gets an error reply,
  or the Step is refused with its limit named) and the service answers afterwards; what a tool started ends when
  its worker is replaced, and when its env service is killed (kill -9). Each worker runs in a sandbox of its own
  (services/env/worker_sandbox.py); these tests need a host that can give it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml

from bench.faults import service_address
from meshrl.v1 import common_pb2, env_pb2
from services.coordctl.control import CoordinatorClient, RunStatus
from services.coordctl.local import LocalCluster, ServiceSpec
from services.common.auth import cluster_token
from services.common.sandbox import check_sandbox
from tests.integration.plugins.hostile_tools import secrets_probe
from tests.integration.test_agent_run import agent_config
from tests.integration.test_env_service import assistant, call, with_env, worker_pids
from tests.integration.test_faults import LogTail

PLUGINS = Path(__file__).resolve().parent / "plugins"
USER_ENV = PLUGINS / "user_env.py"
HOSTILE = PLUGINS / "hostile_tools.py"
PROMPTS, N, STEPS = 4, 2, 2
WAIT_S = 180  # longest the test waits for the run to reach the fault's point (pytest-timeout ends a test at 300 s)


def env_service(root: Path, environment: str, folder: Path, workers: int) -> ServiceSpec:
    """An env service hosting ``countdown``, the user's ``environment`` class sharing ``folder`` with the test;
    its calls may wait for the test (call_timeout_s well past WAIT_S). Its workers are unsandboxed (sandbox:
    false): the environment writes to the test's folder and names its service's process id."""
    config = root / f"env-{environment}.yaml"
    config.write_text(yaml.safe_dump({
        "environments": {"countdown": {"environment": f"{USER_ENV}:{environment}", "options": {"folder": str(folder)}}},
        "workers": workers, "call_timeout_s": 2 * WAIT_S, "sandbox": False}))
    return ServiceSpec(kind="env", settings=("--config", str(config)))


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"the run did not reach {what} within {WAIT_S} s"
        await asyncio.sleep(0.05)


def kill(cluster: LocalCluster, name: str) -> None:
    victim = cluster.processes.pop(name)
    victim.kill()  # SIGKILL
    victim.wait()


def fault_config(cluster: LocalCluster, chat_model: Path, data: Path, samples: str = "samples", **changes) -> str:
    """A multi-turn run whose model turns are one token each (every token stops a turn): none runs out of room,
    so every trajectory reaches its environment's first step. Its samples go to ``samples`` in the state folder."""
    from transformers import AutoTokenizer

    every_token = list(range(len(AutoTokenizer.from_pretrained(chat_model))))
    return agent_config(chat_model, data, cluster.state_dir / samples, data__train_batch_size=PROMPTS,
                        actor_rollout_ref__rollout__n=N, actor_rollout_ref__actor__ppo_mini_batch_size=PROMPTS,
                        actor_rollout_ref__rollout__stop_token_ids=every_token, **changes)


async def follow(cluster: LocalCluster, config: str, fault) -> tuple[RunStatus, list[str]]:
    """Start the run, ``await fault()`` (it kills something), then follow the run to its end: its status and
    messages."""
    client = CoordinatorClient(cluster.coordinator)
    try:
        started = await client.start_run(config)
        await fault()
        messages = [update.message async for update in client.watch(started.run_id)]
        return await client.get_run(started.run_id), messages
    finally:
        await client.close()


async def list_services(cluster: LocalCluster):
    client = CoordinatorClient(cluster.coordinator)
    try:
        return await client.list_services()
    finally:
        await client.close()


def check_every_sample_kept(cluster: LocalCluster, final: RunStatus, samples: str = "samples",
                            steps: int = STEPS) -> tuple[dict[int, dict], dict[int, list]]:
    """The run finished its ``steps``; each has its metrics and all its samples (in ``samples`` in the state
    folder), scored: (step -> metrics, step -> samples file records)."""
    assert final.state == "finished", final.error
    assert final.step == steps
    with sqlite3.connect(cluster.state_dir / "meshrl.db") as db:
        metrics = {step: json.loads(m) for step, m in
                   db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (final.run_id,))}
    assert sorted(metrics) == list(range(1, steps + 1))
    records = {step: [json.loads(line) for line in (cluster.state_dir / samples / f"{step}.jsonl").read_text()
                      .splitlines()] for step in metrics}
    for step in metrics:
        assert len(records[step]) == PROMPTS * N, step  # 0 samples lost
        assert sum(v for k, v in metrics[step].items() if k.startswith("reward/samples_by/")) == PROMPTS * N
        assert all(r["turns"] and r["turns"][0]["role"] == "model" for r in records[step])
    return metrics, records


def test_an_env_service_killed_mid_episode_its_episodes_start_again_on_the_other(make_cluster, chat_model,
                                                                                 reverse_data, tmp_path):
    """Two env services host StallsOnce: the first step of all, on whichever service gets it, writes that
    service's pid to a file and never returns, so when the test kills that service one of its episodes is
    inside a step (the others open on it lose their state with it). Those trajectories start again from their
    prompts on the other service."""
    folder = tmp_path / "stall"
    folder.mkdir()
    env = env_service(tmp_path, "StallsOnce", folder, workers=PROMPTS * N // 2)
    cluster = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"), env,
                           env)
    killed: dict[str, str] = {}

    async def kill_the_stalled_env() -> None:
        await wait_until((folder / "stalled").exists, "a step of an episode")
        pid = int((folder / "stalled").read_text())
        [name] = [name for name, process in cluster.processes.items() if process.pid == pid]
        killed.update(name=name, address=str(service_address(cluster, name)))
        kill(cluster, name)

    final, messages = asyncio.run(follow(cluster, fault_config(cluster, chat_model, reverse_data),
                                         kill_the_stalled_env))
    metrics, records = check_every_sample_kept(cluster, final)
    assert metrics[1]["agent/episodes_restarted"] >= 1
    restarted = [r for r in records[1] if r["restarts"] > 0]
    assert restarted, "no trajectory of step 1 says it started again"
    [survivor] = [service_address(cluster, name) for name in cluster.processes if name.startswith("env")]
    service_ids = {s.address: s.service_id for s in asyncio.run(list_services(cluster))}
    on_survivor = f"{service_ids[survivor]} ("  # a record's env_service: service id (meshrl version)
    assert all(r["env_service"].startswith(on_survivor) for r in restarted)
    assert all(r["env_service"].startswith(on_survivor) for r in records[2])
    assert any(f"env {killed['address']} left the run" in message for message in messages), messages


def test_a_rollout_killed_mid_trajectory_its_next_turns_are_sampled_on_the_other(make_cluster, chat_model,
                                                                                 reverse_data, tmp_path):
    """Every trajectory of step 1 holds in its environment's first step (HeldAfterFirstTurn) until the test has
    killed a rollout that sampled first turns; their second turns, from the same prefix, are sampled on the other
    rollout (after a Generate call to the killed one fails, or once the run has dropped it)."""
    folder = tmp_path / "hold"
    (folder / "held").mkdir(parents=True)
    env = env_service(tmp_path, "HeldAfterFirstTurn", folder, workers=PROMPTS * N)
    cluster = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="rollout"),
                            ServiceSpec(kind="reward"), env)
    rollouts = [name for name in cluster.processes if name.startswith("rollout")]
    killed: dict[str, str] = {}

    async def kill_a_rollout_between_turns() -> None:
        await wait_until(lambda: len(list((folder / "held").iterdir())) == PROMPTS * N,
                         "every trajectory's first step")
        # a rollout that sampled first turns (each "generating" is a Generate call of them)
        name = next(name for name in rollouts if any(e["event"] == "generating" for e in LogTail(cluster, name).read()))
        killed.update(name=name, address=str(service_address(cluster, name)))
        kill(cluster, name)
        (folder / "released").touch()

    final, _ = asyncio.run(follow(cluster, fault_config(cluster, chat_model, reverse_data),
                                  kill_a_rollout_between_turns))
    metrics, records = check_every_sample_kept(cluster, final)
    [kept] = [str(service_address(cluster, name)) for name in rollouts if name != killed["name"]]
    first_there = [r for r in records[1] if r["rollout"] == killed["address"]]
    assert first_there, "no trajectory of step 1 had its first turn sampled on the killed rollout"
    # their later turns came from the other rollout, the killed one gone
    assert any(len([t for t in r["turns"] if t["role"] == "model"]) >= 2 for r in first_there), first_there
    assert metrics[1][f"rollout/samples_by/{kept}"] >= sum(
        len([t for t in r["turns"] if t["role"] == "model"]) - 1 for r in first_there)
    assert f"rollout/samples_by/{killed['address']}" not in metrics[2]
    assert all(r["rollout"] == kept for r in records[2])


def test_two_runs_on_an_env_service_too_small_for_both_wait_for_its_workers_and_finish(make_cluster, chat_model,
                                                                                      reverse_data, tmp_path):
    """One env service with a worker for each trajectory of one run's step, shared by two runs (each on a trainer
    and rollout of its own): each counts only its own episodes, so together they ask it for twice its workers.
    Run a's trajectories all hold in their first steps (HeldAfterFirstTurn), every worker taken, when run b starts;
    once the service has refused a Reset of b's (busy), the test releases them. Both finish with every sample,
    and b counted the Resets refused. One step each: the refusals come in the first."""
    folder = tmp_path / "hold"
    (folder / "held").mkdir(parents=True)
    env = env_service(tmp_path, "HeldAfterFirstTurn", folder, workers=PROMPTS * N)
    cluster = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="trainer",
                                                                                                 group="b"),
                           ServiceSpec(kind="rollout", group="b"), ServiceSpec(kind="reward"), env)
    [env_name] = [name for name in cluster.processes if name.startswith("env")]
    config_a = fault_config(cluster, chat_model, reverse_data, "samples-a", trainer__experiment_name="a",
                            trainer__total_training_steps=1)
    config_b = fault_config(cluster, chat_model, reverse_data, "samples-b", trainer__experiment_name="b",
                            trainer__total_training_steps=1,
                            placement={"actor": "b", "critic": "b", "ref": "b", "rollout": "b"})

    def refused_busy(log: LogTail) -> bool:
        return any(e["event"] == "rpc_refused" and e["method"].endswith("/Reset") and e["code"] == "RESOURCE_EXHAUSTED"
                   for e in log.read())

    async def both() -> list[RunStatus]:
        client = CoordinatorClient(cluster.coordinator)
        try:
            run_a = await client.start_run(config_a)
            await wait_until(lambda: len(list((folder / "held").iterdir())) == PROMPTS * N, "every worker held by a")
            log = LogTail(cluster, env_name).from_now()
            run_b = await client.start_run(config_b)
            await wait_until(lambda: refused_busy(log), "a Reset of run b refused as busy")
            (folder / "released").touch()
            for run in (run_a, run_b):
                async for _ in client.watch(run.run_id):
                    pass
            return [await client.get_run(run.run_id) for run in (run_a, run_b)]
        finally:
            await client.close()

    final_a, final_b = asyncio.run(both())
    check_every_sample_kept(cluster, final_a, "samples-a", steps=1)
    metrics_b, _ = check_every_sample_kept(cluster, final_b, "samples-b", steps=1)
    assert metrics_b[1]["agent/env_busy_waits"] > 0


FORKS = 20  # processes the forking tool starts, then left running
WORKER_PROCESSES = 64  # each worker's bound on processes (worker_processes)
SANDBOX = check_sandbox()


def hostile_tool(name: str, cls: str, **config) -> dict:
    return {"class_name": f"{HOSTILE}:{cls}", "config": config,
            "tool_schema": {"type": "function", "function": {"name": name}}}


def hostile_config(root: Path) -> Path:
    """An env service's config hosting "hostile": hostile_tools.py's tools beside user_env.py's Lookup and the code
    interpreter; 2 s per call, 512 MiB of private memory and WORKER_PROCESSES processes per worker."""
    tools = [{"class_name": f"{USER_ENV}:Lookup", "config": {"table": {"a": 1}},
              "tool_schema": {"type": "function", "function": {"name": "lookup"}}},
             hostile_tool("spins", "Spins"), hostile_tool("forks", "Forks"), hostile_tool("hogs", "Hogs"),
             hostile_tool("credentials", "ReadsCredentials"), hostile_tool("reads_file", "ReadsFile"),
             hostile_tool("writes_file", "WritesFile"), hostile_tool("connects", "Connects"),
             hostile_tool("forges", "ForgesAnswer"), hostile_tool("secrets", "SearchesSecrets"),
             hostile_tool("detaches", "Detaches"),
             {"class_name": "meshrl.code_interpreter", "config": {"default_timeout": 10},
              "tool_schema": {"type": "function", "function": {"name": "code_interpreter"}}}]
    config = root / "env.yaml"
    config.write_text(yaml.safe_dump({"environments": {"hostile": {"tools": tools}}, "workers": 2,
                                      "call_timeout_s": 2.0, "worker_memory_mb": 512,
                                      "worker_processes": WORKER_PROCESSES}))
    return config


@pytest.fixture(scope="module")
def hostile_env(tmp_path_factory):
    """Coordinator and one env service hosting "hostile" (``hostile_config``)."""
    if SANDBOX is not None:
        pytest.skip(f"this host cannot sandbox env workers: {SANDBOX}")
    root = tmp_path_factory.mktemp("hostile")
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="env", settings=("--config", str(hostile_config(root)))),))
    asyncio.run(cluster.start(timeout_s=90))
    yield cluster
    cluster.stop()


def steps(coordinator: str, episode_id: str, messages: list[str]) -> list[env_pb2.StepResponse]:
    """Open an episode of "hostile", step it with each of ``messages`` in turn, close it: the steps' answers."""
    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id=episode_id, row_json="{}", env_name="hostile"), timeout=30)
        try:
            return [await stub.Step(env_pb2.StepRequest(episode_id=episode_id, message=assistant(message)),
                                    timeout=60) for message in messages]
        finally:
            await stub.Close(env_pb2.CloseRequest(episode_id=episode_id), timeout=30)
    return with_env(coordinator, episode)


def named(name: str) -> list[int]:
    """The host's running processes (zombies, ended but not yet reaped, excluded) whose argv[0] is ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            running = entry.name.isdigit() and (entry / "stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
            if running and (entry / "cmdline").read_bytes().split(b"\0")[0] == name.encode():
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


def wait_for(condition, what: str, seconds: float = 60) -> None:
    """Wait until ``condition()`` holds (the kernel delivering signals, processes starting): not a timing test."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.1)


def end_leftovers(name: str) -> None:
    """Kill what the forking tool started that still runs (a failed test's mess), its processes only."""
    for pid in named(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def forks(count: int, name: str) -> str:
    return call("forks", {"count": count, "name": name})


def test_tools_that_loop_fork_or_fill_memory_get_error_replies_and_what_they_started_ends(hostile_env):
    """The forking tool's processes run on after its call; the next call spins past its timeout, the worker is
    replaced, and every process of its sandbox ends with it."""
    name = f"forked-{uuid.uuid4().hex[:12]}"

    async def episode(stub):
        async def step(message: str) -> env_pb2.StepResponse:
            return await stub.Step(env_pb2.StepRequest(episode_id="contained", message=assistant(message)), timeout=60)
        await stub.Reset(env_pb2.ResetRequest(episode_id="contained", row_json="{}", env_name="hostile"), timeout=30)
        try:
            fork = await step(forks(FORKS, name))
            await asyncio.to_thread(wait_for, lambda: len(named(name)) == FORKS, f"{FORKS} processes named {name}")
            return fork, await step(call("spins", {})), await step(call("hogs", {})), await step(
                call("lookup", {"key": "a"}))
        finally:
            await stub.Close(env_pb2.CloseRequest(episode_id="contained"), timeout=30)

    try:
        fork, spin, hog, after = with_env(hostile_env.coordinator, episode)
        assert fork.messages[0].content == f"started {FORKS}"
        assert "error: tool spins did not return within 2.0 s" in spin.messages[0].content
        wait_for(lambda: not named(name), "the forked processes ending with their worker")
        [hogged] = hog.messages
        assert hogged.content.startswith("error: tool hogs failed: MemoryError"), hogged.content
        assert (after.messages[0].content, after.reward) == ("1", 0.5)
    finally:
        end_leftovers(name)
    info = with_env(hostile_env.coordinator, lambda stub: stub.Info(common_pb2.InfoRequest(), timeout=10))
    assert info.open_episodes == 0 and info.workers == 2


def test_what_a_tool_started_and_detached_ends_with_its_episode_and_its_worker_stays(hostile_env):
    """A daemon (a session of its own, its parent gone) started by a tool runs until its episode closes, and no
    longer; the worker that held the episode is not replaced for it."""
    name = f"detached-{uuid.uuid4().hex[:12]}"
    [service] = [process for key, process in hostile_env.processes.items() if key.startswith("env")]
    workers = sorted(worker_pids(service.pid))

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="detached", row_json="{}", env_name="hostile"), timeout=30)
        try:
            step = await stub.Step(env_pb2.StepRequest(episode_id="detached", message=assistant(
                call("detaches", {"name": name}))), timeout=60)
            await asyncio.to_thread(wait_for, lambda: len(named(name)) == 1, f"a process named {name}")
            return step
        finally:
            await stub.Close(env_pb2.CloseRequest(episode_id="detached"), timeout=30)

    try:
        assert with_env(hostile_env.coordinator, episode).messages[0].content == "detached"
        wait_for(lambda: not named(name), "the detached process ending with its episode", seconds=10)
        assert sorted(worker_pids(service.pid)) == workers
    finally:
        end_leftovers(name)


def test_a_tool_forking_thousands_of_processes_is_stopped_at_its_workers_bound(hostile_env):
    """5000 forks: those past the worker's bound (worker_processes) fail, the model is told; the processes started
    end when a spinning call has the worker replaced, and the next call is answered."""
    name = f"bomb-{uuid.uuid4().hex[:12]}"
    try:
        bomb, _, after = steps(hostile_env.coordinator, "bomb", [forks(5000, name), call("spins", {}),
                                                                 call("lookup", {"key": "a"})])
        content = bomb.messages[0].content
        assert content.startswith("error: tool forks failed: OSError: fork "), content
        assert "Resource temporarily unavailable" in content, content
        started = int(content.split("fork ")[1].split()[0]) - 1
        assert 0 < started <= WORKER_PROCESSES, content
        wait_for(lambda: not named(name), "the forked processes ending with their worker")
        assert after.messages[0].content == "1"
    finally:
        end_leftovers(name)


def test_a_tool_finds_no_cluster_credentials_in_its_environment(hostile_env):
    assert os.environ.get("MESHRL_TOKEN_FILE"), "the cluster runs with a token file, named in its environment"
    [found] = steps(hostile_env.coordinator, "credentials", [call("credentials", {})])
    assert json.loads(found.messages[0].content) == {}


def secrets_seen_by_tools(coordinator: str, secrets: list[str], paths: list[str]) -> list[str]:
    """What a user's tool in a sandboxed worker, and code it has the code interpreter run, see of ``secrets`` and
    ``paths`` (hostile_tools.secrets_seen): both replies, each a JSON list (empty where nothing is seen)."""
    arguments = {"secrets": secrets, "paths": paths}
    [step] = steps(coordinator, f"secrets-{uuid.uuid4().hex[:8]}", [
        call("secrets", arguments) + call("code_interpreter", {"code": secrets_probe(secrets, paths)})])
    return [message.content for message in step.messages]


def test_a_tool_and_its_code_see_nothing_of_a_token_given_as_a_file(hostile_env):
    """The cluster's token in a file (MESHRL_TOKEN_FILE, in the state folder, as coordctl --local makes it): neither
    the token, nor the file, its path, the state folder or the variables' names show inside either sandbox."""
    token_file = Path(os.environ["MESHRL_TOKEN_FILE"])
    state = hostile_env.state_dir
    assert token_file.parent == state and token_file.read_text().strip(), "the cluster has a token in its file"
    secrets = [token_file.read_text().strip(), str(token_file), str(state), "MESHRL_"]
    paths = [str(token_file), str(state), str(state / "ports"), str(state / "logs")]
    assert secrets_seen_by_tools(hostile_env.coordinator, secrets, paths) == ["[]", "[]\n"]


def test_a_tool_and_its_code_see_nothing_of_a_token_given_as_a_variable(tmp_path, monkeypatch):
    """The cluster's token in MESHRL_TOKEN, which the env service inherits: it shows inside neither sandbox, nor
    does the state folder or any variable's name."""
    if SANDBOX is not None:
        pytest.skip(f"this host cannot sandbox env workers: {SANDBOX}")
    token = f"token-{uuid.uuid4().hex}"
    monkeypatch.delenv("MESHRL_TOKEN_FILE", raising=False)
    monkeypatch.setenv("MESHRL_TOKEN", token)
    cluster_token.cache_clear()
    cluster = LocalCluster(tmp_path / "state", (ServiceSpec(kind="env", settings=("--config",
                                                                             str(hostile_config(tmp_path)))),))
    try:
        asyncio.run(cluster.start(timeout_s=90))
        assert cluster.own_token_file is None, "the services run with the variable's token"
        secrets = [token, str(cluster.state_dir), "MESHRL_"]
        paths = [str(cluster.state_dir), str(cluster.state_dir / "ports"), str(cluster.state_dir / "logs")]
        assert secrets_seen_by_tools(cluster.coordinator, secrets, paths) == ["[]", "[]\n"]
    finally:
        cluster.stop()
        monkeypatch.undo()
        cluster_token.cache_clear()


def test_an_unknown_tool_and_a_10_mb_call_are_answered_and_the_service_keeps_answering(hostile_env):
    cluster = hostile_env
    huge = call("lookup", {"key": "x" * 10_000_000})

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="bounded", row_json="{}", env_name="hostile"), timeout=30)
        unknown = await stub.Step(env_pb2.StepRequest(episode_id="bounded", message=assistant(call("nope", {}))),
                                  timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Step(env_pb2.StepRequest(episode_id="bounded", message=assistant(huge)), timeout=30)
        after = await stub.Step(env_pb2.StepRequest(episode_id="bounded", message=assistant(
            call("lookup", {"key": "a"}))), timeout=30)
        await stub.Close(env_pb2.CloseRequest(episode_id="bounded"), timeout=30)
        return unknown, refused.value, after

    unknown, refused, after = with_env(cluster.coordinator, episode)
    assert unknown.messages[0].content.startswith("unknown tool 'nope'; tools: code_interpreter, connects"), unknown
    assert not unknown.done and json.loads(unknown.info_json)["calls"] == [{"tool": "", "outcome": "error"}]
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_message_chars" in refused.details() and str(len(huge)) in refused.details()
    assert after.messages[0].content == "1"


@pytest.mark.parametrize("tool", ["reads_file", "writes_file", "connects"])
def test_a_tool_cannot_read_the_token_file_write_outside_its_folder_or_open_a_socket(hostile_env, tool, tmp_path):
    token_file = Path(os.environ["MESHRL_TOKEN_FILE"])
    assert token_file.read_text(), "the cluster has a token in its file"
    written = tmp_path / "written"
    arguments = {"reads_file": {"path": str(token_file)}, "writes_file": {"path": str(written)},
                 "connects": {"address": hostile_env.coordinator}}[tool]
    [step] = steps(hostile_env.coordinator, tool, [call(tool, arguments)])
    refused = {"reads_file": "FileNotFoundError", "writes_file": "FileNotFoundError",
               "connects": "ConnectionRefusedError"}[tool]
    assert step.messages[0].content.startswith(f"error: tool {tool} failed: {refused}"), step.messages[0].content
    assert not written.exists()


def test_a_forged_pickle_from_a_worker_runs_nothing_in_the_service(hostile_env, tmp_path):
    """The service reads its workers' answers as JSON: a pickle that would create a file is a malformed answer
    (an error reply, the worker replaced), and the file is not created."""
    created = tmp_path / "created"
    forged, after = steps(hostile_env.coordinator, "forged", [call("forges", {"path": str(created)}),
                                                             call("lookup", {"key": "a"})])
    assert "its worker sent a malformed answer" in forged.messages[0].content, forged.messages[0].content
    assert not created.exists()
    assert after.messages[0].content == "1"


def test_what_a_tool_started_ends_when_its_env_service_is_killed(tmp_path):
    """kill -9 of the env service: the tool's processes, running on after its call, end with the service's
    workers (bwrap's --die-with-parent: the sandbox's pid 1 goes, and its pid namespace with it)."""
    if SANDBOX is not None:
        pytest.skip(f"this host cannot sandbox env workers: {SANDBOX}")
    cluster = LocalCluster(tmp_path / "state", (ServiceSpec(kind="env", settings=("--config",
                                                                             str(hostile_config(tmp_path)))),))
    name = f"orphan-{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(cluster.start(timeout_s=90))

        async def fork_and_hold(stub):  # the episode stays open: its worker lives until the service dies
            await stub.Reset(env_pb2.ResetRequest(episode_id="held", row_json="{}", env_name="hostile"), timeout=30)
            return await stub.Step(env_pb2.StepRequest(episode_id="held", message=assistant(forks(3, name))),
                                   timeout=60)

        assert with_env(cluster.coordinator, fork_and_hold).messages[0].content == "started 3"
        wait_for(lambda: len(named(name)) == 3, f"3 processes named {name}")
        [env] = [service for service in cluster.processes if service.startswith("env")]
        kill(cluster, env)
        wait_for(lambda: not named(name), "the tool's processes ending with their env service")
    finally:
        end_leftovers(name)
        cluster.stop()
