"""Weight sync trainer -> vLLM on two GPUs, against a raw NCCL broadcast of the same bytes.

The trainer side (this process, GPU 0) holds the model's HF tensors and is
rank 0 of an NCCL channel; a vLLM engine (AsyncLLM, spawned onto GPU 1)
joins it through the rollout's worker extension. Measured in the same run:
- our sync: WeightSender.send (bucketed, checksummed, pipelined) until vLLM serves
  the new weights (loaded, prefix cache cleared if it is on, generation
  resumed), with nothing generating, as between synchronous steps; the
  trainer's weights change before every sync, so a sync that loads nothing
  fails the checksum comparison. The first sync goes through vLLM's
  load_weights and is reported apart; later ones copy straight into the
  learned views (services/rollout/direct_load.py);
- where the time goes: each stage of the sender, of the vLLM workers and of
  the engine's calls;
- the reference: one plain broadcast of the same number of bytes on the same
  channel into a buffer in the vLLM worker.
Also checks that every vLLM parameter equals the trainer's after the last
sync (checksums), and measures the rollout/trainer logprob gap of sampled
tokens.

    python bench/weight_sync.py --size 0.5b [--size 1.5b]   (needs 2 GPUs and vllm)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.run.models import load_causal_lm, load_tokenizer
from services.common.nccl_channel import NcclChannel, new_unique_id
from services.common.sequences import SequenceBatch, join_ragged
from services.common.timing import StageTimer
from services.common.weight_sync import WeightSender, tensor_checksum
from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model
from services.rollout.config import RolloutServiceConfig
from services.rollout.sampling import SamplingSettings
from services.rollout.vllm_engine import VLLMEngine, receive_raw, vllm_layout
from services.trainer.batching import MicroBatching
from services.trainer.forward import batched_logprobs
from services.trainer.ranks import Ranks

BUCKET_BYTES = 1 << 30
TIMEOUT_S = 120.0


@dataclass
class SyncReport:
    total_bytes: int
    buckets: int
    first_sync_s: float  # through load_weights
    sync_s: list[float]  # each later sync, until vLLM serves the weights
    transfer_s: list[float]  # of each later sync: receiving and loading
    pause_s: list[float]  # the window generation was held back
    stages: list[dict[str, float]]  # of each later sync: seconds per stage, as the engine and its workers saw them
    raw_s: list[float]  # each raw broadcast of the same bytes
    mismatched: list[str]  # vLLM parameters whose checksum differs from the trainer's
    unmatched: list[str]  # vLLM parameters with no trainer counterpart
    logprob_diff_mean: float
    logprob_diff_max: float


async def start_engine(model_path: Path, gpu: str) -> VLLMEngine:
    """A vLLM engine whose workers see only ``gpu`` (spawned with that CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        config = RolloutServiceConfig(engine="vllm", enforce_eager=True, gpu_memory_utilization=0.4)
        return await VLLMEngine.create(str(model_path), "bfloat16", config)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def stage(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


async def measure(model_path: Path, repeats: int = 3, bucket_bytes: int = BUCKET_BYTES) -> SyncReport:
    model = load_causal_lm(model_path, "bfloat16").to("cuda:0")
    named = [(name, tensor.detach()) for name, tensor in model.named_parameters()]
    engine = await start_engine(model_path, "1")
    try:
        unique_id, channel_id = new_unique_id(), "bench-weights"
        join = asyncio.create_task(engine.join_channel(channel_id, "nccl", unique_id, rank=1, world_size=2,
                                                       timeout_s=TIMEOUT_S))
        channel = await asyncio.to_thread(NcclChannel, channel_id, unique_id, 0, world_size=2, timeout_s=TIMEOUT_S,
                                            device="cuda:0")
        await join
        stage("channel joined")
        sync_s, raw_s, timings, total, buckets = [], [], [], 0, 0
        weight_sender = WeightSender()
        for version in range(1, repeats + 2):  # the first sync teaches the direct path; reported apart
            with torch.no_grad():  # new weights every time, as after an update
                for _, tensor in named:
                    tensor.mul_(1.0 + 2.0 ** -6)
            torch.cuda.synchronize()
            started = time.perf_counter()
            receiving = asyncio.create_task(engine.receive_weights(channel_id, TIMEOUT_S))
            sender = StageTimer()
            total, buckets = await asyncio.to_thread(weight_sender.send, channel, named, version,
                                                     bucket_bytes=bucket_bytes, timer=sender)
            swap = await receiving
            assert swap.version == version
            sync_s.append(time.perf_counter() - started)
            timings.append(dataclasses.replace(swap, stages={**swap.stages,
                                                             **{f"sender_{k}": v for k, v in sender.seconds.items()}}))
            buffer = torch.empty(total, dtype=torch.uint8, device="cuda:0")
            started = time.perf_counter()
            receiving = asyncio.create_task(receive_raw(engine, channel_id, total, timeout_s=TIMEOUT_S))
            await asyncio.to_thread(channel.broadcast, buffer)
            await receiving
            raw_s.append(time.perf_counter() - started)
            stage(f"round {version}: sync {sync_s[-1] * 1e3:.1f} ms (transfer {timings[-1].transfer_s * 1e3:.1f}, "
                  f"pause {timings[-1].pause_s * 1e3:.1f}), raw {raw_s[-1] * 1e3:.1f} ms")
        expected = {name: tensor_checksum(t) for name, t in vllm_layout(dict(named)).items()}
        [held] = await engine.checksums()
        stage("checksums read")
        mismatched = sorted(n for n, c in held.items() if n in expected and expected[n] != c)
        unmatched = sorted(n for n in held if n not in expected)
        diff_mean, diff_max = await logprob_gap(engine, model, model_path)
        stage("logprobs compared")
        channel.close()
        later = timings[1:]
        return SyncReport(total, buckets, sync_s[0], sync_s[1:], [t.transfer_s for t in later],
                          [t.pause_s for t in later], [t.stages for t in later], raw_s[1:], mismatched, unmatched,
                          diff_mean, diff_max)
    finally:
        await engine.close()


async def logprob_gap(engine: VLLMEngine, model, model_path: Path) -> tuple[float, float]:
    """Mean and max |logp_vllm - logp_trainer| over the tokens vLLM sampled (temperature 1)."""
    tokenizer = load_tokenizer(model_path)
    prompts = [tokenizer(f"{i * 7919 % 100000}=", add_special_tokens=False)["input_ids"] for i in range(32)]
    completions = await asyncio.wait_for(engine.generate(prompts, SamplingSettings(n=4, temperature=1.0, top_p=1.0,
                                                                                   max_new_tokens=64, seed=1234,
                                                                                   stop_token_ids=()), 0), 60)
    stage("generated")
    flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
    prompt_ids, prompt_lens = join_ragged([torch.tensor(p) for p, _ in flat], torch.int64)
    response_ids, response_lens = join_ragged([torch.tensor(c.token_ids) for _, c in flat], torch.int64)
    batch = SequenceBatch(prompt_ids=prompt_ids, prompt_lens=prompt_lens, response_ids=response_ids,
                          response_lens=response_lens)
    trainer = batched_logprobs(model, batch, tokenizer.pad_token_id, temperature=1.0, micro=MicroBatching(size=32),
                               ranks=Ranks.single(next(model.parameters()).device))
    rollout = torch.tensor([lp for _, c in flat for lp in c.logprobs])
    gap = (rollout - trainer).abs()
    return float(gap.mean()), float(gap.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", choices=sorted(QWEN25_SHAPES), help="model size(s)")
    parser.add_argument("--bucket-mb", type=int, action="append", help="bucket size(s) in MiB (default 1024)")
    args = parser.parse_args()
    for size in args.size or ["0.5b"]:
        with tempfile.TemporaryDirectory() as tmp:
            path = build_random_model(Path(tmp) / size, QWEN25_SHAPES[size], "bfloat16", seed=0)
            for bucket_mb in args.bucket_mb or [BUCKET_BYTES >> 20]:
                report = asyncio.run(measure(path, bucket_bytes=bucket_mb << 20))
                print_report(f"{size}, {bucket_mb} MiB buckets", report)


def print_report(label: str, report: SyncReport) -> None:
    median = statistics.median
    sync, raw = median(report.sync_s), median(report.raw_s)
    print(f"[{label}] {report.total_bytes / 1e9:.2f} GB in {report.buckets} buckets; vLLM parameters equal to the "
          f"trainer's: {not report.mismatched and not report.unmatched} (mismatched {len(report.mismatched)}, "
          f"unmatched {len(report.unmatched)}); |logp_vllm - logp_trainer| mean {report.logprob_diff_mean:.4f} "
          f"max {report.logprob_diff_max:.4f}")
    print(f"[{label}] first sync (load_weights) {report.first_sync_s * 1e3:.1f} ms; later syncs (nothing generating, "
          f"each bucket loaded as it arrives): received and loaded {median(report.transfer_s) * 1e3:.1f} ms, "
          f"generation held back {median(report.pause_s) * 1e3:.1f} ms")
    print(f"[{label}] stages (ms, median): " + ", ".join(
        f"{stage} {median([s[stage] for s in report.stages]) * 1e3:.2f}" for stage in report.stages[0]))
    print(f"[{label}] raw NCCL broadcast {raw * 1e3:.1f} ms ({report.total_bytes / raw / 1e9:.0f} GB/s); "
          f"sync until vLLM serves {sync * 1e3:.1f} ms; ratio {sync / raw:.2f}x the raw broadcast")


if __name__ == "__main__":
    main()
