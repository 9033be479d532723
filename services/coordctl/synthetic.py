"""The synthetic tasks of ``--local``: reverse a string of digits (the default), multi-step arithmetic
written as word problems and answered GSM8K's way (the GPU example), or look up the code of a key with a tool
(the multi-turn example, examples/local_tools.yaml).

Rows follow verl's data schema (``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model.ground_truth``, ``extra_info``), so the task goes
through the same loading, prompting and scoring path as GSM8K does. A share
of all digit strings can be held out: training never draws them, validation
draws only them.
"""

from __future__ import annotations

import json
import random
import string
import zlib
from pathlib import Path
from typing import Any

DATA_SOURCE = "meshrl/reverse"
ARITHMETIC_SOURCE = "meshrl/arithmetic"  # scored by the GSM8K rule: the number after the last "#### "
LOOKUP_SOURCE = "meshrl/lookup"  # scored by exact match of the final answer
LOOKUP_SALT = "meshrl-lookup"
"""The key of the lookup task's hash; examples/local_tools/tools.yaml gives its tool the same salt."""
LOOKUP_TOOL = "lookup"
NAMES = ("Ann", "Ben", "Cal", "Dan", "Eva", "Fay", "Gus", "Ivy", "Joe", "Kim", "Leo", "Mia", "Ned", "Ola", "Pam")
ITEMS = ("apples", "books", "coins", "cards", "eggs", "pens", "shells", "stamps", "balls", "cups")


def held_out(digits: str, share: float) -> bool:
    """Whether a digit string is in the held-out part of the task: a fixed ``share`` of all strings, by hash, so
    that training never sees a string that validation asks."""
    return zlib.crc32(digits.encode()) % 10_000 < share * 10_000


def in_split(key: str, split: str, share: float) -> bool:
    """Whether a task's item (named by ``key``) belongs to ``split``: with no held-out share every item is a train
    item; with one, the held-out items are the test split's and only they."""
    return share <= 0 or held_out(key, share) == (split == "test")


def reverse_task_rows(count: int, min_digits: int, max_digits: int, *, seed: int, split: str = "train",
                      held_out_share: float = 0.0) -> list[dict]:
    """``count`` prompts "<digits>=" whose expected response is the digits reversed. With ``held_out_share``,
    the train split draws only strings outside the held-out share and the test split only strings in it."""
    if split == "test" and held_out_share <= 0:
        raise ValueError("a test split needs a held-out share of the strings")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        if not in_split(digits, split, held_out_share):
            continue
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{digits}="}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
            "extra_info": {"split": split, "index": len(rows)},
        })
    return rows


def arithmetic_problem(rng: random.Random, steps: int, largest: int) -> tuple[str, str, int, tuple]:
    """A word problem of ``steps`` operations on numbers up to ``largest``, its worked solution ending in
    "#### <answer>", the answer, and what identifies the problem (for the held-out split)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, largest)
    sentences, lines = [f"{name} has {value} {item}."], []
    key: list[int | str] = [value]
    for _ in range(steps):
        operation = rng.choice(("add", "take", "times") if value <= largest else ("take",))
        if operation == "times":
            factor = rng.randint(2, 4)
            sentences.append(f"Then {name} gets {factor} times as many.")
            lines.append(f"{value}*{factor}={value * factor}.")
            value *= factor
        elif operation == "take" and value > 1:
            amount = rng.randint(1, min(value - 1, largest))
            sentences.append(f"{name} gives away {amount}.")
            lines.append(f"{value}-{amount}={value - amount}.")
            value -= amount
        else:
            amount = rng.randint(1, largest)
            sentences.append(f"{name} finds {amount} more.")
            lines.append(f"{value}+{amount}={value + amount}.")
            value += amount
        key.extend((operation, lines[-1]))
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return question, " ".join(lines) + f" #### {value}", value, tuple(key)


def arithmetic_task_rows(count: int, min_steps: int, max_steps: int, *, largest: int, seed: int, split: str = "train",
                         held_out_share: float = 0.0) -> list[dict]:
    """``count`` word problems of ``min_steps`` to ``max_steps`` operations in verl's GSM8K schema: the ground
    truth is the number, extra_info.answer the worked solution that a warm start teaches. With
    ``held_out_share``, the train split never holds a problem of the test split (by its numbers and steps)."""
    if split == "test" and held_out_share <= 0:
        raise ValueError("a test split needs a held-out share of the problems")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        question, answer, value, key = arithmetic_problem(rng, rng.randint(min_steps, max_steps), largest)
        if not in_split(repr(key), split, held_out_share):
            continue
        rows.append({
            "data_source": ARITHMETIC_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {"split": split, "index": len(rows), "answer": answer},
        })
    return rows


def lookup_code(key: str, salt: str = LOOKUP_SALT) -> str:
    """The code of ``key``: a keyed hash, four digits, that nothing in the prompt gives away."""
    return f"{zlib.crc32((salt + key).encode()) % 10_000:04d}"


def lookup_call(key: str) -> str:
    """The model's turn that asks the lookup tool for ``key``'s code (a Hermes tool call, compact JSON)."""
    call = json.dumps({"name": LOOKUP_TOOL, "arguments": {"key": key}}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def lookup_task_rows(count: int, key_letters: int, seed: int, *, split: str = "train",
                     held_out_share: float = 0.0) -> list[dict]:
    """``count`` prompts "code of KEY?" (KEY: ``key_letters`` capital letters) whose answer is ``lookup_code(KEY)``,
    which only the lookup tool knows. ``extra_info.turns`` is the worked trajectory after the prompt, as chat
    messages, that a warm start teaches: the tool call, the tool's reply, the answer. With ``held_out_share``,
    the train split draws only keys outside the held-out share and the test split only keys in it."""
    if split == "test" and held_out_share <= 0:
        raise ValueError("a test split needs a held-out share of the keys")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        key = "".join(rng.choice(string.ascii_uppercase) for _ in range(key_letters))
        if not in_split(key, split, held_out_share):
            continue
        code = lookup_code(key)
        turns = [{"role": "assistant", "content": lookup_call(key)}, {"role": "tool", "content": code},
                 {"role": "assistant", "content": code}]
        rows.append({
            "data_source": LOOKUP_SOURCE,
            "prompt": [{"role": "user", "content": f"code of {key}?"}],
            "ability": "tool",
            "reward_model": {"style": "rule", "ground_truth": code},
            "extra_info": {"split": split, "index": len(rows), "turns": turns},
        })
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.replace(path)
    return path
