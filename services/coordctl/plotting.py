"""coordctl plot: which of a run's metrics to draw, from its metrics.jsonl, and the PNG each goes to (drawn by
services/run/plot.py, as the coordinator's reward.png is)."""

from __future__ import annotations

import difflib
import fnmatch
import re

DEFAULT_METRICS = ("critic/score/mean", "val-core/*/mean@*", "timing_s/*", "perf/throughput",
                   "training/off_policy/staleness/*")


def steps_of(lines: list[dict]) -> list[tuple[int, dict[str, float]]]:
    """metrics.jsonl's lines as (step, metrics) by step, a validation's line merged into its step's."""
    merged: dict[int, dict[str, float]] = {}
    for line in lines:
        metrics = {key: value for key, value in line.items() if isinstance(value, (int, float))}
        merged.setdefault(line["step"], {}).update({k: v for k, v in metrics.items() if k not in ("step", "time")})
    return sorted(merged.items())


def chosen_keys(wanted: str, known: set[str]) -> list[str]:
    """The metric ``wanted`` names (a name, or a pattern with * and ?), sorted; ValueError naming the closest
    metrics when it names none."""
    keys = sorted(fnmatch.filter(known, wanted)) if any(c in wanted for c in "*?[") else [wanted] * (wanted in known)
    if not keys:
        close = difflib.get_close_matches(wanted, sorted(known), n=4, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `coordctl status RUN` lists the last step's"
        raise ValueError(f"the run has no metric {wanted!r}{hint}")
    return keys


def plotted(wanted: list[str], known: set[str]) -> dict[str, list[str]]:
    """Each metric or pattern asked for -> the metrics it draws (ValueError for one that names none); none asked:
    those of DEFAULT_METRICS the run has."""
    if wanted:
        return {name: chosen_keys(name, known) for name in wanted}
    defaults = {name: sorted(fnmatch.filter(known, name)) for name in DEFAULT_METRICS}
    return {name: keys for name, keys in defaults.items() if keys}


def file_name(wanted: str) -> str:
    """The PNG's name for a metric or pattern: critic/score/mean -> critic_score_mean.png, timing_s/* ->
    timing_s_all.png."""
    return re.sub(r"[^A-Za-z0-9@.-]+", "_", wanted.replace("*", "all")).strip("_") + ".png"
