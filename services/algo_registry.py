"""Advantage estimators and policy losses, found by name: the one place a run's ``algorithm.adv_estimator`` and
``actor_rollout_ref.actor.policy_loss.loss_mode`` are looked up.

Choices, stated before the code:

- An estimator or a loss is a pure function of a fixed, typed shape (tensors in a NamedTuple and plain
  parameters in, a NamedTuple with the result and its metrics out), registered under its name by a decorator:
  ``@register_adv_est("name")`` or ``@register_policy_loss("name", loss_agg_mode=...)``. The built-ins
  (``services/estimators.py``, ``services/policy_losses.py``) register themselves exactly as a user's do.
- Estimators run in the coordinator, losses in the trainer. A user's module is named by the service's own
  config (the coordinator's ``adv_estimator_modules``, the trainer's ``policy_loss_modules``) and imported once
  at its start: a run config, which any token holder may send, names an algorithm, never code.
- A name registered twice (a user's module reusing a built-in's name) refuses the service at its start.
- Looking up a name that is not registered is a ValueError naming the config key and every registered name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch

from services.algo_names import LOSS_AGG_MODES
from services.algos import Advantages, LossScale



# ---------------------------------------------------------------- the shapes a user's function takes and returns


class EstimatorInputs(NamedTuple):
    """What an advantage estimator gets of a batch of B responses with T response tokens in all (flat, see
    ``services/algos.py``)."""

    rewards: torch.Tensor  # [T] token rewards: each response's score on its last model token, minus the KL
    # penalty on every model token when it goes into the reward
    lengths: torch.Tensor  # [B] response lengths
    group_ids: torch.Tensor  # [B] int64: responses to the same prompt share an id
    mask: torch.Tensor | None  # [T] bool loss mask (False on tool and environment tokens); None: every token trains
    values: torch.Tensor | None  # [T] the critic's values; None where the run has no critic
    baselines: torch.Tensor | None  # [B] the score of the greedy response to each response's prompt (remax);
    # None where the run does not generate them


class EstimatorParams(NamedTuple):
    """The run's ``algorithm`` parameters an estimator may use."""

    gamma: float
    lam: float
    norm_by_std: bool  # algorithm.norm_adv_by_std_in_grpo


class PolicyLossInputs(NamedTuple):
    """What a policy loss gets of one micro-batch: flat [T] token tensors and lengths [B]."""

    logprobs: torch.Tensor  # [T] under the weights being trained (carries the gradient)
    old_logprobs: torch.Tensor  # [T] pi_old's, detached
    advantages: torch.Tensor  # [T]
    lengths: torch.Tensor  # [B]
    mask: torch.Tensor | None  # [T] bool loss mask: masked tokens carry no loss and count in no statistic
    is_weights: torch.Tensor | None  # [T] detached rollout-correction weights on each token's loss; None: off


class PolicyLossParams(NamedTuple):
    """The actor's settings a policy loss may use (verl's names)."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None  # dual-clip bound (None: off)
    loss_agg_mode: str  # how per-token losses become one number (``algos.aggregate``)
    scale: LossScale  # the mini-batch's divisors: a micro-batch's loss and metrics are its shares of them
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar: this micro-batch's share of the mini-batch loss
    metrics: Mapping[str, float]  # verl's names (actor/pg_clipfrac, ...): this micro-batch's share of each
    # mini-batch token mean (a sum over its trained tokens / scale.num_tokens), so micro-batches add up


EstimatorFn = Callable[[EstimatorInputs, EstimatorParams], Advantages]
PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossParams], PolicyLossOutput]


@dataclass(frozen=True)
class Registered:
    fn: Callable  # the registered function


@dataclass(frozen=True)
class RegisteredEstimator(Registered):
    fn: EstimatorFn
    greedy_baseline: bool  # the coordinator generates and scores a greedy response to each prompt (baselines)


@dataclass(frozen=True)
class RegisteredLoss(Registered):
    fn: PolicyLossFn
    loss_agg_mode: str  # the aggregation its paper prescribes: the default when actor.loss_agg_mode is null


# ---------------------------------------------------------------- registries

T = TypeVar("T", bound=Registered)



class Registry(Generic[T]):
    """Names -> entries, filled by decorators; the built-ins' module is imported on first use."""

    def __init__(self, what: str, key: str, builtins: str):
        self.what, self.key, self.builtins = what, key, builtins
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if not name.isidentifier():
            raise ValueError(f"{self.what} name {name!r} must be a Python identifier (letters, digits, _)")
        held = self._entries.get(name)
        if held is not None and held.fn is not entry.fn:
            raise ValueError(f"{self.what} {name!r} is registered already (by {describe(held.fn)}); "
                             f"{describe(entry.fn)} must take another name")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        """The entry of ``name``; ValueError naming the config key and every registered name otherwise."""
        self.load_builtins()
        if name not in self._entries:
            raise ValueError(f"{self.key}={name!r}: no {self.what} of that name is registered; registered: "
                             f"{', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        self.load_builtins()
        return tuple(self._entries)

    def load_builtins(self) -> None:
        """Register the built-ins (once: later imports are cached). A service does this before it imports its
        users' modules, so that a user's module reusing a built-in's name is the one refused."""
        importlib.import_module(self.builtins)


def describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


ADV_ESTIMATORS: Registry[RegisteredEstimator] = Registry("advantage estimator", "algorithm.adv_estimator",
                                                 "services.estimators")
POLICY_LOSSES: Registry[RegisteredLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode",
                                                   "services.policy_losses")


def register_adv_est(name: str, greedy_baseline: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register an advantage estimator under ``name`` (the value of algorithm.adv_estimator that chooses it);
    with ``greedy_baseline`` its inputs carry the score of a greedy response to each prompt (``baselines``),
    which the coordinator generates beside the sampled ones."""

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        ADV_ESTIMATORS.add(name, RegisteredEstimator(fn, greedy_baseline))
        return fn

    return decorator


def register_policy_loss(name: str, loss_agg_mode: str = "token-mean") -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name`` (the value of actor_rollout_ref.actor.policy_loss.loss_mode that
    chooses it), with the ``loss_agg_mode`` it uses where the run leaves actor.loss_agg_mode null."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"policy loss {name!r}: loss_agg_mode {loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, RegisteredLoss(fn, loss_agg_mode))
        return fn

    return decorator
