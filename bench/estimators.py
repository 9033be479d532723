"""Each advantage estimator on the local synthetic task, same seed, same services.

One local cluster (coordinator, trainer, rollout, reward) serves the runs one
after another. Prints the mean reward (10-step moving average) at fixed steps
for each estimator, the reference being the warm-start level every run
starts from (step 1), and writes one plot of all curves.

    python bench/estimators.py [--steps 200] [--out bench/results/estimators.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from services.common.config import to_yaml
from services.coordctl.resolve import resolve_config
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ESTIMATORS = {
    "gae": [str(EXAMPLES / "local_ppo.yaml")],
    "grpo": ["algorithm.adv_estimator=grpo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
}
WINDOW = 10


async def run_all(steps: int, state_dir: Path) -> dict[str, list[float]]:
    cluster = LocalCluster(state_dir)
    curves = {}
    try:
        await cluster.start()
        client = CoordinatorClient(cluster.coordinator)
        for name, args in ESTIMATORS.items():
            config, _ = resolve_config(args + [f"trainer.total_training_steps={steps}",
                                               f"trainer.experiment_name=bench-{name}", "trainer.test_freq=-1",
                                               "trainer.val_before_train=false"], local=True)
            run = await client.start_run(to_yaml(config))
            async for _ in client.watch(run.run_id):
                pass
            final = await client.get_run(run.run_id)
            if final.state != "finished":
                raise RuntimeError(f"{name}: run {final.state}: {final.error}")
            lines = (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()
            curves[name] = [json.loads(line)["critic/score/mean"] for line in lines]
            print(f"{name}: done", flush=True)
        await client.close()
    finally:
        cluster.stop()
    return curves


def moving_average(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1): i + 1]) / len(values[max(0, i - WINDOW + 1): i + 1])
            for i in range(len(values))]


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, rewards in curves.items():
        axes.plot(range(1, len(rewards) + 1), moving_average(rewards), label=name)
    axes.set_xlabel("step")
    axes.set_ylabel(f"mean reward ({WINDOW}-step moving average)")
    axes.set_title("advantage estimators, local synthetic task, same seed")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/estimators.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = asyncio.run(run_all(args.steps, Path(tmp)))
    plot(curves, args.out)
    marks = [m for m in (25, 50, 100, 150, 200, args.steps) if m <= args.steps]
    marks = sorted(set(marks))
    print(f"{'estimator':<30}" + "".join(f"{'step ' + str(m):>10}" for m in marks) + f"{'gain vs step 1':>16}")
    for name, rewards in curves.items():
        smooth = moving_average(rewards)
        print(f"{name:<30}" + "".join(f"{smooth[m - 1]:>10.3f}" for m in marks)
              + f"{smooth[-1] - rewards[0]:>+16.3f}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
