"""The reward service's Prometheus metrics (besides every service's: ``services/common/telemetry.py``)."""

from prometheus_client import Counter

from services.reward.scoring import SampleResult

OUTCOMES = ("scored", "failed", "timed_out")
SAMPLES = Counter("meshrl_reward_samples", "Samples this service was asked to score, by outcome: scored, failed "
                  "(an error: the sample is invalid), timed_out (a component ran past sample_timeout_s)", ["outcome"])
for _outcome in OUTCOMES:
    SAMPLES.labels(_outcome)  # each outcome is exported from the start, at 0


def outcome(result: SampleResult) -> str:
    """timed_out (a rule's sample that ran out of time still has a score, its failure value; a user function's is
    invalid), else scored or failed."""
    if result.timed_out:
        return "timed_out"
    return "scored" if result.valid else "failed"


def count(results: list[SampleResult]) -> None:
    for result in results:
        SAMPLES.labels(outcome(result)).inc()
