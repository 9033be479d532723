"""FSDP2 on two GPUs against one, bf16 compute over fp32 master weights, on a random model of Qwen2.5's shape.

Each configuration (1 rank; 2 ranks; 2 ranks with parameter offload) runs as its own processes, one per GPU,
through the trainer's own code (``ranks.join``, ``sharding.place``, ``Actor``): gradient checkpointing, token
budget micro-batches, two old-logprob passes (the first warms up) and four updates of the same batch (one
optimizer step each; the first also warms up). Printed: trainer tokens/s (all ranks together), peak GPU
memory of rank 0, and how far the weights after the first update and the logprobs are from the one-rank run's.

    python -m pytest tests/gpu/test_fsdp_gpu.py -s       (skips without 2 GPUs)
    python tests/gpu/test_fsdp_gpu.py [--size 1.5b]       (prints the table)

(with the repository installed, ``pip install -e .``, or PYTHONPATH=.:protos)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.run.models import load_causal_lm
from services.common.sequences import SequenceBatch
from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model
from services.trainer.actor import Actor, ActorSettings, UpdateInputs
from services.trainer.batching import MicroBatching
from services.trainer.optim import OptimSettings
from services.trainer.ranks import join
from services.trainer.sharding import Sharding, place
from tests.gpu.conftest import needs

LR = 1e-5
OPTIM = OptimSettings(lr=LR, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0, warmup_steps=0,
                      warmup_style="constant", min_lr_ratio=0.0, total_steps=10)
SEQUENCES, BUDGET = 64, 8192
SETTINGS = ActorSettings(mini_batch_size=SEQUENCES, micro_batch_size=8, epochs=1, clip_ratio_low=0.2,
                         clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0,
                         use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", temperature=1.0,
                         max_response_length=768, max_token_len=BUDGET)
LOG_PROB_PASS = MicroBatching(size=SEQUENCES, max_tokens=2 * BUDGET)
RUNS = (("1 rank", 1, False), ("2 ranks", 2, False), ("2 ranks, param offload", 2, True))
UPDATES = 4


def synthetic(vocab_size: int) -> tuple[SequenceBatch, torch.Tensor, torch.Tensor]:
    """64 sequences (prompts of 64-127 tokens, responses of 128-767, random ids), random advantages, and noise
    of 0.05 nats to put on the old logprobs (so that some ratios clip)."""
    generator = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(64, 128, (SEQUENCES,), generator=generator)
    response_lens = torch.randint(128, 768, (SEQUENCES,), generator=generator)

    def ids(count: torch.Tensor) -> torch.Tensor:
        return torch.randint(3, vocab_size, (int(count),), generator=generator)

    batch = SequenceBatch(prompt_ids=ids(prompt_lens.sum()), prompt_lens=prompt_lens,
                          response_ids=ids(response_lens.sum()), response_lens=response_lens)
    tokens = batch.num_response_tokens
    return batch, torch.randn(tokens, generator=generator), 0.05 * torch.randn(tokens, generator=generator)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: every rank calls it), on the CPU."""
    return {name: p.full_tensor().detach().to("cpu", copy=True) for name, p in model.named_parameters()}


def timed(function):
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, time.perf_counter() - started


def job(rank: int, world_size: int, port: int, model_path: Path, offload: bool, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")  # the store is the parent's
    ranks = join("cuda", 600.0)
    sharding = Sharding(fsdp=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, param_offload=offload)
    model = place(load_causal_lm(model_path, "float32"), ranks, sharding, gradient_checkpointing=True)
    actor = Actor(model, OPTIM, OPTIM, pad_id=0, seed=0, ranks=ranks)
    batch, advantages, noise = synthetic(model.config.vocab_size)
    actor.compute_log_probs(batch, 1.0, LOG_PROB_PASS)
    logprobs, logprob_seconds = timed(lambda: actor.compute_log_probs(batch, 1.0, LOG_PROB_PASS))
    old = logprobs if rank == 0 else torch.zeros(batch.num_response_tokens)
    if world_size > 1:  # the old logprobs, gathered on rank 0, as the trainer's relay hands them to every rank
        torch.distributed.broadcast(old, src=0, group=ranks.cpu)
    inputs = UpdateInputs(old_logprobs=old + noise, advantages=advantages, ref_logprobs=None)
    metrics, first_seconds = timed(lambda: actor.update(batch, inputs, SETTINGS))
    weights = full_weights(actor.model)
    seconds = [timed(lambda: actor.update(batch, inputs, SETTINGS))[1] for _ in range(UPDATES - 1)]
    if rank == 0:
        torch.save({"weights": weights, "logprobs": logprobs}, out / "tensors.pt")
        tokens = int(batch.sequence_lens.sum())
        (out / "result.json").write_text(json.dumps({
            "tokens": tokens, "logprob_tokens_per_s": tokens / logprob_seconds, "first_update_s": first_seconds,
            "update_tokens_per_s": tokens / (sum(seconds) / len(seconds)), "metrics": metrics,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}))
    ranks.close()


def run_all(model_path: Path, workdir: Path) -> list[dict]:
    """Each configuration of RUNS in its own processes; rank 0's result, with the weights and logprobs compared
    to the first (one-rank) run's."""
    results = []
    for name, world_size, offload in RUNS:
        out = workdir / name.replace(" ", "_").replace(",", "")
        out.mkdir()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # listening before the ranks
        mp.spawn(job, args=(world_size, store.port, model_path, offload, out), nprocs=world_size, join=True)
        result = {"name": name, **json.loads((out / "result.json").read_text()),
                  **torch.load(out / "tensors.pt", weights_only=True)}
        reference = results[0] if results else result
        gaps = torch.cat([(result["weights"][key] - weights).abs().flatten()
                          for key, weights in reference["weights"].items()])
        result["max_weight_diff"] = float(gaps.max())
        result["share_over_half_lr"] = float((gaps > LR / 2).double().mean())
        result["max_logprob_diff"] = float((result["logprobs"] - reference["logprobs"]).abs().max())
        results.append(result)
    return results


def table(results: list[dict]) -> str:
    lines = [f"{'run':<24}{'update tok/s':>14}{'first update s':>16}{'logprob tok/s':>15}{'peak GiB':>10}"
             f"{'grad_norm':>11}{'max |dw|':>11}{'|dw|>lr/2':>11}{'max |dlogp|':>13}"]
    for r in results:
        lines.append(f"{r['name']:<24}{r['update_tokens_per_s']:>14.0f}{r['first_update_s']:>16.2f}"
                     f"{r['logprob_tokens_per_s']:>15.0f}{r['peak_gib']:>10.1f}{r['metrics']['actor/grad_norm']:>11.4f}"
                     f"{r['max_weight_diff']:>11.2e}{r['share_over_half_lr']:>11.2e}{r['max_logprob_diff']:>13.2e}")
    return "\n".join(lines) + f"\n(|dw|, |dlogp|: against the 1-rank run after one update of lr {LR}; " \
                              f"{results[0]['tokens']} tokens a batch)"


def check(results: list[dict]) -> None:
    one = results[0]
    for r in results[1:]:
        # Adam's first step moves each weight by at most lr, whatever the gradient's scale: weights differ by at
        # most 2 lr (a flipped sign), and by more than lr / 2 only where bf16 noise flips a tiny gradient's sign
        # (2 H200s: 0.2% of them)
        assert r["max_weight_diff"] <= 2.5 * LR, r["name"]
        assert r["share_over_half_lr"] < 0.05, r["name"]
        # the gradient's scale shows in its norm: summed, not averaged, over the ranks (2 H200s: within 2e-4)
        assert abs(r["metrics"]["actor/grad_norm"] / one["metrics"]["actor/grad_norm"] - 1) < 0.01, r["name"]
        assert r["max_logprob_diff"] < 0.1, r["name"]  # bf16 compute: the same logprobs up to rounding (2 H200s: 0)


@needs(2, vllm=False)
def test_fsdp_two_gpus_against_one(qwen_05b, tmp_path):
    results = run_all(qwen_05b, tmp_path)
    print("\n" + table(results))
    check(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(QWEN25_SHAPES), default="0.5b")
    size = parser.parse_args().size
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(Path(tmp) / f"qwen2.5-{size}-random", QWEN25_SHAPES[size], "bfloat16", seed=0)
        results = run_all(model, Path(tmp))
    print(table(results))
    check(results)


if __name__ == "__main__":
    main()
