"""Checkpoints of a trainer's roles: weights and optimizer through torch.distributed.checkpoint (so the same
code serves FSDP shards later), the LR schedules and RNG states beside them.

A checkpoint is written into ``<path>.tmp`` and renamed to ``<path>`` once
complete, so a crash mid-save leaves the previous checkpoint as it was and
no half-written one under a checkpoint's name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

EXTRA = "trainer_state.pt"


def trainable(roles) -> dict[str, object]:
    return {name: role for name, role in (("actor", roles.actor), ("critic", roles.critic)) if role is not None}


def save(roles, path: Path, weight_version: int) -> int:
    """Write the roles' state into ``path`` atomically; returns the bytes written."""
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state, extra = {}, {"weight_version": weight_version, "torch_rng": torch.get_rng_state()}
    for name, role in trainable(roles).items():
        model_state, optim_state = get_state_dict(role.model, role.optimizer.adamw)
        state[name] = {"model": model_state, "optim": optim_state}
        extra[name] = {"schedule": role.optimizer.schedule.state_dict(), "shuffle": role.shuffle.get_state()}
    dcp.save(state, checkpoint_id=staging)
    torch.save(extra, staging / EXTRA)
    if path.exists():
        shutil.rmtree(path)
    staging.rename(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load(roles, path: Path) -> int:
    """Restore the roles from ``path``; returns the actor weight version saved there."""
    if not (path / EXTRA).exists():
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    extra = torch.load(path / EXTRA, weights_only=True)
    state = {}
    for name, role in trainable(roles).items():
        if name not in extra:
            raise ValueError(f"checkpoint {path} holds no {name}")
        model_state, optim_state = get_state_dict(role.model, role.optimizer.adamw)
        state[name] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    for name, role in trainable(roles).items():
        set_state_dict(role.model, role.optimizer.adamw, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"])
        role.optimizer.schedule.load_state_dict(extra[name]["schedule"])
        role.shuffle.set_state(extra[name]["shuffle"])
    torch.set_rng_state(extra["torch_rng"])
    return extra["weight_version"]
