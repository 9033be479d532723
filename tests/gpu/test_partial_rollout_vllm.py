"""Partial rollout on the vLLM engine: new weights arriving over NCCL while a Generate call is in flight.

The scenario of tests/integration/test_partial_rollout.py, with a vLLM rollout on GPU 1 and this process, the
trainer, sending from GPU 0: with restart_in_flight the call's requests are aborted in vLLM and sampled again,
whole, under the new weights (equal to a fresh call under them); without it the call finishes under the old
ones while the swap waits.
"""

from __future__ import annotations

import asyncio

from services.coordinator.local import LocalCluster, ServiceSpec
from tests.gpu.conftest import needs
from tests.integration.test_partial_rollout import scenario

# vLLM samples the 8 sequences together: long responses keep the call in flight while the weights go out
TOKENS = 600


@needs(2)
def test_a_sync_restarts_or_finishes_the_vllm_generate_call_in_flight(qwen_05b, tmp_path):
    cluster = LocalCluster(tmp_path / "state", (
        ServiceSpec("rollout", settings=("engine=vllm", "enforce_eager=true", "gpu_memory_utilization=0.3"),
                    env=(("CUDA_VISIBLE_DEVICES", "1"),)),))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        asyncio.run(scenario(cluster, str(qwen_05b), dtype="bfloat16", backend="nccl", device="cuda:0",
                             tokens=TOKENS))
    finally:
        cluster.stop()
