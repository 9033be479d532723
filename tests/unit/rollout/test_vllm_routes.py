"""CPU test of how the vLLM engine turns a CompletionOutput's routed_experts (vLLM 0.20.1's capture: int32 numpy
[prompt + response tokens - 1, decoder layers, top-k], zeros at layers without experts) into the routes a sample
carries, as the hf engine records them (services/rollout/vllm_engine.py; tests/gpu/test_moe_vllm.py runs it on
vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.rollout.vllm_engine import completion_of, route_layout, routes_of


def test_routes_keep_the_moe_layers_rows_of_every_fed_token_as_small_integers():
    # 3 decoder layers, the middle one dense (its row never filled: zeros), top-2 of 300 experts: int16
    layout = route_layout([2, 0], SimpleNamespace(num_experts=300))
    assert layout.moe_layers == (0, 2) and layout.dtype == torch.int16
    captured = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)
    captured[:, 1] = 0
    routes = routes_of(captured, layout, fed=4)
    assert routes.dtype == torch.int16 and routes.shape == (4, 2, 2)
    assert routes[:, 0].tolist() == captured[:, 0].tolist() and routes[:, 1].tolist() == captured[:, 2].tolist()
    assert route_layout([1], SimpleNamespace(num_local_experts=8)).dtype == torch.uint8  # Mixtral's key


def test_a_capture_that_does_not_cover_the_fed_tokens_or_a_dense_model_is_refused():
    layout = route_layout([0, 1], SimpleNamespace(num_experts=8))
    with pytest.raises(RuntimeError, match=r"shape \[5, 2, 2\] for a response that fed 4 tokens"):
        routes_of(np.zeros((5, 2, 2), dtype=np.int32), layout, fed=4)
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        routes_of(None, layout, fed=4)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        route_layout([], SimpleNamespace(num_experts=8))
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        route_layout([0], SimpleNamespace())


def test_a_completion_carries_the_routes_of_its_prompt_and_every_sampled_token_but_the_last():
    # prompt of 3 tokens, 2 sampled: vLLM's request had 5 tokens and captured 4 (its last never went through)
    layout = route_layout([0, 1], SimpleNamespace(num_experts=8))
    captured = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    output = SimpleNamespace(token_ids=[11, 12], logprobs=[{11: SimpleNamespace(logprob=-0.5)},
                                                           {12: SimpleNamespace(logprob=-1.0)}],
                             finish_reason="length", routed_experts=captured)
    completion = completion_of(output, stops=[2], first_version=3, last_version=3, prompt_len=3, routes=layout)
    assert completion.routed_experts.dtype == torch.uint8
    assert completion.routed_experts.tolist() == captured.tolist()
    assert completion.logprobs == [-0.5, -1.0] and completion.finish_reason == "length"
    plain = completion_of(output, stops=[2], first_version=3, last_version=3, prompt_len=3)
    assert plain.routed_experts is None


def test_the_experts_in_each_fused_moe_kernel_s_layout():
    """2 experts of I=2 rows, H=3: Triton keeps the checkpoint's gate then up rows, FlashInfer's CUTLASS up then
    gate; the down projection as it is in both; checksums of each expert in that layout."""
    from services.common.weight_sync import tensor_checksum
    from services.rollout.vllm_engine import expected_expert_checksums, kernel_expert_layout

    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    down = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    w13, w2 = kernel_expert_layout(gate_up, down, "TRITON")
    assert torch.equal(w13, gate_up) and torch.equal(w2, down)
    w13, _ = kernel_expert_layout(gate_up, down, "FLASHINFER_CUTLASS")
    assert w13[1].tolist() == gate_up[1, 2:].tolist() + gate_up[1, :2].tolist()  # expert 1: up rows, then gate
    with pytest.raises(ValueError, match="FLASHINFER_TRTLLM"):
        kernel_expert_layout(gate_up, down, "FLASHINFER_TRTLLM")
    named = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}
    held = expected_expert_checksums(named, "model.layers.0.mlp.experts", "FLASHINFER_CUTLASS")
    assert held.kernel == "FLASHINFER_CUTLASS" and held.w2 == [tensor_checksum(down[0]), tensor_checksum(down[1])]
    assert held.w13[0] == tensor_checksum(torch.cat([gate_up[0, 2:], gate_up[0, :2]]))
    assert held.w13 != expected_expert_checksums(named, "model.layers.0.mlp.experts", "TRITON").w13
