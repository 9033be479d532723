"""The synthetic task of the local default: reverse a string of digits.

Rows follow verl's data schema (``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model.ground_truth``, ``extra_info``), so the task goes
through the same loading, prompting and scoring path as GSM8K does. A share
of all digit strings can be held out: training never draws them, validation
draws only them.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

DATA_SOURCE = "meshrl/reverse"


def held_out(digits: str, share: float) -> bool:
    """Whether a digit string is in the held-out part of the task: a fixed ``share`` of all strings, by hash, so
    that training never sees a string that validation asks."""
    return zlib.crc32(digits.encode()) % 10_000 < share * 10_000


def reverse_task_rows(count: int, min_digits: int, max_digits: int, seed: int, split: str = "train",
                      held_out_share: float = 0.0) -> list[dict]:
    """``count`` prompts "<digits>=" whose expected response is the digits reversed. With ``held_out_share``,
    the train split draws only strings outside the held-out share and the test split only strings in it."""
    if split == "test" and held_out_share <= 0:
        raise ValueError("a test split needs a held-out share of the strings")
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        if held_out_share > 0 and held_out(digits, held_out_share) != (split == "test"):
            continue
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{digits}="}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
            "extra_info": {"split": split, "index": len(rows)},
        })
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.replace(path)
    return path
