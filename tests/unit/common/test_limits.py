"""CPU tests of services/common/limits.py: what a request may ask for."""

from __future__ import annotations

import json

import pytest

from services.common.errors import ResourceExhausted
from services.common.limits import (MAX_WAIT_S, check_at_most, check_temperature, check_wait,
                                    nesting_depth)


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0.0, -1.0, MAX_WAIT_S * 2])
def test_a_wait_that_is_no_number_of_seconds_is_refused(seconds):
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds in"):
        check_wait("timeout_s", seconds)


def test_a_wait_within_a_day_is_taken():
    assert [check_wait("timeout_s", s) for s in (0.001, 120.0, MAX_WAIT_S)] == [0.001, 120.0, MAX_WAIT_S]


@pytest.mark.parametrize("temperature", [1e-300, 1e-4, float("inf"), float("nan"), -1.0])
def test_a_temperature_too_small_to_divide_by_or_no_number_is_refused(temperature):
    with pytest.raises(ValueError, match=r"params.temperature must be 0 \(greedy\) or a finite number >= 0.001"):
        check_temperature("params.temperature", temperature)


def test_greedy_and_ordinary_temperatures_are_taken():
    assert [check_temperature("t", t) for t in (0.0, 1e-3, 0.7, 50.0)] == [0.0, 1e-3, 0.7, 50.0]


def test_over_a_limit_names_the_field_the_limit_and_the_setting():
    assert check_at_most("params.n", 1024, 1024, setting="max_n") == 1024
    with pytest.raises(ResourceExhausted, match=r"params.n = 1025 is over this service.s limit of 1024 .setting max_n"):
        check_at_most("params.n", 1025, 1024, setting="max_n")


def test_nesting_depth_counts_levels_of_lists_and_objects():
    assert nesting_depth(3) == 0
    assert nesting_depth({"a": 1}) == 1
    assert nesting_depth({"a": [1], "b": {"c": [[]]}}) == 4
    assert nesting_depth(json.loads('{"a": ' + "[" * 9 + "]" * 9 + "}")) == 10
