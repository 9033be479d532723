"""The tensor plane: a small ``TensorChannel`` interface and its gloo implementation.

A channel is a fixed group of ranks; rank 0 (the trainer) sends, the others
(rollout engines) receive. The coordinator arranges it: the root's
``prepare_gloo_rendezvous`` opens a store and returns its address, every
member (root included) is then told to join with its rank, concurrently,
since joining blocks until all have arrived. On GPU the same interface sits
on NCCL through cupy (``nccl_channel``), or on CUDA IPC where members share a
GPU (``ipc_channel``).

Every collective has a deadline: a member that does not show up makes the
call fail with ``TimeoutError`` instead of hanging. A channel being replaced
while a broadcast waits on a stopped member need not wait for that deadline:
``abandon`` (from any thread) ends the broadcast at once, here and at the
other members, with ``ConnectionError``.
"""

from __future__ import annotations

import datetime
import threading
from typing import Protocol

import torch
import torch.distributed as dist


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


def prepare_gloo_rendezvous(host: str, timeout_s: float) -> tuple[dist.TCPStore, bytes]:
    """Open the store that a gloo channel meets at, on a free port of ``host``.

    Returns the store (keep it alive until the channel is joined) and its
    address as the rendezvous bytes that members pass to ``GlooChannel``.
    """
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{host}:{store.port}".encode()


POKE_TAG = (1 << 31) - 1  # a point-to-point tag that no transfer uses: nothing ever receives a poke


class GlooChannel:
    """A torch.distributed gloo group of its own (not the process's default group)."""

    def __init__(self, channel_id: str, rendezvous: bytes, rank: int, world_size: int, timeout_s: float):
        host, _, port = rendezvous.decode().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"gloo rendezvous must be host:port, got {rendezvous!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.channel_id, self.rank, self.world_size, self.timeout = channel_id, rank, world_size, timeout
        self.device = torch.device("cpu")
        self.abandoned = False
        self._lock = threading.Lock()  # a transfer is started on the group, or the channel abandoned, not both
        store = dist.PrefixStore(f"channel/{channel_id}/", dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        try:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, options)
        except dist.DistStoreError as error:
            raise TimeoutError(
                f"channel {channel_id}: not all {world_size} members joined within {timeout_s} s ({error})"
            ) from error
        except RuntimeError as error:
            raise ConnectionError(f"channel {channel_id}: rank {rank} could not connect ({error})") from error

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> GlooTransfer:
        options = dist.BroadcastOptions()
        options.rootRank = root
        return GlooTransfer(self._start(lambda group: group.broadcast([tensor], options)), root, self)

    def barrier(self) -> None:
        """Return once every member has called barrier (an all-reduce of one number)."""
        GlooTransfer(self._start(lambda group: group.allreduce([torch.zeros(1)])), None, self).wait()

    def _start(self, collective):
        with self._lock:
            if self.abandoned:
                raise ConnectionError(f"channel {self.channel_id} was abandoned: nothing more can be sent on it")
            return collective(self._group)

    def abandon(self) -> None:
        """Close the group's connections, so that every transfer on it ends now, here and at the other members.

        ProcessGroupGloo has no call for that (its ``abort`` leaves a pending transfer waiting, and dropping the
        group waits for it: up to the deadline). gloo does close every connection of a group when a transfer
        of the application's times out, to make the others fail too; so the channel sends a poke (a
        point-to-point send that nothing receives) to a member and gives it one millisecond. A member whose
        connection is already closed fails the poke at once: the next one is poked."""
        with self._lock:
            if self.abandoned or self._group is None:
                self.abandoned = True
                return
            self.abandoned, group = True, self._group
        for peer in range(1, self.world_size):
            try:
                group.send([torch.zeros(1)], (self.rank + peer) % self.world_size, POKE_TAG).wait(
                    datetime.timedelta(milliseconds=1))
            except RuntimeError as error:
                if "timed out" in str(error).lower():  # every connection of the group is closed now
                    return

    def close(self) -> None:
        self.abandon()
        with self._lock:
            self._group = None


class GlooTransfer:
    def __init__(self, work, root: int | None, channel: GlooChannel):
        """``root``: of a broadcast; None for a barrier."""
        self.work, self.channel, self.timeout = work, channel, channel.timeout
        self.what = "barrier" if root is None else f"broadcast from rank {root}"

    def wait(self) -> None:
        try:
            self.work.wait(self.timeout)
        except RuntimeError as error:
            if self.channel.abandoned:
                raise ConnectionError(f"channel {self.channel.channel_id}: {self.what} ended: the channel was "
                                      f"abandoned while it was on the wire (a new channel replaces it)") from error
            if "timed out" in str(error).lower():
                raise TimeoutError(f"{self.what} did not finish within {self.timeout.total_seconds()} s "
                                   f"({error})") from error
            raise ConnectionError(f"{self.what} failed: a member is gone ({error})") from error


def open_channel(channel_id: str, backend: str, rendezvous: bytes, rank: int, world_size: int, timeout_s: float,
                 device: str) -> TensorChannel:
    """Join a channel (blocking until every member has joined or the deadline passes).

    gloo works on any device (tensors on CPU); nccl needs ``device`` to be a CUDA device, and every member a
    GPU of its own; cuda_ipc needs CUDA devices of one host, which members may share.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if backend == "gloo":
        return GlooChannel(channel_id, rendezvous, rank, world_size, timeout_s)
    if backend == "nccl":
        if not device.startswith("cuda"):
            raise ValueError(f"channel backend nccl needs a CUDA device, this service runs on {device!r}")
        from services.common.nccl_channel import NcclChannel

        return NcclChannel(channel_id, rendezvous, rank, world_size, timeout_s, device)
    if backend == "cuda_ipc":
        from services.common.ipc_channel import CudaIpcChannel

        return CudaIpcChannel(channel_id, rendezvous, rank, world_size, timeout_s, device)
    raise ValueError(f"channel backend must be gloo, nccl or cuda_ipc, got {backend!r}")


def gpu_uuid(device: torch.device | str) -> str:
    """The UUID of a CUDA device: the same GPU has the same one in every process, whatever it is numbered."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


class ChannelTable:
    """The channels a service has joined, by id. Joining an id again replaces the old channel."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._channels: dict[str, TensorChannel] = {}

    async def join(self, channel_id: str, backend: str, rendezvous: bytes, rank: int, world_size: int,
                   timeout_s: float) -> None:
        """Join (blocks, on a thread of its own, until every member has joined or the deadline passes)."""
        import asyncio

        channel = await asyncio.to_thread(open_channel, channel_id, backend, rendezvous, rank, world_size, timeout_s,
                                          self.device)
        old = self._channels.pop(channel_id, None)
        if old is not None:
            old.close()
        self._channels[channel_id] = channel

    def get(self, channel_id: str) -> TensorChannel:
        from services.common.errors import NotFound

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
