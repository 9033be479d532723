"""What bf16 arithmetic alone does to the weight check's figures, on the CPU: the random-init Qwen3-MoE of
tests/gpu/test_moe_vllm.py (and a dense model of its shape without experts) scored by the hf engine in bf16 (the
"rollout") against the same weights in fp32 (the "trainer"), on responses the fp32 model sampled.

For each model seed it prints, over the probe positions: the mean and max |delta logprob| of the sampled tokens,
the mean and max top-k KL (``algos.topk_kl``: KL(bf16 || fp32) over the bf16 side's top-k and the tail) and the
whole vocabulary's mean KL beside it; for the MoE twice: each side routing by its own routers (as the probe does:
a token whose top-k experts are nearly tied may flip), and the bf16 side replaying the fp32 side's routes
(``routing.replaying``: what routing replay removes). The tolerances of weight_probe.MEASURED for bf16 stand on
these and on the GPU runs' figures.

    python bench/probe_kl.py [--seeds 3] [--sequences 16] [--top-k 20]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch

from services import algos
from services.coordctl.tiny_model import SMALL_QWEN3_MOE, build_random_model
from services.rollout.hf_engine import HFEngine
from services.rollout.sampling import SamplingSettings
from services.run.models import load_causal_lm
from services.run.routing import RouteRecorder, replaying

EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def sequences(model: torch.nn.Module, count: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` random prompts of 8 tokens and a response of 24 the fp32 model sampled at temperature 1 for each."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (8,), generator=generator).tolist() for _ in range(count)]
    engine = HFEngine(model, pad_id=0, eos_ids=(-1,), batch_size=count)
    sampling = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=seed, stop_token_ids=())
    return prompts, [group[0].token_ids for group in engine.generate(prompts, sampling)]


@torch.no_grad()
def scores(model: torch.nn.Module, prompt: list[int], response: list[int],
           routes: torch.Tensor | None) -> torch.Tensor:
    """The log-softmax [R, V] (fp32) at the positions predicting the response, routed by ``routes`` if given."""
    replay = contextlib.nullcontext() if routes is None else replaying(model, routes)
    with replay:
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)


def compare(trainer: torch.nn.Module, rollout: torch.nn.Module, *, prompts: list[list[int]],
            responses: list[list[int]], top_k: int, replay: bool) -> str:
    kl_top, kl_full, diffs = [], [], []
    for prompt, response in zip(prompts, responses):
        routes = None
        if replay:
            recorder = RouteRecorder(trainer)
            expected = scores(trainer, prompt, response, None)
            routes = recorder.take().long()  # replaying takes int64 routes, as the trainer holds them
            recorder.close()
        else:
            expected = scores(trainer, prompt, response, None)
        served = scores(rollout, prompt, response, routes)
        top = served.topk(top_k, dim=-1)
        kl_top.append(algos.topk_kl(top.values, expected.gather(-1, top.indices)))
        kl_full.append((served.exp() * (served - expected)).sum(dim=-1))
        targets = torch.tensor(response).unsqueeze(-1)
        diffs.append((served.gather(-1, targets) - expected.gather(-1, targets)).squeeze(-1))
    diff = algos.logprob_diff(torch.cat(diffs), torch.zeros(sum(len(d) for d in diffs)))
    kl = algos.distribution_diff(torch.cat(kl_top))
    return (f"|delta logprob| mean {diff.mean:.4f} max {diff.max:.3f}; top-{top_k} KL mean {kl.mean:.2e} max "
            f"{kl.max:.2e}; whole-vocabulary KL mean {float(torch.cat(kl_full).mean()):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=20)
    args = parser.parse_args()
    dense_shape = {key: value for key, value in SMALL_QWEN3_MOE.items() if key not in EXPERT_KEYS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for name, shape in (("dense", dense_shape), ("moe", SMALL_QWEN3_MOE)):
                folder = build_random_model(Path(tmp) / f"{name}-{seed}", shape, "float32", seed=seed)
                trainer = load_causal_lm(str(folder), "float32").eval()
                rollout = load_causal_lm(str(folder), "bfloat16").eval()
                prompts, responses = sequences(trainer, args.sequences, seed)
                for replay in ((False, True) if name == "moe" else (False,)):
                    label = f"{name} seed {seed}" + (" replayed routes" if replay else " own routes" * (name == "moe"))
                    figures = compare(trainer, rollout, prompts=prompts, responses=responses, top_k=args.top_k,
                                      replay=replay)
                    print(f"{label:<28} {figures}", flush=True)


if __name__ == "__main__":
    main()
