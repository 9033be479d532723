"""Users' agents for tests/integration/test_gateway.py, written against the openai package alone, as a user would
write them (they know the gateway only by its documented interface: OPENAI_MODEL, the client they are given,
vLLM's return_token_ids).

With MESHRL_AGENT_LOG set (an unsandboxed env service: a sandboxed worker cannot write outside its /tmp), each
agent appends what it saw to that file, one JSON line per episode.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai


def log(entry: dict) -> None:
    path = os.environ.get("MESHRL_AGENT_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(entry) + "\n")


async def two_calls(client: openai.AsyncOpenAI, row: dict) -> float:
    """Two calls, the second going on from the first's answer with a user message; its reward: 1 where the two
    answers differ in length parity, else 0 (a number the test can recompute)."""
    model = os.environ["OPENAI_MODEL"]
    messages = list(row["prompt"])
    calls = []
    for _ in range(2):
        completion = await client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True,
                                                          extra_body={"return_token_ids": True})
        choice = completion.choices[0]
        calls.append({"prompt_token_ids": completion.model_extra["prompt_token_ids"],
                      "token_ids": choice.model_extra["token_ids"], "text": choice.message.content,
                      "logprobs": [entry.logprob for entry in choice.logprobs.content]})
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    reward = float(len(calls[0]["text"]) % 2 != len(calls[1]["text"]) % 2)
    log({"agent": "two_calls", "calls": calls, "reward": reward})
    return reward


async def hostile(client: openai.AsyncOpenAI, row: dict) -> None:
    """Each bad request the gateway must refuse with OpenAI's error object, then one good call (the reward
    service scores its answer: this agent returns None)."""
    model, base_url = os.environ["OPENAI_MODEL"], os.environ["OPENAI_BASE_URL"]
    key = os.environ["OPENAI_API_KEY"]
    messages = list(row["prompt"])
    refusals = {}

    async def refused(name: str, **kwargs) -> None:
        try:
            await client.chat.completions.create(**{"model": model, "messages": messages, **kwargs})
            refusals[name] = None
        except openai.APIStatusError as error:
            refusals[name] = {"status": error.status_code, "body": error.body}

    await refused("unknown_model", model="gpt-4o")
    await refused("n_too_large", n=1000)
    await refused("over_budget", messages=[{"role": "user", "content": "9" * 400}])
    other_run = openai.AsyncOpenAI(base_url=base_url, api_key="meshrl-episode-otherrun-secret", max_retries=0)
    try:
        await other_run.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError as error:
        refusals["other_runs_key"] = {"status": error.status_code, "body": error.body}
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as raw:
        answer = await raw.post("/chat/completions", content=b'{"model": "x", "messages": [',
                                headers={"Content-Type": "application/json"})
        refusals["malformed_json"] = {"status": answer.status_code, "body": answer.json()}
        async with raw.stream("POST", "/chat/completions", json={"model": model, "messages": messages,
                                                                  "stream": True}) as stream:
            async for _ in stream.aiter_bytes():
                break  # the client cuts the stream after its first bytes
    streamed = await client.chat.completions.create(model=model, messages=messages, stream=True)
    chunks = [chunk async for chunk in streamed]
    listed = await client.models.list()
    log({"agent": "hostile", "refusals": refusals, "models": [m.id for m in listed.data],
         "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)})
    return None


async def never_calls(client: openai.AsyncOpenAI, row: dict) -> float:
    return 1.0


async def raises(client: openai.AsyncOpenAI, row: dict) -> float:
    await client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=list(row["prompt"]), max_tokens=2)
    raise RuntimeError("the agent's own bug")


async def flaky(client: openai.AsyncOpenAI, row: dict) -> float | None:
    """By the row's index: never calls, raises after a call, hangs after a call, or makes its two calls."""
    kind = row["extra_info"]["index"] % 4
    if kind == 0:
        return await never_calls(client, row)
    if kind == 1:
        return await raises(client, row)
    if kind == 2:
        await client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=list(row["prompt"]),
                                             max_tokens=2)
        await asyncio.sleep(3600)
    return await two_calls(client, row)
