"""Rollout throughput through the gRPC rollout service against vLLM's own LLM.generate, same prompts, same GPU.

Both sides run vLLM with the same engine arguments on GPU 0, one after the
other, each in a process of its own with vLLM's engine core beside it (the
layout of the service):
- the reference: ``LLM.generate`` on every prompt at once, in a child process;
- ours: a rollout service process (engine=vllm) started by LocalCluster,
  given the prompts as the coordinator gives them: one Generate call with
  the whole batch, n samples each, per-prompt seeds, logprobs of the
  sampled tokens, streamed back over gRPC.
Each side first generates a small warm-up batch, untimed. With random weights
and a large vocabulary, responses run to max_new_tokens, so both sides
generate the same number of tokens. Prints tokens/s of each and the ratio,
last (goal at least 0.95).

--seed-cost: the reference also generates the batch again without per-request
seeds (vLLM samples the rows of seeded requests one kernel at a time, the rows
of unseeded ones at once), and prints what meshrl's per-sample seeds cost.
--cuda-graphs: vLLM with CUDA graphs, as bench/grpo_step.py runs it (slower to
start), instead of enforce_eager.

    python bench/rollout_throughput.py [--prompts 256 --n 8 --max-new-tokens 128] [--seed-cost] [--cuda-graphs]
    (needs a GPU and vllm)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE = {"gpu_memory_utilization": 0.6, "enforce_eager": True, "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
SEED = 1234


def prompts_of(count: int) -> list[list[int]]:
    """Prompts of 8 to 39 character tokens (digits of a deterministic sequence)."""
    from services.coordctl.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    return [tokenizer(str(7919 ** (i % 40 + 8))[: 8 + i % 32], add_special_tokens=False)["input_ids"]
            for i in range(count)]


def reference(model: str, count: int, n: int, max_new_tokens: int, engine: dict, seed_cost: bool) -> None:
    """The child process: LLM.generate, printing one JSON line with tokens and seconds (and with ``seed_cost``
    the seconds of the same batch without per-request seeds)."""
    from vllm import LLM, SamplingParams

    from services.rollout.sampling import hash_seed

    prompts = prompts_of(count)
    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, seed=0, logprobs_mode="processed_logprobs",
              **engine)
    eos = llm.llm_engine.model_config.hf_config.eos_token_id

    def run(batch: list[list[int]], seeded: bool = True) -> tuple[int, float]:
        params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_new_tokens, logprobs=0,
                                 seed=hash_seed(SEED, i, 0) % (1 << 31) if seeded else None, stop_token_ids=[eos],
                                 detokenize=False)
                  for i in range(len(batch))]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs), time.perf_counter() - started

    run(prompts[:8])
    tokens, seconds = run(prompts)
    unseeded = {"unseeded_seconds": run(prompts, seeded=False)[1]} if seed_cost else {}
    print(json.dumps({"tokens": tokens, "seconds": seconds, **unseeded}), flush=True)


async def through_service(model: str, count: int, n: int, max_new_tokens: int, engine: dict,
                          state: Path) -> tuple[int, float]:
    from services.coordinator.fleet.clients import RolloutClient
    from services.coordinator.settings import Sampling
    from services.coordctl.control import CoordinatorClient
    from services.coordctl.local import LocalCluster, ServiceSpec

    settings = ("engine=vllm", *(f"{key}={str(value).lower()}" for key, value in engine.items()))
    cluster = LocalCluster(state, (ServiceSpec("rollout", settings=settings, env=(("CUDA_VISIBLE_DEVICES", "0"),)),))
    try:
        await cluster.start(timeout_s=180)
        control = CoordinatorClient(cluster.coordinator)
        [service] = await control.list_services()
        await control.close()
        rollout = RolloutClient(service.address)
        await rollout.init_run("bench", model, "bfloat16", 300)
        prompts = prompts_of(count)

        async def run(batch: list[list[int]]) -> tuple[int, float]:
            started = time.perf_counter()
            out = await rollout.generate(batch, Sampling(n=n, temperature=1.0, top_p=1.0,
                                                         max_new_tokens=max_new_tokens, stop_token_ids=()), SEED, 0, 600)
            return int(out.response_lens.sum()), time.perf_counter() - started

        await run(prompts[:8])
        result = await run(prompts)
        await rollout.close()
        return result
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed-cost", action="store_true", help="the reference also generates without seeds")
    parser.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs, not enforce_eager")
    parser.add_argument("--reference-model", help=argparse.SUPPRESS)  # the child process's role
    args = parser.parse_args()
    engine = {**ENGINE, "enforce_eager": not args.cuda_graphs}
    if args.reference_model:
        reference(args.reference_model, args.prompts, args.n, args.max_new_tokens, engine=engine,
                  seed_cost=args.seed_cost)
        return
    from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_random_model(Path(tmp) / "qwen-0.5b", QWEN25_SHAPES["0.5b"], "bfloat16", seed=0))
        child = subprocess.run(
            [sys.executable, __file__, "--reference-model", model, "--prompts", str(args.prompts), "--n", str(args.n),
             "--max-new-tokens", str(args.max_new_tokens), *(["--seed-cost"] if args.seed_cost else []),
             *(["--cuda-graphs"] if args.cuda_graphs else [])], capture_output=True, text=True, check=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        raw = json.loads(next(line for line in child.stdout.splitlines() if line.startswith('{"tokens"')))
        tokens, seconds = asyncio.run(through_service(model, args.prompts, args.n, args.max_new_tokens,
                                                      engine=engine, state=Path(tmp) / "state"))
    raw_rate, our_rate = raw["tokens"] / raw["seconds"], tokens / seconds
    print(f"{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} new tokens, random Qwen2.5-0.5B "
          f"shape, bf16, {engine}")
    if args.seed_cost:
        print(f"LLM.generate without per-request seeds: {raw['unseeded_seconds']:.2f} s; with them (below) "
              f"{raw['seconds'] / raw['unseeded_seconds']:.3f}x that")
    print(f"LLM.generate:    {raw['tokens']} tokens in {raw['seconds']:.2f} s = {raw_rate:,.0f} tokens/s")
    print(f"rollout service: {tokens} tokens in {seconds:.2f} s = {our_rate:,.0f} tokens/s")
    print(f"ratio service / LLM.generate: {our_rate / raw_rate:.3f}")


if __name__ == "__main__":
    main()
