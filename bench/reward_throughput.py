"""Reward throughput: the GSM8K rule through a reward service vs called in this process, same batch.

Starts a coordinator and one reward service on loopback, then scores the
same batch of GSM8K-style samples (a mix of right, wrong and unformatted
answers) both ways. Prints samples/s of each and the ratio, figure last.

    python bench/reward_throughput.py [--samples 20000] [--shard 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from services.coordinator.fleet.clients import RewardClient, RewardSample
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.reward.rules import score_sample


def gsm8k_batch(count: int, seed: int = 0) -> list[RewardSample]:
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        answer = rng.randint(1, 10_000)
        reasoning = " ".join(f"step {i}: {rng.randint(1, 99)} + {rng.randint(1, 99)}" for i in range(8))
        final = rng.choice([f"#### {answer}", f"#### {answer + 1}", f"so it is {answer}"])
        samples.append(RewardSample(data_source="openai/gsm8k", response=f"{reasoning}. {final}",
                                    ground_truth=str(answer), extra_info={"index": index}))
    return samples


async def through_service(samples, shard: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), (ServiceSpec(kind="reward", settings=("score_threads=1",)),))
        try:
            await cluster.start()
            control = CoordinatorClient(cluster.coordinator)
            [service] = await control.list_services()
            await control.close()
            client = RewardClient(service.address)
            await client.score(samples[:shard], timeout=60)  # warm-up
            started = time.perf_counter()
            shards = [samples[i:i + shard] for i in range(0, len(samples), shard)]
            results = await asyncio.gather(*(client.score(part, timeout=300) for part in shards))
            elapsed = time.perf_counter() - started
            await client.close()
            assert sum(len(scores) for scores, _ in results) == len(samples)
            return elapsed
        finally:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--shard", type=int, default=1_000)
    args = parser.parse_args()
    samples = gsm8k_batch(args.samples)
    started = time.perf_counter()
    for sample in samples:
        score_sample(sample.data_source, sample.response, sample.ground_truth)
    in_process = time.perf_counter() - started
    service = asyncio.run(through_service(samples, args.shard))
    print(f"in process      {len(samples) / in_process:>10.0f} samples/s")
    print(f"reward service  {len(samples) / service:>10.0f} samples/s  ({args.shard} samples per Score call)")
    print(f"service / in-process throughput: {in_process / service:.2f}")


if __name__ == "__main__":
    main()
