"""Where meshrl's trainer loses time against a plain PyTorch loop doing the same work (issue 18).

In one process, on the same random model and the same token sequences, each side does the trainer's two jobs
of a GRPO step at the shape of bench/grpo_step.py (a random Qwen2.5-0.5B-shaped model, 32 prompts x 8
samples of 64 prompt + 256 response tokens, 64 sequences a micro-batch):

- old_log_prob: the logprob of every response token, without gradients, a micro-batch at a time;
- update: per micro-batch a forward, the response tokens' logprobs, the clipped policy-gradient loss (token
  mean over the batch) and a backward; then gradient clipping and one AdamW step, both sides with the settings
  of meshrl's run config (clipping at 1.0, lr 1e-6).

The sides:
- reference: a plain loop written here. The transformers model (its default attention, sdpa; the rows
  unpadded, as every sequence is as long), logits of the response positions alone (``logits_to_keep``, as
  TRL asks for them) upcast to fp32, log_softmax and gather; AdamW fused on CUDA.
- reference+ckpt: the same with gradient checkpointing on, as TRL's GRPOTrainer has it by default.
- meshrl: the trainer's ``RankWorker`` in this process, loaded by the op InitRun calls with the run config of
  grpo_step's colocated run, and called with the ops and tensors ComputeLogProbs and UpdateActor hand it:
  everything the trainer service does but gRPC.

A side's first old_log_prob pass and first update run on the initial weights, so their logprobs and gradient
norms can be compared across sides (the largest logprob difference to the reference's is printed: float noise
in float32 on a CPU, bf16 noise on a GPU). Then each job is timed with the device synchronised around it, the
median of --repeats after --warmup calls; its peak GB is the most a call allocated above what was allocated
before it (every side's weights and optimizer state stay resident throughout; CUDA only).
The update's MFU is counted as the trainer's ``perf/mfu/actor`` is (services/trainer/mfu.py). The ratios
meshrl / reference are printed last.

--profile adds torch.profiler's view of one old_log_prob pass and one update of meshrl and of the reference:
the 15 ops with the most self time on the device, and how often the host waited for the device or copied
to or from it. --tiny runs a 2-layer 64-wide model on 8 sequences of 8 + 24 tokens (the unit test's shape,
with --device cpu, where every side computes in float32).

    python -m bench.trainer_step [--tiny] [--device cuda|cpu] [--profile] [--out FILE.json] [key=value ...]

key=value overrides apply to meshrl's run config, to see what a setting costs (for instance
actor_rollout_ref.model.logprob_chunk_tokens=0, actor_rollout_ref.model.use_remove_padding=false).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

if not __package__:  # run as a file (python bench/trainer_step.py): the bench package is in the folder above
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpo_step import (MICRO_BATCH, PROMPT_TOKENS, PROMPTS, RESPONSE_TOKENS, ROOT, SAMPLES, machine,
                             meshrl_config, prepare_assets)
from services.run.sections.actor import ActorConfig
from services.common.sequences import SequenceBatch
from services.coordinator.runs.manager import parse_run_config
from services.coordctl.tiny_model import QWEN25_SHAPES
from services.trainer.mfu import ModelShape, device_peak_flops, mfu, training_flops

TOP_OPS = 15
REPORTED_PEAK = "perf/max_memory_allocated_gb"
HOST_DEVICE = ("Synchronize", "Memcpy", "aten::nonzero")  # the profiled events counted: waits for the device, copies


@dataclass(frozen=True)
class Shape:
    """One GRPO step's work for the trainer: every sequence has the same prompt and response lengths."""

    model: dict  # the random model's shape (services/coordctl/tiny_model.py)
    prompts: int
    samples: int  # per prompt
    prompt_tokens: int
    response_tokens: int
    micro_batch: int  # sequences per forward (and backward)

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


SHAPES = {
    "grpo-step": Shape(QWEN25_SHAPES["0.5b"], PROMPTS, SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS, MICRO_BATCH),
    "tiny": Shape(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2), prompts=2, samples=4, prompt_tokens=8, response_tokens=24,
                  micro_batch=4),
}


def random_batch(shape: Shape, vocab_size: int) -> tuple[SequenceBatch, torch.Tensor]:
    """The sequences (token ids drawn uniformly, seeded) and an advantage per response token [T]: one
    standard-normal value per sequence, as GRPO's are."""
    generator = torch.Generator().manual_seed(0)
    count = shape.sequences
    prompts = torch.randint(vocab_size, (count * shape.prompt_tokens,), generator=generator)
    responses = torch.randint(vocab_size, (count * shape.response_tokens,), generator=generator)
    advantages = torch.randn(count, generator=generator).repeat_interleave(shape.response_tokens)
    batch = SequenceBatch(prompt_ids=prompts, prompt_lens=torch.full((count,), shape.prompt_tokens),
                          response_ids=responses,
                          response_lens=torch.full((count,), shape.response_tokens))
    return batch, advantages


def meshrl_overrides(shape: Shape, dtype: str) -> list[str]:
    """What makes grpo_step's run config train ``shape`` in ``dtype``."""
    return [f"data.train_batch_size={shape.prompts}", f"data.max_prompt_length={shape.prompt_tokens}",
            f"data.max_response_length={shape.response_tokens}", f"actor_rollout_ref.rollout.n={shape.samples}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.micro_batch}",
            f"actor_rollout_ref.model.dtype={dtype}"]


# ---------------------------------------------------------------- the two sides


class Reference:
    """The plain loop, with the lr, AdamW, clip range and gradient clipping of meshrl's ``actor`` config. Both
    jobs take and give flat [T] CPU tensors, as meshrl's do."""

    def __init__(self, model_path: Path, dtype: torch.dtype, device: torch.device, shape: Shape,
                 batch: SequenceBatch, actor: ActorConfig, checkpointing: bool = False):
        from transformers import AutoModelForCausalLM

        from services.trainer.sharding import enable_gradient_checkpointing

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        if checkpointing:
            enable_gradient_checkpointing(self.model)  # transformers' own, named as this version names it
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=actor.optim.lr, betas=actor.optim.betas,
                                           weight_decay=actor.optim.weight_decay, fused=device.type == "cuda")
        self.rows = torch.cat([batch.prompt_ids.view(len(batch), -1), batch.response_ids.view(len(batch), -1)],
                              dim=1).to(device)  # [B, prompt + response]
        self.shape, self.actor = shape, actor

    def logprobs(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logprobs of each row's response tokens. [rows, L] -> [rows, response]"""
        response = self.shape.response_tokens
        logits = self.model(input_ids=rows, logits_to_keep=response + 1, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, rows[:, -response:, None]).squeeze(-1)

    @torch.no_grad()
    def old_log_prob(self) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self.logprobs(rows) for rows in self.rows.split(self.shape.micro_batch)]).flatten().cpu()

    def update(self, old_logprobs: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step over the batch; its metric: the gradient norm before clipping."""
        self.model.train()
        device, micro = self.rows.device, self.shape.micro_batch
        old_logprobs, advantages = (values.view(len(self.rows), -1).to(device) for values in (old_logprobs, advantages))
        for rows, old, advantage in zip(self.rows.split(micro), old_logprobs.split(micro), advantages.split(micro)):
            ratio = torch.exp(self.logprobs(rows) - old)
            clipped = ratio.clamp(1 - self.actor.clip_ratio_low, 1 + self.actor.clip_ratio_high)
            (torch.maximum(-advantage * ratio, -advantage * clipped).sum() / old_logprobs.numel()).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.actor.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/grad_norm": float(grad_norm)}


class Meshrl:
    """The trainer service's RankWorker, given what its servicer gives it (check_init's and the batch's checks
    aside, which refuse bad input and compute nothing)."""

    def __init__(self, config: dict, device: torch.device, batch: SequenceBatch):
        from services.trainer.ranks import Ranks
        from services.trainer.worker import SEQUENCE_KEYS, RankWorker

        self.worker = RankWorker(Ranks.single(device))
        self.worker.run("init_run", {"run_id": "trainer-step", "run_config_yaml": yaml.safe_dump(config),
                                     "roles": ["actor"], "seed": 0}, {})
        self.sequences = {key: getattr(batch, key) for key in SEQUENCE_KEYS}

    def old_log_prob(self) -> torch.Tensor:
        return self.worker.run("compute_log_probs", {"role": "actor"}, self.sequences)

    def update(self, old_logprobs: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        """The update's metrics, verl's (``perf/max_memory_allocated_gb`` among them on CUDA)."""
        tensors = {**self.sequences, "old_logprobs": old_logprobs, "advantages": advantages}
        return self.worker.run("update_actor", {}, tensors).metrics


# ---------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> dict:
    """Median seconds of ``work`` over ``repeats`` calls after ``warmup``, and the most GB a call allocated above
    what was allocated before it (CUDA only): the allocator's peak during the call, or the one the call reports
    where it does (meshrl's update reads the peak for its metrics, then starts it again)."""
    for _ in range(warmup):
        work()
    cuda = device.type == "cuda"
    seconds, peaks = [], []
    for _ in range(repeats):
        synchronize(device)
        if cuda:
            resident = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        result = work()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        if cuda:
            reported = result.get(REPORTED_PEAK) if isinstance(result, dict) else None
            peak = reported * 2**30 if reported is not None else torch.cuda.max_memory_allocated(device)
            peaks.append((peak - resident) / 2**30)
    return {"seconds": statistics.median(seconds), "peak_gb": max(peaks) if cuda else None}


def profiled(work: Callable[[], object], device: torch.device) -> dict:
    """torch.profiler's view of one call of ``work``: the ops with the most self time on the device (on a CPU:
    CPU time), and the count of each event where the host waits for the device or copies to or from it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as profiler:
        started = time.perf_counter()
        work()
        synchronize(device)
        wall = time.perf_counter() - started
    events = profiler.key_averages()

    def self_us(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    ops = [event for event in events if event.device_type == DeviceType.CPU]  # the ops, not their kernels
    device_work = [event for event in events if event.device_type != DeviceType.CPU] if cuda else events
    return {"wall_s": wall, "time": "device" if cuda else "cpu",
            "busy_ms": sum(self_us(event) for event in device_work) / 1e3,
            "top": [{"op": event.key, "calls": event.count, "self_ms": self_us(event) / 1e3}
                    for event in sorted(ops, key=self_us, reverse=True)[:TOP_OPS]],
            "host_device": {event.key: event.count for event in events
                            if any(word in event.key for word in HOST_DEVICE)}}


def update_flops(model_path: Path, shape: Shape) -> float:
    """The FLOPs of one update as the trainer counts them for ``perf/mfu/actor`` (services/trainer/mfu.py)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    lengths = [shape.prompt_tokens + shape.response_tokens] * shape.sequences
    return training_flops(ModelShape.of(config, config.vocab_size), lengths)


def jobs(side: Reference | Meshrl, old_logprobs: torch.Tensor, advantages: torch.Tensor) -> dict[str, Callable]:
    return {"old_log_prob": side.old_log_prob, "update": lambda: side.update(old_logprobs, advantages)}


def measure(args) -> dict:
    """Build the sides, compare them on the initial weights, time them (and profile them)."""
    shape = SHAPES["tiny" if args.tiny else "grpo-step"]
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model_path, data = prepare_assets(args.work / ("tiny" if args.tiny else "grpo-step"), shape.model)
    config = meshrl_config("colocated", model_path, data, args.warmup + args.repeats + 2,
                           meshrl_overrides(shape, dtype) + args.overrides)
    actor = parse_run_config(yaml.safe_dump(config)).actor_rollout_ref.actor
    batch, advantages = random_batch(shape, json.loads((model_path / "config.json").read_text())["vocab_size"])
    sides = {"reference": Reference(model_path, getattr(torch, dtype), device, shape, batch, actor),
             "reference+ckpt": Reference(model_path, getattr(torch, dtype), device, shape, batch, actor,
                                         checkpointing=True),
             "meshrl": Meshrl(config, device, batch)}
    first = {name: side.old_log_prob() for name, side in sides.items()}
    old_logprobs = first["reference"]
    flops, peak_flops = update_flops(model_path, shape), device_peak_flops(device)
    results = {}
    for name, side in sides.items():
        grad_norm = side.update(old_logprobs, advantages)["actor/grad_norm"]  # the initial weights' gradient
        timings = {job: timed(work, device, args.warmup, args.repeats)
                   for job, work in jobs(side, old_logprobs, advantages).items()}
        timings["update"]["mfu"] = mfu(flops, timings["update"]["seconds"], peak_flops,
                                       world_size=1) if peak_flops else None
        results[name] = {"logprob_max_diff": float((first[name] - old_logprobs).abs().max()),
                         "first_grad_norm": grad_norm, **timings}
    profiles = {f"{name} {job}": profiled(work, device) for name in ("meshrl", "reference")
                for job, work in jobs(sides[name], old_logprobs, advantages).items()} if args.profile else {}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "torch": torch.__version__, "device": str(device), "dtype": dtype, "shape": shape.__dict__,
            "overrides": args.overrides, "sides": results, "profiles": profiles,
            "ratios": {job: results["meshrl"][job]["seconds"] / results["reference"][job]["seconds"]
                       for job in ("old_log_prob", "update")}}


# ---------------------------------------------------------------- the report


def number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def report(result: dict) -> str:
    """The table, each profile, and the ratios meshrl / reference last."""
    shape = result["shape"]
    lines = [f"{shape['prompts'] * shape['samples']} sequences of {shape['prompt_tokens']} + "
             f"{shape['response_tokens']} tokens, {shape['micro_batch']} a micro-batch, {result['dtype']} on "
             f"{result['device']}, {result['machine']}, torch {result['torch']}, {result['date']}"
             + "".join(f", {override}" for override in result["overrides"]),
             f"{'side':<16}{'old_log_prob s':>16}{'update s':>10}{'old_log_prob GB':>17}{'update GB':>11}"
             f"{'update MFU':>12}{'logprob diff':>14}{'grad norm':>11}"]
    for name, side in result["sides"].items():
        old, update = side["old_log_prob"], side["update"]
        lines.append(f"{name:<16}{old['seconds']:>16.3f}{update['seconds']:>10.3f}{number(old['peak_gb'], '.1f'):>17}"
                     f"{number(update['peak_gb'], '.1f'):>11}{number(update['mfu'], '.3f'):>12}"
                     f"{side['logprob_max_diff']:>14.2e}{side['first_grad_norm']:>11.4g}")
    for name, profile in result["profiles"].items():
        lines += ["", f"{name}: {profile['wall_s']:.3f} s, {profile['busy_ms']:.1f} ms busy on the {profile['time']}; "
                      "host waits and copies: " + (", ".join(f"{key} x{count}" for key, count in
                                                              profile["host_device"].items()) or "none seen"),
                  f"  {'self ms':>9}{'share':>7}{'calls':>7}  op"]
        lines += [f"  {op['self_ms']:>9.2f}{op['self_ms'] / max(profile['busy_ms'], 1e-9):>7.1%}{op['calls']:>7}  "
                  f"{op['op'][:100]}" for op in profile["top"]]
    ratios = result["ratios"]
    lines += ["", f"meshrl / reference: old_log_prob {ratios['old_log_prob']:.2f}x, update {ratios['update']:.2f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model on 8 short sequences")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=2, help="calls of each job before the timed ones (at least 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each job")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over one call of each job")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument("--work", type=Path, default=ROOT / "meshrl-runs" / "trainer-step", help="the random models")
    parser.add_argument("overrides", nargs="*", help="key=value for meshrl's run config")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1:
        parser.error("--warmup and --repeats must be at least 1 (the first update allocates AdamW's state)")
    result = measure(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(report(result))


if __name__ == "__main__":
    main()
