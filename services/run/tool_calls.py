"""Tool calls parsed out of an assistant turn's text: each one a call or an error the model will be shown.

A tool call is model output, so untrusted. Parsing never raises on what the model wrote: every ``<tool_call>``
block becomes either a ``ToolCall`` (its arguments valid Unicode: a lone surrogate, which JSON's ``\\u`` escapes
can write, is an error) or a ``ParseError`` whose ``message`` names what was wrong, and the agent
loop sends that message back as the tool's reply (as verl does) and counts it. The bounds hold before any JSON
is parsed: a block over ``max_call_bytes`` (UTF-8) is refused unread, and past ``max_parallel_calls`` blocks the
rest of the turn is one error, not thousands.

Formats are named as verl's ``actor_rollout_ref.rollout.multi_turn.format`` names them. verl registers
``hermes``, ``gpt-oss``, ``qwen3_coder`` and ``glm``; this module parses ``hermes`` (Qwen2.5/Qwen3:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn) and refuses the others by
name until they are written.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple

FORMATS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
QUOTED_LIMIT = 200  # characters of the offending text quoted back in an error message


class ToolCall(NamedTuple):
    """One well-formed call of a known tool."""

    name: str
    arguments: Mapping[str, Any]  # a JSON object, as parsed


class ParseError(NamedTuple):
    """A ``<tool_call>`` block that cannot be run; ``message`` is what the model is told."""

    message: str


class ParsedTurn(NamedTuple):
    """An assistant turn split into its text and its calls, in the order written."""

    content: str  # the text outside the tool-call blocks
    calls: tuple[ToolCall | ParseError, ...]


def check_format(name: str) -> None:
    """Refuse a ``multi_turn.format`` this module does not parse, naming those it does."""
    if name not in FORMATS:
        raise ValueError(f"tool-call format {name!r} is not supported; supported: {', '.join(FORMATS)}")


def parse_tool_calls(text: str, *, tool_names: frozenset[str], max_parallel_calls: int,
                     max_call_bytes: int) -> ParsedTurn:
    """The Hermes tool calls in ``text``: at most ``max_parallel_calls`` parsed, any beyond one ``ParseError``.

    A block opened and never closed (generation stopped inside it) is an error too. Text with no
    ``<tool_call>`` is a final answer: no calls.
    """
    blocks, content = _split_blocks(text)
    calls: list[ToolCall | ParseError] = [
        _parse_block(block, tool_names, max_call_bytes) for block in blocks[:max_parallel_calls]]
    if len(blocks) > max_parallel_calls:
        calls.append(ParseError(
            f"{len(blocks)} tool calls in one turn, at most {max_parallel_calls}: the first "
            f"{max_parallel_calls} were taken, the other {len(blocks) - max_parallel_calls} were not run"))
    return ParsedTurn(content=content, calls=tuple(calls))


def _split_blocks(text: str) -> tuple[list[str | None], str]:
    """The bodies of the ``<tool_call>`` blocks (None for one left open at the end) and the text around them.

    A linear scan with ``str.find``: no regular expression, so no backtracking on hostile text.
    """
    blocks: list[str | None] = []
    outside: list[str] = []
    position = 0
    while (start := text.find(OPEN, position)) >= 0:
        outside.append(text[position:start])
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            blocks.append(None)
            return blocks, "".join(outside)
        blocks.append(text[start + len(OPEN):end])
        position = end + len(CLOSE)
    outside.append(text[position:])
    return blocks, "".join(outside)


def _parse_block(block: str | None, tool_names: frozenset[str], max_call_bytes: int) -> ToolCall | ParseError:
    """One block's call, or what is wrong with it."""
    if block is None:
        return ParseError(f"a {OPEN} was not closed with {CLOSE}")
    size = len(block.encode("utf-8", errors="replace"))
    if size > max_call_bytes:
        return ParseError(f"tool call of {size} bytes, at most {max_call_bytes}")
    try:
        call = json.loads(block, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        return ParseError(f"tool call is not valid JSON ({_first_line(error)}): {_quoted(block)}")
    if not isinstance(call, dict):
        return ParseError(f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}: {_quoted(block)}')
    name = call.get("name")
    if not isinstance(name, str):
        return ParseError(f'tool call has no "name" string: {_quoted(block)}')
    if name not in tool_names:
        return ParseError(f"unknown tool {_quoted(name)}; tools: {', '.join(sorted(tool_names)) or 'none'}")
    arguments = _arguments(call.get("arguments", {}))
    if arguments is None:
        return ParseError(f'the "arguments" of {name} must be a JSON object: {_quoted(block)}')
    try:
        invalid = _invalid_unicode(arguments)
    except RecursionError:  # parsed at the edge of the recursion limit, the check one frame deeper
        return ParseError(f"the arguments of {name} are nested too deep: {_quoted(block)}")
    if invalid is not None:
        return ParseError(f"the arguments of {name} hold {invalid!r}, a \\u escape of half a surrogate pair, which is "
                          f"no Unicode character (write the pair, or the character itself): {_quoted(block)}")
    return ToolCall(name=name, arguments=arguments)


def _invalid_unicode(arguments: dict[str, Any]) -> str | None:
    """The first lone surrogate in the arguments' keys and strings (JSON's ``\\ud800`` parses to one; no text
    encoding, so no tool, reply or wire, can carry it), or None where there is none."""
    try:
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        return str(error.object[error.start:error.end])
    return None


def _arguments(value: Any) -> dict[str, Any] | None:
    """The arguments as an object; a string holding a JSON object (OpenAI's wire form) counts. None if neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _refuse_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's parser accepts them): refused, so arguments re-serialize strictly."""
    raise ValueError(f"{name} is not a JSON value")


def _quoted(text: str) -> str:
    """``text`` quoted, cut to QUOTED_LIMIT characters so an error reply stays small."""
    return repr(text if len(text) <= QUOTED_LIMIT else text[:QUOTED_LIMIT] + "...")


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
