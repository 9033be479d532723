"""The reward servicer's reading of a request: a sample's extra_info."""

from __future__ import annotations

import json

import pytest

from meshrl.v1 import reward_pb2
from services.common.limits import MAX_NESTING
from services.reward.server import extra_info_of


def nested(depth: int) -> str:
    """A JSON object ``depth`` levels deep: {"a": [[...]]}."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 100_000])
def test_extra_info_nested_too_deep_is_refused_naming_the_sample(depth):
    with pytest.raises(ValueError, match=rf"samples\[7\].extra_info_json nests deeper than {MAX_NESTING}"):
        extra_info_of(reward_pb2.Sample(extra_info_json=nested(depth)), 7)


def test_extra_info_at_the_depth_limit_is_read():
    text = nested(MAX_NESTING)
    assert extra_info_of(reward_pb2.Sample(extra_info_json=text), 0) == json.loads(text)
