"""The worker processes that run rules and users' functions (services/reward/plugins.py), as real processes."""

from __future__ import annotations

import os
import time

from services.reward.plugins import FunctionScore, FunctionWorkers


def as_told(data_source, solution_str, ground_truth, extra_info):
    """Does what the response says: hang, end its process, or score the number it holds."""
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "exit":
        os._exit(3)
    return float(solution_str)


def test_a_task_that_hangs_or_ends_its_worker_costs_only_itself():
    workers = FunctionWorkers(f"{__name__}:as_told", workers=1, timeout_s=1.0)
    try:
        tasks = [("x", told, "", {}) for told in ("1", "hang", "2", "exit", "3")]
        results = workers.score_all(tasks, warm_up=("x", "0", "", {}))
        assert [r.score for r in results[::2] if isinstance(r, FunctionScore)] == [1.0, 2.0, 3.0]
        assert isinstance(results[1], TimeoutError) and "did not return within 1.0 s" in str(results[1])
        assert isinstance(results[3], ValueError) and "its worker died (exit code 3" in str(results[3])
        [again] = workers.score_all([("x", "4", "", {})])  # the pool goes on with its replacements
        assert again.score == 4.0
    finally:
        workers.close()
