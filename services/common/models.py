"""Loading models and tokenizers from local folders (nothing is fetched)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The tokenizer saved in ``path``.

    Where the folder has a ``tokenizer.json``, it is loaded exactly as saved:
    ``AutoTokenizer`` would pick a class from the model type (a Qwen2 config
    gets Qwen2's own pre-tokenizer, which drops a character-level tokenizer's
    spaces).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def load_causal_lm(path: str | Path, dtype: str = "float32"):
    """A causal LM from a local Hugging Face folder, in the given dtype, on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))


def load_value_model(path: str | Path, dtype: str = "float32"):
    """A causal LM's body with a one-output token head (a value per position), from a local folder.

    The head is freshly initialised when the folder holds a plain causal LM. Dropout in the head is off,
    so values in training equal values in evaluation.
    """
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    config = AutoConfig.from_pretrained(folder, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(folder, config=config, dtype=getattr(torch, dtype))
