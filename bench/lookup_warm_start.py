"""What the warm start alone gives the local multi-turn example (examples/local_tools.yaml, issue 28 point 6).

In one process, with what ``coordctl start-run --local examples/local_tools.yaml`` builds and reads (the tiny
chat model and the lookup task's rows from the ``local`` section, the run config laid over the embedded
default, the tools of its tool_config_path):

1. the warm start: the coordinator's ``WarmStart`` (its worked trajectories rendered token-exactly, tool replies
   masked) feeding the trainer's ``RankWorker`` in this process, through the op TrainSupervised calls;
2. greedy held-out success: on each held-out row, the model's turns generated greedily, each turn's tool calls
   parsed (Hermes) and answered by the tool class of the tool config, the replies appended as ``render_reply``
   renders them, until a turn without calls, multi_turn.max_assistant_turns or data.max_response_length; the
   last turn's text scored by the reward rule of the row's data source.

It prints the warm start's seconds (wall, and CPU: about what it takes on an idle core) and loss, then success,
the share of rows whose first turn called the tool, and the share whose call was well-formed and answered,
before and after the warm start. One torch thread, as --local gives each service.

    python -m bench.lookup_warm_start [key=value ...]   (overrides of the example, e.g. local.tiny_model.num_layers=3)
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch
import yaml

from services.common.config import to_yaml
from services.coordctl.resolve import checked, resolve_config
from services.coordinator.fleet.clients import sequence_tensors
from services.coordinator.settings import loop_settings
from services.coordinator.agent.turns import ReplyTokens, render_prompt, render_reply
from services.coordinator.step.warm_start import WarmStart
from services.env.tools import as_reply, read_tool_config, tool_class
from services.reward.rules import score_sample
from services.run.tool_calls import ParseError, parse_tool_calls
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "local_tools.yaml")


class InProcessActor:
    """The trainer's RankWorker where the warm start expects the trainer's client."""

    def __init__(self, worker: RankWorker):
        self.worker = worker

    async def train_supervised(self, batch, step: int, timeout: float) -> tuple[dict[str, float], int]:
        updated = self.worker.run("train_supervised", {}, sequence_tensors(batch))
        return updated.metrics, updated.weight_version


class Printed:
    def log(self, text: str) -> None:
        print(text, flush=True)


class Tools:
    """The tool config's tools, built once (the lookup tool keeps no state between calls)."""

    def __init__(self, path: str):
        configs = read_tool_config(path)
        self.schemas = tuple(tool.tool_schema for tool in configs)
        self.instances = {tool.name: tool_class(tool)(dict(tool.config), {}) for tool in configs}

    def reply(self, text: str) -> tuple[list[dict], bool] | None:
        """The tool messages answering a turn's calls, and whether every call was well-formed and answered;
        None for a turn without calls."""
        parsed = parse_tool_calls(text, tool_names=frozenset(self.instances), max_parallel_calls=1,
                                  max_call_bytes=1 << 16)
        if not parsed.calls:
            return None
        replies, answered = [], True
        for call in parsed.calls:
            if isinstance(call, ParseError):
                replies.append({"role": "tool", "content": call.message})
                answered = False
                continue
            try:
                replies.append({"role": "tool", "content": as_reply(
                    self.instances[call.name].call(dict(call.arguments))).text})
            except Exception as error:  # noqa: BLE001 - as the env service does: the model is told
                replies.append({"role": "tool", "content": f"error: {error}"})
                answered = False
        return replies, answered


@torch.no_grad()
def greedy_turns(model, tokenizer, inputs: list[list[int]], rooms: list[int]) -> list[list[int]]:
    """Each input's greedy continuation up to and including EOS, at most its room."""
    width = max(map(len, inputs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in inputs])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in inputs])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(rooms), do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)[:, width:].tolist()
    turns = []
    for row, room in zip(out, rooms):
        row = row[:room]
        turns.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return turns


def evaluate(model, tokenizer, prompts, tools: Tools, max_response_length: int, max_turns: int) -> dict[str, float]:
    """Greedy multi-turn rollouts of ``prompts`` with the tools simulated here; success and call rates."""
    kwargs = {"tools": list(tools.schemas)}
    states = [{"ids": list(render_prompt(tokenizer, p.messages, kwargs)), "used": 0, "messages": tuple(p.messages),
               "text": "", "turns": 0} for p in prompts]
    called = well_formed = 0
    active = list(range(len(prompts)))
    for turn in range(max_turns):
        if not active:
            break
        sampled = greedy_turns(model, tokenizer, [states[i]["ids"] for i in active],
                               [max_response_length - states[i]["used"] for i in active])
        still = []
        for i, ids in zip(active, sampled):
            state = states[i]
            state["ids"] += ids
            state["used"] += len(ids)
            state["text"] = tokenizer.decode(ids, skip_special_tokens=True)
            answer = tools.reply(state["text"])
            if turn == 0 and answer is not None:
                called += 1
                well_formed += answer[1]
            room = max_response_length - state["used"]
            if answer is None or room <= 0:
                continue
            replies = answer[0]
            appended = render_reply(tokenizer, messages=state["messages"], sampled_ids=ids, replies=replies,
                                    room=room, max_reply_tokens=room, truncate_side="middle", template_kwargs=kwargs)
            if not isinstance(appended, ReplyTokens):
                continue
            state["ids"] += appended.ids
            state["used"] += len(appended.ids)
            state["messages"] = appended.messages
            still.append(i)
        active = still
    right = sum(score_sample(p.data_source, s["text"], p.ground_truth) >= 1.0 for p, s in zip(prompts, states))
    count = len(prompts)
    return {"success": right / count, "called": called / count, "well_formed": well_formed / count}


def main(overrides: list[str]) -> None:
    torch.set_num_threads(1)
    config, _ = resolve_config([EXAMPLE, *overrides], local=True)
    config, data = checked(config)
    settings = loop_settings(config)
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    tools = Tools(str(multi_turn.tool_config_path))
    worker = RankWorker(Ranks.single("cpu"))
    worker.run("init_run", {"run_id": "lookup-warm-start", "run_config_yaml": to_yaml(config), "roles": ["actor"],
                            "seed": config.trainer.seed}, {})
    model = worker.roles.need("actor").model
    tokenizer = data.tokenizer
    print(yaml.safe_dump({"model": {k: v for k, v in config.model_dump()["actor_rollout_ref"]["model"].items()
                                    if k == "path"}, "warm_start": config.actor_rollout_ref.actor.warm_start.model_dump(),
                          "held_out": len(data.val_prompts), "train_rows": len(data.prompts)}, sort_keys=False))

    def held_out() -> dict[str, float]:
        model.eval()
        return evaluate(model, tokenizer, data.val_prompts, tools, config.data.max_response_length,
                        multi_turn.max_assistant_turns or 3)

    print("before the warm start:", held_out(), flush=True)
    warm = WarmStart(settings=settings, actor=InProcessActor(worker), prompts=data.prompts, tokenizer=tokenizer,
                     notices=Printed(), timeout_s=0.0)
    started, cpu_started = time.monotonic(), time.process_time()
    asyncio.run(warm.run(tools.schemas))
    seconds, cpu_seconds = time.monotonic() - started, time.process_time() - cpu_started
    evaluated = time.monotonic()
    result = held_out()
    print(f"after the warm start ({seconds:.1f} s, {cpu_seconds:.1f} s of CPU): {result} "
          f"(evaluated in {time.monotonic() - evaluated:.1f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the example")
    main(parser.parse_args().overrides)
