"""The reward service's Prometheus metrics (besides every service's: ``services/common/telemetry.py``)."""

from prometheus_client import Counter

from services.reward.scoring import SampleResult

OUTCOMES = ("scored", "failed", "timed_out")
SAMPLES = Counter("meshrl_reward_samples", "Samples this service was asked to score, by outcome: scored, failed "
                  "(an error: the sample is invalid), timed_out (a component ran past sample_timeout_s)", ["outcome"])
for _outcome in OUTCOMES:
    SAMPLES.labels(_outcome)  # each outcome is exported from the start, at 0


def outcome(result: SampleResult) -> str:
    """scored, timed_out or failed: a timeout is the error a component raised as TimeoutError."""
    if result.valid:
        return "scored"
    return "timed_out" if result.error.startswith("TimeoutError") else "failed"


def count(results: list[SampleResult]) -> None:
    for result in results:
        SAMPLES.labels(outcome(result)).inc()
