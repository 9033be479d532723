"""Code-contest rewards: the response's program run on the row's test cases in the code sandbox, scored by the share
of cases it passes.

The meaning is verl's (``default_compute_score`` sends the data sources ``codecontests``, ``apps``, ``codeforces``
and ``taco`` to its ``prime_code`` scorer, or to ``sandbox_fusion`` where a sandbox URL is set, both with
``continuous=True``); the code is meshrl's:

- The ground truth is JSON of test cases: ``{"inputs": [...], "outputs": [...]}``, one output per input, and
  optionally ``"fn_name"``. Without ``fn_name`` a case's input is the program's stdin and its output what the
  program must print (either may be a list of lines, joined with newlines). With ``fn_name`` (call-based, LeetCode
  style) the program defines that function, or a method of that name on ``class Solution``; a case's input is its
  arguments (a JSON list, or a string of JSON values one per line) and its output the value it must return (JSON
  text is read as JSON; an output wrapped in a one-element list also matches its element, as verl accepts). The
  function's module starts with the names of ``typing``, ``collections``, ``math``, ``itertools``, ``functools``,
  ``heapq``, ``bisect``, ``string`` and ``re`` imported (``List``, ``deque``, ``inf`` ...), as verl's harness
  does.
- The program is the last fenced block marked ``python`` (``py``, ``python3``), else the last unmarked one; a block
  left open at the end of a truncated response runs to its end. A response with no fence at all is taken as the
  program itself (verl's reading: the response may be pure code); one whose fences all name other languages has no
  program and scores 0.
- Each case runs in a sandbox of its own (``services/common/sandbox.py``) under the service's ``sandbox`` limits:
  ``wall_s`` is the per-case timeout (verl's 10 s by default).
- A case passes when the program exits 0, its output is not cut at the cap, and what it printed matches: equal
  lines once each line is stripped of surrounding whitespace and blank lines are dropped, or else the same count
  of whitespace-separated numbers, integers equal and others within numpy.allclose's tolerance (``|a - b| <=
  1e-8 + 1e-5 * |b|``), as prime_code compares. A call-based case compares the returned value as JSON.
- The score is the share of the first ``max_cases`` cases (verl's 10) that pass; ``all_or_nothing`` gives 1 when
  all of them pass, else 0. ``acc`` is whether all of them passed; ``pred`` is ``passed/run`` and one letter per
  case: P passed, W wrong answer, E error (a non-zero exit, a signal), T time (wall clock or CPU), M memory,
  O output past the cap (``"3/5 PWPTP"``; ``""`` when there is no program).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from services.common.sandbox import SandboxResult

CODE_RULES = frozenset({"codecontests", "apps", "codeforces", "taco"})
"""verl's data sources scored by running the response's program on test cases."""

MAX_CASES = 10
"""Cases scored by default: the first ten, as verl's continuous code scores count."""

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_MARKS = frozenset({"python", "py", "python3"})

SOLUTION_FILE = "solution.py"
CALL_HARNESS = '''\
import contextlib, json, sys
request = json.loads(sys.stdin.read())
namespace = {"__name__": "solution"}
for module in ("typing", "collections", "math", "itertools", "functools", "heapq", "bisect", "string", "re"):
    exec(f"import {module}\\nfrom {module} import *", namespace)
with contextlib.redirect_stdout(sys.stderr):  # what the solution prints is not its answer
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    name = request["fn_name"]
    if name in namespace:
        function = namespace[name]
    elif "Solution" in namespace:
        function = getattr(namespace["Solution"](), name)
    else:
        sys.exit(f"the program defines no function and no Solution method named {name}")
    returned = function(*request["arguments"])
print(json.dumps(returned))
'''
"""The program a call-based case runs: it loads the solution, calls the function on the arguments read from stdin
and prints what it returned as JSON."""


@dataclass(frozen=True)
class ContestCase:
    """One test case as the sandbox runs it."""

    stdin: str  # what the program reads (a call-based case: the harness's request)
    expected: Any  # the text it must print, or (call-based) the value the function must return


@dataclass(frozen=True, kw_only=True)
class CodeTask:
    """What running one response on its test cases takes: the program, its files, and the cases to run."""

    program: str
    files: dict[str, str]
    cases: tuple[ContestCase, ...]
    call_based: bool


def extract_code(response: str) -> str | None:
    """The program in a response: its last fenced block marked python, else its last unmarked one (a block of
    sample output after the program does not replace it), the whole response when it has no fence, None when all
    its fences name other languages."""
    blocks = [(mark.strip().lower(), code) for mark, code in _FENCE.findall(response)]
    python = [code for mark, code in blocks if mark in _PYTHON_MARKS]
    unmarked = [code for mark, code in blocks if not mark]
    if python or unmarked:
        return (python or unmarked)[-1]
    return response if "```" not in response else None


def read_cases(ground_truth: str, max_cases: int) -> tuple[tuple[ContestCase, ...], str | None]:
    """The first ``max_cases`` test cases of a ground truth, and its ``fn_name`` (None: stdin/stdout cases).
    ValueError naming the field for anything that is not verl's format."""
    try:
        tests = json.loads(ground_truth)
    except json.JSONDecodeError as error:
        raise ValueError(f"ground_truth is not JSON of test cases: {error}") from None
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) \
            or not isinstance(tests.get("outputs"), list):
        raise ValueError('ground_truth must be a JSON object with lists "inputs" and "outputs"')
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if len(inputs) != len(outputs):
        raise ValueError(f"ground_truth has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("ground_truth has no test cases")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"ground_truth.fn_name must be a Python name, got {fn_name!r}")
    pairs = list(zip(inputs, outputs))[:max_cases]
    if fn_name is None:
        return tuple(ContestCase(stdin=_text(given, f"inputs[{index}]"), expected=_text(wanted, f"outputs[{index}]"))
                     for index, (given, wanted) in enumerate(pairs)), None
    return tuple(ContestCase(stdin=json.dumps({"fn_name": fn_name, "arguments": _arguments(given, index)}),
                          expected=_json_value(wanted)) for index, (given, wanted) in enumerate(pairs)), fn_name


def _text(value: Any, field: str) -> str:
    """A case's stdin or output: a string, or a list of lines joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(f"ground_truth.{field} must be a string or a list of strings, got {type(value).__name__}")


def _arguments(value: Any, index: int) -> list:
    """A call-based case's arguments: a JSON list as they are, or a string of JSON values, one per line."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            return [json.loads(line) for line in value.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"ground_truth.inputs[{index}] is not JSON values one per line: {error}") from None
    raise ValueError(f"ground_truth.inputs[{index}] must be a list of arguments or JSON lines")


def _json_value(value: Any) -> Any:
    """A call-based case's expected value: JSON text read as JSON, anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def check_options(rule: str, options: dict) -> None:
    """Refuse options a code rule does not take, naming them: ``max_cases`` (a positive integer) and
    ``all_or_nothing`` (a bool)."""
    unknown = sorted(set(options) - {"max_cases", "all_or_nothing"})
    if unknown:
        raise ValueError(f"rule {rule} has no options {unknown}; it takes ['all_or_nothing', 'max_cases']")
    max_cases = options.get("max_cases", MAX_CASES)
    if isinstance(max_cases, bool) or not isinstance(max_cases, int) or max_cases < 1:
        raise ValueError(f"rule {rule}: max_cases must be a positive integer, got {max_cases!r}")
    if not isinstance(options.get("all_or_nothing", False), bool):
        raise ValueError(f"rule {rule}: all_or_nothing must be true or false, got {options['all_or_nothing']!r}")


def code_task(solution_str: str, ground_truth: str, max_cases: int = MAX_CASES) -> CodeTask | None:
    """What to run for one response (None: it holds no program); ValueError for a bad ground truth."""
    cases, fn_name = read_cases(ground_truth, max_cases)
    code = extract_code(solution_str)
    if code is None:
        return None
    if fn_name is None:
        return CodeTask(program=code, files={}, cases=cases, call_based=False)
    return CodeTask(program=CALL_HARNESS, files={SOLUTION_FILE: code}, cases=cases, call_based=True)


def output_matches(printed: str, expected: str) -> bool:
    """Whether a program's output answers ``expected``: the same non-blank lines once each is stripped, or the same
    count of whitespace-separated numbers, integers equal and others within 1e-8 + 1e-5 * |expected|."""
    if _lines(printed) == _lines(expected):
        return True
    got, wanted = printed.split(), expected.split()
    return bool(wanted) and len(got) == len(wanted) and all(map(_numbers_match, got, wanted))


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _numbers_match(got: str, wanted: str) -> bool:
    if _is_integer(got) and _is_integer(wanted):
        return int(got) == int(wanted)
    try:
        a, b = float(got), float(wanted)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b)


def _is_integer(token: str) -> bool:
    return re.fullmatch(r"[+-]?\d+", token) is not None


def return_matches(printed: str, expected: Any) -> bool:
    """Whether a call-based case's printed JSON is the expected value, or the element of a one-element list."""
    try:
        returned = json.loads(printed)
    except json.JSONDecodeError:
        return False
    one_wrapped = isinstance(expected, list) and len(expected) == 1 and returned == expected[0]
    return returned == expected or one_wrapped


def verdict(result: SandboxResult, case: ContestCase, call_based: bool) -> str:
    """One letter for one case's run: P passed, W wrong answer, E error, T time, M memory, O output cap."""
    if result.stopped == "output" or result.truncated:
        return "O"
    if result.stopped in ("timeout", "cpu"):
        return "T"
    if result.stopped == "memory":
        return "M"
    if result.stopped != "exited" or result.exit_code != 0:
        return "E"
    matches = return_matches(result.stdout, case.expected) if call_based else output_matches(result.stdout,
                                                                                              case.expected)
    return "P" if matches else "W"


class CodeScore(NamedTuple):
    """What a code-contest rule says of one response."""

    score: float  # the share of cases passed (all_or_nothing: 1 when all did, else 0)
    acc: bool  # all passed
    pred: str  # passed/run and a letter per case, "" when the response holds no program


def code_score(verdicts: Sequence[str], all_or_nothing: bool = False) -> CodeScore:
    """A response's score from its cases' verdicts (see the module docstring)."""
    passed = verdicts.count("P")
    everything = passed == len(verdicts)
    score = float(everything) if all_or_nothing else passed / len(verdicts)
    return CodeScore(score=score, acc=everything, pred=f"{passed}/{len(verdicts)} {''.join(verdicts)}")


NO_PROGRAM = CodeScore(score=0.0, acc=False, pred="")
"""What a response with no program scores."""
