"""OpenAI's chat-completions wire format at the gateway's edge: requests checked into ``ChatRequest``, answers and
errors built as OpenAI's clients read them. Pure functions, no I/O.

What is accepted: ``model``, ``messages``, ``tools``, ``tool_choice``, ``n``, ``temperature``, ``top_p``,
``max_tokens`` / ``max_completion_tokens``, ``logprobs``, ``top_logprobs`` (0 only), ``stop``, ``stream``,
``stream_options.include_usage``, and vLLM's ``return_token_ids`` (the prompt's ids as rendered and each choice's
sampled ids in the answer). Other fields OpenAI defines are ignored, as OpenAI ignores what it does not use for a
model; a field of the wrong type is refused naming it.

``tool_choice`` (``ToolChoice``): ``auto`` (the default) offers the tools (the chat template renders them into the
prompt) and parses the model's Hermes calls into ``tool_calls``; ``none`` offers none (the prompt is rendered
without them) and returns the model's text as content; ``required`` and a named function (``{"type": "function",
"function": {"name": ...}}``) are constrained by the turn's opening: the model's turn is made to begin with a
call's ``<tool_call>`` (required), or with a call of that function up to its arguments (named), fed to the
model as prompt tokens (in the sample, untrained) and the model samples the rest freely. What it samples is
still the policy's choice: a call it leaves malformed comes back as content, as any malformed call does.
``required`` or a named function without ``tools``, or a name that is not one of them, is refused (400,
``param: tool_choice``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from services.run.tool_calls import ParseError, ToolCall, parse_tool_calls

MAX_STOP_STRINGS = 4  # as OpenAI's API allows
TOOL_CALL_OPEN = "<tool_call>"  # a Hermes call's opening, as ``hermes_text`` writes calls


class RequestError(Exception):
    """A request the gateway refuses: HTTP ``status`` with an OpenAI error object (``type``, ``code``, ``param``)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def body(self) -> dict:
        return error_body(str(self), kind=self.kind, code=self.code, param=self.param)


def error_body(message: str, *, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ToolChoice(NamedTuple):
    """What a request's ``tool_choice`` asks of its completion."""

    offered: bool  # the tools go into the prompt and the model's calls are parsed (False: tool_choice none)
    opening: str  # the text the model's turn is made to begin with ("": none; required: a call's opening;
    # a named function: its call up to the arguments)


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """One checked ``POST /v1/chat/completions`` body."""

    model: str
    messages: tuple[dict, ...]  # as sent
    tools: tuple[dict, ...]  # OpenAI function schemas, rendered into the prompt by the chat template
    tool_choice: ToolChoice
    n: int
    temperature: float | None  # None: the run's
    top_p: float | None
    max_tokens: int | None  # None: what the episode's budget leaves
    logprobs: bool
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


def chat_request(body: bytes, max_n: int) -> ChatRequest:
    """The request in ``body``; RequestError (400) naming the field that is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise RequestError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_json")
    model = _field(data, "model", str, required=True)
    messages = _messages(data.get("messages"))
    tools = _tools(data.get("tools"))
    n = _field(data, "n", int, default=1)
    if not 1 <= n <= max_n:
        raise RequestError(400, f"n must be between 1 and {max_n} (the gateway's max_n), got {n}", param="n",
                           code="n_too_large" if n > max_n else None)
    temperature = _number(data, "temperature", 0.0, high=2.0)
    top_p = _number(data, "top_p", 0.0, high=1.0)
    if top_p == 0.0:
        raise RequestError(400, "top_p must be above 0", param="top_p")
    max_tokens = _field(data, "max_completion_tokens", int) if data.get("max_completion_tokens") is not None else \
        _field(data, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if _field(data, "top_logprobs", int, default=0):
        raise RequestError(400, "top_logprobs is not served: the gateway returns each sampled token's logprob "
                                "(logprobs: true), not the alternatives", param="top_logprobs")
    stream_options = _field(data, "stream_options", dict, default={})
    return ChatRequest(model=model, messages=messages, tools=tools, tool_choice=_tool_choice(data.get("tool_choice"),
                                                                                           tools),
                       n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                       logprobs=bool(_field(data, "logprobs", bool, default=False)), stop=_stop(data.get("stop")),
                       stream=bool(_field(data, "stream", bool, default=False)),
                       include_usage=bool(stream_options.get("include_usage", False)),
                       return_token_ids=bool(_field(data, "return_token_ids", bool, default=False)))


def _field(data: dict, name: str, kind: type, *, required: bool = False, default: Any = None) -> Any:
    value = data.get(name)
    if value is None:
        if required:
            raise RequestError(400, f"{name} is required", param=name)
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(400, f"{name} must be a {kind.__name__}, got {type(value).__name__}", param=name)
    return value


def _number(data: dict, name: str, low: float, *, high: float) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def _messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "messages must be a non-empty list of chat messages", param="messages")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                          "tool"):
            raise RequestError(400, f"messages[{index}] must be an object with a role of system, developer, user, "
                                    f"assistant or tool", param=f"messages[{index}]")
    return tuple(value)


def _tools(value: Any) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(400, "tools must be a list of function schemas", param="tools")
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(function.get("name"),
                                                                                                str):
            raise RequestError(400, f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}',
                               param=f"tools[{index}]")
    return tuple(value)


def _tool_choice(value: Any, tools: tuple[dict, ...]) -> ToolChoice:
    names = [str(tool["function"]["name"]) for tool in tools]
    if value is None or value == "auto":
        return ToolChoice(offered=True, opening="")
    if value == "none":
        return ToolChoice(offered=False, opening="")
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if value != "required" and not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise RequestError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', param="tool_choice")
    if not tools:
        raise RequestError(400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice")
    if function is None:
        return ToolChoice(offered=True, opening=TOOL_CALL_OPEN)
    if function["name"] not in names:
        raise RequestError(400, f"tool_choice names the function {function['name']!r}, which is not one of the "
                                f"request's tools ({', '.join(names)})", param="tool_choice")
    return ToolChoice(offered=True, opening=TOOL_CALL_OPEN + '{"name": ' + json.dumps(function["name"])
                      + ', "arguments": ')


def _stop(value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else () \
        if value is None else None
    if stops is None or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                           param="stop")
    return stops


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts (None: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and part.get("type") == "text")
    raise RequestError(400, "a message's content must be a string or a list of content parts", param="messages")


def hermes_text(content: str, tool_calls: list) -> str:
    """An assistant message's text in the model's own format: its content, then each call as a Hermes block."""
    blocks = []
    for call in tool_calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # rendered as the string it is
        blocks.append(TOOL_CALL_OPEN + json.dumps({"name": function.get("name", ""), "arguments": arguments})
                      + "</tool_call>")
    return content + "".join(blocks)


class Choice(NamedTuple):
    """One sampled completion, decoded."""

    text: str  # what the model wrote, special tokens skipped, cut before a stop string
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]  # each sampled token as text (the logprobs' ``token``; empty where none were asked)
    logprobs: tuple[float, ...]
    finish_reason: str  # stop or length (tool_calls where calls are parsed out)


def assistant_message(text: str, *, tool_names: frozenset[str], parse_tools: bool, call_id: str) -> dict:
    """The assistant message of a completion: its Hermes tool calls as OpenAI's ``tool_calls`` (ids
    ``{call_id}_{k}``) where every block parses, else the whole text as content."""
    if parse_tools and TOOL_CALL_OPEN in text:
        parsed = parse_tool_calls(text, tool_names=tool_names, max_parallel_calls=64, max_call_bytes=1 << 20)
        calls = [c for c in parsed.calls if isinstance(c, ToolCall)]
        if calls and not any(isinstance(c, ParseError) for c in parsed.calls):
            return {"role": "assistant", "content": parsed.content.strip() or None,
                    "tool_calls": [{"id": f"{call_id}_{k}", "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                                   for k, c in enumerate(calls)]}
    return {"role": "assistant", "content": text}


def completion(*, completion_id: str, model: str, messages: list[dict], choices: list[Choice],
               prompt_ids: tuple[int, ...], logprobs: bool, return_token_ids: bool) -> dict:
    """A ``chat.completion`` object; ``messages``: each choice's assistant message."""
    answer = {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
              "choices": [_choice(index, message, choice, logprobs=logprobs, return_token_ids=return_token_ids)
                          for index, (message, choice) in enumerate(zip(messages, choices))],
              "usage": usage(prompt_ids, choices)}
    if return_token_ids:
        answer["prompt_token_ids"] = list(prompt_ids)
    return answer


def finish_reason(message: dict, choice: Choice) -> str:
    return "tool_calls" if message.get("tool_calls") else choice.finish_reason


def _choice(index: int, message: dict, choice: Choice, *, logprobs: bool, return_token_ids: bool) -> dict:
    entry = {"index": index, "message": message, "logprobs": logprob_content(choice) if logprobs else None,
             "finish_reason": finish_reason(message, choice)}
    if return_token_ids:
        entry["token_ids"] = list(choice.token_ids)
    return entry


def logprob_content(choice: Choice) -> dict:
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                        for token, logprob in zip(choice.tokens, choice.logprobs)]}


def usage(prompt_ids: tuple[int, ...], choices: list[Choice]) -> dict:
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens}


def stream_chunks(*, completion_id: str, model: str, messages: list[dict], choices: list[Choice],
                  prompt_ids: tuple[int, ...], logprobs: bool, include_usage: bool) -> list[dict]:
    """The same completion as ``chat.completion.chunk`` objects, in order: per choice its role, its content (with
    its logprobs), its tool calls, its finish reason; then, where asked, the usage."""
    created = int(time.time())

    def chunk(index: int, delta: dict, reason: str | None = None, *, extra: dict | None = None) -> dict:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
                             **(extra or {})}]}

    chunks = []
    for index, (message, choice) in enumerate(zip(messages, choices)):
        chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        if message.get("content"):
            chunks.append(chunk(index, {"content": message["content"]},
                                extra={"logprobs": logprob_content(choice)} if logprobs else None))
        for k, call in enumerate(message.get("tool_calls") or []):
            chunks.append(chunk(index, {"tool_calls": [{"index": k, **call}]}))
        chunks.append(chunk(index, {}, finish_reason(message, choice)))
    if include_usage:
        chunks.append({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_ids, choices)})
    return chunks


def models(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "meshrl"}]}
