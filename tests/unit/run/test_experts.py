"""CPU tests of services/run/experts.py: a mixture of experts' fused parameters split into the tensors
transformers' own save_pretrained writes, and a model folder of either layout passing check_weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.coordctl.tiny_model import build_tiny_model
from services.run.experts import checkpoint_shapes, fused_experts_parts, per_expert_tensors
from services.run.models import check_weights, load_causal_lm


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", hidden_size=16, num_layers=2,
                            num_heads=2, seed=0, num_experts=4, experts_per_token=2)


def test_fused_experts_split_into_what_save_pretrained_writes(moe):
    saved = load_file(moe / "model.safetensors")
    split = {}
    for name, tensor in load_causal_lm(moe).named_parameters():
        split.update(per_expert_tensors(name, tensor.detach()))
    assert split.keys() == saved.keys() - {"lm_head.weight"}  # tied to the embeddings: sent once
    for name, tensor in split.items():
        assert torch.equal(tensor, saved[name]), name
    # 4 experts x (gate, up, down), each [I, H] or [H, I] with I = 4 * 16 / 2
    assert saved["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (32, 16)
    assert saved["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (16, 32)


def test_only_a_layers_fused_experts_are_split():
    assert fused_experts_parts("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts", ("gate_proj", "up_proj"))
    assert fused_experts_parts("model.layers.0.mlp.down_proj.weight") is None  # a dense MLP
    assert fused_experts_parts("model.layers.0.mlp.gate.weight") is None  # the router
    dense = torch.zeros(8, 4)
    assert per_expert_tensors("model.layers.0.mlp.up_proj.weight", dense) == [("model.layers.0.mlp.up_proj.weight",
                                                                                dense)]
    assert checkpoint_shapes("m.experts.down_proj", (2, 16, 8)) == {"m.experts.0.down_proj.weight": (16, 8),
                                                                      "m.experts.1.down_proj.weight": (16, 8)}


def test_a_moe_folder_passes_with_experts_per_tensor_or_fused_and_a_missing_expert_is_named(moe, tmp_path):
    check_weights(moe)
    fused = tmp_path / "fused"
    shutil.copytree(moe, fused)
    model = load_causal_lm(moe)
    save_file({name: tensor.detach().contiguous() for name, tensor in model.named_parameters()},
              fused / "model.safetensors", metadata={"format": "pt"})
    check_weights(fused)
    assert torch.equal(dict(load_causal_lm(fused).named_parameters())["model.layers.0.mlp.experts.gate_up_proj"],
                       dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"])

    missing = tmp_path / "missing"
    shutil.copytree(moe, missing)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'"):
        check_weights(missing)
