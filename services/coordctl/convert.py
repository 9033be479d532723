"""Convert raw GSM8K / MATH JSONL into verl-schema parquet, as verl's preprocessing scripts do.

- GSM8K rows ``{"question", "answer"}``: the ground truth is the number after
  the last ``####`` of the answer, commas stripped.
- MATH rows ``{"problem", "solution"}`` (``level`` and ``type`` optional): the
  ground truth is the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``)
  of the solution, braces balanced.

The prompt is one user message: the question, a space, then an instruction
that asks for the final answer in the form the rule scorer reads. Each output
row has ``data_source``, ``prompt``, ``ability`` ("math"), ``reward_model``
(``{"style": "rule", "ground_truth"}``) and ``extra_info`` (split, index and the
raw fields). A bad row is refused with the input file and its 1-based line.
The parquet is written to a temporary file in the output's folder and then
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from enum import Enum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class Format(str, Enum):
    gsm8k = "gsm8k"
    math = "math"


DEFAULT_DATA_SOURCE = {Format.gsm8k: "openai/gsm8k", Format.math: "lighteval/MATH"}
DEFAULT_INSTRUCTION = {
    Format.gsm8k: "Let's think step by step and output the final answer after \"####\".",
    Format.math: "Let's think step by step and output the final answer within \\boxed{}.",
}
# The raw fields each format needs (question field, answer field), kept in extra_info.
RAW_FIELDS = {Format.gsm8k: ("question", "answer"), Format.math: ("problem", "solution")}
OPTIONAL_FIELDS = {Format.gsm8k: (), Format.math: ("level", "type")}

_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def schema(fmt: Format) -> pa.Schema:
    """The parquet schema of one format's converted rows."""
    extra = [("split", pa.string()), ("index", pa.int64())]
    extra += [(name, pa.string()) for name in RAW_FIELDS[fmt] + OPTIONAL_FIELDS[fmt]]
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct(extra)),
    ])


def gsm8k_ground_truth(answer: str) -> str | None:
    """The number after the last ``####``, commas stripped; None when there is none."""
    found = _GSM8K_ANSWER.findall(answer)
    if not found:
        return None
    number = found[-1].replace(",", "").rstrip(".")
    return number or None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced); None when there is none."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                return text[start:position]
    return None


def convert_row(raw: Any, fmt: Format, index: int, *, split: str, data_source: str, instruction: str) -> dict:
    """One raw JSONL row as a verl row; ValueError names what is wrong with it."""
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be a JSON object, not {type(raw).__name__}")
    question_key, answer_key = RAW_FIELDS[fmt]
    for key in (question_key, answer_key):
        if raw.get(key) in (None, ""):
            raise ValueError(f"missing field {key!r}")
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise ValueError(f"field {key!r} must be a non-empty string")
    question, answer = raw[question_key], raw[answer_key]
    if fmt is Format.gsm8k:
        ground_truth = gsm8k_ground_truth(answer)
        if ground_truth is None:
            raise ValueError(f"field {answer_key!r} has no '#### <number>' final answer")
    else:
        ground_truth = last_boxed(answer)
        if ground_truth is None:
            raise ValueError(f"field {answer_key!r} has no \\boxed{{...}} final answer")
    extra = {"split": split, "index": index, question_key: question, answer_key: answer}
    extra.update({key: None if raw.get(key) is None else str(raw[key]) for key in OPTIONAL_FIELDS[fmt]})
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{question} {instruction}" if instruction else question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def convert_file(path: Path, fmt: Format, split: str = "train", *, data_source: str | None = None,
                 instruction: str | None = None) -> list[dict]:
    """Every row of a JSONL file as verl rows (blank lines count as lines but are skipped).

    ``data_source`` and ``instruction`` default to the format's. A ValueError
    names the file and the 1-based line of the first bad row.
    """
    fmt = Format(fmt)
    data_source = DEFAULT_DATA_SOURCE[fmt] if data_source is None else data_source
    instruction = DEFAULT_INSTRUCTION[fmt] if instruction is None else instruction
    if not path.is_file():
        raise ValueError(f"input file {path} does not exist")
    rows: list[dict] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error.msg})") from None
            rows.append(convert_row(raw, fmt, len(rows), split=split, data_source=data_source, instruction=instruction))
        except ValueError as error:
            raise ValueError(f"{path} line {number}: {error}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def write_parquet(rows: list[dict], fmt: Format, output: Path) -> None:
    """Write the rows with the format's schema, atomically: a temporary file in the same folder, then rename."""
    if output.suffix != ".parquet":
        raise ValueError(f"output {output}: expected a .parquet path")
    table = pa.Table.from_pylist(rows, schema=schema(Format(fmt)))
    output.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(handle)
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, output)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
