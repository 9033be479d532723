"""Each step's samples with their lineage: what trainer.rollout_data_dir keeps, one JSON line per response.

Choices:
- verl's file and keys first: ``<rollout_data_dir>/<step>.jsonl`` with ``input``, ``output``, ``gts``,
  ``score`` and ``step`` per response, so that what reads verl's dumps reads these.
- Then where the response came from: the weight versions that sampled its first and its last token
  (``weight_version`` and ``last_weight_version``: they differ where new weights were swapped in while it
  was sampled, partial_rollout keep) and its staleness (the versions between the first and the weights the
  update started from), the rollout replica that generated it, the reward service that scored it (id and
  address), the parts of its score (each component's name, weight and value), and its advantage.
- A response's advantage is the mean over its response tokens: every token's own for the outcome estimators
  (GRPO, RLOO, REINFORCE++), the average of GAE's per-token ones.
- ``group`` numbers the step's prompts: the responses of one prompt (one GRPO group) share it.
- A multi-turn trajectory's ``output`` is its final model turn (what the reward service scored), its
  ``score`` that score plus its weighted environment rewards (``env_reward`` unweighted); ``turns``
  lists every turn: the model's (trained, with the weight version that sampled it) and the tools' or
  environment's replies (not trained, with the tool that answered and the seconds the step took), each with
  the ``sample`` it is in.
- A trajectory that went on in new samples (its template could not extend it) has one record per sample,
  each with ``trajectory_sample`` (0, 1, ...) of ``trajectory_samples``, its own tokens' length, versions and
  advantage, and the trajectory's output, score and turns.
"""

from __future__ import annotations

import torch

from services.coordinator.agent.agent_loop import AgentTrace
from services.coordinator.step.generation import Rollouts


def step_records(step: int, rollouts: Rollouts, served: int, *, advantages: torch.Tensor) -> list[dict]:
    """One record per response of a step's scored ``rollouts``, trained from weight version ``served``;
    ``advantages`` [T] over their response tokens."""
    lens, groups, trajectory_ids = rollouts.batch.response_lens, rollouts.group_ids, rollouts.trajectory_ids
    first_rows, last_rows = rollouts.first_rows, rollouts.last_rows
    per_token = torch.split(advantages.float(), lens.tolist())
    records = []
    for row, origin in enumerate(rollouts.lineage):
        trajectory = int(trajectory_ids[row])
        first, last = int(first_rows[trajectory]), int(last_rows[trajectory])
        sample, scored, by = origin.sample, origin.scored, origin.scored_by
        if sample is None or scored is None or by is None:
            raise ValueError(f"step {step}: response {row} has no score to keep (its lineage was not scored)")
        version = int(rollouts.versions[row])
        records.append({
            "step": step, "input": sample.prompt, "output": sample.response, "gts": sample.ground_truth,
            "score": float(rollouts.scores[row]), "data_source": sample.data_source, "acc": scored.acc,
            "pred": scored.pred, "valid": scored.valid, "error": scored.error,
            "reward_components": [{"name": name, "weight": weight, "value": value}
                                  for name, weight, value in scored.components],
            "weight_version": version, "last_weight_version": int(rollouts.last_versions[row]),
            "staleness": served - version,
            "rollout": origin.rollout, "reward_service": by.service_id, "reward_address": by.address,
            "advantage": float(per_token[row].mean()) if len(per_token[row]) else 0.0,
            "response_length": int(lens[row]), "truncated": bool(rollouts.truncated[row]),
            "group": int(groups[row]),
        } | trajectory_fields(origin.trace, row - first, last - first + 1))
    return records


def trajectory_fields(trace: AgentTrace | None, sample: int, samples: int) -> dict:
    """A trajectory's turns (role, text, token count, trained or not, weight version, tool, seconds, the sample
    they are in), how it ended, its episode's env replica and rewards, and which of its ``samples`` this
    record's is; nothing for a single-turn response."""
    if trace is None:
        return {}
    return {"num_turns": len(trace.turns), "ended": trace.ended, "env_service": trace.episode_service,
            "env_reward": trace.env_reward, "restarts": trace.restarts,
            "trajectory_sample": sample, "trajectory_samples": samples,
            "turns": [{"role": turn.role, "text": turn.text, "tokens": turn.tokens, "trained": turn.trained,
                       "weight_version": turn.weight_version, "tool": turn.tool, "seconds": round(turn.seconds, 4),
                       "sample": turn.sample}
                      for turn in trace.turns]}
