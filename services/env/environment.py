"""Environments: what an episode steps through, one assistant message at a time.

The interface (gym-like, for stateful multi-turn tasks; a user's class has these two methods)::

    class MyEnvironment:
        def __init__(self, **options): ...                     # once per episode
        def reset(self, row: dict) -> list[dict]: ...          # the messages before the model's first turn
        def step(self, message: dict) -> StepResult | dict: ...  # the model's turn in; the reply out

Messages are OpenAI chat messages, ``{"role": ..., "content": ...}`` (a tool reply adds ``"name"``). ``step``
may return a ``StepResult`` or a dict with its fields (``messages``; optionally ``reward``, ``done``, ``info``).

``ToolEnvironment`` is the common case: its step parses the Hermes tool calls of the model's message
(services/run/tool_calls.py), runs each on its tool (services/env/tools.py) and replies with one tool message
per call. A message without tool calls is a final answer: the episode is done. Nothing the model wrote and
nothing a tool does raises out of its step: a malformed call, an unknown tool, a tool that raises or returns
garbage each becomes an error reply, counted in ``info``. Both kinds run in an episode's worker process
(services/env/episodes.py), which also bounds each call's time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

from services.env.config import ToolConfig
from services.env.tools import CodeInterpreterTool, CodeRunner, ToolReply, as_reply, create_kwargs, tool_class
from services.run.tool_calls import ParseError, parse_tool_calls


class Message(NamedTuple):
    """One chat message."""

    role: str  # system, user, assistant or tool
    content: str
    name: str = ""  # a tool reply's tool


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step gave back."""

    messages: list[Message]  # the reply: tool messages, or the environment's observation
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # JSON-serializable facts: tool calls, errors, ...


class Environment(Protocol):
    """An episode's environment. ``reset`` is called once, when the episode starts; ``step`` once per assistant
    message (``{"role": "assistant", "content": ...}``), until a result says done."""

    def reset(self, row: dict) -> list[Message]: ...

    def step(self, message: dict) -> StepResult: ...


ROLES = ("system", "user", "assistant", "tool")


def as_messages(value: Any) -> list[Message]:
    """A list of messages from what a user's class returned (Messages or dicts), their text made valid Unicode
    (``valid_text``: the service reads every message a worker sends through here); ValueError for anything
    else."""
    if not isinstance(value, list):
        raise ValueError(f"returned {type(value).__name__}, not a list of messages")
    messages = []
    for item in value:
        role, content, name = ((item.get("role"), item.get("content"), item.get("name", "")) if isinstance(item, dict)
                               else item if isinstance(item, Message) else (None, None, None))
        if role not in ROLES or not isinstance(content, str) or not isinstance(name, str):
            raise ValueError(f"returned a message {str(item)[:200]!r}, not {{role: {'|'.join(ROLES)}, content: str}}")
        messages.append(Message(role, valid_text(content), valid_text(name)))
    return messages


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate written as its ``\\udXXX`` escape: a tool that echoes what it was given,
    or reads file names the host cannot decode, may return one, and no UTF-8 wire (a gRPC reply) carries it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def as_step_result(value: Any) -> StepResult:
    """A step's result from what a user's class returned (a StepResult or a dict of its fields); ValueError else."""
    if isinstance(value, dict):
        value = StepResult(messages=value.get("messages", []), reward=value.get("reward", 0.0),
                           done=value.get("done", False), info=value.get("info", {}))
    if not isinstance(value, StepResult):
        raise ValueError(f"returned {type(value).__name__}, not a StepResult or a dict of its fields")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"returned reward {reward!r}, not a finite number")
    if not isinstance(value.done, bool) or not isinstance(value.info, dict):
        raise ValueError("returned done that is not a bool or info that is not a dict")
    json.dumps(value.info)  # TypeError (INVALID data) if it cannot travel
    return StepResult(messages=as_messages(value.messages), reward=float(reward), done=value.done, info=value.info)


class ToolLimits(NamedTuple):
    """Bounds on one assistant message's tool calls."""

    max_parallel_calls: int
    max_call_bytes: int
    max_reply_chars: int


Report = Callable[[str, Any], None]
"""Told ("calling", tool name) before each tool call and ("reply", Message) after it (the worker passes them on,
so that a call that hangs costs only itself)."""


class ToolEnvironment:
    """An environment whose step runs the tool calls of the model's message, one tool message per call."""

    def __init__(self, tools: list[ToolConfig], limits: ToolLimits, report: Report = lambda kind, value: None,
                 *, code_runner: CodeRunner | None = None):
        self.tools = tools
        self.limits = limits
        self.report = report
        self.code_runner = code_runner  # how its code interpreter runs code (None: in the code sandbox, from here)
        self.instances: dict[str, Any] = {}
        self.broken: dict[str, str] = {}  # tool name -> why it could not be built for this episode

    def reset(self, row: dict) -> list[Message]:
        """Build each tool for this episode with the row's create_kwargs; no messages of its own."""
        for tool in self.tools:
            try:
                cls = tool_class(tool)
                runs_code = {"run": self.code_runner} if cls is CodeInterpreterTool and self.code_runner else {}
                self.instances[tool.name] = cls(dict(tool.config), create_kwargs(row, tool.name), **runs_code)
            except Exception as error:  # noqa: BLE001 - told to the model at each call of the tool
                self.broken[tool.name] = f"{type(error).__name__}: {error}"
        return []

    def step(self, message: dict) -> StepResult:
        parsed = parse_tool_calls(str(message.get("content", "")), tool_names=frozenset(t.name for t in self.tools),
                                  max_parallel_calls=self.limits.max_parallel_calls,
                                  max_call_bytes=self.limits.max_call_bytes)
        if not parsed.calls:
            return StepResult(messages=[], done=True, info={"calls": []})
        replies, calls, reward = [], [], 0.0
        for call in parsed.calls:
            if isinstance(call, ParseError):
                reply, outcome, name = ToolReply(call.message), "error", ""
            else:
                self.report("calling", call.name)
                reply, outcome = self._call(call.name, dict(call.arguments))
                name = call.name
            message_out = Message("tool", self._cut(reply.text), name)
            self.report("reply", message_out)
            replies.append(message_out)
            calls.append({"tool": name, "outcome": outcome})
            reward += reply.reward
        return StepResult(messages=replies, reward=reward, info={"calls": calls})

    def _call(self, name: str, arguments: dict) -> tuple[ToolReply, str]:
        """The tool's reply and "ok", or an error reply and "error" (it could not be built, raised, or returned
        garbage)."""
        if name in self.broken:
            return ToolReply(f"error: tool {name} is unavailable: {self.broken[name]}"), "error"
        try:
            return as_reply(self.instances[name].call(arguments)), "ok"
        except Exception as error:  # noqa: BLE001 - the model is told, as verl does
            return ToolReply(f"error: tool {name} failed: {type(error).__name__}: {error}"), "error"

    def _cut(self, text: str) -> str:
        limit = self.limits.max_reply_chars
        return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} characters cut)"
