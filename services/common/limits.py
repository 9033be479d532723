"""What one request may ask for: the bounds each service checks at its edge, before any work starts.

A value that means nothing (NaN, infinite, negative, a temperature too small to divide by) is refused with
ValueError (INVALID_ARGUMENT); a request over a limit a setting could raise is refused with ResourceExhausted
(RESOURCE_EXHAUSTED), naming the field, the limit and the setting. The table of
docs/operations/request-limits.md lists them all. A streamed request is counted as it arrives
(``wire.read_stream``): of a stream over its limit no more than the limit's worth of bytes is ever held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import ResourceExhausted

MAX_ENV_WORKERS = 256
"""The most worker processes (open episodes) one env service runs: its ``workers`` setting's bound."""
MAX_WAIT_S = 86_400.0
"""The longest a JoinChannel, ReceiveWeights or BroadcastWeights may be asked to wait (a day)."""
MIN_TEMPERATURE = 1e-3
"""The least non-zero sampling temperature: below it logits / temperature overflows float32 and the logprobs are
NaN (0 asks for greedy decoding)."""
MAX_STOP_TOKENS = 1024
"""The most stop token ids one Generate call may give (each generated token is checked against them)."""
MAX_PROBE_TOP_K = 20
"""The most next tokens per position the weight check's probe may ask a rollout for (vLLM's default max_logprobs,
which bounds its prompt_logprobs)."""
MAX_NESTING = 64
"""The deepest nesting of lists and mappings in a structured value a request carries: a run config's YAML, a
sample's extra_info (a dataset row holds a few levels; far deeper overflows a parser's stack)."""
MAX_YAML_CHARS = 64 << 10
"""The longest YAML a request may carry (a whole run config written out is about 4 KB; pure-Python YAML reads
about 100 KB a second). Its aliases and interpolations count, written out in full (``request_text``)."""
MAX_YAML_PARSE_S = 10.0
"""The longest reading one request's YAML may take (a whole run config takes a few milliseconds; the longest YAML
allowed, about a second)."""
MESSAGE_FLOOR_BYTES = 1024
"""Each message of a request stream counts at least this much against its byte limit, so a stream of empty
messages is bounded too."""


@dataclass(frozen=True)
class StreamLimits:
    """What a client-streamed request may send: ``max_bytes`` in all, within ``timeout_s`` of its start."""

    max_bytes: int  # the setting max_request_bytes
    timeout_s: float  # the setting request_stream_timeout_s


def check_wait(field: str, seconds: float) -> float:
    """``seconds`` if it is a wait a request may ask for: positive, finite, at most MAX_WAIT_S."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_WAIT_S):
        raise ValueError(f"{field} must be a number of seconds in (0, {MAX_WAIT_S:.0f}], got {seconds}")
    return seconds


def check_temperature(field: str, temperature: float) -> float:
    """``temperature`` if it is 0 (greedy) or a finite number >= MIN_TEMPERATURE."""
    if not (temperature == 0 or (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"{field} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    return temperature


def check_at_most(field: str, value: int, limit: int, *, setting: str) -> int:
    """``value`` if it is within ``limit``; ResourceExhausted naming the ``setting`` that raises the limit."""
    if value > limit:
        raise ResourceExhausted(f"{field} = {value} is over this service's limit of {limit} (setting {setting})")
    return value


def nesting_depth(value) -> int:
    """Levels of lists and dicts in a JSON value: 0 for a scalar, 1 for ``{"a": 1}``, 2 for ``{"a": [1]}``."""
    depth, level = 0, [value]
    while containers := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]
    return depth
