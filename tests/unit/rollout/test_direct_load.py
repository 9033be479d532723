"""DirectLoader (services/rollout/direct_load.py) on a model laid out as vLLM lays out Qwen2 with one worker:
q/k/v and gate/up stacked. The real vLLM path is checked on the GPU (tests/gpu/test_vllm_sync.py)."""

from __future__ import annotations

import torch

from services.rollout.direct_load import DirectLoader


class StackedModel(torch.nn.Module):
    """One layer's q (4 rows), k and v (2 rows each) stacked, gate/up (3 rows each) stacked, a norm."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(8, 5))
        self.qkv_bias = torch.nn.Parameter(torch.zeros(8))
        self.gate_up = torch.nn.Parameter(torch.zeros(6, 5))
        self.norm = torch.nn.Parameter(torch.zeros(5))

    def named_parameters(self, *args, **kwargs):
        return iter([("layers.0.self_attn.qkv_proj.weight", self.qkv), ("layers.0.self_attn.qkv_proj.bias", self.qkv_bias),
                     ("layers.0.mlp.gate_up_proj.weight", self.gate_up), ("layers.0.norm.weight", self.norm)])

    def load_weights(self, named):
        """What vLLM's loader does for these names: rows of the stacked parameters, by part."""
        rows = {"q_proj": (0, 4), "k_proj": (4, 6), "v_proj": (6, 8), "gate_proj": (0, 3), "up_proj": (3, 6)}
        with torch.no_grad():
            for name, tensor in named:
                if name == "layers.0.norm.weight":
                    self.norm.copy_(tensor)
                    continue
                part = name.split(".")[-2]
                lo, hi = rows[part]
                target = self.gate_up if part in ("gate_proj", "up_proj") else (
                    self.qkv_bias if name.endswith("bias") else self.qkv)
                target[lo:hi].copy_(tensor)


def hf_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [("layers.0.self_attn.q_proj.weight", (4, 5)), ("layers.0.self_attn.q_proj.bias", (4,)),
              ("layers.0.self_attn.k_proj.weight", (2, 5)), ("layers.0.self_attn.k_proj.bias", (2,)),
              ("layers.0.self_attn.v_proj.weight", (2, 5)), ("layers.0.self_attn.v_proj.bias", (2,)),
              ("layers.0.mlp.gate_proj.weight", (3, 5)), ("layers.0.mlp.up_proj.weight", (3, 5)),
              ("layers.0.norm.weight", (5,))]
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes]


def test_after_one_load_weights_the_direct_copy_gives_what_load_weights_gives():
    direct_model, reference = StackedModel(), StackedModel()
    loader = DirectLoader(direct_model)
    first = hf_weights(0)
    assert not loader.knows(first)
    direct_model.load_weights(first)
    loader.learn(first)
    second = hf_weights(1)
    assert loader.knows(second)
    loader.load(second)
    reference.load_weights(second)
    for (name, got), (_, want) in zip(direct_model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got, want), name
    assert torch.equal(direct_model.qkv[4:6], second[2][1])  # k's rows come after q's


def test_a_tensor_that_is_not_where_the_layout_puts_it_stops_the_direct_path():
    model = StackedModel()
    loader = DirectLoader(model)
    first = hf_weights(0)
    model.load_weights(first[:2])  # k, v, gate, up, norm never loaded: not found where expected
    loader.learn(first)
    assert loader.unknown
    assert not loader.knows(first[:2])  # even tensors that were found: the model's layout is not understood


def test_a_sharded_parameter_is_never_learned():
    model = StackedModel()
    model.norm = torch.nn.Parameter(torch.zeros(3))  # a shard of the HF tensor, as with tensor parallelism
    loader = DirectLoader(model)
    weights = [w for w in hf_weights(0) if w[0] == "layers.0.norm.weight"]
    loader.learn(weights)
    assert not loader.knows(weights)
