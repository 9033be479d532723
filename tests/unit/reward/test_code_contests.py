"""CPU tests of the code-contest rules' reading (services/reward/code_contests.py): the program taken from a
response, the test cases read from a ground truth, outputs compared, verdicts and scores; hand-made cases, no
sandbox."""

from __future__ import annotations

import json

import pytest

from services.common.sandbox import SandboxResult
from services.reward.code_contests import (CALL_HARNESS, SOLUTION_FILE, ContestCase, check_options, code_score,
                                           code_task, extract_code, output_matches, read_cases, return_matches,
                                           verdict)

RAN = SandboxResult(stdout="3\n", stderr="", exit_code=0, stopped="exited", seconds=0.1, truncated=False)


def ran(**changes) -> SandboxResult:
    return SandboxResult(**{**RAN.__dict__, **changes})


def test_the_last_python_block_is_the_program():
    response = "First try:\n```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```\nDone."
    assert extract_code(response) == "print(2)\n"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```Python3\nx = 3\n```") == "x = 3\n"


def test_an_unmarked_block_counts_where_no_block_is_marked_python_and_other_languages_do_not():
    assert extract_code("```\nprint(5)\n```") == "print(5)\n"
    assert extract_code("```python\nprint(3)\n```\nIt prints:\n```\n3\n```") == "print(3)\n"
    assert extract_code("```python\nprint(1)\n```\nIn C:\n```cpp\nint main() {}\n```") == "print(1)\n"
    assert extract_code("Only C++:\n```cpp\nint main() {}\n```") is None


def test_a_block_left_open_runs_to_the_end_and_a_response_without_fences_is_the_program():
    assert extract_code("Here:\n```python\nprint(1)\nprint(2") == "print(1)\nprint(2"
    assert extract_code("print(input())") == "print(input())"


def test_stdin_cases_are_read_in_order_up_to_max_cases():
    truth = json.dumps({"inputs": ["1 2\n", ["3", "4"], "5\n"], "outputs": ["3\n", ["7", "8"], "5\n"]})
    cases, fn_name = read_cases(truth, max_cases=2)
    assert fn_name is None
    assert cases == (ContestCase(stdin="1 2\n", expected="3\n"), ContestCase(stdin="3\n4", expected="7\n8"))


def test_call_based_cases_carry_the_arguments_and_the_expected_value():
    truth = json.dumps({"fn_name": "add", "inputs": ["1\n2", [[1, 2], 3]], "outputs": ["3", [[1, 2, 3]]]})
    cases, fn_name = read_cases(truth, max_cases=10)
    assert fn_name == "add"
    assert [json.loads(case.stdin) for case in cases] == [{"fn_name": "add", "arguments": [1, 2]},
                                                          {"fn_name": "add", "arguments": [[1, 2], 3]}]
    assert [case.expected for case in cases] == [3, [[1, 2, 3]]]


@pytest.mark.parametrize(("truth", "message"), [
    ("[1, 2", "not JSON of test cases"),
    ('{"inputs": ["1"]}', 'lists "inputs" and "outputs"'),
    ('{"inputs": ["1", "2"], "outputs": ["1"]}', "2 inputs but 1 outputs"),
    ('{"inputs": [], "outputs": []}', "no test cases"),
    ('{"inputs": [5], "outputs": ["5"]}', r"ground_truth.inputs\[0\] must be a string or a list of strings"),
    ('{"inputs": ["1"], "outputs": [{"a": 1}]}', r"ground_truth.outputs\[0\] must be a string"),
    ('{"fn_name": "os.system", "inputs": ["1"], "outputs": ["1"]}', "fn_name must be a Python name"),
    ('{"fn_name": "f", "inputs": ["{oops"], "outputs": ["1"]}', r"inputs\[0\] is not JSON values one per line"),
])
def test_a_ground_truth_not_in_verls_format_is_refused_naming_the_field(truth, message):
    with pytest.raises(ValueError, match=message):
        read_cases(truth, max_cases=10)


def test_a_task_runs_the_program_itself_or_the_harness_on_the_solution():
    stdin_truth = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    plain = code_task("```python\nprint(input())\n```", stdin_truth)
    assert (plain.program, plain.files, plain.call_based) == ("print(input())\n", {}, False)
    call_truth = json.dumps({"fn_name": "f", "inputs": ["1"], "outputs": ["1"]})
    called = code_task("```python\ndef f(x):\n    return x\n```", call_truth)
    solution = {SOLUTION_FILE: "def f(x):\n    return x\n"}
    assert (called.program, called.files, called.call_based) == (CALL_HARNESS, solution, True)
    assert code_task("```cpp\nint main() {}\n```", stdin_truth) is None
    with pytest.raises(ValueError, match="not JSON"):  # a bad ground truth is an error even without a program
        code_task("```cpp\n```", "oops")


@pytest.mark.parametrize(("printed", "expected"), [
    ("3\n", "3"), ("3", "3\n"), ("  1 2  \n3\n\n", "1 2\n3"), ("a\n\nb\n", "a\nb\n"), ("1 2\n", "1\n2\n"),
    ("0.3333333\n", "0.333333333"), ("1e3\n", "1000.0"), ("3.0000001\n", "3"),
])
def test_outputs_that_match(printed, expected):
    assert output_matches(printed, expected)


@pytest.mark.parametrize(("printed", "expected"), [
    ("4\n", "3"), ("1 2\n", "1  2 3"), ("1000001\n", "1000000"), ("0.334\n", "0.333"), ("", "3"),
    ("YES\n", "yes"), ("a b\n", "ab"), ("inf\n", "1e999"), ("3\n4\n", "3"),
])
def test_outputs_that_do_not(printed, expected):
    assert not output_matches(printed, expected)


def test_a_returned_value_matches_itself_or_the_element_of_a_one_element_list():
    assert return_matches("[0, 1]\n", [0, 1]) and return_matches("[0, 1]\n", [[0, 1]])
    assert return_matches("3\n", 3) and return_matches('"ab"\n', "ab")
    assert not return_matches("1\n", [1, 2]) and not return_matches("[1]\n", [[2]]) and not return_matches("x", 1)


def test_each_run_gets_its_letter():
    case = ContestCase(stdin="", expected="3")
    assert verdict(RAN, case, call_based=False) == "P"
    assert verdict(ran(stdout="4\n"), case, call_based=False) == "W"
    assert verdict(ran(exit_code=1), case, call_based=False) == "E"
    assert verdict(ran(exit_code=137, stopped="killed"), case, call_based=False) == "E"
    assert verdict(ran(exit_code=None, stopped="timeout"), case, call_based=False) == "T"
    assert verdict(ran(exit_code=152, stopped="cpu"), case, call_based=False) == "T"
    assert verdict(ran(exit_code=1, stopped="memory"), case, call_based=False) == "M"
    assert verdict(ran(exit_code=None, stopped="output", truncated=True), case, call_based=False) == "O"
    assert verdict(ran(stdout="[3]\n"), ContestCase(stdin="", expected=[3]), call_based=True) == "P"


def test_the_score_is_the_share_passed_or_all_or_nothing():
    assert code_score(list("PWPTP")) == (0.6, False, "3/5 PWPTP")
    assert code_score(list("PPP")) == (1.0, True, "3/3 PPP")
    assert code_score(list("PWPTP"), all_or_nothing=True) == (0.0, False, "3/5 PWPTP")
    assert code_score(list("PP"), all_or_nothing=True).score == 1.0


def test_options_are_checked_by_name_and_type():
    check_options("apps", {"max_cases": 3, "all_or_nothing": True})
    with pytest.raises(ValueError, match=r"rule apps has no options \['method'\]"):
        check_options("apps", {"method": "strict"})
    with pytest.raises(ValueError, match="max_cases must be a positive integer, got 0"):
        check_options("taco", {"max_cases": 0})
    with pytest.raises(ValueError, match="all_or_nothing must be true or false"):
        check_options("taco", {"all_or_nothing": "yes"})
