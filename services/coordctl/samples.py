"""A run's kept samples (trainer.rollout_data_dir), read back and laid out for a person."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import yaml


def kept_samples_dir(run_dir: Path) -> Path | None:
    """The folder the run keeps its steps' samples in, from its config.yaml (None: it keeps none, or its folder is
    not readable here)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    config = yaml.safe_load(path.read_text()) or {}
    chosen = (config.get("trainer") or {}).get("rollout_data_dir")
    return None if chosen is None else run_dir / chosen  # an absolute one stays itself


def steps_kept(folder: Path) -> list[int]:
    """The steps whose samples are in ``folder`` (<step>.jsonl), in order."""
    return sorted(int(path.stem) for path in folder.glob("*.jsonl") if path.stem.isdigit())


def read_samples(path: Path) -> list[dict]:
    """The records of one step's file; ValueError naming the file and line of one that is not a JSON object."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        records.append(record)
    return records


def wrapped(label: str, text: str, width: int) -> list[str]:
    """``text`` beside ``label``, wrapped to ``width`` columns under itself, its own line breaks kept; "(empty)"
    for none."""
    room = max(20, width - len(label))
    rows = [row for paragraph in (text.splitlines() or ["(empty)"])
            for row in textwrap.wrap(paragraph, room, replace_whitespace=False) or [""]]
    return [(label if index == 0 else " " * len(label)) + row for index, row in enumerate(rows)]


def shown(record: dict, key: str, form: str = "") -> str:
    """A field of a record formatted for a person: "?" when the record lacks it (or a number is not one)."""
    value = record.get(key)
    if value is None:
        return "?"
    if form and not isinstance(value, (int, float)):
        return "?"
    return format(value, form)


def counted(record: dict, key: str) -> str:
    """An index of a record counted from 1 for a person: "?" when the record lacks it."""
    value = record.get(key)
    return str(value + 1) if isinstance(value, int) else "?"


def versions_shown(record: dict) -> str:
    """The weight version that sampled a record's response, or "first-last" where new weights were swapped in
    while it was sampled."""
    first, last = shown(record, "weight_version"), shown(record, "last_weight_version")
    return first if last in ("?", first) else f"{first}-{last}"


def describe(index: int, record: dict, width: int) -> list[str]:
    """One kept sample as lines for a terminal ``width`` wide: its score, advantage, weight version and the
    services that handled it, then its prompt, response and expected answer, wrapped. A field the record lacks
    shows as "?"."""
    judged = f" (acc {record['acc']}, pred {record.get('pred', '')!r})" if record.get("acc") is not None else ""
    length = f"{shown(record, 'response_length')} tokens" + (", truncated" if record.get("truncated") else "")
    lines = [f"#{index}  step {shown(record, 'step')}  group {shown(record, 'group')}  "
             f"score {shown(record, 'score', '.3f')}{judged}  advantage {shown(record, 'advantage', '+.3f')}  {length}",
             f"    version {versions_shown(record)} (staleness {shown(record, 'staleness')})  "
             f"rollout {shown(record, 'rollout')}  "
             f"reward {shown(record, 'reward_service')} ({shown(record, 'reward_address')})"]
    parts = record.get("reward_components") or []
    if parts:
        lines.append("    parts     " + ", ".join(f"{c['name']} {c['value']:.3f} x{c['weight']:g}" for c in parts))
    if not record.get("valid", True):
        lines.append(f"    unscored  {shown(record, 'error')}")
    if "turns" in record:  # a multi-turn trajectory: each turn, then its final answer
        # a trajectory that went on in new samples (its template could not extend it): which this record is,
        # and which each turn is in, counted from 1
        split = isinstance(record.get("trajectory_samples"), int) and record["trajectory_samples"] > 1
        part = f", sample {counted(record, 'trajectory_sample')} of {record['trajectory_samples']}" if split else ""
        lines.append(f"    episode   {shown(record, 'env_service')}: {shown(record, 'num_turns')} turns, ended "
                     f"{shown(record, 'ended')}, env reward {shown(record, 'env_reward', '.3f')}, restarts "
                     f"{shown(record, 'restarts')}{part}")
        lines += wrapped(f"    {'prompt':<10}", shown(record, "input"), width)
        for turn in record["turns"]:
            lines.append(f"    {turn_header(turn)}" + (f", sample {counted(turn, 'sample')}" if split else ""))
            lines += wrapped(" " * 14, str(turn.get("text", "")), width)
        lines += wrapped(f"    {'expected':<10}", shown(record, "gts"), width)
        return lines
    for label, key in (("prompt", "input"), ("response", "output"), ("expected", "gts")):
        lines += wrapped(f"    {label:<10}", shown(record, key), width)
    return lines


def turn_header(turn: dict) -> str:
    """A turn's line above its text: the model's (trained, with the weight version that sampled it) or a reply
    (not trained, with the tool that answered), its token count and seconds."""
    tokens, seconds = shown(turn, "tokens"), shown(turn, "seconds", ".2f")
    if turn.get("role") == "model":
        return f"model     trained, weight version {shown(turn, 'weight_version')}, {tokens} tokens, {seconds} s"
    tool = f" from {turn['tool']}" if turn.get("tool") else ""
    return f"reply{tool}  not trained, {tokens} tokens, {seconds} s"
