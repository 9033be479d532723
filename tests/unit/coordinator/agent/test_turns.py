"""CPU tests of services/coordinator/agent/turns.py: replies appended token-exactly, against ChatML written by hand.

The tokenizer is built here: one token per printable character (newline included) and ChatML's special tokens,
so the expected ids of a conversation are those of its text, written out in full in each test.
"""

from __future__ import annotations

import string

import pytest

from services.coordinator.agent.turns import (
    CannotExtend, OverBudget, ReplyTokens, SampledTokens, Trajectory, Turn, extend, render_prompt, render_reply,
    ids_text, text_ids, truncate_text,
)

CHATML = r"""
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
{%- else -%}
{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""

# As Qwen3's template does: an assistant turn followed by others loses its thinking.
STRIPS_THINKING = CHATML.replace(
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- set content = message.content if loop.last else message.content.split('</think>')[-1] -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}")

CONVERSATION = ({"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 6*7?"})
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
PROMPT_TEXT = ("<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\nWhat is 6*7?<|im_end|>\n"
               "<|im_start|>assistant\n")


def build_tokenizer(template: str = CHATML, *, clean_up_tokenization_spaces: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(string.printable)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def sampled(tokenizer, text: str, version: int) -> SampledTokens:
    ids = encode(tokenizer, text)
    return SampledTokens(ids=ids, logprobs=tuple(-0.25 for _ in ids), weight_version=version)


def reply(tokenizer, messages, turn: SampledTokens, replies, room: int = 10_000, max_reply_tokens: int = 1000,
          side: str = "middle", template_kwargs=None):
    return render_reply(tokenizer, messages=messages, sampled_ids=turn.ids, replies=replies, room=room,
                        max_reply_tokens=max_reply_tokens, truncate_side=side, template_kwargs=template_kwargs or {})


def test_the_tokenizer_is_one_token_per_character_and_special_token(tokenizer):
    assert len(encode(tokenizer, "<|im_start|>ab\n<|im_end|>")) == 5
    assert render_prompt(tokenizer, CONVERSATION, {}) == encode(tokenizer, PROMPT_TEXT)


def test_a_tool_reply_appends_exactly_the_chatml_between_the_turns(tokenizer):
    turn = sampled(tokenizer, CALL, version=3)  # the engine left out the stop token
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "42"}])
    assert isinstance(result, ReplyTokens)
    assert tokenizer.decode(list(result.ids), skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert result.loss_mask == (0,) * len(result.ids)
    assert not result.truncated


def test_a_sampled_stop_token_is_not_appended_again(tokenizer):
    turn = sampled(tokenizer, CALL + "<|im_end|>", version=3)
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "42"}])
    assert tokenizer.decode(list(result.ids), skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_three_turns_give_the_ids_of_the_whole_conversation_and_mask_exactly_the_models(tokenizer):
    trajectory = Trajectory(prompt_ids=render_prompt(tokenizer, CONVERSATION, {}), max_response_length=1000)
    first = sampled(tokenizer, CALL + "<|im_end|>", version=3)
    trajectory = extend(trajectory, first)
    replies = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "ok"}]
    bridge = reply(tokenizer, CONVERSATION, first, replies, room=trajectory.room)
    trajectory = extend(trajectory, bridge)
    second = sampled(tokenizer, "It is 42.<|im_end|>", version=4)
    trajectory = extend(trajectory, second)

    whole = (PROMPT_TEXT + CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
             "<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 42.<|im_end|>")
    assert trajectory.ids == encode(tokenizer, whole)
    messages = [*bridge.messages, {"role": "assistant", "content": "It is 42."}]
    assert tokenizer.decode(list(trajectory.ids), skip_special_tokens=False) + "\n" == tokenizer.apply_chat_template(
        messages, tokenize=False)
    model_ids = [i for i, m in zip(trajectory.response_ids, trajectory.loss_mask) if m]
    assert model_ids == list(first.ids + second.ids)
    assert [p for p, m in zip(trajectory.logprobs, trajectory.loss_mask) if not m] == [0.0] * len(bridge.ids)
    assert trajectory.turns == (
        Turn(role="model", start=0, end=len(first.ids), weight_version=3),
        Turn(role="reply", start=len(first.ids), end=len(first.ids) + len(bridge.ids), weight_version=None),
        Turn(role="model", start=len(first.ids) + len(bridge.ids), end=len(trajectory.response_ids),
             weight_version=4))
    assert trajectory.weight_versions == (3, 4)


def test_the_next_reply_extends_the_conversation_the_last_one_returned(tokenizer):
    first = sampled(tokenizer, CALL, version=1)
    bridge = reply(tokenizer, CONVERSATION, first, [{"role": "tool", "content": "42"}])
    second = sampled(tokenizer, "Check: " + CALL, version=2)
    again = reply(tokenizer, bridge.messages, second, [{"role": "tool", "content": "42 again"}])
    ids = render_prompt(tokenizer, CONVERSATION, {}) + first.ids + bridge.ids + second.ids + again.ids
    assert ids == render_prompt(tokenizer, [*again.messages], {})


def test_a_template_that_strips_earlier_thinking_cannot_be_extended():
    tokenizer = build_tokenizer(STRIPS_THINKING)
    turn = sampled(tokenizer, "<think>6*7 is easy</think>" + CALL, version=1)
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "42"}])
    assert isinstance(result, CannotExtend) and "strips earlier thinking" in result.reason
    # what a new sample renders fresh: the conversation, the model's turn as sampled, the reply
    assert result.messages == (*CONVERSATION, {"role": "assistant", "content": "<think>6*7 is easy</think>" + CALL},
                               {"role": "tool", "content": "42"})
    plain = reply(tokenizer, CONVERSATION, sampled(tokenizer, CALL, version=1), [{"role": "tool", "content": "42"}])
    assert isinstance(plain, ReplyTokens)  # without thinking in the turn, nothing is rewritten


def test_a_template_that_rewrites_the_models_turn_cannot_be_extended():
    tokenizer = build_tokenizer(CHATML.replace("message.content +", "message.content.strip() +"))
    result = reply(tokenizer, CONVERSATION, sampled(tokenizer, CALL + "  ", version=1),
                   [{"role": "tool", "content": "42"}])
    assert isinstance(result, CannotExtend) and "as sampled" in result.reason


@pytest.mark.parametrize(("side", "expected"), [
    ("left", "abcdefg...(truncated)"),
    ("right", "(truncated)...tuvwxyz"),
    ("middle", "abcd...(truncated)...xyz"),
])
def test_truncation_keeps_the_side_verl_names_and_counts_the_marker(tokenizer, side, expected):
    text = string.ascii_lowercase
    limit = len(expected)
    assert truncate_text(tokenizer, text, limit, side=side) == expected
    assert truncate_text(tokenizer, text, 26, side=side) is None


def test_a_long_reply_is_cut_to_max_reply_tokens(tokenizer):
    turn = sampled(tokenizer, CALL, version=1)
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "x" * 500}], max_reply_tokens=30,
                   side="left")
    assert result.truncated
    assert result.messages[-1] == {"role": "tool", "content": "x" * 16 + "...(truncated)"}
    assert "x" * 16 + "...(truncated)\n</tool_response>" in tokenizer.decode(list(result.ids))


def test_a_reply_that_would_overflow_the_response_is_cut_to_fit(tokenizer):
    turn = sampled(tokenizer, CALL, version=1)
    full = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "y" * 100}])
    room = len(full.ids) - 40
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "y" * 100}], room=room, side="right")
    assert isinstance(result, ReplyTokens) and result.truncated
    assert len(result.ids) <= room
    assert result.messages[-1]["content"].startswith("(truncated)...y")


def test_replies_that_cannot_fit_even_cut_are_over_budget(tokenizer):
    turn = sampled(tokenizer, CALL, version=1)
    result = reply(tokenizer, CONVERSATION, turn, [{"role": "tool", "content": "42"}], room=20)
    assert isinstance(result, OverBudget) and result.room == 20 and result.needed > 20


def test_extend_refuses_what_does_not_fit_and_logprobs_that_do_not_match(tokenizer):
    trajectory = Trajectory(prompt_ids=(1, 2), max_response_length=3)
    with pytest.raises(ValueError, match="4 ids do not fit the 3 left"):
        extend(trajectory, SampledTokens(ids=(5, 6, 7, 8), logprobs=(0.0,) * 4, weight_version=0))
    with pytest.raises(ValueError, match="2 sampled ids with 1 logprobs"):
        extend(trajectory, SampledTokens(ids=(5, 6), logprobs=(0.0,), weight_version=0))


def test_an_unknown_truncate_side_is_refused(tokenizer):
    with pytest.raises(ValueError, match="'top' is not one of left, right, middle"):
        reply(tokenizer, CONVERSATION, sampled(tokenizer, CALL, version=1), [], side="top")


def bpe_tokenizer(**kwargs):
    """A byte-level BPE tokenizer trained here on a few sentences (merges across characters, as real ones have),
    with ChatML's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([PROMPT_TEXT, CALL, "the tool answered 42, the model wrote it back"] * 20,
                             trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>",
                                                                                         "<|im_end|>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", clean_up_tokenization_spaces=False,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"], **kwargs)


TEXTS = ("", "plain", PROMPT_TEXT + CALL, "<|im_start|><|im_end|>x<eos>", "  two  spaces\n\tand a tab",
         "ünïcödé ✓ 数字")


@pytest.mark.parametrize("build", [build_tokenizer, bpe_tokenizer, lambda: bpe_tokenizer(split_special_tokens=True)],
                         ids=["characters", "bpe", "bpe, special tokens split"])
def test_text_ids_are_what_the_tokenizers_encode_gives(build):
    tokenizer, reference = build(), build()
    for text in TEXTS:
        assert text_ids(tokenizer, text) == tuple(reference.encode(text, add_special_tokens=False)), text


def test_text_ids_ignore_a_truncation_a_call_left_on_the_rust_tokenizer():
    tokenizer, reference = bpe_tokenizer(), bpe_tokenizer()
    tokenizer(PROMPT_TEXT, truncation=True, max_length=3)  # leaves the Rust tokenizer truncating at 3
    assert tokenizer.backend_tokenizer.truncation is not None
    ids = text_ids(tokenizer, PROMPT_TEXT + CALL)
    assert ids == tuple(reference.encode(PROMPT_TEXT + CALL, add_special_tokens=False)) and len(ids) > 3


def test_text_ids_of_a_tokenizer_whose_class_encodes_its_own_way_are_its_own():
    from transformers import PreTrainedTokenizerFast

    class Marking(PreTrainedTokenizerFast):  # as a model's tokenizer class may change what encode does
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus("<|im_start|>" + text, *args, **kwargs)

    core = bpe_tokenizer().backend_tokenizer
    marking = Marking(tokenizer_object=core, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    assert text_ids(marking, "plain") == tuple(marking.encode("plain", add_special_tokens=False))
    assert text_ids(marking, "plain")[0] == marking.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize("build", [build_tokenizer, bpe_tokenizer,
                                   lambda: build_tokenizer(clean_up_tokenization_spaces=True)],
                         ids=["characters", "bpe", "characters, spaces cleaned up"])
def test_ids_text_is_what_the_tokenizers_decode_gives(build):
    tokenizer = build()
    for text in (*TEXTS, "a , b . c ' d n't"):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        for skip in (False, True):
            assert ids_text(tokenizer, ids, skip_special_tokens=skip) == tokenizer.decode(
                list(ids), skip_special_tokens=skip), (text, skip)


def test_ids_text_of_a_tokenizer_whose_class_decodes_its_own_way_is_its_own():
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):  # as a model's tokenizer class may change what decode does
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=bpe_tokenizer().backend_tokenizer)
    ids = shouting.encode("plain", add_special_tokens=False)
    assert ids_text(shouting, ids, skip_special_tokens=True) == "PLAIN"
