"""CPU tests of services/coordctl/synthetic.py and of what --local builds from it (local.prepare_assets)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from services.common.config import validate
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig
from services.coordctl.local import prepare_assets
from services.coordctl.synthetic import held_out, lookup_code, lookup_task_rows, reverse_task_rows


def digits_of(rows: list[dict]) -> list[str]:
    return [row["prompt"][0]["content"].removesuffix("=") for row in rows]


def test_the_held_out_strings_never_reach_training():
    train = reverse_task_rows(3000, 2, 4, seed=1, split="train", held_out_share=0.1)
    test = reverse_task_rows(200, 2, 4, seed=2, split="test", held_out_share=0.1)
    assert not set(digits_of(train)) & set(digits_of(test))
    assert all(held_out(d, 0.1) for d in digits_of(test)) and not any(held_out(d, 0.1) for d in digits_of(train))
    # the share is about a tenth of all strings of 2 to 4 digits, of every length
    strings = [f"{i:0{n}d}" for n in (2, 3, 4) for i in range(10 ** n)]
    assert sum(held_out(s, 0.1) for s in strings) / len(strings) == pytest.approx(0.1, abs=0.01)
    assert {len(d) for d in digits_of(test)} == {2, 3, 4}
    assert [row["reward_model"]["ground_truth"] for row in test[:3]] == [d[::-1] for d in digits_of(test)[:3]]
    with pytest.raises(ValueError, match="held-out share"):
        reverse_task_rows(5, 2, 4, seed=2, split="test")


def test_local_builds_held_out_data_unless_the_run_names_its_own(tmp_path):
    local = validate(LocalConfig, {"tiny_model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2},
                                   "synthetic_task": {"rows": 50, "val_rows": 20}})
    overrides = prepare_assets(validate(RunConfig, {}), local, tmp_path)
    named = dict(override.split("=", 1) for override in overrides)
    assert set(named) == {"actor_rollout_ref.model.path", "data.train_files", "data.val_files"}
    test_file = named["data.val_files"].strip("[]")
    assert len([json.loads(line) for line in open(test_file)]) == 20
    own = validate(RunConfig, {"data": {"train_files": ["/data/train.jsonl"]}})
    assert prepare_assets(own, local, tmp_path) == [f"actor_rollout_ref.model.path={named['actor_rollout_ref.model.path']}"]


def test_the_lookup_task_asks_codes_only_the_tool_knows_and_holds_out_keys():
    train = lookup_task_rows(2000, key_letters=2, seed=1, split="train", held_out_share=0.1)
    test = lookup_task_rows(100, key_letters=2, seed=2, split="test", held_out_share=0.1)
    keys = {split: {row["prompt"][0]["content"].removeprefix("code of ").removesuffix("?") for row in rows}
            for split, rows in (("train", train), ("test", test))}
    assert not keys["train"] & keys["test"] and all(held_out(key, 0.1) for key in keys["test"])
    assert len(keys["train"]) > 500  # of the 676 two-letter keys, about 608 are trained on
    row = test[0]
    key = row["prompt"][0]["content"][8:10]
    # the code is crc32("meshrl-lookup" + key) mod 10000, four digits
    expected = f"{zlib.crc32(f'meshrl-lookup{key}'.encode()) % 10000:04d}"
    assert row["reward_model"]["ground_truth"] == lookup_code(key) == expected
    assert row["data_source"] == "meshrl/lookup"
    assert row["extra_info"]["turns"] == [
        {"role": "assistant",
         "content": f'<tool_call>{{"name":"lookup","arguments":{{"key":"{key}"}}}}</tool_call>'},
        {"role": "tool", "content": lookup_code(key)}, {"role": "assistant", "content": lookup_code(key)}]
    assert len({row["reward_model"]["ground_truth"] for row in train}) > 400  # codes differ from key to key
    with pytest.raises(ValueError, match="held-out share"):
        lookup_task_rows(5, 2, seed=2, split="test")


def test_local_builds_the_lookup_task_only_with_the_chat_model(tmp_path):
    local = {"task": "lookup", "tiny_model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2},
             "lookup_task": {"rows": 50, "val_rows": 10}}
    with pytest.raises(ValueError, match=r"local\.task lookup needs local\.tiny_model\.chat: true"):
        prepare_assets(validate(RunConfig, {}), validate(LocalConfig, local), tmp_path)
    chat = validate(LocalConfig, {**local, "tiny_model": {**local["tiny_model"], "chat": True}})
    named = dict(override.split("=", 1) for override in prepare_assets(validate(RunConfig, {}), chat, tmp_path))
    assert named["actor_rollout_ref.model.path"].endswith("-chat")
    rows = [json.loads(line) for line in Path(named["data.val_files"].strip("[]")).read_text().splitlines()]
    assert len(rows) == 10 and {row["data_source"] for row in rows} == {"meshrl/lookup"}
