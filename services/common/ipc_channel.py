"""The tensor plane between processes on one host that may share a GPU: CUDA IPC.

NCCL refuses two ranks on one GPU, which is exactly the colocated placement
(trainer and rollout on the same GPU, the rollout asleep while the trainer
updates). Here the root shares the memory of each tensor it broadcasts (a
CUDA IPC handle, sent over a gloo group of the members) and every other rank
copies from that memory into its own tensor on its own GPU (the same one,
or a peer GPU of the host), then all meet at a barrier before the root
reuses the memory. Tensors of at most ``SMALL_BYTES`` (manifests,
checksums) travel through the gloo group itself.

The handle is sent as JSON (never pickled): the eight fields of
``UntypedStorage._share_cuda_`` plus the tensor's byte offset in its
storage. The producer's IPC event is part of the handle, so the copy waits
for the kernels that filled the tensor. Every step goes through the gloo
group's deadline: a missing member is an error, never a hang.
"""

from __future__ import annotations

import datetime
import json

import torch

from services.common.gloo_channel import GlooChannel

SMALL_BYTES = 1 << 16
HANDLE_BYTES = 1024  # the JSON of one shared tensor, space-padded


class CudaIpcChannel:
    def __init__(self, channel_id: str, rendezvous: bytes, rank: int, *, world_size: int, timeout_s: float,
                 device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"channel backend cuda_ipc needs a CUDA device, this service runs on {device!r}")
        if self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.channel_id, self.rank, self.world_size = channel_id, rank, world_size
        self.control = GlooChannel(channel_id, rendezvous, rank=rank, world_size=world_size, timeout_s=timeout_s)

    @property
    def timeout_s(self) -> float:
        return self.control.timeout.total_seconds()

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self.control.timeout = datetime.timedelta(seconds=seconds)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Send ``tensor`` (contiguous, on this channel's device) from ``root`` into every other rank's."""
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"channel {self.channel_id}: tensor must be contiguous on {self.device}")
        flat = tensor.view(-1).view(torch.uint8)
        if flat.numel() <= SMALL_BYTES:
            self._broadcast_small(flat, root)
            return
        handle = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
        if self.rank == root:
            handle.copy_(torch.frombuffer(bytearray(share(flat).ljust(HANDLE_BYTES)), dtype=torch.uint8))
        self.control.broadcast(handle, root)
        if self.rank != root:
            shared = open_shared(bytes(handle.numpy()), self.device)
            flat.copy_(shared)
            torch.cuda.current_stream(self.device).synchronize()
            del shared  # the root's memory is released once every rank has let go of it
        self.control.barrier()
        if self.rank == root:
            torch.cuda.ipc_collect()

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Finished:
        """The broadcast, done before it returns (a copy within one host takes well under a millisecond per
        100 MB, so there is nothing to overlap)."""
        self.broadcast(tensor, root)
        return Finished()

    def _broadcast_small(self, flat: torch.Tensor, root: int) -> None:
        staged = flat.cpu() if self.rank == root else torch.empty(flat.numel(), dtype=torch.uint8)
        self.control.broadcast(staged, root)
        if self.rank != root:
            flat.copy_(staged)

    def abandon(self) -> None:
        """End the channel now: every step waits on the gloo group, whose transfers ``abandon`` ends."""
        self.control.abandon()

    def close(self) -> None:
        self.control.close()


class Finished:
    def wait(self) -> None:
        pass


def share(flat: torch.Tensor) -> bytes:
    """The IPC handle of a CUDA uint8 tensor's memory, as JSON."""
    device, handle, size, offset, counter, counter_offset, event, event_sync = flat.untyped_storage()._share_cuda_()
    return json.dumps({
        "device": device, "handle": handle.hex(), "size": size, "offset": offset, "counter": counter.hex(),
        "counter_offset": counter_offset, "event": event.hex(), "event_sync": event_sync,
        "tensor_offset": flat.storage_offset(), "numel": flat.numel(),
    }).encode()


def open_shared(handle: bytes, device: torch.device) -> torch.Tensor:
    """The uint8 tensor another process shared (``share``), mapped on ``device``."""
    fields = json.loads(handle.decode().rstrip())
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index, bytes.fromhex(fields["handle"]), fields["size"], fields["offset"],
        bytes.fromhex(fields["counter"]), fields["counter_offset"], bytes.fromhex(fields["event"]),
        fields["event_sync"])
    return torch.empty(0, dtype=torch.uint8, device=device).set_(  # type: ignore[call-overload]  # stub lacks
        storage, fields["tensor_offset"], (fields["numel"],))  # set_(source, offset, size)
