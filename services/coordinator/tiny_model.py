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
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def check_round_trip(tokenizer, text: str = ALPHABET) -> None:
    """Refuse a tokenizer that does not give back exactly what it was given."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=True)
    if len(ids) != len(text) or back != text:
        raise RuntimeError(f"character tokenizer does not round-trip: {text!r} -> {ids} -> {back!r}")


def build_tiny_model(folder: Path, hidden_size: int, num_layers: int, num_heads: int, seed: int) -> Path:
    """Write a random-init Qwen2 model and its tokenizer into ``folder`` (atomically); return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.common.models import load_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    check_round_trip(load_tokenizer(staging))
    (staging / "meshrl_tiny.json").write_text(json.dumps({"seed": seed, "hidden_size": hidden_size}))
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder
