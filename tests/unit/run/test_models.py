"""The cheap check of a model folder's safetensors weights (from the headers alone, naming the file and tensor), the
refusal of pickled weights unless the run allows them, and loading from several threads at once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.run.models import check_weights, load_causal_lm, refuse_pickled_weights
from services.coordctl.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                            seed=0)


def copy_with(tiny: Path, folder: Path, change) -> Path:
    """A copy of the tiny model whose tensors ``change`` edits (a dict, in place)."""
    shutil.copytree(tiny, folder)
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_loadable_folder_passes(tiny):
    check_weights(tiny)
    check_weights(tiny, body_only=True)
    load_causal_lm(tiny)


def test_a_truncated_file_is_refused_naming_it_and_a_tensor(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '.+' lies at bytes .* truncated"):
        check_weights(tmp_path / "cut")
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file, or truncated"):
        check_weights(tmp_path / "cut")


def test_a_tensor_of_another_shape_or_missing_is_refused(tiny, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    wide = copy_with(tiny, tmp_path / "wide", lambda t: t.update({name: torch.zeros(t[name].shape[0], 7)}))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' has shape \[\d+, 7\], its config"):
        check_weights(wide)
    with pytest.raises(RuntimeError):  # what the loader itself would do with it, after the check
        load_causal_lm(wide)
    missing = copy_with(tiny, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"no tensor '{name}'"):
        check_weights(missing)
    ints = copy_with(tiny, tmp_path / "ints", lambda t: t.update({name: t[name].to(torch.int32)}))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype I32, not a float"):
        check_weights(ints)


def test_a_folder_without_safetensors_is_left_to_the_loader(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "bare")
    (tmp_path / "bare" / "model.safetensors").unlink()
    check_weights(tmp_path / "bare")


def test_pickled_weights_are_refused_unless_allowed_and_safetensors_pass(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.path: .*pytorch_model.bin holds pickled weights.*"
                                         r"allow_pickle=true"):
        refuse_pickled_weights(tmp_path, False, "actor_rollout_ref.model.path")
    refuse_pickled_weights(tmp_path, True, "actor_rollout_ref.model.path")
    (tmp_path / "model.safetensors").write_bytes(b"")
    refuse_pickled_weights(tmp_path, False, "actor_rollout_ref.model.path")


LOAD_IN_EIGHT_THREADS = """
import sys, threading
from services.run.models import check_weights, load_tokenizer
failures = []
def load(i):
    try:
        (load_tokenizer if i % 2 else check_weights)(sys.argv[1])
    except Exception as error:
        failures.append(repr(error))
threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
[thread.start() for thread in threads]
[thread.join() for thread in threads]
print(failures)
"""


def test_a_fresh_process_checks_and_loads_from_eight_threads_at_once(tiny):
    """As a coordinator that two runs start on together: its first imports of transformers' names come from several
    threads at once (transformers imports them lazily, and refused some with ImportError when two threads did)."""
    done = subprocess.run([sys.executable, "-c", LOAD_IN_EIGHT_THREADS, str(tiny)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
