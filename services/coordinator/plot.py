"""The PNG a person looks at after a run: reward per step, and held-out validation where the run has it."""

from __future__ import annotations

from pathlib import Path


def validation_curves(steps: list[tuple[int, dict[str, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Each val-core mean (per data source and variable) over the steps that have it."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in steps:
        for key, value in metrics.items():
            if key.startswith("val-core/") and "/mean@" in key:
                curves.setdefault(key.removeprefix("val-core/"), []).append((step, value))
    return curves


def plot_reward(steps: list[tuple[int, dict[str, float]]], path: Path, title: str) -> Path | None:
    """Mean score per step, its 10-step moving average, and the validation curves; None when there is nothing
    to plot."""
    training = [(step, m["critic/score/mean"]) for step, m in steps if "critic/score/mean" in m]
    curves = validation_curves(steps)
    if not training and not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    if training:
        xs, mean = [step for step, _ in training], [value for _, value in training]
        window = 10
        smooth = [sum(mean[max(0, i - window + 1): i + 1]) / len(mean[max(0, i - window + 1): i + 1])
                  for i in range(len(mean))]
        axes.plot(xs, mean, alpha=0.35, label="mean reward of the step")
        axes.plot(xs, smooth, linewidth=2, label=f"{window}-step moving average")
    for name, points in sorted(curves.items()):
        axes.plot([s for s, _ in points], [v for _, v in points], marker="o", linewidth=1.5,
                  label=f"validation {name}")
    axes.set_xlabel("step")
    axes.set_ylabel("reward (critic/score), validation")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
