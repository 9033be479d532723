"""An agent written with the openai package alone, with one tool: what examples/local_agent.yaml trains.

It knows nothing of meshrl. It asks the model for the code of a key, runs the lookup tool whenever the model
calls it, gives the model the tool's answer, and stops at the model's first answer without a tool call (at most
three calls). It returns None: the run's reward service scores that last answer against the row's ground truth
(return a number instead and that number is the score).

During a run, meshrl's env service calls ``run`` once per prompt, with an ``openai.AsyncOpenAI`` pointed at the
run's gateway for that episode; OPENAI_MODEL names the policy. Outside a run the same function works against
any OpenAI-compatible server (``python examples/local_agent/agent.py`` with OPENAI_BASE_URL, OPENAI_API_KEY and
OPENAI_MODEL set).
"""

from __future__ import annotations

import asyncio
import json
import os
import zlib

import openai

SALT = "meshrl-lookup"  # the lookup task's (services/coordctl/synthetic.py LOOKUP_SALT)
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The code of a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key, capital letters."}},
                   "required": ["key"]}}}
MAX_CALLS = 3


def lookup(key: object) -> str:
    """The tool: a key's four-digit code."""
    if not isinstance(key, str) or not key.isalpha() or not key.isupper():
        return f'error: "key" must be capital letters, got {key!r}'
    return f"{zlib.crc32((SALT + key).encode()) % 10_000:04d}"


async def run(client: openai.AsyncOpenAI, row: dict) -> float | None:
    messages = list(row["prompt"])
    for _ in range(MAX_CALLS):
        completion = await client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages,
                                                          tools=[LOOKUP])
        message = completion.choices[0].message
        if not message.tool_calls:
            return None  # an answer: the reward service scores it
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                key = json.loads(call.function.arguments).get("key")
            except ValueError:
                key = None
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(key)})
    return None


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Needs OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set.")
    parser.add_argument("question", nargs="?", default="code of QX?", help="the user's message")
    question = parser.parse_args().question
    asyncio.run(run(openai.AsyncOpenAI(), {"prompt": [{"role": "user", "content": question}]}))
