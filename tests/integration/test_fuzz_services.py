"""Fuzzing the services' request handling: random and malformed requests get a clear status, never a crash.

Real processes (trainer, rollout, reward) with a tiny model loaded; hypothesis sends them streams of
tensor chunks with random names, dtypes, shapes, offsets, bytes and values, and random scoring batches.
Every answer must be OK or a refusal that names what is wrong (INVALID_ARGUMENT, FAILED_PRECONDITION),
and each service must still answer afterwards.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from meshrl.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2,
                       rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc)
from services.common.auth import cluster_token, token_interceptors
from services.common.cli import REFUSED_EXIT_CODE
from services.common.rpc import open_channel
from services.common.wire import DTYPES, batch_to_chunks, tensor_bytes
from services.coordctl.control import CoordinatorClient
from tests.integration.test_grpo_run import run_config

ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
NAMES = ["prompt_ids", "prompt_lens", "response_ids", "response_lens", "old_logprobs", "advantages", "rollout_logprobs",
         "x", ""]
STREAM_TIMEOUT_S = 4.0  # the trainer's request_stream_timeout_s here
WRITE_TIMEOUT_S = 2.0  # the rollout's response_write_timeout_s here
FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@st.composite
def chunks(draw):
    """A list of TensorChunks: mostly well-formed tensors with odd values, sometimes garbage fields."""
    out = []
    for name in draw(st.lists(st.sampled_from(NAMES), max_size=6)):
        dtype = draw(st.sampled_from(sorted(DTYPES) + ["complex64", ""]))
        shape = draw(st.lists(st.integers(-1, 6), max_size=2))
        if dtype in DTYPES and all(d >= 0 for d in shape) and draw(st.booleans()):
            values = torch.randint(-5, 200, shape).to(DTYPES[dtype])
            data = tensor_bytes(values)
        else:
            data = draw(st.binary(max_size=64))
        out.append(common_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, data=data,
                                          offset=draw(st.sampled_from([0, 0, 0, 3, -1]))))
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_model, reverse_data):
    """The cluster, with a run finished on it so that the trainer and rollout hold a model."""
    from services.coordctl.local import LocalCluster, ServiceSpec

    services = (ServiceSpec(kind="trainer", settings=(f"request_stream_timeout_s={STREAM_TIMEOUT_S}",)),
                ServiceSpec(kind="rollout", settings=(f"response_write_timeout_s={WRITE_TIMEOUT_S}",)),
                ServiceSpec(kind="reward"))
    cluster = LocalCluster(tmp_path_factory.mktemp("fuzz") / "state", services)
    asyncio.run(cluster.start(timeout_s=120))

    async def prepare():
        client = CoordinatorClient(cluster.coordinator)
        try:
            run = await client.start_run(run_config(tiny_model, reverse_data, trainer__total_training_steps=1))
            async for _ in client.watch(run.run_id):
                pass
            return {**{s.kind: s.address for s in await client.list_services()}, "coordinator": cluster.coordinator,
                    "rollout_metrics": f"127.0.0.1:{cluster.metrics_ports['rollout'][1]}"}
        finally:
            await client.close()

    addresses = asyncio.run(prepare())
    yield addresses
    cluster.stop()


async def answer(address: str, invoke) -> tuple[grpc.StatusCode, str]:
    """The status and details ``invoke(channel)`` ends with."""
    channel = open_channel(address)
    try:
        await invoke(channel)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    finally:
        await channel.close()


async def call(address: str, invoke) -> grpc.StatusCode:
    return (await answer(address, invoke))[0]


async def info(address: str, stub_class) -> None:
    channel = open_channel(address)
    try:
        await stub_class(channel).Info(common_pb2.InfoRequest(), timeout=10)
    finally:
        await channel.close()


@FUZZ
@given(parts=st.lists(chunks(), min_size=1, max_size=3), n=st.integers(-1, 3), temperature=st.floats(-1, 2),
       top_p=st.floats(-0.5, 1.5), max_new=st.integers(-1, 4))
def test_rollout_generate_refuses_bad_input_clearly(loaded, parts, n, temperature, top_p, max_new):
    params = rollout_pb2.SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new, seed=1)

    async def invoke(channel):
        requests = [rollout_pb2.GenerateRequest(params=params if i == 0 else None, chunks=c) for i, c in enumerate(parts)]
        async for _ in rollout_pb2_grpc.RolloutStub(channel).Generate(iter(requests), timeout=30):
            pass

    assert asyncio.run(call(loaded["rollout"], invoke)) in ACCEPTED
    asyncio.run(info(loaded["rollout"], rollout_pb2_grpc.RolloutStub))


@FUZZ
@given(parts=st.lists(chunks(), min_size=1, max_size=3), method=st.sampled_from(["ComputeLogProbs", "UpdateActor",
                                                                                 "ComputeValues", "UpdateCritic"]),
       role=st.sampled_from(["", "actor", "ref", "critic"]))
def test_trainer_refuses_bad_batches_clearly(loaded, parts, method, role):
    async def invoke(channel):
        stub = trainer_pb2_grpc.TrainerStub(channel)
        requests = iter([trainer_pb2.BatchRequest(step=1, chunks=c, role=role) for c in parts])
        if method in ("ComputeLogProbs", "ComputeValues"):
            async for _ in getattr(stub, method)(requests, timeout=30):
                pass
        else:
            await getattr(stub, method)(requests, timeout=30)

    assert asyncio.run(call(loaded["trainer"], invoke)) in ACCEPTED
    asyncio.run(info(loaded["trainer"], trainer_pb2_grpc.TrainerStub))


@FUZZ
@given(samples=st.lists(st.tuples(st.sampled_from(["openai/gsm8k", "lighteval/MATH", "meshrl/reverse", "format",
                                                   "exact_match", "", "nope"]),
                                  st.text(max_size=200), st.text(max_size=20),
                                  st.sampled_from(["", "{}", "[1]", "not json", '{"index": 3}'])), max_size=8))
def test_reward_scores_or_refuses_any_batch(loaded, samples):
    async def invoke(channel):
        request = reward_pb2.ScoreRequest(samples=[
            reward_pb2.Sample(data_source=s, response=r, ground_truth=g, extra_info_json=e) for s, r, g, e in samples])
        reply = await reward_pb2_grpc.RewardStub(channel).Score(request, timeout=30)
        assert len(reply.scores) == len(samples)

    assert asyncio.run(call(loaded["reward"], invoke)) in ACCEPTED
    asyncio.run(info(loaded["reward"], reward_pb2_grpc.RewardStub))


def generate_requests(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, stop=(), prompts=1, prompt_len=1):
    """The request stream of a Generate call of ``prompts`` prompts of ``prompt_len`` tokens with these sampling
    parameters."""
    params = rollout_pb2.SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                        seed=1, stop_token_ids=list(stop))
    batch = {"prompt_ids": torch.full((prompts * prompt_len,), 5, dtype=torch.int64),
             "prompt_lens": torch.full((prompts,), prompt_len, dtype=torch.int64)}
    return [rollout_pb2.GenerateRequest(params=params if i == 0 else None, chunks=c)
            for i, c in enumerate(batch_to_chunks(batch))]


def generate(**sampling):
    """A Generate call (``generate_requests`` says what ``sampling`` may hold), read to its end."""
    async def invoke(channel):
        requests = generate_requests(**sampling)
        async for _ in rollout_pb2_grpc.RolloutStub(channel).Generate(iter(requests), timeout=30):
            pass

    return invoke


def unary(stub_class, method: str, request):
    async def invoke(channel):
        await getattr(stub_class(channel), method)(request, timeout=30)

    return invoke


DEEP_YAML = "a: " + "[" * 30_000 + "]" * 30_000
PYTHON_TAG = 'a: !!python/object/apply:os.system ["echo ran > {marker}"]'
JOIN_FOREVER = common_pb2.JoinChannelRequest(channel_id="c", backend="gloo", rank=0, world_size=2,
                                             rendezvous=b"127.0.0.1:1", timeout_s=float("inf"))
HOSTILE = [  # (what, service, invoke, the status it must get, a word its details must hold)
    ("n 2^31-1", "rollout", generate(n=2**31 - 1), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_n"),
    ("n x max tokens", "rollout", generate(n=1000, max_new_tokens=65_536, prompts=2),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "max_tokens_per_call"),
    ("max tokens 2^31-1", "rollout", generate(max_new_tokens=2**31 - 1), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "max_new_tokens"),
    ("temperature 1e-300", "rollout", generate(temperature=1e-300), grpc.StatusCode.INVALID_ARGUMENT,
     "params.temperature"),
    ("temperature nan", "rollout", generate(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT,
     "params.temperature"),
    ("top_p nan", "rollout", generate(top_p=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "params.top_p"),
    ("a prompt longer than the model takes", "rollout", generate(prompt_len=1000), grpc.StatusCode.INVALID_ARGUMENT,
     "the model takes"),
    ("2,000 stop tokens", "rollout", generate(stop=range(2000)), grpc.StatusCode.INVALID_ARGUMENT,
     "stop_token_ids"),
    ("rollout JoinChannel timeout inf", "rollout", unary(rollout_pb2_grpc.RolloutStub, "JoinChannel", JOIN_FOREVER),
     grpc.StatusCode.INVALID_ARGUMENT, "timeout_s"),
    ("ReceiveWeights timeout nan", "rollout", unary(rollout_pb2_grpc.RolloutStub, "ReceiveWeights",
                                                    rollout_pb2.ReceiveWeightsRequest(channel_id="c",
                                                                                      timeout_s=float("nan"))),
     grpc.StatusCode.INVALID_ARGUMENT, "timeout_s"),
    ("rollout InitRun of a missing folder", "rollout",
     unary(rollout_pb2_grpc.RolloutStub, "InitRun", rollout_pb2.RolloutInitRequest(run_id="x", model_path="/no/such")),
     grpc.StatusCode.NOT_FOUND, "model_path"),
    ("rollout InitRun of a folder without a model", "rollout",
     unary(rollout_pb2_grpc.RolloutStub, "InitRun", rollout_pb2.RolloutInitRequest(run_id="x", model_path="/")),
     grpc.StatusCode.INVALID_ARGUMENT, "config.json"),
    ("rollout InitRun dtype os", "rollout",
     unary(rollout_pb2_grpc.RolloutStub, "InitRun", rollout_pb2.RolloutInitRequest(run_id="x", model_path="/",
                                                                                   dtype="os")),
     grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ("trainer InitRun nested 30,000 deep", "trainer",
     unary(trainer_pb2_grpc.TrainerStub, "InitRun", trainer_pb2.TrainerInitRequest(run_id="x",
                                                                                   run_config_yaml=DEEP_YAML)),
     grpc.StatusCode.INVALID_ARGUMENT, "run_config_yaml"),
    ("trainer JoinChannel timeout inf", "trainer", unary(trainer_pb2_grpc.TrainerStub, "JoinChannel", JOIN_FOREVER),
     grpc.StatusCode.INVALID_ARGUMENT, "timeout_s"),
    ("StartRun nested 30,000 deep", "coordinator",
     unary(coordinator_pb2_grpc.CoordinatorStub, "StartRun", coordinator_pb2.StartRunRequest(config_yaml=DEEP_YAML)),
     grpc.StatusCode.INVALID_ARGUMENT, "nests deeper"),
    ("StartRun of 10 MB of YAML", "coordinator",
     unary(coordinator_pb2_grpc.CoordinatorStub, "StartRun", coordinator_pb2.StartRunRequest(
         config_yaml="a: [" + "1, " * 3_000_000 + "1]")),
     grpc.StatusCode.INVALID_ARGUMENT, "characters long"),
    ("StartRun temperature 1e-300", "coordinator",
     unary(coordinator_pb2_grpc.CoordinatorStub, "StartRun", coordinator_pb2.StartRunRequest(
         config_yaml="actor_rollout_ref: {rollout: {temperature: 1.0e-300}}")),
     grpc.StatusCode.INVALID_ARGUMENT, "actor_rollout_ref.rollout.temperature"),
]


@pytest.mark.parametrize("what, kind, invoke, expected, word", HOSTILE, ids=[row[0] for row in HOSTILE])
def test_hostile_requests_are_refused_at_the_edge(loaded, what, kind, invoke, expected, word):
    code, details = asyncio.run(answer(loaded[kind], invoke))
    assert (code, word in details) == (expected, True), details


def damaged_copies(tiny_model: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    """Copies of the tiny model whose weights the trainer cannot load: (folder, what its refusal must name)."""
    name = "model.layers.0.mlp.up_proj.weight"
    truncated, wrong_shape = folder / "truncated", folder / "wrong_shape"
    for copy in (truncated, wrong_shape):
        shutil.copytree(tiny_model, copy)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    tensors = load_file(wrong_shape / "model.safetensors")
    tensors[name] = torch.zeros(tensors[name].shape[0], 7)
    save_file(tensors, wrong_shape / "model.safetensors", metadata={"format": "pt"})
    return {"truncated": (truncated, f"{weights}: tensor '"),
            "wrong shape": (wrong_shape, f"{wrong_shape / 'model.safetensors'}: tensor '{name}' has shape")}


def log_probs(trainer) -> list[float]:
    """The actor's logprobs of one short sequence."""
    batch = {"prompt_ids": torch.tensor([5, 6], dtype=torch.int64), "prompt_lens": torch.tensor([2]),
             "response_ids": torch.tensor([7, 8], dtype=torch.int64), "response_lens": torch.tensor([2])}

    async def read():
        requests = iter([trainer_pb2.BatchRequest(step=1, role="actor", chunks=c) for c in batch_to_chunks(batch)])
        return [chunk async for reply in trainer.ComputeLogProbs(requests, timeout=30) for chunk in reply.chunks]

    return read()


def test_a_failed_init_run_leaves_the_service_as_it_was(loaded, tmp_path, tiny_model, reverse_data):
    """The rollout keeps serving the model it held, also when the new model fails while it loads; the trainer keeps
    its run, whose weights still compute, when the new run's model folder has no model, weights cut short or of
    the wrong shape (named, with the file), and a `!!python` tag runs nothing."""
    marker, broken = tmp_path / "ran", tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    for tokenizer_file in tiny_model.glob("*token*"):
        shutil.copy(tokenizer_file, broken)
    damaged = {**damaged_copies(tiny_model, tmp_path), "no model": (broken, "config.json")}

    async def check():
        channel = open_channel(loaded["rollout"])
        trainer_channel = open_channel(loaded["trainer"])
        rollout, trainer = rollout_pb2_grpc.RolloutStub(channel), trainer_pb2_grpc.TrainerStub(trainer_channel)
        try:
            held = await rollout.Info(common_pb2.InfoRequest(), timeout=10)
            trained = await trainer.Info(common_pb2.InfoRequest(), timeout=10)
            for request in (rollout_pb2.RolloutInitRequest(run_id="other", model_path="/no/such"),
                            rollout_pb2.RolloutInitRequest(run_id="other", model_path="/"),
                            rollout_pb2.RolloutInitRequest(run_id="other", model_path=str(broken))):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await rollout.InitRun(request, timeout=30)
                assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
                assert "model_path" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await trainer.InitRun(trainer_pb2.TrainerInitRequest(
                    run_id="other", run_config_yaml=PYTHON_TAG.format(marker=marker)), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "run_config_yaml" in refused.value.details()
            for what, (folder, named) in damaged.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await trainer.InitRun(trainer_pb2.TrainerInitRequest(
                        run_id="other", run_config_yaml=run_config(folder, reverse_data), roles=["actor", "ref"]),
                        timeout=60)
                assert (refused.value.code(), named in refused.value.details()) == (
                    grpc.StatusCode.INVALID_ARGUMENT, True), (what, refused.value.details())
            assert [(chunk.name, list(chunk.shape)) for chunk in await log_probs(trainer)] == [("logprobs", [2])]
            after = await rollout.Info(common_pb2.InfoRequest(), timeout=10)
            assert (after.run_id, after.details["model_path"]) == (held.run_id, held.details["model_path"])
            assert (await trainer.Info(common_pb2.InfoRequest(), timeout=10)).run_id == trained.run_id
        finally:
            await channel.close()
            await trainer_channel.close()
        assert await call(loaded["rollout"], generate()) == grpc.StatusCode.OK

    asyncio.run(check())
    assert not marker.exists()


def resident_bytes(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def test_a_request_stream_over_its_limit_is_refused_and_not_held(loaded):
    """A 512 MiB Generate stream is refused for passing the rollout's 64 MiB limit; nothing past the limit is held.

    Measured so that allocator and load noise cannot cross the bound: a first refused stream warms the rollout up
    (its allocator and gRPC's buffers take the room any such call takes, and keep it), then two more may grow its
    resident set by less than half of what one stream would hold whole (a rollout that held them would grow by
    a GiB)."""
    def stream():
        shape = [512 << 17]  # int64: 512 MiB
        for index in range(512):
            chunk = common_pb2.TensorChunk(name="prompt_ids", dtype="int64", shape=shape, offset=index << 20,
                                           data=bytes(1 << 20))
            yield rollout_pb2.GenerateRequest(params=rollout_pb2.SamplingParams(n=1) if index == 0 else None,
                                              chunks=[chunk])

    async def invoke(channel):
        async for _ in rollout_pb2_grpc.RolloutStub(channel).Generate(stream(), timeout=60):
            pass

    async def pid():
        channel = open_channel(loaded["rollout"])
        try:
            return (await rollout_pb2_grpc.RolloutStub(channel).Info(common_pb2.InfoRequest(), timeout=10)).identity.pid
        finally:
            await channel.close()

    rollout_pid = asyncio.run(pid())
    code, details = asyncio.run(answer(loaded["rollout"], invoke))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_request_bytes" in details, details
    before = resident_bytes(rollout_pid)
    for _ in range(2):
        code, details = asyncio.run(answer(loaded["rollout"], invoke))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_request_bytes" in details, details
    assert resident_bytes(rollout_pid) - before < 256 << 20


def test_a_request_stream_that_never_ends_meets_the_server_deadline(loaded):
    """A client with no deadline of its own that never finishes its UpdateActor stream is ended by the trainer."""
    async def never_ending():
        yield trainer_pb2.BatchRequest(step=1)
        await asyncio.Event().wait()

    async def invoke(channel):
        await trainer_pb2_grpc.TrainerStub(channel).UpdateActor(never_ending())

    started = time.monotonic()
    code, details = asyncio.run(asyncio.wait_for(answer(loaded["trainer"], invoke), 60))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "request_stream_timeout_s" in details, details
    assert STREAM_TIMEOUT_S <= time.monotonic() - started < STREAM_TIMEOUT_S + 20


def test_a_run_over_a_rollouts_limits_is_refused_at_start_run(loaded, tiny_model, reverse_data):
    """A run whose rollout.n is over the registered rollout's max_n is refused by StartRun, naming the key and the
    limit, before anything starts (it used to fail at its first Generate)."""
    config_yaml = run_config(tiny_model, reverse_data, actor_rollout_ref__rollout__n=2048)
    code, details = asyncio.run(answer(loaded["coordinator"], unary(
        coordinator_pb2_grpc.CoordinatorStub, "StartRun", coordinator_pb2.StartRunRequest(config_yaml=config_yaml))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "actor_rollout_ref.rollout.n = 2048" in details and "max_n = 1024" in details, details


def rpcs_ended(metrics_address: str, method: str, code: str) -> float:
    """How many ``method`` calls the service's /metrics counts as ended with ``code``."""
    scrape = urllib.request.Request(f"http://{metrics_address}/metrics",
                                    headers={"Authorization": f"Bearer {cluster_token()}"})  # the cluster's token
    text = urllib.request.urlopen(scrape, timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshrl_rpc_duration_seconds_count"
               and (sample.labels["grpc_method"], sample.labels["grpc_code"]) == (method, code))


def test_a_response_stream_its_client_stops_reading_is_ended_by_the_service(loaded):
    """A client that opens a Generate whose answer (about 200 KB) is more than its flow-control window and never
    reads it holds the rollout's call for response_write_timeout_s at most: /metrics then counts the Generate
    as DEADLINE_EXCEEDED, and the rollout serves the next call."""
    before = rpcs_ended(loaded["rollout_metrics"], "Generate", "DEADLINE_EXCEEDED")

    async def stall():
        small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        channel = grpc.aio.insecure_channel(loaded["rollout"], options=small_window, interceptors=token_interceptors())
        stalled = rollout_pb2_grpc.RolloutStub(channel).Generate(iter(generate_requests(n=8, max_new_tokens=128,
                                                                                       prompts=16)))
        started = time.monotonic()
        while rpcs_ended(loaded["rollout_metrics"], "Generate", "DEADLINE_EXCEEDED") == before:
            assert time.monotonic() - started < WRITE_TIMEOUT_S + 40, "the rollout still holds the call"
            await asyncio.sleep(0.2)
        stalled.cancel()
        await channel.close()

    asyncio.run(stall())
    assert asyncio.run(call(loaded["rollout"], generate())) == grpc.StatusCode.OK


def test_health_watch_answers_serving_on_every_service(loaded):
    async def watch(address):
        channel = open_channel(address)
        try:
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            first = await stream.read()
            stream.cancel()
            return first.status
        finally:
            await channel.close()

    for kind in ("coordinator", "trainer", "rollout", "reward"):
        assert asyncio.run(watch(loaded[kind])) == health_pb2.HealthCheckResponse.SERVING, kind


def test_a_service_whose_port_is_taken_exits_2_naming_it(tmp_path):
    """(A taken metrics_port takes the same way out: test_telemetry checks its message.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        finished = subprocess.run([sys.executable, "-m", "services.coordinator", "host=127.0.0.1",
                                   f"state_dir={tmp_path}", f"port={port}"], capture_output=True, text=True, timeout=60)
    assert finished.returncode == REFUSED_EXIT_CODE, finished.stderr
    assert f"127.0.0.1:{port} (setting port)" in finished.stderr and "Traceback" not in finished.stderr, \
        finished.stderr
