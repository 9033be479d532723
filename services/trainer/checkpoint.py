"""Checkpoints of a trainer's roles: weights and optimizer through torch.distributed.checkpoint, the LR
schedules and RNG states beside them.

Every rank calls ``save`` and ``load``: with FSDP each writes and reads its own
shards (DCP records the global shapes, so a checkpoint also loads on another
number of ranks). The folder must be one that every rank sees (one node, or a
shared file system). The LR schedules, shuffle generators and RNG state are
the same on every rank; rank 0 writes them.

An actor part way through its warm start (some of its steps taken, not all) also saves the warm start's own
optimizer state and schedule, which a resume's warm start goes on with; once the warm start is done they are
left out (nothing uses them again).

A LoRA role (a PEFT model) saves only what it trains, its adapters (and a LoRA
critic's value head) with their optimizer state: the frozen base is the run's
model folder, loaded again on resume. A LoRA actor whose warm start trains its
base (warm_start.full_weights) saves that base too: it is the model folder no
more. Each role's record says whether it is LoRA, and a checkpoint is refused
for a role trained the other way.

A checkpoint is written into ``<path>.tmp`` and renamed to ``<path>`` once
complete (by rank 0, after every rank's shards are written, with the signed
manifest of its files last: ``services.common.manifest``), so a crash
mid-save leaves the previous checkpoint as it was and no half-written one
under a checkpoint's name. A save replaces only a checkpoint of its own run
(its manifest says whose it is) and a staging folder its run left; a load
checks the manifest before anything in the folder is read.

A write that fails (a full or read-only disk) ends the save at once with
``CheckpointNotWritten`` naming the folder, the cause and the space left on
its disk, the partial folder removed; torch.distributed.checkpoint's own
``CheckpointException`` (a BaseException, which nothing above would catch)
becomes that too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

from services.common.errors import FailedPrecondition
from services.common.manifest import EXTRA, STAGING, read_manifest, verify, write_manifest
from services.run.lora import is_lora
from services.trainer.ranks import Ranks

if TYPE_CHECKING:
    from services.trainer.actor import Actor
    from services.trainer.critic import Critic



class CheckpointNotWritten(FailedPrecondition):
    """A save that failed to write (disk full, read-only, gone); nothing of it is left. ``errno``: the system's
    error number of the write that failed, where one did (the status carries it to the caller)."""

    def __init__(self, message: str, errno: int | None):
        super().__init__(message)
        self.errno = errno


def trainable(roles) -> dict[str, Actor | Critic]:
    return {name: role for name, role in (("actor", roles.actor), ("critic", roles.critic)) if role is not None}


def adapters_only(role: Actor | Critic) -> bool:
    """Whether a checkpoint of ``role`` holds only what it trains in RL, not its frozen base: a LoRA role, unless
    its warm start trains the base."""
    return is_lora(role.model) and not getattr(role, "trains_base", False)


def state_options(role: Actor | Critic) -> StateDictOptions:
    """What of a role's state a checkpoint holds: everything, or ``adapters_only``."""
    partial = adapters_only(role)
    return StateDictOptions(ignore_frozen_params=partial, strict=not partial)


def role_state(role: Actor | Critic) -> dict[str, Any]:
    """The role's model and optimizer state as its checkpoint holds them. For LoRA, the parameters it trains: a
    weight tied to a frozen one (the output layer of a model whose embeddings are tied) is left out too, which
    ``ignore_frozen_params`` alone keeps, the tie hiding it from the parameters it asks about."""
    model_state, optim_state = get_state_dict(role.model, role.optimizer.adamw, options=state_options(role))
    if adapters_only(role):
        trained = {name for name, parameter in role.model.named_parameters() if parameter.requires_grad}
        model_state = {name: tensor for name, tensor in model_state.items() if name in trained}
    return {"model": model_state, "optim": optim_state}


def warm_start_under_way(actor: Actor | None) -> bool:
    """Whether ``actor`` has taken some of its warm start's steps, not all."""
    return actor is not None and 0 < actor.warm_start.schedule.last_epoch < actor.warm_start.settings.total_steps


def warm_start_optim_state(actor: Actor) -> dict[str, Any]:
    with actor.warm_start_trainable():  # (what it trains requires gradients, as torch's state dicts expect)
        return get_optimizer_state_dict(actor.model, actor.warm_start.adamw, options=state_options(actor))


def staging_of(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def check_replaceable(path: Path, run_id: str, key: bytes) -> None:
    """Refuse (ValueError naming the folder) a save into ``path`` that would remove anything but a checkpoint of
    ``run_id`` or the staging folder of one of its saves."""
    if path.exists() and read_owner(path, key) != run_id:
        raise ValueError(f"path: {path} exists and is not a checkpoint of run {run_id}; a save replaces nothing "
                         "else (move it away or choose another path)")
    staging = staging_of(path)
    if staging.exists() and staging_owner(staging) != run_id:
        raise ValueError(f"path: {staging} exists and is not a checkpoint that run {run_id} was saving; a save "
                         "replaces nothing else")


def read_owner(path: Path, key: bytes) -> str | None:
    """The run whose checkpoint ``path`` is (by its signed manifest), or None."""
    try:
        return read_manifest(path, key)["run_id"] if path.is_dir() else None
    except ValueError:
        return None


def staging_owner(staging: Path) -> str | None:
    try:
        return json.loads((staging / STAGING).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(roles, path: Path, weight_version: int, *, ranks: Ranks, key: bytes) -> int:
    """Write the roles' state into ``path`` atomically; returns the bytes written (0 on ranks other than 0).
    ``check_replaceable`` has passed."""
    staging = staging_of(path)
    try:
        if ranks.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            (staging / STAGING).write_text(json.dumps({"run_id": roles.run_id}))
        ranks.barrier()
        state: dict[str, dict[str, Any]] = {}
        extra: dict[str, Any] = {"weight_version": weight_version, "torch_rng": torch.get_rng_state()}
        for name, role in trainable(roles).items():
            state[name] = role_state(role)
            extra[name] = {"schedule": role.optimizer.schedule.state_dict(), "shuffle": role.shuffle.get_state(),
                           "lora": is_lora(role.model)}
        if warm_start_under_way(roles.actor):
            state["actor"]["warm_start_optim"] = warm_start_optim_state(roles.actor)
            extra["actor"]["warm_start_schedule"] = roles.actor.warm_start.schedule.state_dict()
        dcp.save(state, checkpoint_id=staging)  # returns once every rank's shards and the metadata are written
        if ranks.rank != 0:
            return 0
        torch.save(extra, staging / EXTRA)
        (staging / STAGING).unlink()
        write_manifest(staging, roles.run_id, key)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except (CheckpointException, OSError, RuntimeError) as error:
        if ranks.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        refused = first_os_error(error)
        raise CheckpointNotWritten(f"the checkpoint was not written to {path}: {cause_of(error)}; "
                                   f"{free_space(path)}", refused.errno if refused else None) from None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def first_os_error(error: BaseException) -> OSError | None:
    """The first OSError under ``error`` with the system's words for it (a CheckpointException holds each
    rank's failure)."""
    failures = [failure for failure, _ in error.failures.values()] if isinstance(error, CheckpointException) else []
    candidate: BaseException | None
    for candidate in [error, *failures]:
        while candidate is not None:
            if isinstance(candidate, OSError) and candidate.strerror:
                return candidate
            candidate = candidate.__cause__ or candidate.__context__
    return None


def cause_of(error: BaseException) -> str:
    """What went wrong, in the system's words where an OSError is under ``error``."""
    refused = first_os_error(error)
    if refused is not None:
        return f"{refused.strerror}" + (f" ({refused.filename})" if refused.filename else "")
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def free_space(path: Path) -> str:
    """The space left on the disk that holds ``path`` (the nearest folder of it that exists)."""
    folder = next(parent for parent in [path, *path.parents] if parent.exists())
    free = shutil.disk_usage(folder).free
    return f"{free / 2**20:.1f} MiB free on the disk of {folder}"


def check_complete(roles, path: Path, key: bytes) -> dict:
    """The state saved beside the weights, once ``path``'s signed manifest matches its files (checked before
    anything in it is read; else DamagedCheckpoint naming the file) and it holds every role of ``roles``."""
    verify(path, key)
    return read_extra(roles, path)


def read_extra(roles, path: Path) -> dict:
    extra = torch.load(path / EXTRA, weights_only=True)
    for name, role in trainable(roles).items():
        if name not in extra:
            raise ValueError(f"checkpoint {path} holds no {name}")
        saved, now = extra[name].get("lora", False), is_lora(role.model)
        if saved != now:
            keys = "actor_rollout_ref.model" if name == "actor" else "critic.model"
            trained = {True: "LoRA adapters", False: "full weights"}
            raise ValueError(f"checkpoint {path} holds the {name}'s {trained[saved]}, and this run trains its "
                             f"{trained[now]} ({keys}.lora_rank): resume with the lora_rank the checkpoint was "
                             "saved with, or start a new run")
    return extra


def load(roles, path: Path) -> int:
    """Restore the roles from ``path`` (``check_complete`` has passed); returns the actor weight version saved
    there."""
    extra = read_extra(roles, path)
    state: dict[str, dict[str, Any]] = {}
    for name, role in trainable(roles).items():
        state[name] = role_state(role)
    warm_start = "actor" in state and "warm_start_schedule" in extra["actor"]  # saved part way through it
    if warm_start:
        state["actor"]["warm_start_optim"] = warm_start_optim_state(roles.actor)
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as error:
        raise ValueError(f"checkpoint {path} cannot be loaded: {cause_of(error)}") from None
    for name, role in trainable(roles).items():
        set_state_dict(role.model, role.optimizer.adamw, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"], options=state_options(role))
        role.optimizer.schedule.load_state_dict(extra[name]["schedule"])
        role.shuffle.set_state(extra[name]["shuffle"])
    if warm_start:
        with roles.actor.warm_start_trainable():
            set_optimizer_state_dict(roles.actor.model, roles.actor.warm_start.adamw,
                                     state["actor"]["warm_start_optim"], options=state_options(roles.actor))
        roles.actor.warm_start.schedule.load_state_dict(extra["actor"]["warm_start_schedule"])
    torch.set_rng_state(extra["torch_rng"])
    return extra["weight_version"]
