"""The tensor plane: a small ``TensorChannel`` interface, the choice of its implementation, and a service's
table of the channels it has joined.

A channel is a fixed group of ranks; rank 0 (the trainer) sends, the others
(rollout engines) receive. The coordinator arranges it: the root prepares a
rendezvous (for gloo, ``gloo_channel.prepare_gloo_rendezvous`` opens a store
and returns its address and the channel's secret), every member (root
included) is then told to join with its rank, concurrently, since joining
blocks until all have arrived.
On CPU the channel is a gloo group (``gloo_channel``); on GPU the same
interface sits on NCCL through cupy (``nccl_channel``), or on CUDA IPC where
members share a GPU (``ipc_channel``).

Every collective has a deadline: a member that does not show up makes the
call fail with ``TimeoutError`` instead of hanging. A channel being replaced
while a broadcast waits on a stopped member need not wait for that deadline:
``abandon`` (from any thread) ends the broadcast at once, here and at the
other members, with ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from services.common.errors import NotFound
from services.common.gloo_channel import GlooChannel


class Transfer(Protocol):
    def wait(self) -> None:
        """Block until the broadcast has completed on this rank (TimeoutError past the channel's deadline)."""


class TensorChannel(Protocol):
    """A broadcast group for moving weights, outside gRPC.

    Calls are blocking; services make them from a worker thread.
    """

    rank: int
    world_size: int
    device: torch.device  # where the tensors it moves must live

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Send ``tensor`` from ``root`` into the same-shaped tensor of every other rank."""

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Transfer:
        """Begin a broadcast and return at once; the tensor must stay untouched until the transfer's
        ``wait()`` returns. Transfers complete in the order they were started."""

    def abandon(self) -> None:
        """End the channel now; may be called from any thread while another is in a transfer on it. The
        transfers in flight, and any started later, fail promptly with ConnectionError, at this member and
        (for gloo) at the others; the channel is then only good for ``close``."""

    def close(self) -> None:
        """Leave the group and release its resources (abandoning it first, so it never waits on a transfer)."""


def open_weight_channel(channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int,
                        timeout_s: float, device: str) -> TensorChannel:
    """Join a channel (blocking until every member has joined or the deadline passes).

    gloo works on any device (tensors on CPU); nccl needs ``device`` to be a CUDA device, and every member a
    GPU of its own; cuda_ipc needs CUDA devices of one host, which members may share. A rendezvous store not
    reached within ``timeout_s`` (gloo and cuda_ipc meet at one) is a TimeoutError, as a member that did not
    come is: the network's trouble, which may pass, not the request's.
    """
    try:
        return _open_weight_channel(channel_id, backend, rendezvous=rendezvous, rank=rank, world_size=world_size,
                                    timeout_s=timeout_s, device=device)
    except torch.distributed.DistNetworkError as error:
        raise TimeoutError(f"channel {channel_id}: rank {rank} did not reach the rendezvous within {timeout_s} s "
                           f"({error})") from error


def _open_weight_channel(channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int,
                         timeout_s: float, device: str) -> TensorChannel:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if backend == "gloo":
        return GlooChannel(channel_id, rendezvous, rank=rank, world_size=world_size, timeout_s=timeout_s)
    if backend == "nccl":
        if not device.startswith("cuda"):
            raise ValueError(f"channel backend nccl needs a CUDA device, this service runs on {device!r}")
        from services.common.nccl_channel import NcclChannel

        return NcclChannel(channel_id, rendezvous, rank=rank, world_size=world_size, timeout_s=timeout_s,
                           device=device)
    if backend == "cuda_ipc":
        from services.common.ipc_channel import CudaIpcChannel

        return CudaIpcChannel(channel_id, rendezvous, rank=rank, world_size=world_size, timeout_s=timeout_s,
                              device=device)
    raise ValueError(f"channel backend must be gloo, nccl or cuda_ipc, got {backend!r}")


def gpu_uuid(device: torch.device | str) -> str:
    """The UUID of a CUDA device: the same GPU has the same one in every process, whatever it is numbered."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


class ChannelTable:
    """The channels a service has joined, by id. Joining an id again replaces the old channel."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._channels: dict[str, TensorChannel] = {}

    async def join(self, channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int,
                   timeout_s: float) -> None:
        """Join (blocks, on a thread of its own, until every member has joined or the deadline passes)."""
        channel = await asyncio.to_thread(open_weight_channel, channel_id, backend, rendezvous=rendezvous, rank=rank,
                                          world_size=world_size, timeout_s=timeout_s, device=self.device)
        old = self._channels.pop(channel_id, None)
        if old is not None:
            old.close()
        self._channels[channel_id] = channel

    def get(self, channel_id: str) -> TensorChannel:
        channel = self._channels.get(channel_id)
        if channel is None:
            raise NotFound(f"channel {channel_id!r} not joined")
        return channel

    def abandon_all(self) -> None:
        """End the transfers on every channel now (from any thread; see ``TensorChannel.abandon``)."""
        for channel in list(self._channels.values()):
            channel.abandon()

    def close_all(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
