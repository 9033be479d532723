"""Many episodes at once through the gateway: the CPU agent example's agent (examples/local_agent/agent.py,
unchanged) run for ``--episodes`` lookup prompts concurrently, each with its own episode key, against a run's
gateway whose turns go through the agent loop's ``TurnDispatcher`` to a real rollout service process (the hf
engine, examples/local_agent.yaml's tiny chat model and budget; random-init, so most answers are text, not calls).

The agents run in this process (the env service runs one per worker process; 256 of those would not fit a
2-core machine), so what is exercised is the endpoint, the recording and the dispatch under that load. Checked
per episode: every call the agent got an answer to (HTTP 200) is recorded exactly once (the recording's calls,
and its model tokens equal the answers' completion tokens), and no call failed; and at the end nothing is left
open: no episode key, no turn waiting or being sampled, no HTTP connection.

Prints the episodes, the calls, their wall time, the Generate calls they were batched into and the calls' p50/p90
latency, and last whether every check held.

    python bench/gateway_episodes.py [--episodes 256]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, NamedTuple

AGENT = Path(__file__).resolve().parents[1] / "examples" / "local_agent" / "agent.py"
BUDGET = (64, 96)  # examples/local_agent.yaml's data.max_prompt_length, data.max_response_length
MODEL_SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4}  # its local.tiny_model


@dataclass
class EpisodeCheck:
    """What one episode's agent got and what the gateway recorded for it."""

    answered: int = 0  # calls answered 200
    completion_tokens: int = 0  # their usage's
    failed: list[str] = field(default_factory=list)  # calls answered otherwise, or the agent's exception
    recorded_calls: int = 0
    recorded_model_tokens: int = 0
    seconds: list[float] = field(default_factory=list)  # each answered call's

    @property
    def exact(self) -> bool:
        return not self.failed and self.answered >= 1 and self.recorded_calls == self.answered \
            and self.recorded_model_tokens == self.completion_tokens


@dataclass
class Report:
    episodes: list[EpisodeCheck]
    seconds: float
    left_open: dict[str, int]  # what was still open at the end, by kind (all 0 where nothing was)
    generate_calls: int  # the Generate calls that sampled the episodes' calls

    @property
    def calls(self) -> int:
        return sum(e.answered for e in self.episodes)


def example_agent():
    spec = importlib.util.spec_from_file_location("local_agent_example", AGENT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.run


def tiny_chat_model(folder: Path) -> Path:
    from services.coordctl.tiny_model import build_tiny_model

    return build_tiny_model(folder, seed=0, chat=True, **MODEL_SHAPE)


class Serving(NamedTuple):
    gateway: Any  # services.coordinator.agent.gateway.server.Gateway
    dispatcher: Any  # services.coordinator.agent.agent_loop.TurnDispatcher
    tokenizer: Any


@asynccontextmanager
async def serving(rollout_address: str, model: Path, *, trajectories: int, run_id: str) -> AsyncIterator[Serving]:
    """A run's gateway, serving, whose calls go through a ``TurnDispatcher`` of ``trajectories`` trajectories to the
    rollout at ``rollout_address`` (``model`` loaded there for ``run_id``); all closed on the way out."""
    from transformers import AutoTokenizer

    from services.coordinator.agent.agent_loop import TurnDispatcher
    from services.coordinator.agent.gateway.recorder import Budget
    from services.coordinator.agent.gateway.server import Gateway, GatewaySettings
    from services.coordinator.fleet.clients import RolloutClient
    from services.coordinator.fleet.dispatch import ReplicaPool
    from services.coordinator.settings import Sampling

    rollout = RolloutClient(rollout_address)
    await rollout.init_run(run_id, str(model), "float32", timeout=300)
    tokenizer = AutoTokenizer.from_pretrained(model)
    sampling = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=BUDGET[1],
                        stop_token_ids=(tokenizer.eos_token_id,))
    rollout_set = SimpleNamespace(pool=ReplicaPool("rollout", [rollout]))  # the run's rollouts: this one
    dispatcher = TurnDispatcher(rollout_set, sampling, seed=0, oldest=0, timeout_s=300,  # type: ignore[arg-type]
                                calls_in_flight=1, trajectories=trajectories)
    gateway = Gateway(run_id=run_id, tokenizer=tokenizer, settings=GatewaySettings(
        host="127.0.0.1", port=0, max_n=8, budget=Budget(max_prompt_length=BUDGET[0], max_response_length=BUDGET[1])))
    try:
        await gateway.start()
        yield Serving(gateway=gateway, dispatcher=dispatcher, tokenizer=tokenizer)
    finally:
        await dispatcher.close()
        await gateway.close()
        await rollout.close()


async def episodes_at_once(rollout_address: str, model: Path, episodes: int, *, run_id: str = "gateway-load") -> Report:
    """``episodes`` runs of the example agent at once through a gateway on the rollout at ``rollout_address``."""
    async with serving(rollout_address, model, trajectories=episodes, run_id=run_id) as (gateway, dispatcher, _):
        return await _episodes(gateway, dispatcher, episodes, run_id)


async def _episodes(gateway: Any, dispatcher: Any, episodes: int, run_id: str) -> Report:
    import httpx
    import openai

    from services.coordctl.synthetic import lookup_task_rows

    os.environ["OPENAI_MODEL"] = run_id  # the agent reads the model's name as it does in a run
    agent = example_agent()
    rows = lookup_task_rows(episodes, key_letters=2, seed=0)

    async def episode(index: int) -> EpisodeCheck:
        check = EpisodeCheck()
        access = gateway.open(index, dispatcher)
        sent_at: dict[int, float] = {}

        async def sent(request: httpx.Request) -> None:
            sent_at[id(request)] = time.perf_counter()

        async def answered(response: httpx.Response) -> None:
            await response.aread()
            if response.status_code != 200:
                check.failed.append(f"{response.status_code}: {response.text[:200]}")
                return
            check.answered += 1
            check.completion_tokens += response.json()["usage"]["completion_tokens"]
            check.seconds.append(time.perf_counter() - sent_at.pop(id(response.request)))

        http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1),
                                 event_hooks={"request": [sent], "response": [answered]})
        client = openai.AsyncOpenAI(base_url=access.url, api_key=access.key, max_retries=0, http_client=http)
        try:
            await agent(client, rows[index])
        except Exception as error:  # noqa: BLE001 - counted: the check fails on it
            check.failed.append(f"{type(error).__name__}: {error}")
        finally:
            await client.close()
            recorded = gateway.close_episode(access.key)
            dispatcher.trajectory_ended()  # as the agent loop says when a trajectory ends
        check.recorded_calls = recorded.recording.calls
        check.recorded_model_tokens = sum(sum(leaf.trajectory.loss_mask) for leaf in recorded.recording.leaves)
        return check

    started = time.perf_counter()
    checks = await asyncio.gather(*(episode(index) for index in range(episodes)))
    seconds = time.perf_counter() - started
    for _ in range(100):  # closed connections leave the server within a few loop turns
        if gateway.connections == 0:
            break
        await asyncio.sleep(0.05)
    left_open = {"episode keys": len(gateway.episodes), "turns unanswered": dispatcher.unanswered,
                 "turns waiting": sum(len(w) for w in dispatcher.waiting.values()),
                 "calls in flight": sum(dispatcher.in_flight.values()), "HTTP connections": gateway.connections}
    return Report(episodes=list(checks), seconds=seconds, left_open=left_open,
                  generate_calls=sum(dispatcher.calls.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    args = parser.parse_args()
    from services.coordctl.local import LocalCluster, ServiceSpec

    async def measure(tmp: Path) -> Report:
        from services.coordctl.control import CoordinatorClient

        cluster = LocalCluster(tmp / "state", (ServiceSpec(kind="rollout"),))
        try:
            await cluster.start(timeout_s=180)
            control = CoordinatorClient(cluster.coordinator)
            [service] = await control.list_services()
            await control.close()
            return await episodes_at_once(service.address, tiny_chat_model(tmp / "tiny-chat"), args.episodes)
        finally:
            cluster.stop()

    with tempfile.TemporaryDirectory() as tmp:
        report = asyncio.run(measure(Path(tmp)))
    latencies = [s * 1000 for e in report.episodes for s in e.seconds]
    exact = sum(e.exact for e in report.episodes)
    print(f"episodes at once: {len(report.episodes)}, calls answered: {report.calls}, "
          f"wall {report.seconds:.1f} s ({report.calls / report.seconds:.1f} calls/s), in {report.generate_calls} "
          f"Generate calls (batched by the dispatcher)")
    print(f"call latency under that load: p50 {statistics.median(latencies):.0f} ms, "
          f"p90 {sorted(latencies)[int(0.9 * len(latencies))]:.0f} ms")
    failures = [f for e in report.episodes for f in e.failed]
    print(f"failed calls or agents: {len(failures)}" + (f" (first: {failures[0]})" if failures else ""))
    print(f"left open at the end: {report.left_open}")
    print(f"episodes recorded exactly once (every answered call, its tokens): {exact}/{len(report.episodes)}; "
          f"all checks held: {exact == len(report.episodes) and not any(report.left_open.values())}")


if __name__ == "__main__":
    main()
