"""Rule-based scorers, chosen per sample by ``data_source``.

Each scorer has verl's signature ``(solution_str, ground_truth) -> float``.

- GSM8K follows verl's rule: the answer is taken from the last 300
  characters of the response; ``strict`` wants the ``#### N`` marker and takes
  the last one, ``flexible`` takes the last number anywhere in that tail;
  commas and ``$`` are stripped. Correct scores 1.0, a found but wrong answer
  scores ``format_score``, no answer scores 0.0.
- ``meshrl/reverse`` (the synthetic task of the local default) gives partial
  credit: the share of positions where the response matches the expected
  string, over the longer of the two lengths.
"""

from __future__ import annotations

import re
from typing import Callable

GSM8K_TAIL_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-GSM8K_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        number = candidate.replace(",", "").replace("$", "")
        if number not in ("", ".", "-"):
            return number
    return None


def gsm8k_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def reverse_score(solution_str: str, ground_truth: str) -> float:
    """Share of positions where the response equals the expected string (partial credit)."""
    longest = max(len(solution_str), len(ground_truth))
    if longest == 0:
        return 1.0
    matches = sum(a == b for a, b in zip(solution_str, ground_truth))
    return matches / longest


SCORERS: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "meshrl/reverse": reverse_score,
}


def score_sample(data_source: str, solution_str: str, ground_truth: str) -> float:
    """Score one sample with the rule registered for its data_source."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(f"no scorer for data_source {data_source!r}; known: {sorted(SCORERS)}")
    return scorer(solution_str, ground_truth)
