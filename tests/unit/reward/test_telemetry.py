"""How a scored sample is counted: scored, failed or timed out."""

from services.reward.scoring import SampleResult
from services.reward.telemetry import outcome


def test_a_sample_is_scored_failed_or_timed_out():
    assert outcome(SampleResult(score=1.0, valid=True, error="", seconds=0.1)) == "scored"
    assert outcome(SampleResult(score=0.0, valid=False, error="ValueError: compute_score returned None",
                                seconds=0.1)) == "failed"
    assert outcome(SampleResult(score=0.0, valid=False, error="TimeoutError: f.py:score did not return within 1.0 s",
                                seconds=1.0,
                                timed_out=True)) == "timed_out"
    assert outcome(SampleResult(score=0.0, valid=True, error="", seconds=1.0, acc=False,
                                timed_out=True)) == "timed_out"  # a rule's: scored 0
