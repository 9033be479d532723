"""The faster trainer on one GPU, bf16, on a random model of Qwen2.5-0.5B's shape (14 query heads, 2 key/value
heads): packed micro-batches through the flash kernel's variable-length attention (``varlen_attention``) give the
padded rows' logprobs and gradients, in less time and memory; the fused AdamW step; the MFU figure, and the
actor's update reporting it (perf/mfu/actor).

64 sequences of 64 prompt and 128-384 response tokens (about 320 a sequence), one forward and backward of a loss
of their logprobs and entropies: padded (transformers' sdpa, rows padded to the longest) against packed (one row,
varlen attention). Both compute in bf16, through different attention kernels: logprobs are held to the bf16
agreement of tests/gpu (max 0.1 nats, mean 0.02), gradients to a cosine of 0.995. Prints a table of times (median
of 3 after a warm-up) and peaks.

    python -m pytest tests/gpu/test_fast_trainer_gpu.py -s      (skips without a GPU)
"""

from __future__ import annotations

import statistics
import time

import torch

from services.run.models import load_causal_lm
from services.run.sections.actor_rollout_ref import ModelConfig
from services.common.sequences import SequenceBatch
from services.trainer.actor import Actor, ActorSettings, UpdateInputs
from services.trainer.batching import MicroBatching
from services.trainer.forward import response_logprobs
from services.trainer.mfu import ModelShape, device_peak_flops, mfu, training_flops
from services.trainer.optim import Optimizer, OptimSettings
from services.trainer.ranks import Ranks
from services.trainer.setup import attention
from services.trainer.sharding import Sharding, place
from tests.gpu.conftest import needs

SEQUENCES, PROMPT = 64, 64
CHECKED = ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
           "model.layers.23.mlp.down_proj.weight")
CUDA = torch.device("cuda")


def synthetic(vocab_size: int) -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    response_lens = torch.randint(128, 385, (SEQUENCES,), generator=generator)
    return SequenceBatch(prompt_ids=torch.randint(3, vocab_size, (SEQUENCES * PROMPT,), generator=generator),
                         prompt_lens=torch.full((SEQUENCES,), PROMPT),
                         response_ids=torch.randint(3, vocab_size, (int(response_lens.sum()),), generator=generator),
                         response_lens=response_lens)


def forward_backward(model, batch: SequenceBatch, packed: bool) -> torch.Tensor:
    logprobs, entropy = response_logprobs(model, batch, 0, temperature=1.0, with_entropy=True, device=CUDA,
                                          remove_padding=packed,
                                          chunk_tokens=ModelConfig().logprob_chunk_tokens)
    (-logprobs.mean() - 0.01 * entropy.mean()).backward()
    return logprobs.detach().float().cpu()


def timed(work, repeats: int = 3) -> float:
    """Median seconds of ``work`` after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_gib(work) -> float:
    """Peak memory ``work`` allocates above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(CUDA)
    before = torch.cuda.memory_allocated(CUDA)
    work()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(CUDA) - before) / 2**30


def adamw_step_seconds(model, **kernel) -> float:
    params = [p for p in model.parameters()]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    adamw = torch.optim.AdamW(params, lr=1e-6, **kernel)
    seconds = timed(adamw.step, repeats=5)
    adamw.zero_grad(set_to_none=True)
    return seconds


@needs(1, vllm=False)
def test_packed_varlen_attention_matches_padded_and_is_faster(qwen_05b):
    padded = load_causal_lm(str(qwen_05b), "bfloat16").to(CUDA).train()
    varlen = load_causal_lm(str(qwen_05b), "bfloat16", attn_implementation=attention(True)).to(CUDA).train()
    batch = synthetic(padded.config.vocab_size)

    expected = forward_backward(padded, batch, packed=False)
    got = forward_backward(varlen, batch, packed=True)
    grads = {name: (dict(padded.named_parameters())[name].grad.float().flatten(),
                    dict(varlen.named_parameters())[name].grad.float().flatten()) for name in CHECKED}
    cosines = {name: float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for name, (a, b) in grads.items()}
    gap = (got - expected).abs()
    padded.zero_grad(set_to_none=True)
    varlen.zero_grad(set_to_none=True)

    rows = {}
    for name, model, packed in (("padded (sdpa)", padded, False), ("packed (varlen)", varlen, True)):
        work = lambda: (forward_backward(model, batch, packed), model.zero_grad(set_to_none=True))  # noqa: E731
        rows[name] = (timed(work), peak_gib(work))
    del padded
    steps = {name: adamw_step_seconds(varlen, **kernel) for name, kernel in
             (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {"foreach": False}))}
    peak = device_peak_flops(CUDA)
    flops = training_flops(ModelShape.of(varlen.config, varlen.config.vocab_size), batch.sequence_lens.tolist())
    figure = mfu(flops, rows["packed (varlen)"][0], peak, world_size=1) if peak else None

    print(f"\n{SEQUENCES} sequences, {int(batch.sequence_lens.sum())} tokens ({int(batch.sequence_lens.max())} "
          f"longest); logprob gap max {gap.max():.4f} mean {gap.mean():.5f}; gradient cosines {cosines}")
    print(f"{'forward+backward':<18}{'seconds':>10}{'peak GiB':>10}")
    for name, (seconds, gib) in rows.items():
        print(f"{name:<18}{seconds:>10.3f}{gib:>10.2f}")
    print(f"{'AdamW step':<18}{'seconds':>10}")
    for name, seconds in steps.items():
        print(f"{name:<18}{seconds:>10.4f}")
    print(f"MFU of the packed forward+backward: {figure if figure is None else f'{figure:.3f}'} "
          f"({flops / 1e12:.1f} TFLOPs, {torch.cuda.get_device_name(CUDA)})")

    assert gap.max() < 0.1 and gap.mean() < 0.02
    assert all(cosine > 0.995 for cosine in cosines.values()), cosines
    assert rows["packed (varlen)"][0] < rows["padded (sdpa)"][0]
    assert rows["packed (varlen)"][1] < rows["padded (sdpa)"][1]
    assert steps["fused"] < steps["foreach"]


@needs(1, vllm=False)
def test_fused_adamw_steps_fsdp2_shards(qwen_05b):
    """The trainer's Optimizer on FSDP2 DTensor parameters (one rank) takes the fused kernel and steps them."""
    model = place(load_causal_lm(str(qwen_05b), "float32", attn_implementation=attention(True)),
                  Ranks.single(CUDA), Sharding(fsdp=True, param_dtype=torch.bfloat16), gradient_checkpointing=False)
    optimizer = Optimizer(model.parameters(), OptimSettings(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999),
                                                            grad_clip=1.0, warmup_steps=0, warmup_style="constant",
                                                            min_lr_ratio=0.0, total_steps=1,
                                                            offload=True))
    assert optimizer.adamw.defaults["fused"] and type(optimizer.params[0]).__name__ == "DTensor"
    before = optimizer.params[5].full_tensor().clone()
    with optimizer.resident():
        forward_backward(model, synthetic(model.config.vocab_size).select(torch.arange(8)), packed=True)
        grad_norm = optimizer.step()
    assert 0 < grad_norm < float("inf")
    assert not torch.equal(optimizer.params[5].full_tensor(), before)
    assert {value.device.type for state in optimizer.adamw.state.values() for key, value in state.items()
            if key != "step"} == {"cpu"}


@needs(1, vllm=False)
def test_the_actor_update_reports_its_mfu(qwen_05b):
    """Two mini-batches of 32 packed sequences, micro-batches cut by a 16k-token budget: perf/mfu/actor is there
    and plausible (a share of the H200's peak, not more than all of it)."""
    model = load_causal_lm(str(qwen_05b), "bfloat16", attn_implementation=attention(True)).to(CUDA)
    optim = OptimSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0, warmup_steps=0,
                          warmup_style="constant", min_lr_ratio=0.0, total_steps=10)
    actor = Actor(model, optim, optim, pad_id=0, seed=0)
    batch = synthetic(model.config.vocab_size)
    old_logprobs = actor.compute_log_probs(batch, 1.0, MicroBatching(size=64, max_tokens=16384, remove_padding=True,
                                                                     chunk_tokens=1024))
    inputs = UpdateInputs(old_logprobs=old_logprobs, advantages=torch.randn(batch.num_response_tokens),
                          ref_logprobs=None)
    settings = ActorSettings(mini_batch_size=32, micro_batch_size=32, epochs=1, clip_ratio_low=0.2,
                             clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0,
                             use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", temperature=1.0,
                             max_response_length=384, max_token_len=16384, remove_padding=True,
                             logprob_chunk_tokens=1024)
    actor.update(batch, inputs, settings)  # warm-up
    started = time.perf_counter()
    metrics = actor.update(batch, inputs, settings)
    print(f"\nactor update of {SEQUENCES} sequences: {time.perf_counter() - started:.3f} s, perf/mfu/actor "
          f"{metrics.get('perf/mfu/actor')}")
    assert 0.02 < metrics["perf/mfu/actor"] < 1.0
