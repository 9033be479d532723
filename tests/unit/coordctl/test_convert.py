"""CPU tests of services/coordctl/convert.py and `coordctl data`: raw GSM8K / MATH JSONL to verl parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from services.coordctl.cli import app
from services.coordctl.convert import (
    DEFAULT_INSTRUCTION,
    Format,
    convert_file,
    gsm8k_ground_truth,
    last_boxed,
    schema,
    write_parquet,
)
from services.run.data import load_prompts
from services.coordctl.tiny_model import build_char_tokenizer

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more. Total?", "answer": "#### 5 is a guess\nSo it is 1,272.\n#### 1,272"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
     "level": "Level 1", "type": "Algebra"},
    {"problem": "What is $x$?", "solution": "First $\\boxed{1}$, no: $x = \\boxed{\\{a, b\\}^{2}}$."},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path: Path) -> list:
    return load_prompts([str(path)], "prompt", "data_source", tokenizer=build_char_tokenizer(), max_len=4096)[0]


# ---------------------------------------------------------------------------
# extractors


@pytest.mark.parametrize("answer, expected", [
    ("#### 72", "72"), ("work\n#### 1,234", "1234"), ("#### -3.5", "-3.5"), ("#### $18.", "18"),
    ("#### 1\n#### 2", "2"), ("no marker 72", None), ("#### none", None),
])
def test_gsm8k_ground_truth(answer, expected):
    assert gsm8k_ground_truth(answer) == expected


@pytest.mark.parametrize("solution, expected", [
    ("so $\\boxed{5}$", "5"), ("\\boxed{1} then \\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
    ("\\fbox{x^{2}}", "x^{2}"), ("\\boxed {7}", "7"), ("\\boxed{}", ""), ("no box", None),
    ("\\boxed{3} and an unclosed \\boxed{4", "3"), ("\\boxed{unclosed", None),
])
def test_last_boxed(solution, expected):
    assert last_boxed(solution) == expected


# ---------------------------------------------------------------------------
# file -> parquet -> load_prompts


def test_gsm8k_parquet_has_verl_schema_and_values(tmp_path):
    source = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K_ROWS[0], "", GSM8K_ROWS[1]])
    output = tmp_path / "out" / "gsm8k.parquet"
    write_parquet(convert_file(source, Format.gsm8k, split="test"), Format.gsm8k, output)

    table = pq.read_table(output)
    assert table.schema.equals(schema(Format.gsm8k))
    assert [f.name for f in table.schema] == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert table.schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())]))
    instruction = "Let's think step by step and output the final answer after \"####\"."
    assert table.to_pylist() == [
        {"data_source": "openai/gsm8k",
         "prompt": [{"role": "user", "content": f"{raw['question']} {instruction}"}],
         "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": truth},
         "extra_info": {"split": "test", "index": index, "question": raw["question"], "answer": raw["answer"]}}
        for index, (raw, truth) in enumerate(zip(GSM8K_ROWS, ["7", "1272"]))
    ]
    assert list(tmp_path.joinpath("out").iterdir()) == [output]  # no temporary file left behind

    prompts = load(output)
    assert [p.ground_truth for p in prompts] == ["7", "1272"]
    assert [p.data_source for p in prompts] == ["openai/gsm8k"] * 2
    assert prompts[1].extra_info["index"] == 1


def test_math_parquet_has_verl_schema_and_values(tmp_path):
    source = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    output = tmp_path / "math.parquet"
    rows = convert_file(source, Format.math, data_source="my/math", instruction="Box it.")
    write_parquet(rows, Format.math, output)

    table = pq.read_table(output)
    assert table.schema.equals(schema(Format.math))
    got = table.to_pylist()
    assert [r["reward_model"] for r in got] == [{"style": "rule", "ground_truth": "\\frac{1}{2}"},
                                                {"style": "rule", "ground_truth": "\\{a, b\\}^{2}"}]
    assert got[0]["prompt"] == [{"role": "user", "content": "Simplify $\\frac{2}{4}$. Box it."}]
    assert got[0]["extra_info"] == {"split": "train", "index": 0, "problem": MATH_ROWS[0]["problem"],
                                    "solution": MATH_ROWS[0]["solution"], "level": "Level 1", "type": "Algebra"}
    assert got[1]["extra_info"]["level"] is None and got[1]["extra_info"]["type"] is None
    assert {r["data_source"] for r in got} == {"my/math"} and {r["ability"] for r in got} == {"math"}

    prompts = load(output)
    assert [p.ground_truth for p in prompts] == ["\\frac{1}{2}", "\\{a, b\\}^{2}"]


def test_defaults_per_format(tmp_path):
    rows = convert_file(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS[:1]), Format.math)
    assert rows[0]["data_source"] == "lighteval/MATH"
    assert rows[0]["prompt"][0]["content"].endswith(
        " Let's think step by step and output the final answer within \\boxed{}.")
    assert DEFAULT_INSTRUCTION[Format.math].endswith("\\boxed{}.")
    plain = convert_file(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS[:1]), Format.gsm8k, instruction="")
    assert plain[0]["prompt"][0]["content"] == GSM8K_ROWS[0]["question"]


def test_overwrites_an_existing_output(tmp_path):
    output = tmp_path / "g.parquet"
    output.write_bytes(b"old")
    write_parquet(convert_file(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), Format.gsm8k), Format.gsm8k, output)
    assert pq.read_table(output).num_rows == 2


# ---------------------------------------------------------------------------
# bad rows


@pytest.mark.parametrize("fmt, bad, message", [
    (Format.gsm8k, {"question": "q?"}, "missing field 'answer'"),
    (Format.gsm8k, {"answer": "#### 1"}, "missing field 'question'"),
    (Format.gsm8k, {"question": "q?", "answer": "it is 4"}, "no '#### <number>' final answer"),
    (Format.gsm8k, {"question": "q?", "answer": 4}, "field 'answer' must be a non-empty string"),
    (Format.math, {"problem": "p", "solution": "it is 4"}, "no \\boxed{...} final answer"),
    (Format.math, {"problem": "p"}, "missing field 'solution'"),
    (Format.math, "{not json", "not valid JSON"),
    (Format.math, [1, 2], "a row must be a JSON object, not list"),
])
def test_bad_row_names_file_and_line(tmp_path, fmt, bad, message):
    good = GSM8K_ROWS[0] if fmt is Format.gsm8k else MATH_ROWS[0]
    source = write_jsonl(tmp_path / "in.jsonl", [good, "", "   ", bad if isinstance(bad, str) else json.dumps(bad)])
    with pytest.raises(ValueError) as caught:
        convert_file(source, fmt)
    assert str(caught.value).startswith(f"{source} line 4: ")
    assert message in str(caught.value)


def test_missing_empty_input_and_bad_output_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        convert_file(tmp_path / "nope.jsonl", Format.gsm8k)
    with pytest.raises(ValueError, match="no rows"):
        convert_file(write_jsonl(tmp_path / "empty.jsonl", ["", ""]), Format.gsm8k)
    rows = convert_file(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), Format.gsm8k)
    with pytest.raises(ValueError, match="expected a .parquet path"):
        write_parquet(rows, Format.gsm8k, tmp_path / "out.jsonl")


# ---------------------------------------------------------------------------
# coordctl data


def test_cli_converts_and_reports(tmp_path):
    source = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    output = tmp_path / "g.parquet"
    result = CliRunner().invoke(app, ["data", "gsm8k", str(source), str(output), "--split", "test",
                                      "--data-source", "gsm8k"])
    assert result.exit_code == 0, result.output
    assert f"wrote 2 rows to {output}" in result.output
    got = pq.read_table(output).to_pylist()
    assert [r["data_source"] for r in got] == ["gsm8k"] * 2
    assert [r["extra_info"]["split"] for r in got] == ["test"] * 2


def test_cli_refuses_a_bad_row_with_exit_code_2(tmp_path):
    source = write_jsonl(tmp_path / "m.jsonl", [MATH_ROWS[0], "", {"problem": "p", "solution": "4"}])
    output = tmp_path / "m.parquet"
    result = CliRunner().invoke(app, ["data", "math", str(source), str(output)])
    assert result.exit_code == 2
    assert f"{source} line 3: field 'solution' has no \\boxed{{...}} final answer" in result.output
    assert not output.exists()


def test_cli_refuses_an_unknown_format(tmp_path):
    source = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    result = CliRunner().invoke(app, ["data", "aime", str(source), str(tmp_path / "o.parquet")])
    assert result.exit_code == 2
    assert "FORMAT must be one of ['gsm8k', 'math']" in result.output
