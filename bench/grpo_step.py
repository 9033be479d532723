"""One GRPO step of meshrl against TRL's GRPOTrainer on the same GPUs, at one shape (issue 18).

The shape, the same on both sides: a random-init Qwen2.5-0.5B-shaped bf16 model (152k vocabulary, the
character tokenizer of services/coordctl/tiny_model.py, so EOS is almost never sampled and every response
runs to its maximum length), 32 prompts of 64 tokens x 8 samples x 256 new tokens, one optimizer step per
batch at lr 1e-6, no KL, vLLM with CUDA graphs and a memory share of 0.3, a reward that is constant in effect
(TRL: a function returning 0; meshrl: the digit-reversal rule, which a random model never satisfies).

The runs (--runs, any of them, in this order):
- trl: TRL's GRPOTrainer, vLLM in colocate mode, no sleep mode, 64 samples per micro-batch (4 micro-batches
  of gradient accumulation: one optimizer step per batch of 256), TRL's defaults otherwise (gradient
  checkpointing on, as GRPOConfig has it). It runs in a child process of its own (so its vLLM and CUDA
  memory are gone before the next run; its output in <out>/trl.log); each step is timed from the end of the
  one before by a TrainerCallback, and its split comes from TRL's own profiled blocks (``profiling_context``,
  which TRL only sends to W&B/MLflow/Trackio: the child records them instead): gen = vLLM.generate, update_weights =
  sync_weights, reward = _calculate_rewards, old_log_prob = the logprob passes inside _prepare_inputs,
  batch_prep = the rest of _prepare_inputs, update_actor = the step less all of _prepare_inputs.
- colocated: meshrl, trainer and vLLM rollout on GPU 0, 64 samples per micro-batch (ppo_micro_batch_size_per_gpu).
- colocated-k1: the same with trainer.async_.max_staleness 1: the next batch is generated while the trainer
  works on this one, on the same GPU (each sample one weight version behind; TRL has no such mode).
- colocated-sleep: the same with the rollout started with enable_sleep_mode and the run with
  actor_rollout_ref.rollout.free_cache_engine (the rollout sleeps while the trainer works).
- split-k0, split-k1: trainer on GPU 0, rollout on GPU 1, trainer.async_.max_staleness 0 and 1 (one cluster
  for both).
- every-gpu: a rollout on each GPU, the one on the trainer's GPU asleep while the trainer works
  (free_cache_engine), max_staleness 0.
- colocated-gc: colocated with actor_rollout_ref.model.enable_gradient_checkpointing (as TRL's runs have it).
- colocated-lora: colocated with LoRA (issue 29): actor_rollout_ref.model.lora_rank 64, lora_alpha 128,
  target_modules all-linear; each sync sends the adapters alone, which the vLLM rollout loads from memory.
- colocated-lora-merge: colocated-lora with actor_rollout_ref.model.lora.merge: each sync sends the adapted
  layers' merged weights, which vLLM serves as full weights (no LoRA kernels).
- colocated-lora-gc: colocated-lora with gradient checkpointing, against colocated-gc.
- llm-generate: vLLM's own ``LLM.generate`` at the shape, in a child process, with the engine arguments of
  meshrl's rollout (CUDA graphs, the same memory share) and the steps' sampling (n 8, temperature 1, the
  sampled tokens' logprobs, no per-request seeds, no detokenizing): the generation every other run's gen stage
  is measured against (each "step" one batch generated; the gen table's reference).
- trl-lora: trl with a PEFT LoraConfig of the same rank, alpha and targets (TRL merges the adapters into the
  weights it pushes to vLLM at each sync).
meshrl's runs start the services as a user does (LocalCluster: coordinator, trainer, rollout, reward on
loopback) and take each step's stages from the run's metrics.jsonl (timing_s/*) and memory from its
perf/ metrics; a step's time is from the end of the one before (the first: timing_s/step).
Their one mini-batch a step skips the old-logprob pass (actor.recompute_old_log_prob null): no old_log_prob stage.

A run needing more GPUs than nvidia-smi shows is skipped with a message. Each run's result goes to
<out>/<run>.json (date, machine, every step), replacing an earlier one of the same run, so one folder
gathers the runs of several invocations on one lease; --report prints the table of a folder without running
anything. tok/s/GPU is the step's tokens (32 x 8 x (64 + 256), both sides) over the median s/step over the
GPUs the run holds (verl's and NeMo-RL's perf/throughput). Medians are over steps 3 and later (for
max_staleness >= 1 not the last, which trains a batch generated ahead); peak memory is the largest over all steps: the trainer's allocated (meshrl:
perf/max_memory_allocated_gb; TRL: the process's torch peak less what its vLLM holds), vLLM's (meshrl:
perf/rollout/; TRL: what building vLLM added), and each GPU's used memory (nvidia-smi, every 0.5 s). The
ratios of each run's s/step to TRL's in the same folder are printed last, then the LoRA runs against the full
fine-tunes (colocated-lora and -merge against colocated, colocated-lora-gc against colocated-gc, trl-lora against
trl): trainer peak memory, s/step and sync
seconds, beside issue 29's goals (peak at most 0.6x, the step no slower, the adapter sync under 5 ms).

    python bench/grpo_step.py --runs trl,colocated,colocated-k1 --out OUT [--trl-site DIR] [--steps 8] [key=value ...]
    python bench/grpo_step.py --runs trl,trl-lora,colocated,colocated-lora --out OUT --trl-site DIR
    python bench/grpo_step.py --report --out OUT

key=value overrides apply to every meshrl run's config. --trl-site is a folder put on the TRL child's
PYTHONPATH alone, where the wheels the GPU image lacks are installed (TRL 1.14.2 is the newest release whose
vLLM range includes 0.20.1):

    pip install --no-index --no-deps --target /tmp/trl-site trl-1.14.2-py3-none-any.whl \\
        datasets-5.0.1-py3-none-any.whl dill-0.4.1-py3-none-any.whl multiprocess-0.70.19-py312-none-any.whl \\
        xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl \\
        accelerate-1.15.0-py3-none-any.whl

TRL and those wheels further import pyarrow, pandas, fsspec, httpx, jinja2, huggingface_hub and psutil; the
child names any of them that is missing before it starts. The model (1 GB) is built once into --work
(default meshrl-runs/grpo-step, which git ignores).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS = 32, 8, 64, 256
STEP_TOKENS = PROMPTS * SAMPLES * (PROMPT_TOKENS + RESPONSE_TOKENS)  # a step's tokens, both sides (no early EOS)
GEN_TOKENS = PROMPTS * SAMPLES * RESPONSE_TOKENS  # the tokens a step generates
MICRO_BATCH = 64  # samples per forward/backward, both sides
LR = 1e-6
VLLM_SHARE = 0.3  # vLLM's gpu_memory_utilization, every run
PROMPT_ROWS = 1024
FIRST_TIMED_STEP = 3
TRL_NEEDS = ("trl", "accelerate", "datasets", "dill", "multiprocess", "xxhash", "pyarrow", "pandas", "fsspec",
             "httpx", "jinja2", "huggingface_hub", "psutil", "peft")
LORA_RANK, LORA_ALPHA = 64, 128  # the LoRA runs' adapters, on every linear layer of the decoder


@dataclass(frozen=True)
class Run:
    gpus: int
    layout: str  # the meshrl services it runs on (runs of one layout share a cluster); "" for TRL
    max_staleness: int = 0
    sleep: bool = False  # actor_rollout_ref.rollout.free_cache_engine
    lora: bool = False  # trains LoRA adapters (LORA_RANK, LORA_ALPHA, all-linear) instead of every weight
    merge: bool = False  # a LoRA run's rollout serves the adapters merged into its weights (lora.merge)
    checkpointing: bool = False  # actor_rollout_ref.model.enable_gradient_checkpointing


RUNS = {
    "trl": Run(1, ""),
    "llm-generate": Run(1, ""),
    "colocated": Run(1, "colocated"),
    "colocated-k1": Run(1, "colocated", max_staleness=1),
    "colocated-sleep": Run(1, "colocated-sleep", sleep=True),
    "split-k0": Run(2, "split"),
    "split-k1": Run(2, "split", max_staleness=1),
    "every-gpu": Run(2, "every-gpu", sleep=True),
    "colocated-gc": Run(1, "colocated", checkpointing=True),
    "colocated-lora": Run(1, "colocated", lora=True),
    "colocated-lora-merge": Run(1, "colocated", lora=True, merge=True),
    "colocated-lora-gc": Run(1, "colocated", lora=True, checkpointing=True),
    "trl-lora": Run(1, "", lora=True),
}
LORA_AGAINST = {"colocated-lora": "colocated", "colocated-lora-merge": "colocated",  # each LoRA run's full
                "colocated-lora-gc": "colocated-gc", "trl-lora": "trl"}  # fine-tune, alike in checkpointing


# ---------------------------------------------------------------- what a run's steps come to


def timed_steps(result: dict) -> list[dict]:
    """The steps medians are taken over: from FIRST_TIMED_STEP on (warm-up before), and with max_staleness >= 1
    not the last (its batch was generated ahead: the pipeline draining)."""
    steps = [step for step in result["steps"] if step["step"] >= FIRST_TIMED_STEP]
    return steps[:-1] if result.get("max_staleness", 0) > 0 else steps


def summary(result: dict) -> dict:
    """Median seconds a step and of each stage over the timed steps; the largest of each memory figure over all
    steps and the run (GB)."""
    steps = timed_steps(result)
    stages = sorted({stage for step in steps for stage in step["stages"]})
    memory = {key: max(step["memory"][key] for step in result["steps"] if key in step["memory"])
              for key in {key for step in result["steps"] for key in step["memory"]}}
    return {"timed": len(steps),
            "seconds": statistics.median(step["seconds"] for step in steps) if steps else None,
            "stages": {stage: statistics.median(step["stages"].get(stage, 0.0) for step in steps) for stage in stages},
            "memory": {**memory, **result.get("memory", {})}}


CHECKS = ("training/rollout_mismatch_kl", "weights/probe_logprob_diff_mean", "weights/probe_logprob_diff_max",
          "weights/probe_topk_kl_mean", "weights/probe_topk_kl_max")


def meshrl_steps(rows: list[dict]) -> list[dict]:
    """A meshrl run's steps from its metrics.jsonl rows: seconds since the step before ended (the first: its
    timing_s/step), its timing_s/ stages, its trainer's and rollout's memory peaks (GB), and what says the
    rollout served the trainer's weights (CHECKS)."""
    memory_keys = {"trainer_allocated": "perf/max_memory_allocated_gb",
                   "trainer_reserved": "perf/max_memory_reserved_gb",
                   "rollout_allocated": "perf/rollout/max_memory_allocated_gb",
                   "rollout_reserved": "perf/rollout/max_memory_reserved_gb"}
    steps, ended = [], None
    for row in rows:
        if "timing_s/step" not in row:  # a validation's line
            continue
        steps.append({"step": row["step"], "seconds": row["timing_s/step"] if ended is None else row["time"] - ended,
                      "stages": {key.removeprefix("timing_s/"): value for key, value in row.items()
                                 if key.startswith("timing_s/") and key != "timing_s/step"},
                      "memory": {name: row[key] for name, key in memory_keys.items() if key in row},
                      "checks": {key: row[key] for key in CHECKS if key in row}})
        ended = row["time"]
    return steps


def trl_stages(blocks: list[tuple[str, float, float]], seconds: float) -> dict[str, float]:
    """A TRL step's split from its profiled blocks (name without the class, start, seconds): what the module
    docstring says each stage is. The logprob passes inside _prepare_inputs are the old logprobs; the others
    are the loss's."""
    preparing = [(start, start + length) for name, start, length in blocks if name == "_prepare_inputs"]

    def total(wanted: str, inside: bool | None = None) -> float:
        return sum(length for name, start, length in blocks if name == wanted and
                   (inside is None or inside == any(a <= start <= b for a, b in preparing)))

    prepared = sum(b - a for a, b in preparing)
    stages = {"gen": total("vLLM.generate"), "update_weights": total("sync_weights"),
              "reward": total("_calculate_rewards"),
              "old_log_prob": total("_get_per_token_logps_and_entropies", inside=True)}
    return {**stages, "batch_prep": prepared - sum(stages.values()), "update_actor": seconds - prepared}


class StepRecorder:
    """TRL's optimizer steps as they end: seconds since the one before ended (the first: since it began), the
    profiled blocks that ran in it, and the memory figures given at its end."""

    def __init__(self):
        self.steps: list[dict] = []
        self.blocks: list[tuple[str, float, float]] = []
        self.began: float | None = None

    def begin(self, now: float) -> None:
        if self.began is None:
            self.began = now

    def profiled(self, name: str, start: float, seconds: float) -> None:
        self.blocks.append((name.partition(".")[2], start, seconds))  # TRL names them GRPOTrainer.<block>

    def end(self, now: float, memory: dict[str, float]) -> None:
        seconds = now - self.began
        self.steps.append({"step": len(self.steps) + 1, "seconds": seconds,
                           "stages": trl_stages(self.blocks, seconds), "memory": memory})
        self.blocks, self.began = [], now


# ---------------------------------------------------------------- the report


def load_results(folder: Path) -> dict[str, dict]:
    """Every run's result in ``folder``, in RUNS' order."""
    found = {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}
    return {name: found[name] for name in RUNS if name in found}


STAGE_ORDER = ("gen", "reward", "old_log_prob", "adv", "update_actor", "batch_prep", "rollout_sleep",
               "rollout_wake_up", "update_weights", "rollout_pause")
MEMORY_COLUMNS = (("trainer_allocated", "trainer GB"), ("rollout_allocated", "vLLM GB"))


def tokens_per_gpu_s(seconds: float, gpus: int) -> float:
    """A step's tokens over its seconds over the GPUs the run holds (verl's and NeMo-RL's perf/throughput)."""
    return STEP_TOKENS / seconds / gpus


def report(results: dict[str, dict]) -> str:
    """The table of every result: s/step, tokens/s per GPU, stage medians, peak memory; the ratios to TRL's s/step
    last."""
    lines = [f"medians over steps {FIRST_TIMED_STEP}+ (max_staleness >= 1: not the last); memory: peaks over all "
             "steps, GiB"]
    summaries = {name: summary(r) for name, r in results.items() if r["status"] == "ok"}
    gpus = sorted({key for s in summaries.values() for key in s["memory"] if key.startswith("gpu")})
    lines.append(f"{'run':<16}{'steps':>6}{'s/step':>8}{'tok/s/GPU':>11}{'sync ms':>9}"
                 + "".join(f"{title:>12}" for _, title in MEMORY_COLUMNS)
                 + "".join(f"{key + ' used':>11}" for key in gpus) + "  machine, date")
    for name, result in results.items():
        where = "  " + ", ".join([result["machine"], result["date"], *result.get("overrides", [])])
        if name not in summaries:
            error = " | ".join(line.strip() for line in result["error"].splitlines() if line.strip())
            lines.append(f"{name:<16}{result['status']}: {error[:300]}" + where)
            continue
        s = summaries[name]
        cells = [s["memory"].get(key) for key, _ in MEMORY_COLUMNS] + [s["memory"].get(key) for key in gpus]
        lines.append(f"{name:<16}{len(result['steps']):>6}{s['seconds']:>8.2f}"
                     f"{tokens_per_gpu_s(s['seconds'], RUNS[name].gpus):>11.0f}{sync_ms(s):>9}"
                     + "".join(f"{cell:>12.1f}" if cell is not None else f"{'-':>12}" for cell in cells[:2])
                     + "".join(f"{cell:>11.1f}" if cell is not None else f"{'-':>11}" for cell in cells[2:]) + where)
    stages = sorted({stage for s in summaries.values() for stage in s["stages"]},
                    key=lambda stage: (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), stage))
    if summaries:
        lines += ["", "stage medians, s", f"{'run':<16}" + "".join(f"{stage:>16}" for stage in stages)]
        lines += [f"{name:<16}" + "".join(f"{s['stages'][stage]:>16.3f}" if stage in s["stages"] else f"{'-':>16}"
                                          for stage in stages) for name, s in summaries.items()]
    lora = lora_ratios(summaries)
    lines += ["", *generation(summaries), "", *ratios(results, summaries), *(["", *lora] if lora else [])]
    return "\n".join(lines)


def generation(summaries: dict[str, dict]) -> list[str]:
    """Each run's generation: its median gen stage, the tokens a step generates over it, and that rate over
    llm-generate's (vLLM's own LLM.generate at the same shape, where it ran in the same results)."""
    reference = summaries.get("llm-generate", {}).get("stages", {}).get("gen")
    lines = [f"generation ({GEN_TOKENS} tokens a step)" + ("" if reference else
                                                          ": no llm-generate result here, no ratio to it")]
    for name, s in summaries.items():
        gen = s["stages"].get("gen")
        if gen:
            ratio = f"  {reference / gen:.3f}x LLM.generate's tokens/s" if reference else ""
            lines.append(f"  {name:<22}{gen:>7.2f} s {GEN_TOKENS / gen:>9,.0f} tokens/s{ratio}")
    return lines


def sync_ms(summary_of_run: dict) -> str:
    """A run's median weight sync in ms, as a cell: its update_weights stage less the weight check that meshrl runs
    within it (weight_probe, its own column)."""
    stages = summary_of_run["stages"]
    if "update_weights" not in stages:
        return "-"
    return f"{(stages['update_weights'] - stages.get('weight_probe', 0.0)) * 1e3:.1f}"


def lora_ratios(summaries: dict[str, dict]) -> list[str]:
    """Each LoRA run against its full fine-tune in the same results: trainer peak memory, s/step and sync, and
    issue 29's goals (none without a LoRA run)."""
    if not LORA_AGAINST.keys() & summaries.keys():
        return []
    lines = ["LoRA against full fine-tuning (goals: trainer peak <= 0.6x, s/step <= 1.0x, sync < 5 ms):"]
    for lora, full in LORA_AGAINST.items():
        if lora not in summaries or full not in summaries:
            continue
        mine, theirs = summaries[lora], summaries[full]
        peaks = [s["memory"].get("trainer_allocated") for s in (mine, theirs)]
        peak = f"{peaks[0] / peaks[1]:.2f}x" if None not in peaks and peaks[1] else "-"
        lines.append(f"  {lora:<16}trainer peak {peak}, s/step {mine['seconds'] / theirs['seconds']:.2f}x, sync "
                     f"{sync_ms(mine)} ms against {sync_ms(theirs)} ms ({full})")
    return lines if len(lines) > 1 else ["no LoRA run beside its full fine-tune here: no LoRA ratios"]


def ratios(results: dict[str, dict], summaries: dict[str, dict]) -> list[str]:
    """Each run's s/step over TRL's, where TRL's run is in the same results."""
    if "trl" not in summaries:
        return ["no TRL result here: no ratios (run --runs trl in the same lease)"]
    reference, trl_host = summaries["trl"]["seconds"], results["trl"]["host"]
    lines = [f"s/step over TRL's {reference:.2f} s ({results['trl']['machine']}):"]
    for name, s in summaries.items():
        if name not in ("trl", "llm-generate"):
            elsewhere = "" if results[name]["host"] == trl_host else f" (NOT the same host: {results[name]['host']})"
            lines.append(f"  {name:<16}{s['seconds'] / reference:.2f}x{elsewhere}")
    return lines


# ---------------------------------------------------------------- the machine


def gpu_query(fields: str) -> list[list[str]]:
    """nvidia-smi's answer for ``fields``, a row per GPU; none without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return []
    return [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def gpu_count() -> int:
    """GPUs here: nvidia-smi's, else torch's count (which makes no CUDA context)."""
    import torch

    return len(gpu_query("index")) or torch.cuda.device_count()


def machine() -> str:
    names = [row[0] for row in gpu_query("name")]
    return f"{len(names)}x {names[0]} ({socket.gethostname()})" if names else f"no GPU ({socket.gethostname()})"


def wait_gpus_free(timeout_s: float = 60.0, below_mib: int = 2048) -> None:
    """Wait until every GPU has less than ``below_mib`` in use (a stopped run's processes gone), at most
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(used.isdigit() and int(used) >= below_mib for [used] in gpu_query("memory.used")) \
            and time.monotonic() < deadline:
        time.sleep(1.0)


class GpuMemoryPeaks:
    """The most memory each GPU had in use (GiB) while in the ``with`` block, from nvidia-smi every 0.5 s."""

    def __enter__(self) -> GpuMemoryPeaks:
        self.peaks: dict[str, float] = {}
        try:
            self.process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-lms", "500"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.process = None
            return self
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            index, _, used = line.partition(",")
            if used.strip().isdigit():
                key = f"gpu{index.strip()}"
                self.peaks[key] = max(self.peaks.get(key, 0.0), int(used) / 1024)

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.reader.join()


def stamp(name: str, max_staleness: int) -> dict:
    return {"run": name, "max_staleness": max_staleness, "machine": machine(), "host": socket.gethostname(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


# ---------------------------------------------------------------- the shape's model and prompts


def prepare_assets(work: Path, shape: dict) -> tuple[Path, Path]:
    """The random model of ``shape`` (built once into ``work``) and PROMPT_ROWS prompts of PROMPT_TOKENS
    characters (one token each: digits and "=", the digit-reversal task)."""
    from services.coordctl.synthetic import reverse_task_rows, write_jsonl
    from services.coordctl.tiny_model import build_random_model

    model = work / "model"
    built = model / "meshrl_random_model.json"
    if not built.exists() or json.loads(built.read_text()) != {"seed": 0, "dtype": "bfloat16", **shape}:
        build_random_model(model, shape, "bfloat16", seed=0)
    data = write_jsonl(reverse_task_rows(PROMPT_ROWS, PROMPT_TOKENS - 1, PROMPT_TOKENS - 1, seed=3),
                       work / "prompts.jsonl")
    return model, data


# ---------------------------------------------------------------- meshrl


def meshrl_config(name: str, model: Path, data: Path, steps: int, overrides: list[str] = ()) -> dict:
    """The run config of meshrl run ``name`` (verl's keys), ``overrides`` applied."""
    from services.common.config import apply_overrides

    run = RUNS[name]
    return apply_overrides({
        "data": {"train_files": [str(data)], "train_batch_size": PROMPTS, "max_prompt_length": PROMPT_TOKENS,
                 "max_response_length": RESPONSE_TOKENS},
        "actor_rollout_ref": {
            "model": {"path": str(model), "dtype": "bfloat16", "enable_gradient_checkpointing": run.checkpointing,
                      **({"lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": "all-linear",
                          "lora": {"merge": run.merge}} if run.lora else {})},
            "actor": {"optim": {"lr": LR}, "ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_gpu": MICRO_BATCH,
                      "use_kl_loss": False},
            "rollout": {"name": "vllm", "n": SAMPLES, "free_cache_engine": run.sleep},
        },
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "trainer": {"total_training_steps": steps, "experiment_name": f"grpo-step-{name}", "logger": ["console"],
                    "test_freq": -1, "val_before_train": False, "save_freq": 0,
                    "async_": {"max_staleness": run.max_staleness}},
    }, list(overrides))


def meshrl_services(layout: str, rollout_settings: tuple[str, ...] = ()) -> tuple:
    """The services of a layout (besides the coordinator): the trainer on GPU 0, vLLM rollouts (with
    ``rollout_settings`` added), a reward."""
    from services.coordctl.local import ServiceSpec

    def on(gpu: int) -> tuple:
        return (("CUDA_VISIBLE_DEVICES", str(gpu)),)

    vllm = ("engine=vllm", f"gpu_memory_utilization={VLLM_SHARE}", *rollout_settings)
    asleep = ServiceSpec(kind="rollout", settings=(*vllm, "enable_sleep_mode=true"), env=on(0))
    rollouts = {"colocated": (ServiceSpec(kind="rollout", settings=vllm, env=on(0)),),
                "colocated-sleep": (asleep,),
                "split": (ServiceSpec(kind="rollout", settings=vllm, env=on(1)),),
                "every-gpu": (asleep, ServiceSpec(kind="rollout", settings=vllm, env=on(1)))}[layout]
    return (ServiceSpec(kind="trainer", settings=("device=cuda",), env=on(0)), *rollouts, ServiceSpec(kind="reward"))


def unavailable(name: str, gpus: int) -> str | None:
    """Why run ``name`` cannot run here (None: it can)."""
    if RUNS[name].gpus > gpus:
        needed = RUNS[name].gpus
        return f"needs {needed} GPU{'s' if needed > 1 else ''}, this machine has {gpus}"
    return None


def run_meshrl(names: list[str], work: Path, model: Path, data: Path, steps: int, timeout_s: float,
               overrides: list[str], rollout_settings: tuple[str, ...] = ()) -> dict[str, dict]:
    """Runs ``names`` (one layout) one after the other on one cluster of services, started once."""
    from services.coordctl.control import CoordinatorClient
    from services.coordctl.local import LocalCluster

    layout = RUNS[names[0]].layout
    cluster = LocalCluster(work / f"state-{layout}-{time.strftime('%Y%m%d-%H%M%S')}",
                           meshrl_services(layout, rollout_settings))
    labels = [*overrides, *(f"rollout {setting}" for setting in rollout_settings)]

    async def all_runs() -> dict[str, dict]:
        await cluster.start(timeout_s=180)
        client = CoordinatorClient(cluster.coordinator)
        try:
            return {name: await run_one(client, name, meshrl_config(name, model, data, steps, overrides), labels,
                                        timeout_s) for name in names}
        finally:
            await client.close()

    try:
        return asyncio.run(all_runs())
    finally:
        cluster.stop()
        wait_gpus_free()


async def run_one(client, name: str, config: dict, overrides: list[str], timeout_s: float) -> dict:
    """One meshrl run of ``config`` (``overrides`` applied) to its end, stopped after ``timeout_s``: its result."""
    import yaml

    result = {**stamp(name, config["trainer"]["async_"]["max_staleness"]), "overrides": overrides, "status": "failed",
              "steps": []}
    with GpuMemoryPeaks() as gpus:
        try:
            started = await client.start_run(yaml.safe_dump(config))
        except Exception as error:  # noqa: BLE001 - a refused config is this run's result; the next runs go on
            return {**result, "error": f"StartRun refused it: {getattr(error, 'details', lambda: error)()}",
                    "memory": {}}
        try:
            await asyncio.wait_for(follow(client, started.run_id), timeout_s)
            error = ""
        except TimeoutError:
            error = f"did not finish within {timeout_s:.0f} s (--run-timeout)"
            await client.stop_run(started.run_id)
    final = await client.get_run(started.run_id)
    metrics = Path(final.run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    error = error or (f"run ended {final.state}: {final.error}" if final.state != "finished" else "")
    return {**result, "status": "failed" if error else "ok", "error": error, "run_dir": final.run_dir,
            "steps": meshrl_steps(rows), "memory": gpus.peaks}


async def follow(client, run_id: str) -> None:
    async for _ in client.watch(run_id):
        pass


# ---------------------------------------------------------------- TRL


def trl_arguments(output_dir: Path, steps: int) -> dict:
    """GRPOConfig's arguments at the shape (TRL's defaults otherwise)."""
    return dict(output_dir=str(output_dir), report_to="none", save_strategy="no", max_steps=steps, seed=0,
                per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO_BATCH,
                num_generations=SAMPLES, max_completion_length=RESPONSE_TOKENS, learning_rate=LR,
                lr_scheduler_type="constant", beta=0.0, bf16=True, use_vllm=True, vllm_mode="colocate",
                vllm_gpu_memory_utilization=VLLM_SHARE, vllm_enable_sleep_mode=False)


def constant_reward(completions: list, **_) -> list[float]:
    return [0.0] * len(completions)


def trl_prompts(data: Path, tokenizer) -> list[str]:
    """The prompts as meshrl renders them (the same text, so the same 64 tokens)."""
    from services.run.data import read_rows, render_prompt

    return [render_prompt(row["prompt"], tokenizer) for _, row in read_rows(data)]


def trl_callback(recorder: StepRecorder, memory):
    """A TrainerCallback that feeds ``recorder`` each optimizer step, with ``memory()`` at its end; and TRL's
    profiled blocks go to the recorder too."""
    from transformers import TrainerCallback
    from trl.extras.profiling import ProfilingContext

    def record(context, seconds: float) -> None:
        recorder.profiled(context.name, context._start_time, seconds)

    ProfilingContext._log_metrics = record

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.begin(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            recorder.end(time.perf_counter(), memory())

    return Clock()


def run_trl_here(model: Path, data: Path, steps: int, output_dir: Path, result_file: Path,
                 lora: bool = False) -> None:
    """TRL's GRPOTrainer at the shape in this process, on its first GPU (with ``lora``, training a PEFT LoraConfig
    of LORA_RANK, LORA_ALPHA on every linear layer); each step it finished goes to ``result_file``, however it
    ends."""
    missing = [module for module in TRL_NEEDS if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"TRL's run cannot import {', '.join(missing)}: install the wheels the module docstring "
                         "lists into --trl-site")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda")
    before = torch.cuda.memory_allocated()
    vllm_held = 0.0

    def memory() -> dict[str, float]:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return {"trainer_allocated": peak - vllm_held, "rollout_allocated": vllm_held, "process_allocated": peak}

    recorder = StepRecorder()
    trainer = GRPOTrainer(model=policy, reward_funcs=constant_reward,
                          args=GRPOConfig(**trl_arguments(output_dir, steps)),
                          train_dataset=Dataset.from_dict({"prompt": trl_prompts(data, tokenizer)}),
                          processing_class=tokenizer, callbacks=[trl_callback(recorder, memory)],
                          peft_config=trl_lora_config() if lora else None)
    vllm_held = (torch.cuda.memory_allocated() - before) / 2**30  # its weights and KV cache
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        result_file.write_text(json.dumps({"steps": recorder.steps}))


def trl_lora_config():
    """PEFT's LoraConfig of the LoRA runs: LORA_RANK, LORA_ALPHA, every linear layer but the output layer."""
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0,
                      task_type="CAUSAL_LM")


def run_trl(name: str, work: Path, out: Path, steps: int, timeout_s: float, site: Path | None) -> dict[str, dict]:
    """TRL's run ``name`` (trl or trl-lora), or llm-generate, in a child process (this script with --trl-worker or
    --llm-generate-worker, its output in ``out``/<name>.log): its result, by run name."""
    result_file, log = work / f"{name}-result.json", out / f"{name}.log"
    result_file.unlink(missing_ok=True)
    path = [str(site)] if site else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "0",
           "PYTHONPATH": os.pathsep.join([*path, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    role = "--llm-generate-worker" if name == "llm-generate" else "--trl-worker"
    command = [sys.executable, str(Path(__file__).resolve()), role, str(result_file), "--work", str(work),
               "--steps", str(steps), "--out", str(work), *(["--trl-lora"] if RUNS[name].lora else [])]
    with GpuMemoryPeaks() as gpus, log.open("w") as output:
        child = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=timeout_s)
            error = "" if code == 0 else f"exited with code {code}; {log} ends:\n{log.read_text()[-1500:]}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            error = f"did not finish within {timeout_s:.0f} s (--run-timeout)"
    steps_done = json.loads(result_file.read_text())["steps"] if result_file.exists() else []
    wait_gpus_free()
    return {name: {**stamp(name, 0), "status": "failed" if error else "ok", "error": error, "steps": steps_done,
                   "memory": gpus.peaks}}


# ---------------------------------------------------------------- vLLM's own generation


def run_llm_generate_here(model: Path, data: Path, steps: int, result_file: Path) -> None:
    """``LLM.generate`` of the shape's batch ``steps`` times in this process (module docstring: llm-generate); each
    one's seconds go to ``result_file``."""
    from vllm import LLM, SamplingParams

    from services.run.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in trl_prompts(data, tokenizer)]
    llm = LLM(model=str(model), dtype="bfloat16", seed=0, gpu_memory_utilization=VLLM_SHARE, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs", max_num_seqs=1024, max_num_batched_tokens=8192)
    params = SamplingParams(n=SAMPLES, temperature=1.0, top_p=1.0, max_tokens=RESPONSE_TOKENS, logprobs=0,
                            stop_token_ids=[tokenizer.eos_token_id], detokenize=False)
    done = []
    for step in range(steps):
        batch = prompts[step * PROMPTS:(step + 1) * PROMPTS]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
        done.append({"step": step + 1, "seconds": seconds, "stages": {"gen": seconds}, "memory": {},
                     "tokens": tokens})
        result_file.write_text(json.dumps({"steps": done}))


# ---------------------------------------------------------------- the command


def run_all(names: list[str], args) -> None:
    from services.coordctl.tiny_model import QWEN25_SHAPES

    gpus = gpu_count()
    runnable = []
    for name in names:
        why = unavailable(name, gpus)
        if why:
            print(f"{name}: skipped: {why}", flush=True)
        else:
            runnable.append(name)
    if not runnable:
        return
    model, data = prepare_assets(args.work, QWEN25_SHAPES["0.5b"])
    args.out.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    for name in runnable:
        if name in done:
            continue
        together = [other for other in runnable if RUNS[other].layout == RUNS[name].layout] if RUNS[name].layout \
            else [name]
        try:
            batch = run_trl(name, args.work, args.out, args.steps, args.run_timeout, args.trl_site) \
                if not RUNS[name].layout else \
                run_meshrl(together, args.work, model, data, args.steps, args.run_timeout, args.overrides,
                           tuple(args.rollout_setting))
        except Exception as error:  # noqa: BLE001 - recorded as the runs' result; the other runs go on
            batch = {ran: {**stamp(ran, RUNS[ran].max_staleness), "status": "failed", "steps": [], "memory": {},
                           "error": f"{type(error).__name__}: {error}"} for ran in together}
        for ran, result in batch.items():
            (args.out / f"{ran}.json").write_text(json.dumps(result, indent=1))
            print(f"{ran}: {result['status']} {result['error']}".rstrip(), flush=True)
        done |= set(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="trl,colocated", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, required=True, help="folder of the results (<run>.json)")
    parser.add_argument("--report", action="store_true", help="run nothing: print the table of --out's results")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds a run may take, set-up included")
    parser.add_argument("--work", type=Path, default=ROOT / "meshrl-runs" / "grpo-step",
                        help="the model, prompts and run state")
    parser.add_argument("--trl-site", type=Path, help="folder with TRL and the wheels it needs (on the TRL child's "
                                                      "PYTHONPATH only)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)  # the trl run's child: its result file
    parser.add_argument("--trl-lora", action="store_true", help=argparse.SUPPRESS)  # that child trains LoRA
    parser.add_argument("--llm-generate-worker", type=Path, help=argparse.SUPPRESS)  # llm-generate's child
    parser.add_argument("--rollout-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a rollout service setting for every meshrl run (repeatable), e.g. "
                             "batched_seeded_sampling=true")
    parser.add_argument("overrides", nargs="*", help="key=value for every meshrl run's config")
    args = parser.parse_args()
    if args.llm_generate_worker:
        run_llm_generate_here(args.work / "model", args.work / "prompts.jsonl", args.steps, args.llm_generate_worker)
        return
    if args.trl_worker:
        run_trl_here(args.work / "model", args.work / "prompts.jsonl", args.steps, args.work / "trl", args.trl_worker,
                     lora=args.trl_lora)
        return
    if not args.report:
        names = args.runs.split(",")
        unknown = [name for name in names if name not in RUNS]
        if unknown:
            parser.error(f"--runs: unknown {', '.join(unknown)} (known: {', '.join(RUNS)})")
        run_all(names, args)
    print(report(load_results(args.out)))


if __name__ == "__main__":
    main()
