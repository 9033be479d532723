"""A tiny random-init Qwen2-architecture model (or Qwen3-MoE, a mixture of experts) with a character tokenizer.

Built once into a folder that every service then loads like any local Hugging
Face model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``). The tokenizer maps each character to one token and back,
exactly: ``decode(encode(s)) == s`` for every string over its alphabet, spaces
included (checked when the folder is built).

The chat variant (``chat=True``) is the same idea for multi-turn runs with tools: its alphabet also holds what
a Hermes tool call needs (braces, quotes, brackets, newline, ...), ChatML's ``<|im_start|>`` and
``<|im_end|>`` and Qwen2.5's ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` are
one token each, ``<|im_end|>`` is the EOS (a turn ends there), and its chat template is ChatML as Qwen2.5
writes it, tools and tool replies included, but with the tools named in one short line (a character model's
prompt must stay small).
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
from pathlib import Path

ALPHABET = string.digits + string.ascii_letters + " =+-*/#.,:?!()"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHAT_ALPHABET = ALPHABET + "{}[]\"'_<>;|\n"
CHAT_SPECIAL_TOKENS = ("<pad>", "<|im_end|>", "<unk>", "<|im_start|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Single tokens of the chat variant that decoding keeps (as Qwen2.5's are): the tool-call parser reads them."""
# A small random Qwen3-MoE (the GPU MoE tests' and bench/probe_kl.py's): 8 experts of 1024, 2 a token, 4 layers 512
# wide (head_dim 64): sizes vLLM's fused-MoE kernels take as they are.
SMALL_QWEN3_MOE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=1024, norm_topk_prob=True, vocab_size=2048, initializer_range=0.1,
                       tie_word_embeddings=False, max_position_embeddings=512)

# ChatML as Qwen2.5 renders it, tools in one line ("Tools: lookup(key) other(a,b)") instead of their JSON schemas;
# consecutive tool replies share one user turn, each in its own <tool_response> block, as Qwen2.5's do.
CHAT_TEMPLATE = (  # every literal in {{ }}: the chat template renders with trim_blocks, which eats "\n" after a tag
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{%- set function = tool.function if tool.function is defined else tool %}"
    "{{ ' ' + function.name + '(' + ((function.parameters.properties if function.parameters is defined else {})"
    " | list | join(',')) + ')' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def filler_word(index: int) -> str:
    """The text of the ``index``-th id past the alphabet: letters between brackets no alphabet holds, so that
    it never reads as a digit or a tool call."""
    letters = ""
    while True:
        index, rest = divmod(index, 26)
        letters += chr(ord("a") + rest)
        if not index:
            return f"\u27e8{letters}\u27e9"


def build_char_tokenizer(vocab_size: int | None = None):
    """A fast tokenizer with one token per character of ALPHABET, plus <pad>, <eos>, <unk>; with ``vocab_size``,
    every id up to it decodes, the ids past the alphabet each to a filler word of its own (encoding never makes
    them). A model's vocabulary larger than the alphabet (the Qwen2.5 shapes' 152k) then decodes whatever it
    samples, as a real tokenizer does: engines that detokenize as they generate (TRL's vLLM) pay what they pay
    on a real model, not an error path for each unknown id."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + tuple(ALPHABET)
    words += tuple(filler_word(i) for i in range(max(0, (vocab_size or 0) - len(words))))
    vocab = {token: i for i, token in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_chat_tokenizer():
    """The chat variant: one token per character of CHAT_ALPHABET (newline included), ChatML's special tokens and
    the tool tokens, ``<|im_end|>`` as EOS, and CHAT_TEMPLATE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(CHAT_SPECIAL_TOKENS + TOOL_TOKENS + tuple(CHAT_ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_round_trip(tokenizer, text: str = ALPHABET) -> None:
    """Refuse a tokenizer that does not give back exactly what it was given."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=True)
    if len(ids) != len(text) or back != text:
        raise RuntimeError(f"character tokenizer does not round-trip: {text!r} -> {ids} -> {back!r}")


# Qwen2.5-shaped random models for GPU tests and benchmarks (sizes of the public 0.5B and 1.5B checkpoints).
QWEN25_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}


def moe_shape(hidden_size: int, num_heads: int, num_experts: int, *, experts_per_token: int) -> dict[str, int | bool]:
    """What a Qwen3-MoE config adds to a shape: ``num_experts`` experts in every layer's MLP, ``experts_per_token``
    of them for each token, each ``4 * hidden_size / experts_per_token`` wide (so a token's MLP is as wide as the
    dense model's), the chosen experts' weights normalised to sum to 1 (as in Qwen3-30B-A3B)."""
    return dict(num_experts=num_experts, num_experts_per_tok=experts_per_token,
                moe_intermediate_size=max(1, hidden_size * 4 // experts_per_token),
                head_dim=hidden_size // num_heads, norm_topk_prob=True)


def build_tiny_model(folder: Path, hidden_size: int, num_layers: int, *, num_heads: int, seed: int,
                     chat: bool = False, num_experts: int = 0, experts_per_token: int = 2) -> Path:
    """Write a tiny random-init model and its tokenizer (the chat variant's with ``chat``) into ``folder``
    (atomically); return it. Qwen2 (dense), or Qwen3-MoE with ``num_experts`` > 0 (``moe_shape``)."""
    shape: dict[str, int | float] = dict(
        hidden_size=hidden_size, intermediate_size=hidden_size * 4, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=256)
    if num_experts:
        shape.update(moe_shape(hidden_size, num_heads, num_experts, experts_per_token=experts_per_token))
    if chat:  # a conversation with tools is longer; its answers are copied from far back (a tool reply, the key
        # asked), which weights drawn at Qwen2's 0.02 take ~1000 warm-start steps to learn and at 0.1 ~100
        shape.update(max_position_embeddings=1024, initializer_range=0.1)
    return build_random_model(folder, shape, "float32", seed=seed, chat=chat)


def architecture(shape: dict):
    """The (config, model) classes a shape builds: Qwen3-MoE when it names experts, else Qwen2."""
    if shape.get("num_experts"):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config, Qwen2ForCausalLM


def build_random_model(folder: Path, shape: dict, dtype: str, *, seed: int, chat: bool = False) -> Path:
    """Write a random-init model of the given shape (``architecture``: Qwen2, or Qwen3-MoE when it names experts),
    with the character tokenizer (the chat variant's with ``chat``), into ``folder``.

    A vocabulary larger than the alphabet is allowed: the character tokenizer then decodes every id of it
    (``build_char_tokenizer``), though encoding never produces the extra ids; the chat variant's does not.
    """
    import torch

    from services.run.models import load_tokenizer

    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer(shape.get("vocab_size"))
    config_class, model_class = architecture(shape)
    config = config_class(**{
        "vocab_size": len(tokenizer), "tie_word_embeddings": True, "max_position_embeddings": 4096,
        **shape,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    })
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    check_round_trip(load_tokenizer(staging), CHAT_ALPHABET if chat else ALPHABET)
    (staging / "meshrl_random_model.json").write_text(json.dumps({"seed": seed, "dtype": dtype, **shape,
                                                                  **({"chat": True} if chat else {})}))
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def build_tiny_reward_model(folder: Path, hidden_size: int, num_layers: int, *, seed: int) -> Path:
    """Write a tiny random-init Qwen2 sequence classifier (one output: a reward model) with the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(  # type: ignore[call-arg]  # num_labels goes to PreTrainedConfig's **kwargs
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, num_labels=1,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
