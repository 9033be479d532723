"""The env service's Prometheus metrics (besides every service's: ``services/common/telemetry.py``)."""

from prometheus_client import Counter, Gauge

from services.env.environment import StepResult

EPISODES = Counter("meshrl_env_episodes", "Episodes opened by Reset")
OPEN_EPISODES = Gauge("meshrl_env_open_episodes", "Episodes open now (each holds a worker process)")
TOOL_CALLS = Counter("meshrl_env_tool_calls", "Tool calls answered, by tool and outcome: ok, error (malformed, "
                     "unknown tool, the tool raised or returned garbage; tool empty for a call that named none), "
                     "timed_out (past call_timeout_s: its worker was replaced)", ["tool", "outcome"])
STEP_FAILURES = Counter("meshrl_env_step_failures", "Steps whose worker timed out, died or reported an error")


def count_step(result: StepResult) -> None:
    for call in result.info.get("calls", []):
        TOOL_CALLS.labels(call["tool"], call["outcome"]).inc()
    if "error" in result.info:
        STEP_FAILURES.inc()
        if result.info["timed_out"] and result.info["tool"]:
            TOOL_CALLS.labels(result.info["tool"], "timed_out").inc()
