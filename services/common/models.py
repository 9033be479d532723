"""Loading models and tokenizers from local folders (nothing is fetched).

Weights load from safetensors: a pickled weights file (``pytorch_model.bin``,
``*.pt``) can run code when it is loaded, so a folder holding only those is
refused with a message, unless the run opts in with
``actor_rollout_ref.model.allow_pickle=true``.
"""

from __future__ import annotations

from pathlib import Path

PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_weights(path: str | Path, allow_pickle: bool, field: str) -> None:
    """Refuse (ValueError naming ``field`` and the file) a model folder whose weights are pickled only, unless
    ``allow_pickle``."""
    folder = Path(path)
    if allow_pickle or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))
    if pickled:
        raise ValueError(f"{field}: {folder / pickled[0]} holds pickled weights, which can run code when loaded: "
                         "save the model as safetensors (save_pretrained(..., safe_serialization=True)), or set "
                         "actor_rollout_ref.model.allow_pickle=true if you trust the file")


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


def load_causal_lm(path: str | Path, dtype: str = "float32", allow_pickle: bool = False):
    """A causal LM from a local Hugging Face folder, in the given dtype, on CPU; from safetensors unless
    ``allow_pickle``."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    check_weights(folder, allow_pickle, "model folder")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype),
                                                use_safetensors=None if allow_pickle else True)


def load_value_model(path: str | Path, dtype: str = "float32", allow_pickle: bool = False):
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
    check_weights(folder, allow_pickle, "model folder")
    return AutoModelForTokenClassification.from_pretrained(folder, config=config, dtype=getattr(torch, dtype),
                                                           use_safetensors=None if allow_pickle else True)
