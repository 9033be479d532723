"""The PNG a person looks at after a run: reward per step."""

from __future__ import annotations

from pathlib import Path


def plot_reward(steps: list[tuple[int, dict[str, float]]], path: Path, title: str) -> Path | None:
    """Mean score per step and its 10-step moving average; None when there is nothing to plot."""
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [step for step, _ in steps]
    mean = [m.get("critic/score/mean", float("nan")) for _, m in steps]
    window = 10
    smooth = [sum(mean[max(0, i - window + 1) : i + 1]) / len(mean[max(0, i - window + 1) : i + 1]) for i in range(len(mean))]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(xs, mean, alpha=0.35, label="mean reward of the step")
    axes.plot(xs, smooth, linewidth=2, label=f"{window}-step moving average")
    axes.set_xlabel("step")
    axes.set_ylabel("reward (critic/score)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
