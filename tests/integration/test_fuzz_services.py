"""Fuzzing the services' request handling: random and malformed requests get a clear status, never a crash.

Real processes (trainer, rollout, reward) with a tiny model loaded; hypothesis sends them streams of
tensor chunks with random names, dtypes, shapes, offsets, bytes and values, and random scoring batches.
Every answer must be OK or a refusal that names what is wrong (INVALID_ARGUMENT, FAILED_PRECONDITION),
and each service must still answer afterwards.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc import open_channel
from services.common.wire import DTYPES, tensor_bytes
from services.coordctl.control import CoordinatorClient
from tests.integration.test_grpo_run import run_config

ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
NAMES = ["prompt_ids", "prompt_lens", "response_ids", "response_lens", "old_logprobs", "advantages", "rollout_logprobs",
         "x", ""]
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
    from services.coordctl.local import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("fuzz") / "state")
    asyncio.run(cluster.start(timeout_s=120))

    async def prepare():
        client = CoordinatorClient(cluster.coordinator)
        try:
            run = await client.start_run(run_config(tiny_model, reverse_data, trainer__total_training_steps=1))
            async for _ in client.watch(run.run_id):
                pass
            return {s.kind: s.address for s in await client.list_services()}
        finally:
            await client.close()

    addresses = asyncio.run(prepare())
    yield addresses
    cluster.stop()


async def call(address: str, invoke) -> grpc.StatusCode:
    channel = open_channel(address)
    try:
        await invoke(channel)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        await channel.close()


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
