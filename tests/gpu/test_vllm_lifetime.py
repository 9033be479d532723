"""The vLLM rollout's share of "no wedge, no orphan" (issue 20), on one GPU: a Generate its client abandons stops
taking the engine (the rollout aborts its request ids), and a rollout killed with SIGKILL leaves no engine-core
process behind and its GPU memory free. The CPU versions are tests/integration/test_stalls.py (hf engine) and
test_lifetime.py (reward workers, torchrun ranks)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import grpc
import pytest

from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.settings import Sampling
from services.coordctl.local import LocalCluster
from tests.gpu.conftest import needs, vllm_rollout
from tests.integration.test_lifetime import alive, descendants
from tests.integration.test_stalls import cluster_services

ROLLOUT = vllm_rollout(0, 0.3, "device=cuda")
# 64 prompts x 64 samples x 1024 tokens: minutes of work for a random 0.5B model (no EOS comes)
BUSY_PROMPTS = [[5, 6, 7, 8]] * 64
BUSY = Sampling(n=64, temperature=1.0, top_p=1.0, max_new_tokens=1024, stop_token_ids=())


def gpu_pids() -> set[int]:
    """The processes that hold memory on a GPU (nvidia-smi's compute apps)."""
    listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], text=True,
                            capture_output=True, check=True).stdout
    return {int(line) for line in listed.split()}


@pytest.fixture
def vllm_rollout(tmp_path, qwen_05b):
    cluster = LocalCluster(tmp_path / "state", (ROLLOUT,))
    asyncio.run(cluster.start(timeout_s=300))
    [rollout] = [s for s in asyncio.run(cluster_services(cluster)) if s.kind == "rollout"]

    async def init() -> None:
        client = RolloutClient(rollout.address)
        try:
            await client.init_run("lifetime", str(qwen_05b), "bfloat16", timeout=300)
        finally:
            await client.close()

    asyncio.run(init())
    yield rollout
    cluster.stop()


@needs(1)
def test_a_generate_abandoned_by_its_client_is_aborted_in_the_vllm_engine(vllm_rollout):
    async def scenario() -> float:
        client = RolloutClient(vllm_rollout.address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await client.generate(BUSY_PROMPTS, BUSY, 0, first_index=0, timeout=2.0)
            assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            generated = await client.generate([[5, 6, 7]], Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8,
                                                                    stop_token_ids=()), 0, first_index=0, timeout=120)
            assert len(generated.response_lens) == 2
            return time.monotonic() - started
        finally:
            await client.close()

    waited = asyncio.run(scenario())
    print(f"a 2-sample Generate after an abandoned one of {len(BUSY_PROMPTS) * BUSY.n} samples: {waited:.2f} s")
    assert waited < 10.0  # not behind the abandoned 4M tokens


@needs(1)
def test_a_vllm_rollout_killed_with_sigkill_leaves_no_engine_core_and_frees_its_gpu(vllm_rollout):
    pid = int(vllm_rollout.service_id.rsplit("-", 1)[1])  # kind-host-port-pid
    tree = descendants(pid)
    holders = ({pid} | set(tree)) & gpu_pids()
    assert holders, f"no process of the rollout's tree holds GPU memory: {tree}"
    os.kill(pid, 9)
    deadline = time.monotonic() + 60
    while (left := alive(tree)) or (holders & gpu_pids()):
        assert time.monotonic() < deadline, (f"60 s after the kill: alive {[tree[pid] for pid in left]}, "
                                             f"on the GPU {sorted(holders & gpu_pids())}")
        time.sleep(0.5)
    print(f"the rollout's {len(tree)} child processes gone and its GPU memory free after the kill")
