"""Checkpoints of a trainer's roles: weights and optimizer through torch.distributed.checkpoint, the LR
schedules and RNG states beside them.

Every rank calls ``save`` and ``load``: with FSDP each writes and reads its own
shards (DCP records the global shapes, so a checkpoint also loads on another
number of ranks). The folder must be one that every rank sees (one node, or a
shared file system). The LR schedules, shuffle generators and RNG state are
the same on every rank; rank 0 writes them.

A checkpoint is written into ``<path>.tmp`` and renamed to ``<path>`` once
complete (by rank 0, after every rank's shards are written), so a crash
mid-save leaves the previous checkpoint as it was and no half-written one
under a checkpoint's name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from services.trainer.ranks import Ranks

EXTRA = "trainer_state.pt"


def trainable(roles) -> dict[str, object]:
    return {name: role for name, role in (("actor", roles.actor), ("critic", roles.critic)) if role is not None}


def save(roles, path: Path, weight_version: int, ranks: Ranks) -> int:
    """Write the roles' state into ``path`` atomically; returns the bytes written (0 on ranks other than 0)."""
    staging = path.with_name(path.name + ".tmp")
    if ranks.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    ranks.barrier()
    state, extra = {}, {"weight_version": weight_version, "torch_rng": torch.get_rng_state()}
    for name, role in trainable(roles).items():
        model_state, optim_state = get_state_dict(role.model, role.optimizer.adamw)
        state[name] = {"model": model_state, "optim": optim_state}
        extra[name] = {"schedule": role.optimizer.schedule.state_dict(), "shuffle": role.shuffle.get_state()}
    dcp.save(state, checkpoint_id=staging)  # returns once every rank's shards and the metadata are written
    if ranks.rank != 0:
        return 0
    torch.save(extra, staging / EXTRA)
    if path.exists():
        shutil.rmtree(path)
    staging.rename(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_complete(roles, path: Path) -> dict:
    """The state saved beside the weights, once ``path`` is known to hold a complete checkpoint of the roles."""
    if not (path / EXTRA).exists():
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    extra = torch.load(path / EXTRA, weights_only=True)
    for name in trainable(roles):
        if name not in extra:
            raise ValueError(f"checkpoint {path} holds no {name}")
    return extra


def load(roles, path: Path) -> int:
    """Restore the roles from ``path``; returns the actor weight version saved there."""
    extra = check_complete(roles, path)
    state = {}
    for name, role in trainable(roles).items():
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
