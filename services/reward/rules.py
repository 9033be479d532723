"""Rule-based scorers, chosen per sample by ``data_source``.

Each scorer has verl's signature ``(solution_str, ground_truth) -> float``; ``ANSWERS`` says what each
rule that judges answers reads as the response's answer (verl's ``pred``), and such a rule's full marks
(1.0) are its ``acc``.

- GSM8K follows verl's rule: the answer is taken from the last 300
  characters of the response; ``strict`` wants the ``#### N`` marker and takes
  the last one, ``flexible`` takes the last number anywhere in that tail;
  commas and ``$`` are stripped. Correct scores 1.0, a found but wrong answer
  scores ``format_score``, no answer scores 0.0.
- ``meshrl/arithmetic`` (the word problems of the GPU example) is scored by
  the GSM8K rule.
- ``meshrl/reverse`` (the synthetic task of the local default) gives partial
  credit: the share of positions where the response matches the expected
  string, over the longer of the two lengths.
- ``meshrl/lookup`` (the tool-use task of the local multi-turn example) is
  scored by exact match (below): the final answer must be the key's code.
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``HuggingFaceH4/MATH-500``, ``math``) follows verl's rule: the answer is the
  last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces; also ``\\boxed 5``)
  in the response; it and the ground truth (with or without ``\\boxed{}``) go
  through the Hendrycks / lm-eval-harness string normalisation and must be
  equal, or else equal in value for math-verify (``math_equivalent``): 1.0,
  else 0.0 (an unbalanced, missing or empty box scores 0.0).
- ``exact_match``: 1.0 if response and ground truth are equal after stripping
  and collapsing whitespace runs to one space (case-sensitive), else 0.0.
- ``format``: 1.0 if the response matches a regex (default: ends with a GSM8K
  ``#### N`` line) and is at most ``max_chars`` long, else 0.0; the ground
  truth is unused.

The reward service runs the rules in worker processes, each sample under its
per-sample timeout (``judge``): a response no rule can read in time (``\\boxed{9^{9^{9}}}``
for math-verify) scores ``FAILURE_SCORE`` and cannot stall the service.
"""

from __future__ import annotations

import inspect
import logging
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
    solution_str: str, ground_truth: str, method: str = "strict", *, format_score: float = 0.0, score: float = 1.0
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


# ---------------------------------------------------------------------------
# MATH: last boxed answer, Hendrycks / lm-eval-harness normalisation, string equality

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` or ``\\fbox{...}`` of ``text``, wrapper included, or None.

    Braces are matched by counting, so nested groups (``\\boxed{\\frac{1}{2}}``)
    stay whole. The unbraced form ``\\boxed 5`` yields ``"\\boxed 5"`` (the
    run of characters up to whitespace or ``$``, a final period dropped). When
    the last box is unclosed (a truncated response) or an unbraced box has no
    token, the answer is None: earlier boxes are not consulted.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(command)
    rest = text[i:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        i += len(rest) - len(stripped)
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return command + text[i : j + 1]
        return None
    if command != "\\boxed" or stripped == rest:  # "\fbox 5" is not a form; "\boxedx" is another command
        return None
    token = re.split(r"[\s$]", stripped, maxsplit=1)[0].rstrip(".")  # up to the first space or $
    return f"\\boxed {token}" if token else None


def remove_boxed(s: str) -> str:
    """The content of ``\\boxed{X}``, ``\\fbox{X}`` or ``\\boxed X``: X. ValueError for anything else."""
    if s.startswith("\\boxed "):
        return s[len("\\boxed ") :]
    for command in _BOX_COMMANDS:
        if s.startswith(command + "{") and s.endswith("}"):
            return s[len(command) + 1 : -1]
    raise ValueError(f"not a boxed answer: {s[:80]!r}")


_TRAILING_TEXT = re.compile(r"\\(?:text|mbox)\{[^{}]*\}$")
_WHOLE_TEXT = re.compile(r"^\\(?:text|mbox)\{([^{}]*)\}$")
_FRAC_NUMERATOR = re.compile(r"\\frac([^{\\])")  # \frac12 -> \frac{1}2
_FRAC_DENOMINATOR = re.compile(r"\\frac\{([^{}]*)\}([^{\\])")  # \frac{1}2 -> \frac{1}{2}
_SQRT = re.compile(r"\\sqrt([^{\[\\])")  # \sqrt3 -> \sqrt{3}; \sqrt[3]{x} is left alone
_SIMPLE_SLASH = re.compile(r"^(-?)(\d+)/(\d+)$")  # 3/4 -> \frac{3}{4}


def normalize_math_answer(s: str) -> str:
    """Hendrycks MATH / lm-eval-harness string normalisation of one answer, in order:

    1. drop line breaks and ``\\!``; ``\\\\`` -> ``\\``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``;
       drop ``\\left``, ``\\right``, degrees (``^{\\circ}``, ``^\\circ``) and ``\\$``;
    2. units: a trailing ``\\text{...}`` (or ``\\mbox``) after other content is
       dropped (``10\\text{ cm}`` -> ``10``); a whole ``\\text{X}`` becomes X;
    3. drop ``\\%`` and ``%``; ``" ."`` -> ``" 0."``, ``"{."`` -> ``"{0."``, leading ``.`` -> ``0.``;
    4. a one-variable equation prefix goes when its left side is at most two
       characters (``x = 3`` -> ``3``, ``k=-2`` -> ``-2``);
    5. remove all spaces; then ``\\sqrt3`` -> ``\\sqrt{3}``, ``\\frac12`` ->
       ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``, ``\\frac{1}2`` -> ``\\frac{1}{2}``;
    6. a plain integer ratio ``a/b`` (``-a/b``) -> ``\\frac{a}{b}`` (``-\\frac{a}{b}``).

    Decimals are left alone: ``0.5`` is not ``\\frac{1}{2}`` and ``0.50`` is not
    ``0.5`` (``.5`` becomes ``0.5``).
    """
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = s.strip()
    whole = _WHOLE_TEXT.match(s)
    if whole:
        s = whole.group(1)
    else:
        s = _TRAILING_TEXT.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.strip()
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = s.replace(" ", "")
    s = _SQRT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_NUMERATOR.sub(r"\\frac{\1}", s)
    s = _FRAC_DENOMINATOR.sub(r"\\frac{\1}{\2}", s)
    return _SIMPLE_SLASH.sub(r"\1\\frac{\2}{\3}", s)


SYMBOLIC_MAX_CHARS = 200


def math_equivalent(answer: str, ground_truth: str) -> bool:
    """Symbolic equality of two LaTeX answers through math-verify (sympy): ``0.5`` and ``\\frac{1}{2}``.

    Only answers of at most SYMBOLIC_MAX_CHARS holding a digit are compared this way (sympy would take
    seconds on a megabyte of digits, and would call Ω and ω equal); others stay string-compared. Its
    signal-based timeouts are off (they work only on the main thread; scoring runs on worker threads).
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that timeouts are off
    if any(len(x) > SYMBOLIC_MAX_CHARS or not re.search(r"\d", x) for x in (answer, ground_truth)):
        return False
    try:
        gold = parse(f"${ground_truth}$", parsing_timeout=None)
        predicted = parse(f"${answer}$", parsing_timeout=None)
        return bool(gold and predicted and verify(gold, predicted, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an answer sympy cannot read is not equal
        return False


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer equals the ground truth, else 0.0.

    Equal means: the same string after normalisation, or else the same value
    for math-verify (``0.5`` and ``\\frac{1}{2}``). The ground truth may be bare
    (``"\\frac{1}{2}"``) or boxed. No box, an unclosed box or an answer that
    normalises to "" scores 0.0.
    """
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    raw_answer = remove_boxed(boxed)
    truth_box = last_boxed_only_string(ground_truth)
    raw_truth = remove_boxed(truth_box) if truth_box is not None else ground_truth
    answer, truth = normalize_math_answer(raw_answer), normalize_math_answer(raw_truth)
    if not answer:
        return 0.0
    return 1.0 if answer == truth or math_equivalent(raw_answer, raw_truth) else 0.0


# ---------------------------------------------------------------------------
# exact match and format


def exact_match_answer(solution_str: str) -> str:
    """The response stripped, its whitespace runs collapsed to one space: what exact match compares."""
    return " ".join(solution_str.split())


def exact_match_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if equal after stripping and collapsing whitespace runs to one space (case-sensitive), else 0.0."""
    return 1.0 if exact_match_answer(solution_str) == exact_match_answer(ground_truth) else 0.0


def format_score(
    solution_str: str, ground_truth: str, pattern: str = r"#### -?[0-9.,]+\s*$", *, max_chars: int = 2000
) -> float:
    """1.0 if the response is at most max_chars long and ``re.search(pattern, DOTALL)`` finds it, else 0.0.

    ground_truth is unused (verl's signature). The default pattern wants a
    GSM8K-style ``#### N`` as the last line.
    """
    if len(solution_str) > max_chars:
        return 0.0
    return 1.0 if re.search(pattern, solution_str, re.DOTALL) else 0.0


SCORERS: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "meshrl/arithmetic": gsm8k_score,
    "meshrl/reverse": reverse_score,
    "meshrl/lookup": exact_match_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "exact_match": exact_match_score,
    "format": format_score,
}


def math_answer(solution_str: str) -> str | None:
    """The normalised last boxed answer of a response, or None."""
    boxed = last_boxed_only_string(solution_str)
    return normalize_math_answer(remove_boxed(boxed)) or None if boxed is not None else None


# What each rule that judges answers reads as the response's answer (verl's "pred", counted by majority votes;
# None: it found none). ``format`` judges the form only: it reads no answer, and its marks say nothing of one.
ANSWERS: dict[str, Callable[[str], str | None]] = {
    "openai/gsm8k": extract_gsm8k_answer,
    "gsm8k": extract_gsm8k_answer,
    "meshrl/arithmetic": extract_gsm8k_answer,
    "meshrl/reverse": str.strip,
    "meshrl/lookup": exact_match_answer,
    "lighteval/MATH": math_answer,
    "DigitalLearningGmbH/MATH-lighteval": math_answer,
    "HuggingFaceH4/MATH-500": math_answer,
    "math": math_answer,
    "exact_match": exact_match_answer,
}


SYMBOLIC_RULES = frozenset(name for name, scorer in SCORERS.items() if scorer is math_score)
"""The rules that may call math-verify (sympy): its import and first parse take seconds."""

FAILURE_SCORE = 0.0
"""What every rule gives a response whose answer it cannot accept: none found, or none read in time."""


def judge(rule: str, options: dict, solution_str: str, ground_truth: str) -> dict:  # noqa: PLR0917 - see below
    """What ``rule`` (with its ``options``) says of one response: ``{"score": ...}``, and for a rule that judges
    answers, whether the answer is right (its full marks) and the answer read, as ``acc`` and ``pred`` ("" for
    none). The reward service calls this in its worker processes, under its per-sample timeout, with its four
    arguments by position, as it calls a user's reward function (``plugins``)."""
    score = SCORERS[rule](solution_str, ground_truth, **options)
    if rule not in ANSWERS:  # a rule of form, not of answers
        return {"score": score}
    read = ANSWERS[rule]
    accepted = set(inspect.signature(read).parameters) if options else set()
    answer = read(solution_str, **{k: v for k, v in options.items() if k in accepted})
    return {"score": score, "acc": score >= 1.0, "pred": answer or ""}


def score_sample(data_source: str, solution_str: str, ground_truth: str) -> float:
    """Score one sample with the rule registered for its data_source."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(f"no scorer for data_source {data_source!r}; known: {sorted(SCORERS)}")
    return scorer(solution_str, ground_truth)
