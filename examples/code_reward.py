"""A user's reward function that runs the response's program in meshrl's code sandbox (docs/guides/rewards.md).

The row's ``ground_truth`` is what the program must print and its ``extra_info.stdin`` what it reads: 1.0 for the
right output, 0.1 for a program that runs to the end but prints something else, 0.0 otherwise. Name it in a reward
service's config::

    scorers:
      my_code_task: [{function: examples/code_reward.py:score}]
    sample_timeout_s: 10    # more than LIMITS.wall_s: the sandbox, not the worker's timeout, stops a slow program
"""

from services.common.sandbox import SandboxLimits, run_in_sandbox
from services.reward.code_contests import extract_code, output_matches

LIMITS = SandboxLimits(wall_s=5, cpu_s=5, memory_mb=256, processes=4)


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    code = extract_code(solution_str)  # the last ```python block, as the code-contest rules read it
    if code is None:
        return {"score": 0.0, "acc": False, "pred": ""}
    result = run_in_sandbox(code, LIMITS, stdin=extra_info.get("stdin", ""))
    ran = result.stopped == "exited" and result.exit_code == 0
    right = ran and output_matches(result.stdout, ground_truth)
    return {"score": 1.0 if right else 0.1 if ran else 0.0, "acc": right, "pred": result.stdout[-200:]}
