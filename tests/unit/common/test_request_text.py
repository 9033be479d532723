"""CPU tests of services/common/request_text.py: a request's YAML and JSON, read within the limits."""

from __future__ import annotations

import pytest

from services.common.limits import MAX_NESTING, MAX_YAML_CHARS
from services.common.request_text import json_object, request_yaml, yaml_value


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """``levels`` lists of ``width`` aliases of the list before: 500 characters that are 9^9 strings written out."""
    lines = ['l0: &l0 "lol"']
    lines += [f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]" for level in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def interpolation_bomb(levels: int = 9, width: int = 9) -> str:
    """As ``alias_bomb``, with OmegaConf's interpolations: each list holds ``width`` references to the one before."""
    lines = ["l0: lol"]
    lines += [f"l{level}: [{', '.join([repr(f'${{l{level - 1}}}')] * width)}]" for level in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_the_alias_bomb_is_refused_naming_the_limit():
    assert len(alias_bomb()) < 600
    with pytest.raises(ValueError, match=rf"run config is more than {MAX_YAML_CHARS} characters long once its "
                                         r"aliases are written out \(limit MAX_YAML_CHARS\)"):
        request_yaml(alias_bomb(), "run config")


def test_aliases_count_what_they_stand_for_against_the_length_limit():
    """A 1,000-character value aliased 60 times is about 60,000 characters written out: taken; 70 times is about
    70,000, over the 65,536 a request's YAML may hold: refused."""
    def aliased(times: int) -> str:
        return f"value: &v \"{'x' * 1000}\"\ncopies: [{', '.join(['*v'] * times)}]\n"

    assert yaml_value(aliased(60), "config")["copies"] == ["x" * 1000] * 60
    with pytest.raises(ValueError, match="aliases are written out"):
        yaml_value(aliased(70), "config")


def test_an_interpolation_bomb_is_refused_before_it_is_resolved():
    with pytest.raises(ValueError, match=rf"run config is more than {MAX_YAML_CHARS} characters long once its "
                                         r"interpolations are resolved \(limit MAX_YAML_CHARS; at l\d"):
        request_yaml(interpolation_bomb(), "run config")
    strings = 'l0: "lol"\n' + "".join(f'l{n}: "{f"${{l{n - 1}}}" * 9}"\n' for n in range(1, 10))
    with pytest.raises(ValueError, match="once its interpolations are resolved"):
        request_yaml(strings, "run config")


@pytest.mark.parametrize(("text", "message"), [
    ("trainer: {experiment_name: '${oc.env:HOME}'}",
     r"run config: trainer.experiment_name: '\$\{oc.env:HOME\}': a request's interpolations may only name another "
     r"key, as \$\{section.key\} \(no resolvers, such as oc.env\)"),
    ("a: '${b.${c}}'\nb: {x: 1}\nc: x", r"run config: a: .* may only name another key"),
    ("a: {b: '${a}'}", r"run config: a.b: \$\{a\} refers back to itself"),
    ("a: '${b}'\nb: '${a}'", r"run config: b: \$\{a\} refers back to itself"),
    ("[1, 2]", "run config must be a mapping at the top, not list"),
])
def test_a_request_interpolation_that_reads_more_than_the_config_is_refused_naming_the_key(text, message):
    with pytest.raises(ValueError, match=message):
        request_yaml(text, "run config")


def test_aliases_and_key_interpolations_within_the_limits_are_read_as_written():
    text = ("model: &model {path: /models/a}\ncritic: {model: *model}\n"
            "data: {max_prompt_length: 512, name: 'p${data.max_prompt_length}', literal: '\\${oc.env:HOME}'}\n")
    assert request_yaml(text, "run config") == {
        "model": {"path": "/models/a"}, "critic": {"model": {"path": "/models/a"}},
        "data": {"max_prompt_length": 512, "name": "p${data.max_prompt_length}", "literal": "\\${oc.env:HOME}"}}
    assert request_yaml("", "run config") == {}


def test_nesting_is_bounded_however_deep_the_text_its_aliases_or_its_interpolations_go():
    with pytest.raises(ValueError, match=rf"x nests deeper than {MAX_NESTING} levels \(limit MAX_NESTING\)"):
        yaml_value("a: " + "[" * 30_000 + "]" * 30_000, "x")
    with pytest.raises(ValueError, match=rf"x nests deeper than {MAX_NESTING} levels"):
        yaml_value("a: &a " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30, "x")
    with pytest.raises(ValueError, match=rf"x nests deeper than {MAX_NESTING} levels once its interpolations"):
        request_yaml("a: " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "'${a}'" + "]" * 30, "x")
    chain = "".join(f"k{n}: '${{k{n - 1}}}'\n" for n in range(99, 0, -1))  # each names one not measured yet
    with pytest.raises(ValueError, match=rf"x: k\d+ nests or follows interpolations more than {MAX_NESTING} levels"):
        request_yaml("k0: 1\n" + chain, "x")


def test_a_read_past_its_time_budget_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"run config took longer than 0 s to read \(limit MAX_YAML_PARSE_S\)"):
        yaml_value("a: 1", "run config", budget_s=0)


@pytest.mark.parametrize(("text", "message"), [
    ("{", "row_json is not valid JSON"), ("[1]", "row_json must be a JSON object"),
    ('{"a": ' + "[" * MAX_NESTING + "]" * MAX_NESTING + "}", f"row_json nests deeper than {MAX_NESTING} levels"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", f"row_json nests deeper than {MAX_NESTING} levels")])
def test_a_json_object_that_is_none_or_too_deep_is_refused_naming_the_field(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        json_object(text, "row_json")
