"""The gateway's overhead per call over a direct Generate, on loopback.

A rollout service process (the hf engine, the tiny chat model) started by LocalCluster; in this process, on uvloop
as in the coordinator that hosts the gateway (``services/common/service.py``), four ways to sample the same completion
of the same prompt, interleaved call by call so that they meet the same load:

- direct: ``RolloutClient.generate`` of the prompt's ids (one gRPC Generate);
- dispatcher: a turn of the agent loop's ``TurnDispatcher`` (what a multi-turn run samples with; a lone
  trajectory's turn goes at once, with no gathering window to wait out);
- endpoint: ``POST /v1/chat/completions`` over HTTP on loopback to a run's gateway
  (``services/coordinator/agent/gateway/``) from a lean HTTP client (aiohttp): the request parsed, the messages
  rendered by the chat template, the turn through the same ``TurnDispatcher``, the answer decoded and written,
  the call recorded. What the endpoint adds;
- openai client: the same call through ``openai.AsyncOpenAI`` (``chat.completions.create``): what a user's agent
  sees, the ``openai`` package's own time (httpx, pydantic; about 2 ms a call here) included.

Every 8 calls a new episode (key) begins, as agents' episodes make a few calls each.

Prints p50 and p90 of each (ms), the openai client's overhead over a direct Generate, the endpoint's CPU time per call
over a direct Generate's (this process's CPU time, every thread's, over each way's calls: the gateway, its HTTP client
and the gRPC client all run here; the rollout service's process is not counted), and last the endpoint's p50 overhead
over a direct Generate (each difference taken call by call, the same call's direct Generate). On a machine others load,
the wall-clock figures stretch with the load; the CPU time much less.

    python bench/gateway_overhead.py [--calls N] [--max-tokens K]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import uvloop

CALLS_PER_EPISODE = 8
WARM_UP = 5


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Measured(NamedTuple):
    ms: dict[str, list[float]]  # each way's calls' wall-clock times
    cpu_ms: dict[str, float]  # each way's CPU time of this process over its calls, summed


async def measure(model: Path, state: Path, calls: int, max_tokens: int) -> Measured:
    import aiohttp
    import openai
    from transformers import AutoTokenizer

    from services.coordctl.control import CoordinatorClient
    from services.coordctl.local import LocalCluster, ServiceSpec
    from services.coordinator.agent.agent_loop import TurnDispatcher
    from services.coordinator.fleet.clients import RolloutClient
    from services.coordinator.fleet.dispatch import ReplicaPool
    from services.coordinator.agent.gateway.recorder import Budget
    from services.coordinator.agent.gateway.server import Gateway, GatewaySettings
    from services.coordinator.settings import Sampling
    from services.coordinator.agent.turns import render_prompt

    cluster = LocalCluster(state, (ServiceSpec(kind="rollout"),))
    try:
        await cluster.start(timeout_s=180)
        control = CoordinatorClient(cluster.coordinator)
        [service] = await control.list_services()
        await control.close()
        rollout = RolloutClient(service.address)
        await rollout.init_run("bench", str(model), "float32", timeout=300)
        tokenizer = AutoTokenizer.from_pretrained(model)
        messages = [{"role": "user", "content": "code of QX?"}]
        ids = list(render_prompt(tokenizer, messages, {}))
        sampling = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=max_tokens, stop_token_ids=())
        rollout_set = SimpleNamespace(pool=ReplicaPool("rollout", [rollout]))  # the run's rollouts: this one
        dispatcher = TurnDispatcher(rollout_set, sampling, seed=0, oldest=0, timeout_s=60,  # type: ignore[arg-type]
                                    calls_in_flight=1, trajectories=1)
        gateway = Gateway(run_id="bench", tokenizer=tokenizer, settings=GatewaySettings(
            host="127.0.0.1", port=0, max_n=8, budget=Budget(max_prompt_length=256, max_response_length=64)))
        await gateway.start()
        seconds: dict[str, list[float]] = {"direct": [], "dispatcher": [], "endpoint": [], "openai client": []}
        cpu = dict.fromkeys(seconds, 0.0)
        session = aiohttp.ClientSession()
        client = None
        request = {"model": "bench", "messages": messages, "max_tokens": max_tokens}

        async def direct_generate(call: int) -> None:
            await rollout.generate([ids], sampling, seed=0, first_index=call, timeout=60)

        async def dispatcher_turn(call: int) -> None:
            await dispatcher.sample(ids, max_tokens, call, prefer=None)

        async def endpoint_call(call: int) -> None:
            async with session.post(f"{access.url}/chat/completions", json=request,
                                    headers={"Authorization": f"Bearer {access.key}"}) as response:
                answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"the gateway answered {response.status}: {answer}")

        async def openai_call(call: int) -> None:
            await client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens)

        for call in range(WARM_UP + calls):
            if call % CALLS_PER_EPISODE == 0:
                if client is not None:
                    await client.close()
                access = gateway.open(call // CALLS_PER_EPISODE, dispatcher)
                client = openai.AsyncOpenAI(base_url=access.url, api_key=access.key, max_retries=0)
            times = []
            for way in (direct_generate, dispatcher_turn, endpoint_call, openai_call):
                cpu_started, started = time.process_time(), time.perf_counter()
                await way(call)
                times.append((time.perf_counter() - started, time.process_time() - cpu_started))
            if call >= WARM_UP:
                for name, (wall, used) in zip(seconds, times):
                    seconds[name].append(wall * 1000)
                    cpu[name] += used * 1000
        await session.close()
        if client is not None:
            await client.close()
        await dispatcher.close()
        await gateway.close()
        await rollout.close()
        return Measured(ms=seconds, cpu_ms=cpu)
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    from services.coordctl.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-chat", hidden_size=32, num_layers=1, num_heads=2, seed=0, chat=True)
        measured = uvloop.run(measure(model, Path(tmp) / "state", args.calls, args.max_tokens))
    ms, calls = measured.ms, len(measured.ms["direct"])
    for name, values in ms.items():
        print(f"{name:>13}: p50 {statistics.median(values):7.2f} ms  p90 {percentile(values, 0.9):7.2f} ms "
              f"({len(values)} calls, {args.max_tokens} token each)")
    over_client = statistics.median(o - d for o, d in zip(ms["openai client"], ms["direct"]))
    print(f"through the openai client (its own time included), over a direct Generate (same call), p50: "
          f"{over_client:.2f} ms")
    print("CPU time per call (this process): " + ", ".join(
        f"{name} {used / calls:.2f} ms" for name, used in measured.cpu_ms.items()))
    print(f"gateway endpoint CPU time per call over a direct Generate's: "
          f"{(measured.cpu_ms['endpoint'] - measured.cpu_ms['direct']) / calls:.2f} ms")
    over_direct = statistics.median(e - d for e, d in zip(ms["endpoint"], ms["direct"]))
    print(f"gateway endpoint overhead per call over a direct Generate (same call), p50: {over_direct:.2f} ms")

if __name__ == "__main__":
    main()
