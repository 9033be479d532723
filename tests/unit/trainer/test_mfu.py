"""perf/mfu/actor's arithmetic (``mfu``) against numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from services.trainer.mfu import ModelShape, device_peak_flops, matmul_weights, mfu, peak_flops, training_flops

# hidden 4, 2 layers, 2 query heads and 1 key/value head of 2 dims, MLP 8 wide, 10 outputs
SHAPE = ModelShape(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8, outputs=10)


def test_training_flops_of_a_small_shape_by_hand():
    # per layer: attention 4 x 2 x (2 x 2 + 2 x 1) = 48, MLP 3 x 4 x 8 = 96; two layers 288; output layer 40
    assert matmul_weights(SHAPE) == 328
    # sequences of 3 and 5 tokens: 6 x 328 x 8 = 15744; attention 12 x 2 x 2 x 2 x (9 + 25) = 3264
    assert training_flops(SHAPE, [3, 5]) == 15744 + 3264
    # on 2 GPUs of 1000 FLOPS each for 2 s
    assert mfu(19008, 2.0, 1000.0, world_size=2) == pytest.approx(4.752)


def test_the_shape_of_qwen25_05b_from_its_config():
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936)
    shape = ModelShape.of(config, config.vocab_size)
    assert shape == ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864,
                               outputs=151936)
    # 24 x (896 x 64 x 32 + 3 x 896 x 4864) + 896 x 151936: 0.358B in the layers, 0.136B in the output layer
    assert matmul_weights(shape) == 24 * (1835008 + 13074432) + 136134656


def test_peak_flops_of_known_gpus_only():
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None
    assert device_peak_flops(torch.device("cpu")) is None
