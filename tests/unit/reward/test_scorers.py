"""CPU tests of the MATH, exact-match and format scorers in services/reward/rules.py.

Expected values are worked out by hand from the rules in the module docstring.
"""

from __future__ import annotations

import time

import pytest

from services.reward import rules
from services.reward.rules import last_boxed_only_string, math_score, normalize_math_answer, remove_boxed

ONE_MB = 1_000_000


# ---------------------------------------------------------------------------
# last_boxed_only_string / remove_boxed


def test_last_boxed_keeps_nested_braces_whole():
    text = r"so $\boxed{\frac{\sqrt{3}}{2}}$."
    assert last_boxed_only_string(text) == r"\boxed{\frac{\sqrt{3}}{2}}"
    assert remove_boxed(r"\boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"


def test_last_of_several_boxes_is_taken():
    text = r"first \boxed{1}, then \fbox{2}, finally \boxed{3} done"
    assert last_boxed_only_string(text) == r"\boxed{3}"
    assert last_boxed_only_string(r"\boxed{1} and then \fbox{2}") == r"\fbox{2}"  # \fbox counts too


def test_unbraced_box_form():
    assert last_boxed_only_string(r"the answer is $\boxed 5$") == r"\boxed 5"
    assert last_boxed_only_string(r"the answer is \boxed 12.") == r"\boxed 12"  # final period dropped
    assert remove_boxed(r"\boxed 5") == "5"
    assert last_boxed_only_string(r"\boxed {7}") == r"\boxed{7}"  # a space before the brace is allowed


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no box here, the answer is 5",
        r"\boxed{\frac{1}{2}",  # unclosed (truncated response)
        r"\boxed{1} then a truncated \boxed{2",  # the last box is unclosed: earlier ones are not used
        r"ends with \boxed",
        r"\boxedx{3}",  # another command
    ],
)
def test_malformed_has_no_box(text):
    assert last_boxed_only_string(text) is None


def test_remove_boxed_refuses_non_box():
    assert remove_boxed(r"\fbox{a}") == "a"
    with pytest.raises(ValueError, match="not a boxed answer"):
        remove_boxed("5")


# ---------------------------------------------------------------------------
# normalize_math_answer (cases worked out by hand)


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{1}{2}", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),  # a plain integer ratio becomes \frac
        ("-3/4", r"-\frac{3}{4}"),
        ("x/2", "x/2"),  # not a plain integer ratio: left alone
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        (r"\frac{1}2", r"\frac{1}{2}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\sqrt[3]{2}", r"\sqrt[3]{2}"),  # an index is left alone
        (r"10\%", "10"),
        ("10%", "10"),
        ("x = 3", "3"),
        ("k=-2", "-2"),
        ("a+b = 3", "a+b=3"),  # left side longer than two characters: kept
        (" 5 ", "5"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^{\circ}", "90"),
        (r"90^\circ", "90"),
        (r"\$18.90", "18.90"),
        (r"10\text{ cm}", "10"),  # trailing unit dropped
        (r"\text{Devon}", "Devon"),  # a whole \text{} is unwrapped
        (".5", "0.5"),
        (r"\frac{.5}{2}", r"\frac{0.5}{2}"),
        ("0.5", "0.5"),  # decimals are not turned into fractions
        ("0.50", "0.50"),  # nor are trailing zeros dropped
        (r"3\!000", "3000"),
        ("1\n2", "12"),
        (r"\\frac{1}{2}", r"\frac{1}{2}"),  # a doubled backslash is collapsed
        ("", ""),
    ],
)
def test_normalize_math_answer(raw, normalised):
    assert normalize_math_answer(raw) == normalised


# ---------------------------------------------------------------------------
# math_score


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        (r"\boxed{10\%}", "10"),
        (r"\boxed{x = 3}", "3"),
        (r"\boxed{ 5 }", "5"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"\boxed{\frac12}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt2}", r"\sqrt{2}"),
        (r"\boxed{.5}", "0.5"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\boxed{\frac{\sqrt3}{2}}"),  # boxed ground truth
        (r"The answer is $\boxed 5$.", "5"),
        (r"\fbox{7}", "7"),
    ],
)
def test_math_correct(response, truth):
    assert math_score(response, truth) == 1.0


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{4}", "5"),
        (r"\boxed{5} no wait \boxed{6}", "5"),  # the last box counts
        ("the answer is 5", "5"),  # no box
        (r"\boxed{5", "5"),  # unbalanced
        ("", "5"),
        (r"\boxed{}", ""),  # an empty answer never scores
    ],
)
def test_math_wrong_or_malformed(response, truth):
    assert math_score(response, truth) == 0.0


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{0.50}", ".5"),  # the strings differ; the values do not
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{3}/2}", r"\frac{\sqrt{3}}{2}"),
    ],
)
def test_math_symbolic_equivalence(response, truth):
    assert math_score(response, truth) == 1.0
    assert math_score(response.replace("}", "}+1", 1) if "frac" in response else r"\boxed{7}", truth) == 0.0


def test_math_unicode_around_answer():
    response = "Résumé: 答案是 π≈3.14… donc 🎉 $\\boxed{\\frac{1}{2}}$ ✓ fin."
    assert math_score(response, "1/2") == 1.0
    assert math_score("ответ: \\boxed{Ω}", "Ω") == 1.0
    assert math_score("ответ: \\boxed{Ω}", "ω") == 0.0


def test_math_last_of_several_boxes():
    assert math_score(r"\boxed{1} ... \boxed{2} ... \boxed{3}", "3") == 1.0
    assert math_score(r"\boxed{1} ... \boxed{2} ... \boxed{3}", "1") == 0.0


def test_math_huge_response_is_fast():
    filler = "lorem {ipsum} \\frac dolor " * (ONE_MB // 26)
    start = time.perf_counter()
    assert math_score(filler + r"\boxed{42}", "42") == 1.0
    assert math_score(filler, "42") == 0.0  # no box at all
    assert math_score(r"\boxed{" + "1" * ONE_MB + "}", "42") == 0.0  # a huge box content
    assert math_score(r"\boxed{" + "{" * ONE_MB, "42") == 0.0  # a huge unclosed box
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------
# exact_match_score


def test_exact_match():
    assert rules.exact_match_score("Paris", "Paris") == 1.0
    assert rules.exact_match_score("  New \t York\n", "New York") == 1.0  # strip + collapse runs
    assert rules.exact_match_score("NewYork", "New York") == 0.0  # whitespace is collapsed, not removed
    assert rules.exact_match_score("paris", "Paris") == 0.0  # case-sensitive
    assert rules.exact_match_score("Paris.", "Paris") == 0.0
    assert rules.exact_match_score("", "Paris") == 0.0
    assert rules.exact_match_score("   ", "") == 1.0
    assert rules.exact_match_score("東京\u3000タワー", "東京 タワー") == 1.0  # ideographic space is whitespace
    assert rules.exact_match_score("Zürich", "Zurich") == 0.0


def test_exact_match_huge_is_fast():
    start = time.perf_counter()
    assert rules.exact_match_score("a " * (ONE_MB // 2), "a") == 0.0
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------
# format_score


def test_format_default_pattern():
    assert rules.format_score("reasoning...\n#### 72", "ignored") == 1.0
    assert rules.format_score("reasoning...\n#### -1,000.5\n", "") == 1.0  # trailing whitespace allowed
    assert rules.format_score("#### 72 apples", "72") == 0.0  # not at the end
    assert rules.format_score("the answer is 72", "72") == 0.0  # no marker
    assert rules.format_score("", "72") == 0.0
    assert rules.format_score("日本語の説明… 🎉\n#### 3", "3") == 1.0


def test_format_length_and_custom_pattern():
    assert rules.format_score("x" * 1990 + "\n#### 5", "") == 1.0  # 1997 characters
    assert rules.format_score("x" * 2000 + "\n#### 5", "") == 0.0  # over 2000 characters
    assert rules.format_score("x" * 2000 + "\n#### 5", "", max_chars=3000) == 1.0
    assert rules.format_score("<think>a\nb</think>answer", "", pattern=r"^<think>.*</think>") == 1.0  # DOTALL
    assert rules.format_score("answer", "", pattern=r"^<think>.*</think>") == 0.0


def test_format_huge_is_fast():
    start = time.perf_counter()
    assert rules.format_score("#### 1 " * (ONE_MB // 7) + "#### 1", "") == 0.0  # too long
    assert rules.format_score("#### 1 " * (ONE_MB // 7) + "#### 1", "", max_chars=2 * ONE_MB) == 1.0
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------
# dispatch


@pytest.mark.parametrize(
    "data_source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"]
)
def test_score_sample_math_sources(data_source):
    assert rules.score_sample(data_source, r"so \boxed{\dfrac{1}{2}}", "1/2") == 1.0
    assert rules.score_sample(data_source, r"so \boxed{3}", "1/2") == 0.0


def test_score_sample_exact_match_and_format():
    assert rules.score_sample("exact_match", " yes ", "yes") == 1.0
    assert rules.score_sample("exact_match", "no", "yes") == 0.0
    assert rules.score_sample("format", "...\n#### 4", "unused") == 1.0
    assert rules.score_sample("format", "4", "unused") == 0.0


def test_existing_scorers_still_registered():
    for name in ("openai/gsm8k", "gsm8k", "meshrl/reverse"):
        assert name in rules.SCORERS
    with pytest.raises(ValueError, match="no scorer"):
        rules.score_sample("no/such-source", "x", "x")


def test_rule_options_reach_the_rule_and_unknown_options_are_refused():
    from services.common.config import ConfigError, validate
    from services.reward.config import RewardServiceConfig
    from services.reward.scoring import Sample, Scorer

    config = validate(RewardServiceConfig, {"scorers": {"openai/gsm8k": [
        {"rule": "openai/gsm8k", "options": {"method": "flexible", "format_score": 0.1}}]}})
    scorer = Scorer(config)
    right, formatted_wrong, no_answer = scorer.score_batch([
        Sample(data_source="openai/gsm8k", response="so 42", ground_truth="42", extra_info={}, prompt=""),
                                                            Sample(data_source="openai/gsm8k", response="so 41",
                                                                   ground_truth="42", extra_info={}, prompt=""),
        Sample(data_source="openai/gsm8k", response="no idea", ground_truth="42", extra_info={}, prompt="")])
    assert (right.score, formatted_wrong.score, no_answer.score) == (1.0, 0.1, 0.0)
    # the answer is read with the rule's own method (flexible: the last number), and only full marks are right
    assert [(r.pred, r.acc) for r in (right, formatted_wrong, no_answer)] == [("42", True), ("41", False), ("", False)]
    bad = validate(RewardServiceConfig, {"scorers": {"x": [{"rule": "openai/gsm8k", "options": {"strictness": 1}}]}})
    with pytest.raises(ValueError, match=r"rule openai/gsm8k has no options \['strictness'\]"):
        Scorer(bad)
    with pytest.raises(ConfigError, match="options are for rules only"):
        validate(RewardServiceConfig, {"scorers": {"x": [{"function": "m:f", "options": {"a": 1}}]}})


def test_each_sample_carries_the_answer_read_and_whether_it_is_right():
    """verl's pred and acc: a rule's reading of the response and its full marks; with several components, the
    first that reads an answer gives them (the score is still the weighted sum)."""
    from services.common.config import validate
    from services.reward.config import RewardServiceConfig
    from services.reward.scoring import Sample, Scorer

    scorer = Scorer(validate(RewardServiceConfig, {"scorers": {"both": [
        {"rule": "format", "weight": 0.5}, {"rule": "openai/gsm8k", "weight": 0.5}]}}))
    results = scorer.score_batch([
        Sample(data_source="openai/gsm8k", response="3 + 4 = 7\n#### 7", ground_truth="7", extra_info={}, prompt=""),
        Sample(data_source="openai/gsm8k", response="#### 1,000", ground_truth="7", extra_info={}, prompt=""),
        Sample(data_source="openai/gsm8k", response="seven", ground_truth="7", extra_info={}, prompt=""),
        Sample(data_source="meshrl/reverse", response="321", ground_truth="321", extra_info={}, prompt=""),
        Sample(data_source="meshrl/reverse", response="3x1", ground_truth="321", extra_info={}, prompt=""),
        Sample(data_source="math", response=r"so \boxed{\frac12}", ground_truth=r"\frac{1}{2}", extra_info={},
               prompt=""),
        Sample(data_source="both", response="#### 7\nthanks", ground_truth="7", extra_info={}, prompt=""),
        Sample(data_source="nobody", response="7", ground_truth="7", extra_info={}, prompt=""),
    ])
    assert [(r.score, r.pred, r.acc) for r in results[:6]] == [
        (1.0, "7", True), (0.0, "1000", False), (0.0, "", False), (1.0, "321", True),
        (pytest.approx(2 / 3), "3x1", False), (1.0, r"\frac{1}{2}", True)]
    both = results[6]
    assert (both.score, both.pred, both.acc) == (0.5, "7", True)  # format fails; it reads no answer, gsm8k does
    assert both.components == (("format", 0.5, 0.0), ("openai/gsm8k", 0.5, 1.0))  # the parts of the score
    assert not results[7].valid and (results[7].pred, results[7].acc) == ("", None)
