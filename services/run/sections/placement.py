"""The placement section (meshrl's own; verl places its workers with Ray): which service group hosts each role."""

from __future__ import annotations

from services.common.config import Section


class PlacementConfig(Section):
    """Which service group hosts each role; roles placed in the same trainer group share one trainer service."""

    actor: str = "default"
    """Group (a trainer service's ``group`` setting) of the trainer that hosts the actor; the run uses the
    first trainer of that group that is up."""
    critic: str = "default"
    """Group of the trainer that hosts the critic, when the run has one (critic.enable, or gae)."""
    ref: str = "default"
    """Group of the trainer that hosts the reference policy, when the run has one (use_kl_loss or
    use_kl_in_reward)."""
    rollout: str = "default"
    """Group of the rollout services: every one up in it generates for the run, followed at each step
    boundary as they come and go."""
    reward: str = "default"
    """Group of the reward services: every one up in it scores. SetReward can move a running run to another
    group, or one address, from the next step boundary."""
    env: str = "default"
    """Group of the env services that run a multi-turn run's episodes (actor_rollout_ref.rollout.multi_turn):
    every one up in it, followed at each step boundary as they come and go. SetEnv (coordctl env set) can move a
    running run to another group, or one address, from the next step boundary."""
