"""How a scored sample is counted: scored, failed or timed out."""

from services.reward.scoring import SampleResult
from services.reward.telemetry import outcome


def test_a_sample_is_scored_failed_or_timed_out():
    assert outcome(SampleResult(1.0, True, "", 0.1)) == "scored"
    assert outcome(SampleResult(0.0, False, "ValueError: compute_score returned None", 0.1)) == "failed"
    assert outcome(SampleResult(0.0, False, "TimeoutError: f.py:score did not return within 1.0 s", 1.0,
                                timed_out=True)) == "timed_out"
    assert outcome(SampleResult(0.0, True, "", 1.0, acc=False, timed_out=True)) == "timed_out"  # a rule's: scored 0
