"""The GPU example as a user runs it, and whether it learned: run, export, evaluate, report.

    python bench/gpu_example.py [--config examples/gpu_arithmetic.yaml] [--out DIR] [--stage run|report]
                                [key=value ...]

1. ``coordctl start-run --local CONFIG`` (timed), the services on this machine's GPU;
2. ``coordctl export`` of the run's last checkpoint into a Hugging Face folder;
3. ``coordctl eval`` of that folder on the run's held-out file, with the run's validation sampling and seed,
   on a vLLM rollout (not yet for a multi-turn run such as examples/gpu_tools.yaml: eval calls tools since
   2026-12-05, on the CPU, and its env services would need this bench's worker settings; not tried on a GPU);
4. the warm start's loss lines, a table of every validation (step, weight version, accuracy, reward), then
   the figures: the held-out accuracy after the warm start and after GRPO, the gain in points, the wall time,
   and the exported model's accuracy under ``coordctl eval`` against the last validation's (a multi-turn run:
   turns, tool calls and scores of every tenth step instead).

``--stage run`` does step 1 alone and ``--stage report`` the rest, on the run kept in --out (for a machine that
gives each command at most 10 minutes). The run's metrics.jsonl, reward.png (reward per step and the validation
curves) and the eval's responses are copied into --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml


def coordctl(*args: str) -> str:
    """Run coordctl as a user would (its module, wherever the entry point is not installed); its output."""
    done = subprocess.run([sys.executable, "-m", "services.coordctl.cli", *args], text=True, capture_output=True)
    if done.returncode != 0:
        sys.exit(f"coordctl {args[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def export_and_evaluate(args: argparse.Namespace, run_dir: Path, config: dict, n: int) -> float:
    """Export the run's last checkpoint and score it with coordctl eval as the run validated; its accuracy."""
    val = config["actor_rollout_ref"]["rollout"]["val_kwargs"]
    exported = args.out / "exported"
    shutil.rmtree(exported, ignore_errors=True)
    print(coordctl("export", str(run_dir), str(exported)).strip())
    rollout = args.eval_rollout if args.eval_rollout is not None else \
        yaml.safe_load(Path(args.config).read_text())["local"]["services"]["rollout"]
    evaluated = coordctl(
        "eval", str(exported), "--local", "--state-dir", str(args.out / "eval-state"),
        *[arg for path in config["data"]["val_files"] for arg in ("--data", path)],
        "--n", str(n), "--temperature", str(val["temperature"] if val["do_sample"] else 0.0),
        "--max-response-length", str(config["data"]["max_response_length"]), "--out", str(args.out / "eval.jsonl"),
        f"data.max_prompt_length={config['data']['max_prompt_length']}", f"trainer.seed={config['trainer']['seed']}",
        f"local.services.rollout=[{','.join(rollout)}]")
    print(evaluated.strip())
    responses = [json.loads(line) for line in (args.out / "eval.jsonl").read_text().splitlines()]
    return sum(bool(r["acc"]) for r in responses) / len(responses)


def validation_key(validation: dict, ending: str) -> str:
    """The key of a validation's core metric ending in ``ending`` (its data source is the run's task: the run's
    config.yaml does not keep the local section that chose it)."""
    return next(key for key in validation if key.startswith("val-core/") and key.endswith(ending))


def print_trajectories(steps: list[dict]) -> None:
    """Every tenth step of a multi-turn run: turns and tool calls per trajectory, tool-call rate, mean score."""
    print(f"\n{'step':>5} {'turns':>6} {'tool calls':>10} {'call rate':>9} {'score':>6} {'step s':>7}")
    for m in steps[::10] + steps[-1:]:
        print(f"{m['step']:>5} {m['num_turns/mean']:>6.2f} {m['agent/tool_calls/mean']:>10.2f} "
              f"{m['agent/tool_call_rate']:>9.2f} {m['critic/score/mean']:>6.3f} {m['timing_s/step']:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "gpu_arithmetic.yaml"))
    parser.add_argument("--out", type=Path, default=Path("gpu-example"))
    parser.add_argument("--eval-rollout", nargs="*", default=None,
                        help="settings of eval's rollout service (default: the config's local.services.rollout)")
    parser.add_argument("--stage", choices=("all", "run", "report"), default="all")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    state_dir = args.out / "state"

    if args.stage != "report":
        started = time.monotonic()
        summary = coordctl("start-run", "--local", args.config, *args.overrides, "--state-dir", str(state_dir))
        (args.out / "run.json").write_text(json.dumps({"seconds": time.monotonic() - started, "summary": summary}))
        if args.stage == "run":
            print(summary[summary.find("run        "):])
            return
    kept = json.loads((args.out / "run.json").read_text())
    run_seconds, summary = kept["seconds"], kept["summary"]
    print("\n".join(part[part.find("warm start "):].strip() for line in summary.splitlines()
                    for part in line.split("\r") if "warm start " in part))  # from under the progress bar
    print(summary[summary.find("run        "):])
    [run_dir] = sorted((state_dir / "runs").iterdir())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    n = config["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [line for line in lines if "val/weight_version" in line]
    acc, reward = (validation_key(validations[0], f"/{name}/mean@{n}") for name in ("acc", "reward"))

    eval_acc = None if config["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"] else \
        export_and_evaluate(args, run_dir, config, n)
    for name in ("metrics.jsonl", "reward.png"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, args.out / name)

    print(f"\n{'step':>5} {'version':>8} {'acc mean@' + str(n):>12} {'reward mean@' + str(n):>15} {'testing s':>10}")
    for v in validations:
        print(f"{v['step']:>5} {int(v['val/weight_version']):>8} {v[acc]:>12.3f} "
              f"{v[reward]:>15.3f} {v['timing_s/testing']:>10.2f}")
    if eval_acc is None:
        print_trajectories([line for line in lines if "num_turns/mean" in line])
    first, last = validations[0][acc], validations[-1][acc]
    print(f"\nrun wall time {run_seconds:.0f} s (services started, warm start, {len(lines) - len(validations)} GRPO "
          f"steps, {len(validations)} validations)")
    if eval_acc is not None:
        print(f"exported model under coordctl eval: acc {eval_acc:.3f} (last validation {last:.3f})")
    print(f"held-out acc mean@{n}: warm start {first:.3f} -> after GRPO {last:.3f}: {100 * (last - first):+.1f} points")


if __name__ == "__main__":
    main()
