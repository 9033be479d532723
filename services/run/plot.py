"""PNGs of a run's metrics: reward.png, which the coordinator draws at a run's end (reward per step and held-out
validation), and any metrics over the steps (``coordctl plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Steps = list[tuple[int, dict[str, float]]]  # (step, its metrics), by step


def validation_curves(steps: Steps) -> dict[str, list[tuple[int, float]]]:
    """Each val-core mean (per data source and variable) over the steps that have it."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in steps:
        for key, value in metrics.items():
            if key.startswith("val-core/") and "/mean@" in key:
                curves.setdefault(key.removeprefix("val-core/"), []).append((step, value))
    return curves


def curve(steps: Steps, key: str) -> list[tuple[int, float]]:
    """``key``'s value over the steps that have it."""
    return [(step, metrics[key]) for step, metrics in steps if key in metrics]


def axes_for(title: str, ylabel: str) -> tuple[Figure, Axes]:
    """A figure of the size every plot has, and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    return figure, axes


def save(figure: Figure, axes: Axes, path: Path) -> Path:
    import matplotlib.pyplot as plt

    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_reward(steps: Steps, path: Path, title: str) -> Path | None:
    """Mean score per step, its 10-step moving average, and the validation curves; None when there is nothing
    to plot."""
    training = curve(steps, "critic/score/mean")
    curves = validation_curves(steps)
    if not training and not curves:
        return None
    figure, axes = axes_for(title, "reward (critic/score), validation")
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
    return save(figure, axes, path)


AGENT_CURVES = ["num_turns/mean", "agent/tool_call_rate", "agent/tool_calls/mean"]
"""What agent.png shows of a multi-turn run: turns per trajectory, the share that called a tool, calls per
trajectory."""


def plot_run(steps: Steps, folder: Path, title: str) -> list[Path]:
    """A run's plots in its folder: reward.png, and agent.png for a multi-turn run; those drawn."""
    drawn = [plot_reward(steps, folder / "reward.png", title),
             plot_metrics(steps, AGENT_CURVES, folder / "agent.png", title=f"{title}: turns and tool calls")]
    return [path for path in drawn if path is not None]


def plot_metrics(steps: Steps, keys: list[str], path: Path, *, title: str) -> Path | None:
    """Each of ``keys`` over the steps that have it, one line each (with markers where a metric has few points,
    as validations do); None when none of them has a value."""
    curves = {key: curve(steps, key) for key in keys}
    if not any(curves.values()):
        return None
    figure, axes = axes_for(title, keys[0] if len(keys) == 1 else "value")
    for key, points in curves.items():
        if points:
            axes.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) <= 20 else None,
                      markersize=3, label=key)
    return save(figure, axes, path)
