"""The trainer's ranks: one process per GPU, started by torchrun; rank 0 leads.

Rank 0 runs the gRPC server. It turns each model-work call into a command,
broadcasts it to the other ranks, then does the work itself, so every rank
does the same work in the same order (FSDP's collectives demand it). A
command travels as:

1. the header's length (int64 [1]) on the command group, which waits without
   a deadline: an idle trainer waits for its next call; when rank 0 dies its
   sockets close and the wait fails at once;
2. the header: JSON ``{op, args, tensors: [[name, dtype, shape], ...]}`` as uint8;
3. each tensor's bytes, in the header's order.

Steps 2-3, the results gathered back (``gather``, ``sum_metrics``) and
barriers go over a CPU gloo group with the collective deadline. The models'
own collectives (FSDP) use the default group: NCCL on GPU, gloo on CPU.

Without torchrun (no RANK and WORLD_SIZE in the environment) the trainer is
one rank and starts no process group.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from services.common.wire import DTYPE_NAMES, DTYPES

log = structlog.get_logger()
IDLE_WAIT = datetime.timedelta(days=365)  # "no deadline" for the wait between commands


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """This process's place among the trainer's ranks."""

    rank: int
    world_size: int
    device: torch.device  # where this rank computes (its GPU under torchrun)
    commands: dist.ProcessGroup | None = None  # gloo: the wait for rank 0's next command
    cpu: dist.ProcessGroup | None = None  # gloo, with the collective deadline: payloads, results, barriers

    @classmethod
    def single(cls, device: str | torch.device) -> Ranks:
        """One rank on its own, no process group."""
        return cls(rank=0, world_size=1, device=torch.device(device))

    @property
    def grad_scale(self) -> float:
        """FSDP averages gradients over the ranks; a loss multiplied by this sums them instead, so that N ranks'
        update equals one rank's update of the same mini-batch."""
        return float(self.world_size)

    def send_command(self, op: str, args: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0: broadcast one command to the other ranks."""
        entries = [[name, DTYPE_NAMES[t.dtype], list(t.shape)] for name, t in tensors.items()]
        header = json.dumps({"op": op, "args": args, "tensors": entries}).encode()
        dist.broadcast(torch.tensor([len(header)], dtype=torch.int64), src=0, group=self.commands)
        dist.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), src=0, group=self.cpu)
        for tensor in tensors.values():
            if tensor.numel():
                dist.broadcast(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8), src=0, group=self.cpu)

    def receive_command(self) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """Ranks > 0: wait for rank 0's next command; returns (op, args, tensors)."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.commands)
        header = torch.zeros(int(length), dtype=torch.uint8)
        dist.broadcast(header, src=0, group=self.cpu)
        command = json.loads(header.numpy().tobytes())
        tensors = {}
        for name, dtype_name, shape in command["tensors"]:
            dtype = DTYPES[dtype_name]
            data = torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.uint8)
            if data.numel():
                dist.broadcast(data, src=0, group=self.cpu)
            tensors[name] = data.view(dtype).reshape(shape)
        return command["op"], command["args"], tensors

    def gather(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Each rank's ``local`` [sizes[r], ...] (the same trailing shape on every rank): on rank 0 all of them
        concatenated in rank order, on the others None."""
        if self.world_size == 1:
            return local
        padded = torch.zeros((max(max(sizes), 1), *local.shape[1:]), dtype=local.dtype)
        padded[: len(local)] = local
        parts = [torch.zeros_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.cpu)
        if parts is None:  # not rank 0
            return None
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric summed over the ranks (every rank reports the same keys)."""
        if self.world_size == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(values, group=self.cpu)
        return dict(zip(keys, values.tolist()))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join(device: str, timeout_s: float) -> Ranks:
    """This process's ranks: from torchrun's environment (the process group is started here, blocking until
    every rank has joined), or one rank without it. Under torchrun a CUDA ``device`` means this rank's GPU,
    cuda:LOCAL_RANK."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Ranks.single(device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        this = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(this)
        backend = "cpu:gloo,cuda:nccl"
    else:
        this, backend = torch.device(device), "gloo"
    deadline = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=deadline)
    commands = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    cpu = dist.new_group(backend="gloo", timeout=deadline)
    log.info("ranks_joined", rank=rank, world_size=world_size, device=str(this), backend=backend)
    return Ranks(rank=rank, world_size=world_size, device=this, commands=commands, cpu=cpu)


def fatal(event: str, **fields) -> None:
    """End this rank now, after logging why: the ranks are out of step (one failed in the middle of a
    command), which no call can repair. torchrun then ends the other ranks, and the trainer's supervisor
    (systemd, Slurm) starts the group again."""
    log.exception(event, **fields)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
