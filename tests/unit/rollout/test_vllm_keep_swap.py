"""CPU tests of the vLLM engine's weight swaps around the requests in flight (services/rollout/vllm_engine.py).

vLLM cannot run here, so a stand-in for AsyncLLM records what the engine asks of it, in order: the worker calls
(``collective_rpc``), the freeze and the resume. tests/gpu/test_keep_swap_vllm.py runs the same on vLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.rollout.config import RolloutServiceConfig
from services.rollout.swap import GenerationCall
from services.rollout.vllm_engine import VLLMEngine


class StandIn:
    """What the engine asks of AsyncLLM: the workers receive at once and swap in version ``version``, or fail."""

    def __init__(self, version: int, apply_fails: bool = False):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))
        self.engine_core = self
        self.version, self.apply_fails, self.asked = version, apply_fails, []

    async def collective_rpc(self, method, timeout=None, args=()):
        self.asked.append(method)
        if method == "meshrl_wait_received":
            return [True]
        if method == "meshrl_apply_received":
            if self.apply_fails:
                raise ConnectionError("a bucket failed its checksum")
            return [(self.version, {"apply": 0.001})]
        return [None]

    async def pause_scheduler_async(self, mode, clear_cache):
        self.asked.append(f"pause mode={mode} clear_cache={clear_cache}")

    async def resume_generation(self):
        self.asked.append("resume")

    async def reset_prefix_cache(self):
        self.asked.append("reset_prefix_cache")
        return True


def engine_with(llm: StandIn, prefix_caching: bool = False) -> VLLMEngine:
    return VLLMEngine(llm, 100, 0, config=RolloutServiceConfig(engine="vllm", enable_prefix_caching=prefix_caching),
                      gpus=())


async def in_flight(engine: VLLMEngine, release: asyncio.Event) -> tuple[asyncio.Task, list[GenerationCall]]:
    """A Generate call in flight through the engine's gate, until ``release``; the attempts it made."""
    attempts = []

    async def attempt(call: GenerationCall) -> int:
        attempts.append(call)
        await call.unless_interrupted(release.wait())
        return engine.weight_version

    task = asyncio.create_task(engine.gate.run(attempt))
    while not attempts:
        await asyncio.sleep(0)
    return task, attempts


async def test_keep_freezes_the_requests_in_flight_only_for_the_swap():
    llm, release = StandIn(version=1), asyncio.Event()
    engine = engine_with(llm)
    call, attempts = await in_flight(engine, release)
    swap = await asyncio.wait_for(engine.receive_weights("weights", 5, "keep"), 5)
    assert not call.done() and engine.weight_version == swap.version == 1  # the call goes on under version 1
    assert llm.asked == ["meshrl_start_receive", "meshrl_wait_received", "pause mode=keep clear_cache=False",
                         "meshrl_apply_received", "resume"]
    assert {"freeze", "resume"} <= set(swap.stages)
    release.set()
    assert await call == 1 and len(attempts) == 1


async def test_with_prefix_caching_keep_lets_the_requests_in_flight_finish_then_clears_the_cache():
    """No freeze: vLLM would clear the cache under frozen requests only by preempting them."""
    llm, release = StandIn(version=1), asyncio.Event()
    engine = engine_with(llm, prefix_caching=True)
    call, attempts = await in_flight(engine, release)
    swapping = asyncio.create_task(engine.receive_weights("weights", 5, "keep"))
    while "meshrl_wait_received" not in llm.asked:
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert not swapping.done() and "meshrl_apply_received" not in llm.asked  # waiting for the call in flight
    release.set()
    assert await asyncio.wait_for(call, 5) == 0  # it finished under the weights it began with
    swap = await asyncio.wait_for(swapping, 5)
    assert swap.version == engine.weight_version == 1 and len(attempts) == 1
    assert llm.asked == ["meshrl_start_receive", "meshrl_wait_received", "meshrl_apply_received",
                         "reset_prefix_cache"]


async def test_a_keep_swap_that_fails_resumes_and_runs_the_calls_in_flight_again():
    llm, release = StandIn(version=1, apply_fails=True), asyncio.Event()
    engine = engine_with(llm)
    call, attempts = await in_flight(engine, release)
    with pytest.raises(ConnectionError, match="checksum"):
        await asyncio.wait_for(engine.receive_weights("weights", 5, "keep"), 5)
    assert llm.asked[-2:] == ["meshrl_apply_received", "resume"] and engine.damaged
    while len(attempts) < 2:  # dropped, and run again (where vLLM's attempt would refuse: weights not one version)
        await asyncio.sleep(0)
    release.set()
    await call


@pytest.mark.parametrize("mode", ["finish", "restart"])
async def test_finish_and_restart_never_freeze(mode):
    llm, release = StandIn(version=1), asyncio.Event()
    engine = engine_with(llm)
    call, _ = await in_flight(engine, release)
    swapping = asyncio.create_task(engine.receive_weights("weights", 5, mode))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.wait_for(asyncio.gather(swapping, call), 5)
    assert not [asked for asked in llm.asked if asked.startswith("pause") or asked == "resume"]
