"""Users' reward functions with verl's signature, for the reward-service tests."""

import time


def length_match(data_source, solution_str, ground_truth, extra_info):
    """1.0 when the response is as long as the answer, with a breakdown, as verl allows."""
    return {"score": float(len(solution_str) == len(ground_truth)), "length": len(solution_str)}


def verdict(data_source, solution_str, ground_truth, extra_info):
    """Half marks, but the answer it reads (a number: sent as text) is right."""
    return {"score": 0.5, "acc": True, "pred": int(solution_str)}


def raises(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError(f"cannot score {solution_str!r}")


def hangs(data_source, solution_str, ground_truth, extra_info):
    time.sleep(3600)
    return 1.0


def garbage(data_source, solution_str, ground_truth, extra_info):
    return "very good"
