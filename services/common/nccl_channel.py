"""The tensor plane on GPUs: a TensorChannel on NCCL through cupy (``cupy.cuda.nccl``).

cupy 14's unique id is 128 raw bytes; the root makes it (``new_unique_id``)
and the coordinator hands it to every member in JoinChannel, whose protobuf
field is ``bytes``. Tensors are sent as flat uint8 views, so any dtype goes.

NCCL itself never times out. Here:
- joining runs ``ncclCommInitRank`` on a helper thread and waits at most the
  deadline; a member that never comes makes the join fail with TimeoutError
  (the helper thread stays blocked in NCCL: the caller should treat the
  process as damaged, as a supervisor restart does);
- every broadcast is enqueued on the channel's own stream and waited for by
  polling an event up to the deadline; past it the communicator is aborted
  and TimeoutError raised, so a stopped peer is an error, never a hang;
- ``abandon``, from any thread, aborts the communicator at once
  (ncclCommAbort ends the kernels waiting on peers): the transfers being
  waited for fail with ConnectionError. The other members are not told: a
  member waiting on this one goes on waiting until its own deadline.
"""

from __future__ import annotations

import threading
import time

import torch

POLL_S = 0.00005  # a transfer is done within ~50 us of finishing; the poll costs little CPU


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) for a new channel's root."""
    from cupy.cuda import nccl

    return bytes(nccl.get_unique_id())


class NcclChannel:
    def __init__(self, channel_id: str, unique_id: bytes, rank: int, *, world_size: int, timeout_s: float,
                 device: torch.device | str):
        from cupy.cuda import nccl

        if len(unique_id) != 128:
            raise ValueError(f"an NCCL unique id is 128 bytes, got {len(unique_id)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.channel_id, self.rank, self.world_size, self.timeout_s = channel_id, rank, world_size, timeout_s
        self.device = torch.device(device)
        if self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.abandoned = False
        self._lock = threading.Lock()  # a broadcast is enqueued, or the communicator aborted, not both
        result: dict = {}

        def init() -> None:
            try:
                torch.cuda.set_device(self.device)
                result["comm"] = nccl.NcclCommunicator(world_size, unique_id, rank)
            except Exception as error:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = error

        worker = threading.Thread(target=init, name=f"nccl-init-{channel_id}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise TimeoutError(f"channel {channel_id}: not all {world_size} members joined within {timeout_s} s "
                               f"(rank {rank} waited)")
        if "error" in result:
            raise ConnectionError(f"channel {channel_id}: rank {rank} could not join: {result['error']}")
        self._comm = result["comm"]

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Broadcast ``tensor`` (contiguous, on this channel's device) from ``root``, in place elsewhere."""
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> NcclTransfer:
        """Enqueue the broadcast on the channel's stream, after the work already queued on the current one."""
        from cupy.cuda import nccl

        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"channel {self.channel_id}: tensor must be contiguous on {self.device}")
        flat = tensor.view(-1).view(torch.uint8)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._lock, torch.cuda.stream(self.stream):
            if self._comm is None:
                raise ConnectionError(f"channel {self.channel_id} was aborted: nothing more can be sent on it")
            self._comm.bcast(flat.data_ptr(), flat.numel(), nccl.NCCL_UINT8, root, self.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return NcclTransfer(self, done, root)

    def abandon(self) -> None:
        """Abort the communicator (from any thread; ncclCommAbort ends the kernels still waiting on peers)."""
        with self._lock:
            self.abandoned = True  # before the abort: a transfer that sees its event done then knows why
            if self._comm is not None:
                self._comm.abort()
                self._comm = None

    def close(self) -> None:
        """Leave the channel. ncclCommAbort, not Destroy: destroy waits for the peers to destroy too."""
        self.abandon()


class NcclTransfer:
    """One enqueued broadcast: ``wait`` polls its event up to the channel's deadline, then orders the current
    stream after it (and only after it: later transfers on the channel's stream go on)."""

    def __init__(self, channel: NcclChannel, done: torch.cuda.Event, root: int):
        self.channel, self.done, self.root = channel, done, root

    def wait(self) -> None:
        channel = self.channel
        deadline = time.monotonic() + channel.timeout_s
        while not self.done.query():
            if channel.abandoned:
                break
            if time.monotonic() > deadline:
                channel.abandon()
                raise TimeoutError(f"channel {channel.channel_id}: broadcast from rank {self.root} did not finish "
                                   f"within {channel.timeout_s} s; channel aborted")
            time.sleep(POLL_S)
        if channel.abandoned:  # an aborted kernel ends too, its tensor not whole: done or not, it is not trusted
            raise ConnectionError(f"channel {channel.channel_id}: broadcast from rank {self.root} ended: the channel "
                                  "was abandoned while it was on the wire (a new channel replaces it)")
        torch.cuda.current_stream(channel.device).wait_event(self.done)
