"""A tiny random-init Qwen2-architecture model with a character tokenizer.

Built once into a folder that every service then loads like any local Hugging
Face model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``). The tokenizer maps each character to one token and back,
exactly: ``decode(encode(s)) == s`` for every string over its alphabet, spaces
included (checked when the folder is built).
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
from pathlib import Path

ALPHABET = string.digits + string.ascii_letters + " =+-*/#.,:?!()"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def build_char_tokenizer():
    """A fast tokenizer with one token per character of ALPHABET, plus <pad>, <eos>, <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


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


def build_tiny_model(folder: Path, hidden_size: int, num_layers: int, num_heads: int, seed: int) -> Path:
    """Write a tiny random-init Qwen2 model and its tokenizer into ``folder`` (atomically); return it."""
    shape = dict(hidden_size=hidden_size, intermediate_size=hidden_size * 4, num_hidden_layers=num_layers,
                 num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=256)
    return build_random_model(folder, shape, "float32", seed)


def build_random_model(folder: Path, shape: dict, dtype: str, seed: int) -> Path:
    """Write a random-init Qwen2 model of the given shape, with the character tokenizer, into ``folder``.

    A vocabulary larger than the tokenizer's is allowed (its extra ids are never produced by the tokenizer).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.run.models import load_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**{
        "vocab_size": len(tokenizer), "tie_word_embeddings": True, "max_position_embeddings": 4096,
        **shape,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    })
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    check_round_trip(load_tokenizer(staging))
    (staging / "meshrl_random_model.json").write_text(json.dumps({"seed": seed, "dtype": dtype, **shape}))
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def build_tiny_reward_model(folder: Path, hidden_size: int, num_layers: int, seed: int) -> Path:
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
