"""The synthetic task of the local default: reverse a string of digits.

Rows follow verl's data schema (``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model.ground_truth``, ``extra_info``), so the task goes
through the same loading, prompting and scoring path as GSM8K does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_SOURCE = "meshrl/reverse"


def reverse_task_rows(count: int, min_digits: int, max_digits: int, seed: int, split: str = "train") -> list[dict]:
    """``count`` prompts "<digits>=" whose expected response is the digits reversed."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{digits}="}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
            "extra_info": {"split": split, "index": index},
        })
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.replace(path)
    return path
