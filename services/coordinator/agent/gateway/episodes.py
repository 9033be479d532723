"""One trajectory of an agent environment: the user's agent runs on the env service, calling the run's gateway,
and what the gateway recorded becomes the trajectory's samples.

- The episode is opened (Reset, with the gateway's URL, the episode's key and the model's name) by the agent
  loop; one Step runs the agent to its end on the env service (services/env/agent_runner.py), bounded there by
  the environment's ``agent_timeout_s``. Its answer: the reward the agent returned (``reward_returned``), and how
  it ended (``agent_outcome``: ok, raised, timed_out).
- The key is taken back as the Step returns: a call still in flight is refused, and nothing more is recorded.
- Its samples are the recording's leaves (services/coordinator/agent/gateway/recorder.py), each trained with the
  trajectory's score: the reward the agent returned, else the reward service's score of its last completion. An
  episode that made no call, raised or timed out is failed (``agent/episodes_failed/<why>``): it scores 0, the
  calls it made train with that score, and one that made none is one sample of its prompt and a single masked token (it
  trains nothing and holds its place in its prompt's group), so the run goes on.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.coordinator.agent.agent_loop import AgentTrace, Ended, TurnDispatcher, TurnRecord
from services.coordinator.fleet.clients import EnvStep, RolloutClient
from services.coordinator.fleet.env_set import Episode
from services.coordinator.agent.gateway.recorder import EpisodeRecording
from services.coordinator.agent.turns import Trajectory, Turn, ids_text, render_prompt
from services.run.data import Prompt
from services.run.tool_calls import parse_tool_calls

OUTCOMES = ("ok", "raised", "timed_out")


@dataclass(kw_only=True)
class GatewayEpisode:
    """One open episode: its calls' turns go through ``dispatcher``, its completions into ``recording``."""

    key: str
    index: int  # its trajectory's index in the batch: its calls are seeded from it
    dispatcher: TurnDispatcher
    recording: EpisodeRecording
    seeds_used: int = 0
    replica: RolloutClient | None = None  # the replica of its last call (its prefix cache holds the conversation)
    rollouts: list[str] = field(default_factory=list)  # the replica of each completion recorded
    closed: bool = False
    recording_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a call's plan, and a call's answer and
    # its record: the next call of the episode plans from what was answered before it


def agent_samples(recorded: GatewayEpisode, tokenizer: Any, prompt: Prompt,
                  *, max_prompt_length: int) -> tuple[Trajectory, ...]:
    """The trajectory's samples: what its calls recorded, or the placeholder of an episode that made none."""
    return tuple(leaf.trajectory for leaf in recorded.recording.leaves) or (
        placeholder(tokenizer, prompt, max_prompt_length),)


def agent_outcome(step: EnvStep, calls: int) -> str:
    """How the agent's run ended: ok, raised, timed_out (its own deadline or its worker's), or no_calls."""
    outcome = str(step.info.get("agent_outcome", ""))
    if outcome not in OUTCOMES:  # its worker failed: the env service says why in error
        outcome = "timed_out" if step.info.get("timed_out") else "raised"
    return "no_calls" if outcome == "ok" and calls == 0 else outcome


def agent_score(step: EnvStep, outcome: str) -> float | None:
    """The trajectory's score where the agent decides it: what it returned, 0 where it failed; None: the reward
    service scores its last completion."""
    if outcome != "ok":
        return 0.0
    return float(step.reward) if step.info.get("reward_returned") else None


def placeholder(tokenizer: Any, prompt: Prompt, max_prompt_length: int) -> Trajectory:
    """The one sample of an episode that made no call: the prompt's messages rendered (cut to the prompt budget)
    and one masked pad token, which trains nothing."""
    prompt_ids = render_prompt(tokenizer, prompt.messages, {})[-max_prompt_length:]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Trajectory(prompt_ids=prompt_ids, max_response_length=1, response_ids=(int(pad),), loss_mask=(0,),
                      logprobs=(0.0,), turns=(Turn(role="reply", start=0, end=1, weight_version=None),))


def agent_trace(recorded: GatewayEpisode, step: EnvStep, outcome: str, *, episode: Episode,
                tokenizer: Any) -> AgentTrace:
    recording = recorded.recording
    records, calls = turn_records(recording, tokenizer)
    return AgentTrace(
        turns=tuple(records), final_text=recording.final_text, env_reward=0.0, episode_service=episode.service,
        rollouts=tuple(recorded.rollouts) or ("",), last_versions=tuple(
            leaf.last_version for leaf in recording.leaves) or (recorded.dispatcher.oldest,),
        ended=Ended(f"agent_{outcome}"), tool_calls=calls, tool_errors=Counter(), tool_timeouts=Counter(),
        env_seconds=episode.seconds, restarts=0, agent_outcome=outcome, agent_score=agent_score(step, outcome),
        gateway_calls=recording.calls, gateway_segments=recording.segments)


def turn_records(recording: EpisodeRecording, tokenizer: Any) -> tuple[list[TurnRecord], Counter]:
    """Each sample's turns, in order, as the samples file shows them (the model's, trained, and the replies'), and
    the tool calls the model's turns make, by tool: each model turn read from where it began, a forced opening
    (``tool_choice`` required or a named function: the reply turn before it, untrained) included."""
    records: list[TurnRecord] = []
    calls: Counter = Counter()
    for sample, leaf in enumerate(recording.leaves):
        trajectory, names = leaf.trajectory, frozenset(str(t["function"]["name"]) for t in leaf.tools)
        began = 0  # where the model's next turn began: at a forced opening before it, else where it starts
        for turn in trajectory.turns:
            ids = trajectory.response_ids[turn.start:turn.end]
            text = ids_text(tokenizer, ids, skip_special_tokens=True)
            records.append(TurnRecord(role=turn.role, text=text, tokens=len(ids), trained=turn.role == "model",
                                      weight_version=turn.weight_version, tool="", seconds=0.0, sample=sample))
            if turn.role == "model":
                said = ids_text(tokenizer, trajectory.response_ids[began:turn.end], skip_special_tokens=True) \
                    if began < turn.start else text
                parsed = parse_tool_calls(said, tool_names=names, max_parallel_calls=64, max_call_bytes=1 << 20)
                calls.update(getattr(call, "name", "(unparsed)") for call in parsed.calls)
            began = turn.start if turn.start in leaf.openings else turn.end
    return records, calls
