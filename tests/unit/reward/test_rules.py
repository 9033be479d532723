"""CPU tests of services/reward/rules.py (GSM8K per verl's rule, reverse partial credit, dispatch)."""

from __future__ import annotations

import re
import time

import pytest

from services.reward import rules
from services.reward.rules import extract_gsm8k_answer as extract


# ---------------------------------------------------------------------------
# extraction


def test_strict_requires_marker_and_takes_the_last_one():
    text = "First try #### 12\nno wait, 7 + 8 = 15\n#### 15\nthat is all, 99 apples"
    assert extract(text, "strict") == "15"  # the last "#### N", not the trailing 99
    assert extract("The answer is 15.", "strict") is None  # no marker
    assert extract("####15", "strict") is None  # marker needs the space
    assert extract("#### ", "strict") is None  # marker without a number
    assert extract("####", "strict") is None
    assert extract("", "strict") is None


def test_flexible_takes_the_last_number():
    assert extract("3 + 4 = 7, so she has 7 apples and 2 pears", "flexible") == "2"
    assert extract("#### 15 but actually 16", "flexible") == "16"
    assert extract("no digits here", "flexible") is None
    assert extract("", "flexible") is None
    assert extract("#### ", "flexible") is None
    # a lone "." is skipped, the number before it is taken
    assert extract("It is 5 . ", "flexible") == "5"


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_commas_negatives_and_decimals(method):
    assert extract("so #### 1,234,567", method) == "1234567"
    assert extract("so #### -42", method) == "-42"
    assert extract("so #### 0.25", method) == "0.25"
    assert extract("so #### -1,000.5", method) == "-1000.5"


def test_dollar_sign_is_not_part_of_the_number():
    # "$" is outside the number pattern: flexible finds the digits after it; strict, like verl,
    # requires a digit right after "#### ".
    assert extract("It costs $18 in total", "flexible") == "18"
    assert extract("It costs $1,200", "flexible") == "1200"
    assert extract("#### $18", "strict") is None


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_answer_only_before_the_last_300_chars_is_not_found(method):
    assert rules.GSM8K_TAIL_CHARS == 300
    assert extract("#### 42" + "x" * 300, method) is None
    assert extract("#### 42" + "x" * 293, method) == "42"  # 7 + 293 = 300 chars: exactly in the tail


def test_tail_is_counted_in_characters_not_bytes():
    # "é" is 2 bytes in UTF-8 but one character: "#### 42" + 293 of them is 300 characters.
    assert extract("#### 42" + "é" * 293, "strict") == "42"
    # one more character cuts the first "#": strict loses the marker, flexible still sees 42
    assert extract("#### 42" + "é" * 294, "strict") is None
    assert extract("#### 42" + "é" * 294, "flexible") == "42"


def test_unicode_text():
    text = "答案是：小明有 3 个苹果，再买 4 个 → 共 7 个 ✓\n#### 7 🍎"
    assert extract(text, "strict") == "7"
    assert extract(text, "flexible") == "7"


def test_huge_output_is_fast():
    text = ("12, 34. " * 125_000)[:1_000_000] + "#### 5"  # 1 MB of numbers
    start = time.perf_counter()
    for method in ("strict", "flexible"):
        assert extract(text, method) == "5"
    assert extract("9" * 1_000_000, "flexible") == "9" * 300
    assert time.perf_counter() - start < 0.5


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="fuzzy"):
        extract("#### 1", "fuzzy")


def test_flexible_comma_without_number_is_no_answer():
    assert extract("Hello, world", "flexible") is None
    assert rules.gsm8k_score("Hello, world", "42", method="flexible", format_score=0.1) == 0.0


# ---------------------------------------------------------------------------
# scores


def test_gsm8k_score():
    assert rules.gsm8k_score("... #### 72", "72") == 1.0  # correct
    assert rules.gsm8k_score("... #### 71", "72") == 0.0  # wrong, format_score defaults to 0
    assert rules.gsm8k_score("... #### 71", "72", format_score=0.1) == 0.1  # found but wrong
    assert rules.gsm8k_score("the answer is 72", "72", format_score=0.1) == 0.0  # strict: not found
    assert rules.gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert rules.gsm8k_score("... #### 1,000", "1000", score=2.0) == 2.0
    assert rules.gsm8k_score("... #### 72", "72", format_score=0.1, score=0.5) == 0.5


def test_reverse_score_partial_credit():
    assert rules.reverse_score("cba", "cba") == 1.0
    assert rules.reverse_score("abxd", "abcd") == pytest.approx(3 / 4)  # 3 of 4 positions match
    assert rules.reverse_score("ab", "abcd") == pytest.approx(2 / 4)  # too short: over the longer length
    assert rules.reverse_score("abcdef", "abc") == pytest.approx(3 / 6)  # too long: over the longer length
    assert rules.reverse_score("bca", "abc") == 0.0  # shifted: no position matches
    assert rules.reverse_score("", "abc") == 0.0
    assert rules.reverse_score("", "") == 1.0


def test_score_sample_dispatch():
    assert rules.score_sample("openai/gsm8k", "#### 3", "3") == 1.0
    assert rules.score_sample("gsm8k", "#### 4", "3") == 0.0
    assert rules.score_sample("meshrl/reverse", "abxd", "abcd") == pytest.approx(0.75)


def test_score_sample_unknown_data_source_names_it():
    with pytest.raises(ValueError, match=re.escape("'no/such-source'")):
        rules.score_sample("no/such-source", "#### 3", "3")


def test_the_lookup_task_is_scored_by_exact_match_of_the_final_answer():
    assert rules.judge("meshrl/lookup", {}, " 0423\n", ground_truth="0423") == {"score": 1.0, "acc": True,
                                                                                "pred": "0423"}
    assert rules.judge("meshrl/lookup", {}, "0428", ground_truth="0423") == {"score": 0.0, "acc": False, "pred": "0428"}
    assert rules.score_sample("meshrl/lookup", "code 0423", "0423") == 0.0
