"""Loading models and tokenizers from local folders (nothing is fetched), and checking a folder's weights
cheaply, from the safetensors headers alone, before anything is let go to make room for them.

Weights load from safetensors: a pickled weights file (``pytorch_model.bin``,
``*.pt``) can run code when it is loaded, so a folder holding only those is
refused with a message, unless the run opts in with
``actor_rollout_ref.model.allow_pickle=true``.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

    HFModel: TypeAlias = PreTrainedModel | PeftModel
    """A model as the trainer and the hf engine hold it: a Hugging Face model as loaded (``load_causal_lm``,
    ``load_value_model``), or one with LoRA adapters, wrapped by PEFT (``lora.with_lora``)."""

SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                          "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
MAX_HEADER_BYTES = 100 << 20
"""The longest header the safetensors library itself reads."""

ModuleT = TypeVar("ModuleT", bound="torch.nn.Module")

PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

_TRANSFORMERS_IMPORT = threading.Lock()


def from_transformers(*names: str) -> tuple[Any, ...]:
    """``names`` from transformers, imported one thread at a time: transformers 5's lazily imported names are not
    thread-safe the first time (two threads at once, as two runs started together check their model folders on a
    coordinator, get ImportError: cannot import name 'AutoTokenizer')."""
    with _TRANSFORMERS_IMPORT:
        import transformers

        return tuple(getattr(transformers, name) for name in names)


def refuse_pickled_weights(path: str | Path, allow_pickle: bool, field: str) -> None:
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


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in ``path``.

    Where the folder has a ``tokenizer.json``, it is loaded exactly as saved:
    ``AutoTokenizer`` would pick a class from the model type (a Qwen2 config
    gets Qwen2's own pre-tokenizer, which drops a character-level tokenizer's
    spaces).
    """
    AutoTokenizer, PreTrainedTokenizerFast = from_transformers("AutoTokenizer", "PreTrainedTokenizerFast")

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def load_causal_lm(path: str | Path, dtype: str = "float32", allow_pickle: bool = False,
                   *, attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder, in the given dtype, on CPU; from safetensors unless
    ``allow_pickle``; attention as ``attn_implementation`` names it (None: transformers' default)."""
    import torch

    (AutoModelForCausalLM,) = from_transformers("AutoModelForCausalLM")

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    refuse_pickled_weights(folder, allow_pickle, "model folder")
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), use_safetensors=None if allow_pickle else True,
        attn_implementation=attn_implementation)
    return model


def load_value_model(path: str | Path, dtype: str = "float32", allow_pickle: bool = False,
                     *, attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM's body with a one-output token head (a value per position), from a local folder.

    The head is freshly initialised when the folder holds a plain causal LM. Dropout in the head is off,
    so values in training equal values in evaluation.
    """
    import torch

    AutoConfig, AutoModelForTokenClassification = from_transformers("AutoConfig", "AutoModelForTokenClassification")

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    config = AutoConfig.from_pretrained(folder, num_labels=1)
    config.classifier_dropout = 0.0
    refuse_pickled_weights(folder, allow_pickle, "model folder")
    model: PreTrainedModel = AutoModelForTokenClassification.from_pretrained(
        folder, config=config, dtype=getattr(torch, dtype), use_safetensors=None if allow_pickle else True,
        attn_implementation=attn_implementation)
    return model


def moved(model: ModuleT, device: torch.device | str) -> ModuleT:
    """``model``, its weights moved to ``device`` (in place, as ``Module.to`` moves them). Called through
    ``torch.nn.Module``'s type: transformers wraps its models' ``to`` in ``functools.wraps``, whose type mypy
    cannot call on an instance."""
    module: torch.nn.Module = model
    module.to(device)
    return model


def safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file holds (name -> dtype, shape, data_offsets), read from its header alone;
    ValueError naming the file (and the tensor) where the header is malformed or the file is too short for it."""
    size = file.stat().st_size
    with file.open("rb") as stream:
        length = int.from_bytes(stream.read(8), "little") if size >= 8 else 0
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file}: not a safetensors file, or truncated ({size} bytes, header of {length})")
        try:
            header = json.loads(stream.read(length))
        except ValueError as error:
            raise ValueError(f"{file}: its safetensors header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its safetensors header is not a mapping")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, entry in header.items():
        check_tensor_entry(file, name, entry, data_bytes=data_bytes)
    return header


def check_tensor_entry(file: Path, name: str, entry: Any, *, data_bytes: int) -> None:
    """One header entry's dtype is known, its offsets span its shape's bytes, and they lie within the file."""
    try:
        dtype, shape, (start, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        item_bytes = SAFETENSORS_ITEM_BYTES[dtype]
        tensor_bytes = math.prod(shape) * item_bytes
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{file}: tensor {name!r} has a malformed header entry {entry!r}") from None
    if end - start != tensor_bytes:
        raise ValueError(f"{file}: tensor {name!r} of shape {shape} and dtype {dtype} takes {tensor_bytes} bytes, "
                         f"but its data_offsets span {end - start}")
    if not 0 <= start <= end <= data_bytes:
        raise ValueError(f"{file}: tensor {name!r} lies at bytes {start}..{end} of the data, past its end "
                         f"({data_bytes} bytes): the file is truncated")


def folder_tensors(folder: Path) -> dict[str, tuple[Path, dict[str, Any]]] | None:
    """Each tensor of a folder's safetensors weights (one file, or shards listed in model.safetensors.index.json)
    with the file that holds it; None for a folder with no safetensors weights."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index}: not a safetensors index (a weight_map of tensor names to files)") from None
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return None
    tensors = {}
    for name in files:
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{file}: listed in {index.name} but missing")
        tensors.update({tensor: (file, entry) for tensor, entry in safetensors_header(file).items()})
    return tensors


def expected_weights(folder: Path, body_only: bool = False) -> tuple[dict[str, tuple[int, ...]], str]:
    """The parameters (name -> shape) the causal LM of ``folder``'s config.json has, built on the meta device
    (no memory, no weights read); ``body_only`` leaves out the output head (a value model gets a head of its own).
    Also the model's base prefix, which a folder may save its names without."""
    import torch

    AutoConfig, AutoModelForCausalLM = from_transformers("AutoConfig", "AutoModelForCausalLM")

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    head = next((name for name, module in model.named_modules() if module is model.get_output_embeddings()), None)
    return ({name: tuple(parameter.shape) for name, parameter in model.named_parameters()
             if not (body_only and head and name.startswith(f"{head}."))}, model.base_model_prefix)


def stored_tensor(tensors: dict[str, tuple[Path, dict[str, Any]]], name: str,
                  prefix: str) -> tuple[Path, dict[str, Any]] | None:
    """Where a folder's weights hold parameter ``name`` (with or without the model's base prefix), if they do."""
    return tensors.get(name) or tensors.get(name.removeprefix(f"{prefix}."))


def check_weights(path: str | Path, body_only: bool = False) -> None:
    """Refuse (ValueError naming the file and tensor) a model folder whose safetensors weights would fail to load:
    a tensor the config needs missing, of another shape or not a float, a header past the file's end. Reads the
    headers only. A folder without safetensors weights is left to the loader."""
    folder = Path(path)
    try:
        expected, prefix = expected_weights(folder, body_only)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{folder}/config.json: no model can be built from it ({error})") from None
    tensors = folder_tensors(folder)
    if tensors is None:
        return
    from services.run.experts import checkpoint_shapes

    for parameter, parameter_shape in expected.items():
        # a fused experts parameter may be stored whole or, as save_pretrained writes it, one tensor per expert
        pieces = ({parameter: parameter_shape} if stored_tensor(tensors, parameter, prefix) is not None
                  else checkpoint_shapes(parameter, parameter_shape))
        for name, shape in pieces.items():
            found = stored_tensor(tensors, name, prefix)
            if found is None:
                raise ValueError(f"{folder}: no tensor {name!r} in its safetensors weights, which its config.json "
                                 "needs")
            file, entry = found
            if tuple(entry["shape"]) != shape:
                raise ValueError(f"{file}: tensor {name!r} has shape {entry['shape']}, its config.json needs "
                                 f"{list(shape)}")
            if entry["dtype"] not in SAFETENSORS_FLOATS:
                raise ValueError(f"{file}: tensor {name!r} has dtype {entry['dtype']}, not a float")
