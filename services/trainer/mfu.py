"""Model FLOPs utilization of an update (verl's ``perf/mfu/actor``): the FLOPs the model's math needs for the
tokens it trained on, over what the trainer's GPUs could have done in that time.

The count is the model's, not the hardware's (as verl's ``FlopsCounter``):

    training FLOPs = 6 x N x tokens + 12 x layers x heads x head_dim x sum over sequences of s^2

- N: the weights each token is multiplied with. Per decoder layer the
  attention projections, hidden x head_dim x (2 x heads + 2 x kv_heads)
  (q and o at every head, k and v at the key/value heads), and the gated
  MLP, 3 x hidden x intermediate; then the output layer, hidden x outputs
  (the vocabulary, or 1 for the critic's value head). The input embedding is
  a lookup, not a product, and is not counted (verl counts it too). A
  product with N weights is 2N FLOPs a token forward and 4N backward: 6N.
- attention's own products, per layer, head and sequence of s tokens: scores
  q k^T and their weighted sum of values, 2 x s^2 x head_dim FLOPs each
  forward, x 3 with the backward: 12 s^2 head_dim. Counted over the whole
  s x s square, as verl does, though a causal kernel computes about half.
- Recomputation (gradient checkpointing, the chunked output layer's
  backward) is not counted: it is work the model's math does not need.

    MFU = training FLOPs x epochs / (seconds x peak FLOPS of one GPU x GPUs)

The peak is the GPU's dense bf16 tensor-core rate from ``PEAK_FLOPS``; a GPU
not in the table, or a CPU, has no MFU (the metric is omitted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))
"""Dense bf16 FLOPS of one GPU, by a word of its CUDA device name (NVIDIA's data sheets, SXM parts)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What a decoder-only transformer's FLOPs depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the gated MLP's width
    outputs: int  # the output layer's width: the vocabulary, or 1 for a value head

    @classmethod
    def of(cls, config, outputs: int) -> ModelShape:
        """From a Hugging Face model config (Qwen2, Llama and their like)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads or config.num_attention_heads, head_dim=head_dim,
                   intermediate=config.intermediate_size, outputs=outputs)


def matmul_weights(shape: ModelShape) -> int:
    """N: the weights each token is multiplied with (the embedding lookup not among them)."""
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    mlp = 3 * shape.hidden * shape.intermediate
    return shape.layers * (attention + mlp) + shape.hidden * shape.outputs


def training_flops(shape: ModelShape, sequence_lens: list[int]) -> float:
    """FLOPs of one forward and backward pass over sequences of these lengths (tokens each)."""
    tokens = sum(sequence_lens)
    squares = sum(length * length for length in sequence_lens)
    return 6.0 * matmul_weights(shape) * tokens + 12.0 * shape.layers * shape.heads * shape.head_dim * squares


def peak_flops(device_name: str) -> float | None:
    """One GPU's dense bf16 FLOPS by its CUDA device name; None for a GPU not in ``PEAK_FLOPS``."""
    return next((flops for word, flops in PEAK_FLOPS if word in device_name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """``peak_flops`` of this rank's device; None on a CPU."""
    return peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def mfu(flops: float, seconds: float, peak: float, *, world_size: int) -> float:
    """The share of ``world_size`` GPUs' peak that ``flops`` done in ``seconds`` are."""
    return flops / (seconds * peak * world_size)
