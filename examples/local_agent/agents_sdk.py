"""The lookup agent of examples/local_agent/agent.py written with the OpenAI Agents SDK (``openai-agents``), as a
program of its own: it knows only the standard OpenAI environment variables (OPENAI_BASE_URL, OPENAI_API_KEY,
OPENAI_MODEL) and its question, and runs unchanged against OpenAI, any OpenAI-compatible server, or a meshrl run's
gateway (an env service's ``agent_command``, which also gives it MESHRL_ROW: the dataset row as JSON).

It prints no number: the run's reward service scores the last answer the model gave it.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... OPENAI_MODEL=... python examples/local_agent/agents_sdk.py "code of QX?"
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import zlib

SALT = "meshrl-lookup"


def lookup(key: str) -> str:
    """The code of a key.

    Args:
        key: The key, capital letters.
    """
    if not key.isalpha() or not key.isupper():
        return f'error: "key" must be capital letters, got {key!r}'
    return f"{zlib.crc32((SALT + key).encode()) % 10_000:04d}"


async def main(question: str) -> None:
    from agents import Agent, MaxTurnsExceeded, Runner, function_tool, set_default_openai_api, set_tracing_disabled

    set_default_openai_api("chat_completions")  # the endpoint every OpenAI-compatible server has
    set_tracing_disabled(True)  # no traces sent to OpenAI's platform
    agent = Agent(name="lookup", tools=[function_tool(lookup)], model=os.environ["OPENAI_MODEL"])
    try:
        result = await Runner.run(agent, question, max_turns=3)
        print(f"answer: {result.final_output}", file=sys.stderr)
    except MaxTurnsExceeded:
        print("no answer within 3 turns", file=sys.stderr)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Needs OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set; in a run, "
                                            "the row comes in MESHRL_ROW.")
    parser.add_argument("question", nargs="?", help="the user's message (default: the row's last message)")
    question = parser.parse_args().question
    asyncio.run(main(question or json.loads(os.environ.get("MESHRL_ROW", "{}"))["prompt"][-1]["content"]))
