"""The rollout service's Prometheus metrics (besides every service's: ``services/common/telemetry.py``)."""

from prometheus_client import Counter, Gauge

GENERATED_TOKENS = Counter("meshrl_rollout_generated_tokens", "Response tokens this engine generated")
GENERATED_SEQUENCES = Counter("meshrl_rollout_generated_sequences", "Responses this engine generated")
REQUESTS_IN_FLIGHT = Gauge("meshrl_rollout_requests_in_flight", "Generate calls being served now")
