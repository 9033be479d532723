"""CPU tests of services/run/data.py: loading verl-schema rows and sampling prompt batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.config import validate
from services.run.data import Prompt, load_prompts
from services.run.checks import check_batch_sizes
from services.run.config import RunConfig
from services.coordinator.step.sampler import PromptSampler, split_rows
from services.coordctl.tiny_model import build_char_tokenizer

MAX_LEN = 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def row(digits: str = "123", source: str = "meshrl/reverse", **changes) -> dict:
    base = {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{digits}="}],
        "ability": "reverse",
        "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
        "extra_info": {"split": "train", "index": 0},
    }
    base.update(changes)
    return base


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def load(tokenizer, *paths: Path, max_len: int = MAX_LEN) -> list[Prompt]:
    return load_prompts([str(p) for p in paths], "prompt", "data_source", tokenizer=tokenizer, max_len=max_len)[0]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------
# load_prompts


def test_char_tokenizer_gives_one_token_per_character(tokenizer):
    assert len(ids(tokenizer, "12 a=")) == 5
    assert tokenizer.decode(ids(tokenizer, "12 a=")) == "12 a="


def test_load_prompts_from_jsonl(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [
        row("123", extra_info={"index": 0}),
        row("4567", source="other", extra_info={"index": 1}),
        {"data_source": "s", "prompt": "plain", "reward_model": {"ground_truth": 42}},  # string prompt, no extra_info
    ])
    prompts = load(tokenizer, path)
    assert prompts[0] == Prompt(token_ids=ids(tokenizer, "123="), data_source="meshrl/reverse", ground_truth="321",
                                extra_info={"index": 0},
                                messages=({"role": "user", "content": "123="},))
    assert prompts[1] == Prompt(token_ids=ids(tokenizer, "4567="), data_source="other", ground_truth="7654",
                                extra_info={"index": 1},
                                messages=({"role": "user", "content": "4567="},))
    assert prompts[2] == Prompt(token_ids=ids(tokenizer, "plain"), data_source="s", ground_truth="42", extra_info={},
                                messages=({"role": "user", "content": "plain"},))


def test_load_prompts_from_parquet(tmp_path, tokenizer):
    rows = [row("12", extra_info={"split": "train", "index": 0}), row("9876", extra_info={"split": "train",
                                                                                          "index": 1})]
    prompts = load(tokenizer, write_parquet(tmp_path / "train.parquet", rows))
    assert prompts == [
        Prompt(token_ids=ids(tokenizer, "12="), data_source="meshrl/reverse", ground_truth="21",
               extra_info={"split": "train", "index": 0},
               messages=({"role": "user", "content": "12="},)),
        Prompt(token_ids=ids(tokenizer, "9876="), data_source="meshrl/reverse", ground_truth="6789",
               extra_info={"split": "train", "index": 1},
               messages=({"role": "user", "content": "9876="},)),
    ]


def test_load_prompts_concatenates_files_in_order(tmp_path, tokenizer):
    first = write_parquet(tmp_path / "a.parquet", [row("11")])
    second = write_jsonl(tmp_path / "b.jsonl", [row("22"), row("33")])
    assert [p.ground_truth for p in load(tokenizer, first, second)] == ["11", "22", "33"]


def test_prompt_of_exactly_max_length_is_kept(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [row("1234567")])  # "1234567=" is 8 tokens
    assert len(load(tokenizer, path)[0].token_ids) == MAX_LEN


BAD_ROWS = {
    "missing data_source": ({k: v for k, v in row().items() if k != "data_source"}, "missing field 'data_source'"),
    "null data_source": (row(source=None), "missing field 'data_source'"),
    "missing reward_model": ({k: v for k, v in row().items() if k != "reward_model"}, "missing field 'reward_model'"),
    "missing ground_truth": (row(reward_model={"style": "rule"}), "missing field 'reward_model.ground_truth'"),
    "null ground_truth": (row(reward_model={"style": "rule", "ground_truth": None}), "reward_model.ground_truth"),
    "empty string prompt": (row(prompt=""), "missing field 'prompt'"),
    "empty message list": (row(prompt=[]), "must be a string or a list of chat messages"),
    "empty message content": (row(prompt=[{"role": "user", "content": ""}]), "empty prompt"),
    "message without content": (row(prompt=[{"role": "user"}]), "must be a string or a list of chat messages"),
    "prompt over max length": (row("12345678"), "prompt has 9 tokens, over data.max_prompt_length=8"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_jsonl_row_names_file_and_row(tmp_path, tokenizer, case):
    bad, reason = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "train.jsonl", [row("1"), row("2"), bad, row("3")])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row 3: .*{re.escape(reason)}"):
        load(tokenizer, path)


@pytest.mark.parametrize("case", ["null data_source", "null ground_truth", "prompt over max length"])
def test_bad_parquet_row_names_file_and_row(tmp_path, tokenizer, case):
    bad, reason = BAD_ROWS[case]
    path = write_parquet(tmp_path / "train.parquet", [row("1"), bad, row("3")])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row 2: .*{re.escape(reason)}"):
        load(tokenizer, path)


def test_bad_row_in_second_file_names_that_file(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "a.jsonl", [row("1"), row("2")])
    bad = write_jsonl(tmp_path / "b.jsonl", [row(source="")])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))} row 1: missing field 'data_source'"):
        load(tokenizer, good, bad)


def test_invalid_json_line_names_file_and_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [row("1"), row("2"), '{"data_source": "x", "prompt": ', row("3")])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row 3: not valid JSON"):
        load(tokenizer, path)


@pytest.mark.parametrize("line", ['["not", "an", "object"]', '"just a string"', "5"])
def test_jsonl_line_that_is_not_an_object_names_file_and_row(tmp_path, tokenizer, line):
    path = write_jsonl(tmp_path / "train.jsonl", [row("1"), line])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row 2: "):
        load(tokenizer, path)


def test_row_numbers_agree_with_lines_after_a_blank_line(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row("1")) + "\n\n" + '{"broken": \n')
    with pytest.raises(ValueError, match=r" row 3: not valid JSON"):
        load(tokenizer, path)
    path.write_text(json.dumps(row("1")) + "\n\n" + json.dumps(row(source="")) + "\n")
    with pytest.raises(ValueError, match=r" row 3: missing field 'data_source'"):
        load(tokenizer, path)


def test_missing_file_and_unknown_suffix_are_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=rf"data file {re.escape(str(tmp_path / 'nope.jsonl'))} does not exist"):
        load(tokenizer, tmp_path / "nope.jsonl")
    csv = tmp_path / "train.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=rf"data file {re.escape(str(csv))}: expected .parquet or .jsonl"):
        load(tokenizer, csv)


def test_no_prompts_at_all_is_refused(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"no prompts in"):
        load(tokenizer, path)


# ---------------------------------------------------------------------------
# PromptSampler


def epochs(sampler: PromptSampler, count: int) -> list[list[list[int]]]:
    per_epoch = sampler.size // sampler.batch_size
    return [[sampler.next_batch() for _ in range(per_epoch)] for _ in range(count)]


def test_each_epoch_covers_every_index_once_without_repeats():
    sampler = PromptSampler(size=24, batch_size=6, shuffle=True, seed=3)
    for epoch in epochs(sampler, 3):
        assert all(len(batch) == 6 and len(set(batch)) == 6 for batch in epoch)
        assert sorted(i for batch in epoch for i in batch) == list(range(24))


def test_order_differs_between_epochs_and_from_identity():
    sampler = PromptSampler(size=50, batch_size=10, shuffle=True, seed=0)
    orders = [[i for batch in epoch for i in batch] for epoch in epochs(sampler, 3)]
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders[0] != list(range(50))


def test_same_seed_same_order_other_seed_other_order():
    def order(seed):
        return epochs(PromptSampler(size=40, batch_size=8, shuffle=True, seed=seed), 2)

    assert order(7) == order(7)
    assert order(7) != order(8)


def test_partial_tail_is_skipped_and_no_repeats_within_an_epoch():
    sampler = PromptSampler(size=10, batch_size=4, shuffle=True, seed=1)
    for _ in range(3):
        first, second = sampler.next_batch(), sampler.next_batch()
        assert len(set(first + second)) == 8  # two batches per epoch, the last 2 indices of each order skipped
        assert sampler.position == 8
    assert sampler.epoch == 2


def test_state_is_epoch_and_position():
    sampler = PromptSampler(size=12, batch_size=4, shuffle=True, seed=5)
    expected = [sampler.next_batch() for _ in range(7)]
    resumed = PromptSampler(size=12, batch_size=4, shuffle=True, seed=5)
    resumed.epoch, resumed.position = 1, 4  # after 4 batches: the whole of epoch 0 and one of epoch 1
    assert [resumed.next_batch() for _ in range(3)] == expected[4:]


def test_without_shuffle_batches_are_in_order():
    sampler = PromptSampler(size=6, batch_size=3, shuffle=False, seed=0)
    assert [sampler.next_batch() for _ in range(4)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]


def test_batch_as_large_as_the_data_is_allowed_larger_is_refused():
    assert sorted(PromptSampler(size=5, batch_size=5, shuffle=True, seed=0).next_batch()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"data.train_batch_size \(6\) is larger than the dataset \(5 prompts\)"):
        PromptSampler(size=5, batch_size=6, shuffle=True, seed=0)


def test_split_rows_takes_count_rows_by_seed_and_leaves_the_rest():
    taught, rest = split_rows(20, 6, seed=1)
    assert len(taught) == 6 and sorted(taught + rest) == list(range(20))  # disjoint, every row once
    assert taught == sorted(taught) and rest == sorted(rest)
    assert split_rows(20, 6, seed=1) == (taught, rest)  # a resumed run splits the same way
    assert split_rows(20, 6, seed=2)[0] != taught and taught != list(range(6))


def test_a_warm_start_with_its_own_rows_that_leaves_rl_too_few_is_refused_naming_the_numbers():
    config = validate(RunConfig, {"data": {"train_files": ["train.jsonl"], "train_batch_size": 8},
                                  "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8, "warm_start": {
                                      "steps": 3, "batch_size": 4, "own_rows": True}}}})
    check_batch_sizes(config, 20)  # 12 taught, 8 left: one RL batch
    with pytest.raises(ValueError, match=r"warm_start.own_rows: the warm start's 12 rows .* leave 7 of the 19 "
                                         r"prompts in train.jsonl for RL, fewer than data.train_batch_size \(8\)"):
        check_batch_sizes(config, 19)
