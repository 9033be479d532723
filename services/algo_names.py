"""The names a run config picks the RL math's built-in choices by: loss aggregation modes, KL estimators, and
the rollout correction's levels and modes; one list each, read by the math (``services/algos.py``) and by the
config sections that validate a run (``services/run/sections``). No torch here: a config loads without it.

Each is a ``Literal`` (the type of a config field, which pydantic checks and names in its refusal) and the tuple
of its names (what the math checks its arguments against)."""

from __future__ import annotations

from typing import Literal, get_args

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
RolloutISLevel = Literal["token", "sequence"]
RolloutISMode = Literal["truncate", "mask"]

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
ROLLOUT_IS_LEVELS: tuple[str, ...] = get_args(RolloutISLevel)
ROLLOUT_IS_MODES: tuple[str, ...] = get_args(RolloutISMode)
