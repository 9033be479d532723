"""CPU tests of services/coordctl/tiny_model.py's chat variant: one token per character and per ChatML or tool
tag, <|im_end|> as EOS, a ChatML template with the tools in one line, and replies that extend a conversation
token-exactly (services/coordinator/agent/turns.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.coordctl.synthetic import lookup_task_rows
from services.coordctl.tiny_model import ALPHABET, build_char_tokenizer, build_chat_tokenizer, build_tiny_model
from services.coordinator.agent.turns import ReplyTokens, SampledTokens, Trajectory, extend, render_prompt, render_reply
from services.run.models import load_tokenizer

TOOLS = ({"type": "function", "function": {"name": "lookup", "description": "The code of a key.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}}})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "chat", hidden_size=16, num_layers=1, num_heads=2,
                            seed=0, chat=True)


@pytest.fixture(scope="module")
def tokenizer(folder):
    """The chat variant's tokenizer as a service loads it from the model folder."""
    return load_tokenizer(folder)


def test_the_chat_model_stops_at_im_end_and_holds_a_long_conversation(folder, tokenizer):
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (config["max_position_embeddings"], config["initializer_range"]) == (1024, 0.1)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_each_character_and_each_chatml_or_tool_tag_is_one_token(tokenizer):
    text = '<|im_start|>user\n<tool_call>{"key": [\'Q_X\']}</tool_call><tool_response>\n</tool_response><|im_end|>'
    assert len(ids(tokenizer, text)) == len(text) - sum(len(tag) - 1 for tag in (
        "<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_end|>"))
    assert tokenizer.eos_token == "<|im_end|>"
    # decoding drops ChatML's special tokens but keeps the tool tags, which the tool-call parser reads
    assert tokenizer.decode(ids(tokenizer, text), skip_special_tokens=True) == text.removeprefix(
        "<|im_start|>").removesuffix("<|im_end|>")


def test_the_prompt_names_each_tool_in_one_line(tokenizer):
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "code of QX?"}], {"tools": TOOLS})
    assert tokenizer.decode(list(prompt), skip_special_tokens=False) == (
        "<|im_start|>system\nTools: lookup(key) add(a,b)<|im_end|>\n<|im_start|>user\ncode of QX?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render_prompt(tokenizer, [{"role": "user", "content": "hi"}], {}) == tuple(
        ids(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))


def test_a_worked_lookup_trajectory_extends_token_exactly(tokenizer):
    """The lookup task's worked turns, the model's sampled (EOS included) and the tool's rendered by
    render_reply, give exactly the ids of the whole conversation as the template renders it at once."""
    [row] = lookup_task_rows(1, key_letters=2, seed=0)
    call, tool, answer = row["extra_info"]["turns"]
    messages = tuple(row["prompt"])
    trajectory = Trajectory(prompt_ids=render_prompt(tokenizer, messages, {"tools": TOOLS}), max_response_length=200)
    call_ids = (*ids(tokenizer, call["content"]), tokenizer.eos_token_id)
    turn = SampledTokens(ids=call_ids, logprobs=(-0.1,) * len(call_ids), weight_version=0)
    trajectory = extend(trajectory, turn)
    replies = render_reply(tokenizer, messages=messages, sampled_ids=turn.ids, replies=[tool], room=trajectory.room,
                           max_reply_tokens=50, truncate_side="middle", template_kwargs={"tools": TOOLS})
    assert isinstance(replies, ReplyTokens)
    assert tokenizer.decode(list(replies.ids), skip_special_tokens=False) == (
        f"\n<|im_start|>user\n<tool_response>\n{tool['content']}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    trajectory = extend(trajectory, replies)
    final = [*ids(tokenizer, answer["content"]), tokenizer.eos_token_id]
    trajectory = extend(trajectory, SampledTokens(ids=tuple(final), logprobs=(-0.1,) * len(final), weight_version=0))
    whole = tokenizer.apply_chat_template([*messages, call, tool, answer], tokenize=False, tools=list(TOOLS))
    assert list(trajectory.ids) + ids(tokenizer, "\n") == ids(tokenizer, whole)
    assert trajectory.loss_mask == (1,) * len(turn.ids) + (0,) * len(replies.ids) + (1,) * len(final)
    assert json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "lookup", "arguments": {"key": row["prompt"][0]["content"][8:10]}}


def test_the_default_tokenizer_is_unchanged():
    tokenizer = build_char_tokenizer()
    assert (len(tokenizer), tokenizer.eos_token, tokenizer.chat_template) == (3 + len(ALPHABET), "<eos>", None)
    assert len(build_chat_tokenizer()) > len(tokenizer)


def test_local_num_experts_builds_a_qwen3_moe_model_beside_the_dense_one(tmp_path):
    from services.common.config import ConfigError, validate
    from services.coordctl.config import LocalConfig
    from services.coordctl.local import prepare_assets
    from services.run.config import RunConfig

    def model_folder(tiny: dict) -> str:
        local = validate(LocalConfig, {"tiny_model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, **tiny},
                                       "synthetic_task": {"rows": 10, "val_rows": 0}}, "local")
        overrides = dict(o.split("=", 1) for o in prepare_assets(validate(RunConfig, {}), local, tmp_path))
        return overrides["actor_rollout_ref.model.path"]

    moe, dense = model_folder({"num_experts": 4, "experts_per_token": 2}), model_folder({})
    assert moe.endswith("tiny-qwen3moe-e4k2-char-h16-l1-a2-s0") and dense.endswith("tiny-qwen2-char-h16-l1-a2-s0")
    config = json.loads(Path(moe, "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["norm_topk_prob"]) == ("qwen3_moe", 4, 2, 32, True)
    assert json.loads(Path(dense, "config.json").read_text())["model_type"] == "qwen2"
    with pytest.raises(ConfigError, match=r"local\.tiny_model.*experts_per_token \(5\) must be at most num_experts"):
        model_folder({"num_experts": 4, "experts_per_token": 5})
