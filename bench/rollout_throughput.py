"""Rollout throughput through the gRPC rollout service against vLLM's own LLM.generate, same prompts, same GPU.

Both sides run vLLM with the same engine arguments on GPU 0, one after the
other, each in a process of its own with vLLM's engine core beside it (the
layout of the service):
- the reference: ``LLM.generate`` on every prompt at once, in a child
  process, three times over the same batch: without per-request seeds (as
  TRL and most users call it: the fastest), with meshrl's per-sample seeds
  sampled as vLLM does (one kernel per seeded row per decode step), and with
  them sampled as the rollout service does (``services.rollout.seeded_sampling``:
  one kernel for every seeded row);
- ours: a rollout service process (engine=vllm) started by LocalCluster,
  given the prompts as the coordinator gives them: one Generate call with
  the whole batch, n samples each, per-sample seeds (sampled in one kernel:
  ``batched_seeded_sampling=true``), logprobs of the sampled tokens,
  streamed back over gRPC.
Each side first generates a small warm-up batch, untimed. With random weights
and a large vocabulary, responses run to max_new_tokens, so every run
generates the same number of tokens. Prints each one's tokens/s, what vLLM's
own seeded sampling costs, and last the ratio of the service to unseeded
LLM.generate (goal at least 0.97).

--cuda-graphs: vLLM with CUDA graphs, as bench/grpo_step.py runs it (slower to
start), instead of enforce_eager. bench/grpo_step.py's shape is
``--prompts 32 --n 8 --max-new-tokens 256 --prompt-tokens 64 --cuda-graphs``.

    python bench/rollout_throughput.py [--prompts 256 --n 8 --max-new-tokens 128] [--cuda-graphs]
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
WORKER_EXTENSION = "services.rollout.vllm_worker.MeshrlWorkerExtension"


def prompts_of(count: int, length: int | None = None) -> list[list[int]]:
    """Prompts of digits of a deterministic sequence, one character token each: 8 to 39 tokens, or ``length``."""
    from services.coordctl.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    digits = [(str(7919 ** (i % 40 + 8)) * 8)[: length or 8 + i % 32] for i in range(count)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in digits]


def reference(model: str, prompts: list[list[int]], n: int, max_new_tokens: int, engine: dict) -> None:
    """The child process: LLM.generate of ``prompts`` unseeded, seeded as vLLM samples seeded rows, and seeded as
    the rollout service samples them; prints one JSON line with the tokens and each one's seconds."""
    from vllm import LLM, SamplingParams

    from services.rollout.sampling import hash_seed

    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, seed=0, logprobs_mode="processed_logprobs",
              worker_extension_cls=WORKER_EXTENSION, **engine)
    eos = llm.llm_engine.model_config.hf_config.eos_token_id

    def run(batch: list[list[int]], seeded: bool) -> tuple[int, float]:
        params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_new_tokens, logprobs=0,
                                 seed=hash_seed(SEED, i, 0) % (1 << 31) if seeded else None, stop_token_ids=[eos],
                                 detokenize=False)
                  for i in range(len(batch))]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs), time.perf_counter() - started

    run(prompts[:8], seeded=True)
    tokens, unseeded = run(prompts, seeded=False)
    _, vllm_seeded = run(prompts, seeded=True)
    llm.collective_rpc("meshrl_batched_seeded_sampling")
    run(prompts[:8], seeded=True)  # the kernel's first (compiling) call, untimed
    _, batched_seeded = run(prompts, seeded=True)
    print(json.dumps({"tokens": tokens, "unseeded": unseeded, "vllm_seeded": vllm_seeded,
                      "batched_seeded": batched_seeded}), flush=True)


async def through_service(model: str, prompts: list[list[int]], n: int, max_new_tokens: int, engine: dict,
                          state: Path) -> tuple[int, float]:
    from services.coordinator.fleet.clients import RolloutClient
    from services.coordinator.settings import Sampling
    from services.coordctl.control import CoordinatorClient
    from services.coordctl.local import LocalCluster, ServiceSpec

    settings = ("engine=vllm", "batched_seeded_sampling=true",
                *(f"{key}={str(value).lower()}" for key, value in engine.items()))
    cluster = LocalCluster(state, (ServiceSpec(kind="rollout", settings=settings, env=(("CUDA_VISIBLE_DEVICES", "0"),)),
                                   ))
    try:
        await cluster.start(timeout_s=180)
        control = CoordinatorClient(cluster.coordinator)
        [service] = await control.list_services()
        await control.close()
        rollout = RolloutClient(service.address)
        await rollout.init_run("bench", model, "bfloat16", timeout=300)

        async def run(batch: list[list[int]]) -> tuple[int, float]:
            started = time.perf_counter()
            out = await rollout.generate(batch, Sampling(n=n, temperature=1.0, top_p=1.0,
                                                         max_new_tokens=max_new_tokens, stop_token_ids=()), SEED,
                                         first_index=0, timeout=600)
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
    parser.add_argument("--prompt-tokens", type=int, help="every prompt this many tokens (default: 8 to 39)")
    parser.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs, not enforce_eager")
    parser.add_argument("--reference-model", help=argparse.SUPPRESS)  # the child process's role
    args = parser.parse_args()
    engine = {**ENGINE, "enforce_eager": not args.cuda_graphs}
    prompts = prompts_of(args.prompts, args.prompt_tokens)
    if args.reference_model:
        reference(args.reference_model, prompts, args.n, args.max_new_tokens, engine=engine)
        return
    from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_random_model(Path(tmp) / "qwen-0.5b", QWEN25_SHAPES["0.5b"], "bfloat16", seed=0))
        child = subprocess.run(
            [sys.executable, __file__, "--reference-model", model, "--prompts", str(args.prompts), "--n", str(args.n),
             "--max-new-tokens", str(args.max_new_tokens),
             *(["--prompt-tokens", str(args.prompt_tokens)] if args.prompt_tokens else []),
             *(["--cuda-graphs"] if args.cuda_graphs else [])], capture_output=True, text=True, check=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        raw = json.loads(next(line for line in child.stdout.splitlines() if line.startswith('{"tokens"')))
        tokens, seconds = asyncio.run(through_service(model, prompts, args.n, args.max_new_tokens,
                                                      engine=engine, state=Path(tmp) / "state"))
    print(f"{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} new tokens, random Qwen2.5-0.5B "
          f"shape, bf16, {engine}")
    for label, key in (("unseeded", "unseeded"), ("seeded, vLLM's sampling", "vllm_seeded"),
                       ("seeded, one kernel a step", "batched_seeded")):
        print(f"LLM.generate, {label + ':':<27}{raw['tokens']} tokens in {raw[key]:.2f} s = "
              f"{raw['tokens'] / raw[key]:,.0f} tokens/s ({raw[key] / raw['unseeded']:.3f}x unseeded's time)")
    print(f"rollout service:                          {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s")
    print(f"ratio service / unseeded LLM.generate: {tokens / seconds / (raw['tokens'] / raw['unseeded']):.3f}")


if __name__ == "__main__":
    main()
