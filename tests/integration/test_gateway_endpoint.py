"""The gateway's endpoint under load and at its edges, on a real rollout service process (the hf engine, the CPU
agent example's tiny chat model) through the agent loop's ``TurnDispatcher``, the gateway and its clients in this
process (bench/gateway_episodes.py's ``serving``): many episodes of the CPU agent example at once, a streamed
answer and a client that cuts it, and each ``tool_choice``.

The full 256 episodes at once are bench/gateway_episodes.py; here 32, to keep CI short."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest

from bench.gateway_episodes import episodes_at_once, serving, tiny_chat_model
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordinator.agent.turns import render_prompt

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "The code of a key.",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "code of QX?"}]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> tuple[str, Path]:
    """A rollout service process (its coordinator beside it) and the example's model: (address, model folder)."""
    root = tmp_path_factory.mktemp("gateway-endpoint")
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="rollout"),))

    async def address() -> str:
        await cluster.start(timeout_s=180)
        control = CoordinatorClient(cluster.coordinator)
        try:
            [service] = await control.list_services()
        finally:
            await control.close()
        return service.address

    try:
        yield asyncio.run(address()), tiny_chat_model(root / "tiny-chat")
    finally:
        cluster.stop()


async def eventually(holds, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.01)


def test_32_episodes_of_the_cpu_agent_example_at_once_are_each_recorded_exactly_once_and_nothing_is_left_open(
        rollout):
    report = asyncio.run(episodes_at_once(*rollout, episodes=32))
    assert [e.failed for e in report.episodes if e.failed] == []
    assert all(e.answered >= 1 for e in report.episodes)
    assert [(e.answered, e.recorded_calls, e.completion_tokens, e.recorded_model_tokens)
            for e in report.episodes if not e.exact] == []  # each answered call recorded once, token for token
    assert report.generate_calls < report.calls  # concurrent episodes' calls still go to the rollout together
    assert report.left_open == {"episode keys": 0, "turns unanswered": 0, "turns waiting": 0, "calls in flight": 0,
                                "HTTP connections": 0}


async def sse_events(response: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order; each event must end with a blank line."""
    text = (await response.read()).decode()
    events = text.split("\n\n")
    assert events[-1] == "", "the stream ends with a whole event"
    assert all(event.startswith("data: ") for event in events[:-1])
    return [event[len("data: "):] for event in events[:-1]]


def test_a_stream_is_openai_chunks_then_done_and_recorded_once_and_a_client_that_cuts_it_leaves_nothing(rollout):
    async def run():
        async with serving(*rollout, trajectories=1, run_id="stream") as (gateway, dispatcher, _):
            access = gateway.open(0, dispatcher)
            body = {"model": "stream", "messages": MESSAGES, "tools": [LOOKUP], "stream": True, "max_tokens": 32,
                    "stream_options": {"include_usage": True}}
            headers = {"Authorization": f"Bearer {access.key}"}
            async with aiohttp.ClientSession() as session, \
                    session.post(f"{access.url}/chat/completions", json=body, headers=headers) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                events = await sse_events(response)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            assert deltas[0]["delta"]["role"] == "assistant"
            assert deltas[-1]["finish_reason"] in ("stop", "length", "tool_calls")
            assert all(d["finish_reason"] is None for d in deltas[:-1])
            usage = chunks[-1]["usage"]
            recording = gateway.episodes[access.key].recording
            [leaf] = recording.leaves
            assert recording.calls == 1 and sum(leaf.trajectory.loss_mask) == usage["completion_tokens"]

            # a client that goes away while its call is sampled: nothing recorded, nothing left open
            _, writer = await asyncio.open_connection("127.0.0.1", urlsplit(access.url).port)
            payload = json.dumps({**body, "max_tokens": 96}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {access.key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                         + payload)
            await eventually(lambda: dispatcher.unanswered == 1, "the call's turn being sampled")
            writer.transport.abort()  # the client cuts the stream before its first byte
            await eventually(lambda: gateway.not_recorded["client went away"] == 1, "the cut call left unrecorded")
            await eventually(lambda: gateway.connections == 0, "the cut connection closing")
            assert recording.calls == 1 and recording.leaves == [leaf]
            assert dispatcher.unanswered == 0 and not any(dispatcher.waiting.values())

            # the agent's retry of the call it lost is recorded, once
            client = openai.AsyncOpenAI(base_url=access.url, api_key=access.key, max_retries=0)
            streamed = await client.chat.completions.create(model="stream", messages=MESSAGES, tools=[LOOKUP],
                                                            stream=True)
            [choice_chunks] = [[c async for c in streamed]]
            await client.close()
            assert choice_chunks[-1].choices[0].finish_reason is not None
            assert recording.calls == 2 and len(recording.leaves) == 2
    asyncio.run(run())


def test_tool_choice_none_offers_no_tools_auto_offers_them_and_required_or_named_force_a_calls_opening(rollout):
    async def run():
        async with serving(*rollout, trajectories=1, run_id="choice") as (gateway, dispatcher, tokenizer):
            def asked(tool_choice, tools=(LOOKUP,)):
                access = gateway.open(0, dispatcher)
                client = openai.AsyncOpenAI(base_url=access.url, api_key=access.key, max_retries=0)
                extra = {} if tool_choice is None else {"tool_choice": tool_choice}
                return access, client, client.chat.completions.create(
                    model="choice", messages=MESSAGES, tools=list(tools), max_tokens=24,
                    extra_body={"return_token_ids": True}, **extra)

            with_tools = render_prompt(tokenizer, MESSAGES, {"tools": [LOOKUP]})
            expected = {"auto": (with_tools, ""), None: (with_tools, ""),
                        "none": (render_prompt(tokenizer, MESSAGES, {}), ""),
                        "required": (with_tools, "<tool_call>"),
                        "named": (with_tools, '<tool_call>{"name": "lookup", "arguments": ')}
            for name, (prompt_ids, opening) in expected.items():
                choice = {"type": "function", "function": {"name": "lookup"}} if name == "named" else name
                access, client, call = asked(choice)
                completion = await call
                await client.close()
                opening_ids = tuple(tokenizer.encode(opening, add_special_tokens=False))
                assert tuple(completion.model_extra["prompt_token_ids"]) == prompt_ids + opening_ids, name
                message = completion.choices[0].message
                if opening:  # the call is forced open: a call of the tool if the rest parses, else the text
                    assert (message.tool_calls and message.tool_calls[0].function.name == "lookup") \
                        or message.content.startswith(opening), (name, message)
                [leaf] = gateway.close_episode(access.key).recording.leaves
                sampled = len(completion.choices[0].model_extra["token_ids"])
                assert leaf.trajectory.loss_mask == (0,) * len(opening_ids) + (1,) * sampled, name
            for choice, tools in (("required", ()), ({"type": "function", "function": {"name": "other"}}, (LOOKUP,))):
                access, client, call = asked(choice, tools)
                with pytest.raises(openai.BadRequestError) as refused:
                    await call
                await client.close()
                assert refused.value.body["param"] == "tool_choice" and refused.value.body["message"]
                assert gateway.close_episode(access.key).recording.calls == 0
    asyncio.run(run())
