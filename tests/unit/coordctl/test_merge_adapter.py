"""coordctl eval's merge of a PEFT adapter folder onto its base: the merged folder computes what PEFT's model
of base + adapter computes."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from services.coordctl.export import merge_adapter
from services.coordctl.tiny_model import build_tiny_model
from services.run.models import load_causal_lm

IDS = torch.tensor([[5, 6, 7, 8, 9]])


def test_an_adapter_folder_merged_onto_its_base_computes_as_peft_does(tmp_path):
    base = build_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    model = get_peft_model(load_causal_lm(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
        want = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    merged = merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    with torch.no_grad():
        got = load_causal_lm(merged)(input_ids=IDS).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, load_causal_lm(base)(input_ids=IDS).logits, atol=1e-3)


def test_an_adapter_whose_base_is_not_here_is_refused(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/x"}))
    with pytest.raises(ValueError, match=r"its base model 'Qwen/x' .* is not a model folder here"):
        merge_adapter(tmp_path / "adapter", tmp_path / "merged")
