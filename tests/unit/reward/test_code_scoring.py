"""Code-contest rewards scored by a Scorer on real sandboxes: right programs pass, wrong ones fail the cases they get
wrong, a loop is cut at its timeout, forks and allocations are contained, the host's secrets and network stay out of
reach; where the sandbox cannot be had, code is refused and never runs. Skipped where this host cannot sandbox."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from services.common import sandbox
from services.common.config import validate
from services.common.sandbox import check_sandbox
from services.reward.config import RewardServiceConfig
from services.reward.scoring import Sample, SampleResult, Scorer
from tests.unit.common.test_sandbox import held_uids, sandbox_processes, wait_until_no_sandbox_process  # noqa: F401

REASON = check_sandbox()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no code sandbox here: {REASON}")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "code_reward.py"
SUM_CASES = json.dumps({"inputs": ["1 2\n", "-1 5\n", "2 2\n", "-3 -3\n"], "outputs": ["3\n", "4\n", "4\n", "-6\n"]})
TWO_SUM = json.dumps({"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", [[3, 2, 4], 6]],
                      "outputs": ["[0, 1]", [[1, 2]]]})  # verl's two forms: JSON lines, or a list of arguments


def python(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


@pytest.fixture(scope="module")
def scorer():
    config = validate(RewardServiceConfig, {
        "function_workers": 1, "sample_timeout_s": 10,
        "scorers": {"my_code": [{"function": f"{EXAMPLE}:score"}],
                    "strict_apps": [{"rule": "apps", "options": {"all_or_nothing": True}}]},
        "sandbox": {"wall_s": 4, "cpu_s": 1, "memory_mb": 256, "processes": 8, "output_bytes": 4096,
                    "concurrent_runs": 2}})
    scorer = Scorer(config)
    yield scorer
    scorer.close()


def score(scorer: Scorer, *samples: tuple[str, str, str]) -> list[SampleResult]:
    return scorer.score_batch([Sample(data_source=source, response=response, ground_truth=truth, extra_info={},
                                      prompt="") for source, response, truth in samples])


def test_a_right_program_passes_every_case_stdin_or_call_based(scorer):
    adds = python("a, b = map(int, input().split())\nprint(a + b)\n")
    two_sum = python("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
                     "        seen = {}\n        for i, n in enumerate(nums):\n"
                     "            if target - n in seen:\n                return [seen[target - n], i]\n"
                     "            seen[n] = i\n")
    results = score(scorer, ("apps", adds, SUM_CASES), ("codecontests", adds, SUM_CASES),
                    ("taco", two_sum, TWO_SUM), ("strict_apps", adds, SUM_CASES))
    assert [(r.valid, r.score, r.acc, r.pred) for r in results] == [
        (True, 1.0, True, "4/4 PPPP"), (True, 1.0, True, "4/4 PPPP"), (True, 1.0, True, "2/2 PP"),
        (True, 1.0, True, "4/4 PPPP")]
    assert results[0].components == (("apps", 1.0, 1.0),)


def test_a_wrong_program_fails_the_cases_it_gets_wrong(scorer):
    forgets_signs = python("a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n")
    divides = python("a, b = map(int, input().split())\nprint(a + b + 0 // (a - 2))\n")  # 2 2: ZeroDivisionError
    wrong, crashes, strict, nothing = score(scorer, ("codeforces", forgets_signs, SUM_CASES),
                                            ("apps", divides, SUM_CASES), ("strict_apps", forgets_signs, SUM_CASES),
                                            ("apps", "I would use C++:\n```cpp\nint main() {}\n```", SUM_CASES))
    assert (wrong.score, wrong.acc, wrong.pred) == (0.5, False, "2/4 PWPW")
    assert wrong.components == (("codeforces", 1.0, 0.5),)
    assert (crashes.score, crashes.pred) == (0.75, "3/4 PPEP")
    assert (strict.score, strict.acc, strict.pred) == (0.0, False, "2/4 PWPW")
    assert (nothing.valid, nothing.score, nothing.acc, nothing.pred) == (True, 0.0, False, "")


def test_a_program_that_loops_is_cut_at_its_timeout(scorer):
    loops_on_zero = python("n = int(input())\nwhile n == 0:\n    pass\nprint(n)\n")
    sleeps = python("import time\ntime.sleep(3600)\n")
    cases = json.dumps({"inputs": ["1\n", "0\n", "2\n"], "outputs": ["1\n", "0\n", "2\n"]})
    one_case = json.dumps({"inputs": [""], "outputs": ["done\n"]})
    looped, slept = score(scorer, ("apps", loops_on_zero, cases), ("apps", sleeps, one_case))
    assert (looped.valid, looped.score, looped.pred) == (True, pytest.approx(2 / 3), "2/3 PTP")
    assert (slept.valid, slept.score, slept.pred) == (True, 0.0, "0/1 T")
    assert 4 <= slept.seconds < 30  # stopped at the sandbox's wall_s of 4 s


def test_forks_and_allocations_are_contained(scorer, held_uids):  # noqa: F811 - a fixture
    bomb = python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    hog = python("x = bytearray(100 * 10**9)\nprint(len(x))\n")
    floods = python("while True:\n    print('x' * 1000)\n")
    one_case = json.dumps({"inputs": [""], "outputs": ["0\n"]})
    forked, hogged, flooded = score(scorer, ("apps", bomb, one_case), ("apps", hog, one_case),
                                    ("apps", floods, one_case))
    assert forked.valid and forked.score == 0.0 and forked.pred in ("0/1 T", "0/1 E")
    assert (hogged.valid, hogged.pred) == (True, "0/1 M")
    assert (flooded.valid, flooded.pred) == (True, "0/1 O")
    assert sandbox_processes(held_uids, zombies=False) == []
    assert wait_until_no_sandbox_process(held_uids, seconds=30) == []
    [after] = score(scorer, ("apps", python("print(sum(map(int, input().split())))\n"), SUM_CASES))
    assert after.pred == "4/4 PPPP"


def test_a_program_cannot_pass_by_reading_the_hosts_secrets_or_its_network(scorer, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    monkeypatch.setenv("MESHRL_TOKEN_FILE", str(token))
    monkeypatch.setenv("MESHRL_TOKEN", "secret-token")
    shadow = Path("/etc/shadow").read_text() if Path("/etc/shadow").exists() else "root:*:1::::::\n"
    reads_shadow = python("print(open('/etc/shadow').read(), end='')\n")
    reads_token = python(f"import os\nprint(os.environ.get('MESHRL_TOKEN') or open({str(token)!r}).read(), end='')\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        connects = python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                          "print('connected')\n")
        results = score(scorer, ("apps", reads_shadow, json.dumps({"inputs": [""], "outputs": [shadow]})),
                        ("apps", reads_token, json.dumps({"inputs": [""], "outputs": ["secret-token\n"]})),
                        ("apps", connects, json.dumps({"inputs": [""], "outputs": ["connected\n"]})))
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert [(r.valid, r.score, r.pred) for r in results] == [(True, 0.0, "0/1 E")] * 3


def test_a_users_function_runs_code_in_the_same_sandbox(scorer):
    doubles = "```python\nprint(2 * int(input()))\n```"
    responses = (doubles, "```python\nprint(41)\n```", "```python\nraise SystemExit(1)\n```", "no code ```c\n```")
    results = scorer.score_batch([
        Sample(data_source="my_code", response=response, ground_truth="42", extra_info={"stdin": "21\n"}, prompt="")
        for response in responses])
    assert [(r.valid, r.score, r.acc) for r in results] == [(True, 1.0, True), (True, 0.1, False), (True, 0.0, False),
                                                           (True, 0.0, False)]
    assert results[0].pred == "42\n"


def test_a_ground_truth_that_is_not_test_cases_makes_only_its_sample_invalid(scorer):
    bad, good = score(scorer, ("apps", python("print(1)\n"), '{"inputs": ["1"]}'),
                      ("apps", python("print(sum(map(int, input().split())))\n"), SUM_CASES))
    assert not bad.valid and 'ground_truth must be a JSON object with lists "inputs" and "outputs"' in bad.error
    assert good.valid and good.score == 1.0


def test_without_the_sandbox_code_rules_are_refused_and_nothing_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    configured = validate(RewardServiceConfig, {"function_workers": 1, "scorers": {"apps": [{"rule": "apps"}]}})
    with pytest.raises(ValueError, match=r"rules \['apps'\] run the response's code in the sandbox, which this "
                                         r"host cannot give: /nonexistent/bwrap is missing"):
        Scorer(configured)
    unconfigured = Scorer(validate(RewardServiceConfig, {"function_workers": 1}))
    try:
        code, words = unconfigured.score_batch([
            Sample(data_source="apps", response=python("print(3)\n"), ground_truth=SUM_CASES, extra_info={},
                   prompt=""),
            Sample(data_source="openai/gsm8k", response="#### 3", ground_truth="3", extra_info={}, prompt="")])
    finally:
        unconfigured.close()
    assert not code.valid and "rule apps runs the response's code in the sandbox" in code.error
    assert "/nonexistent/bwrap is missing" in code.error
    assert words.valid and words.score == 1.0
