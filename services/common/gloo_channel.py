"""The tensor plane on CPU: a ``TensorChannel`` on a torch.distributed gloo group (its tensors live on CPU).

The coordinator arranges a channel: the root's ``prepare_gloo_rendezvous``
opens a store and returns its address, every member (root included) is then
told to join with its rank, concurrently, since joining blocks until all
have arrived. Each channel is a torch.distributed gloo group of its own, not
the process's default group, so a process may be in several.

The store is reachable by whoever can reach the root's address (TCPStore has
no authentication: anyone there may read, list and write its keys). So the
rendezvous carries a fresh secret of the channel besides the store's address
(``host:port secret``; the coordinator hands it to the members in their
JoinChannel requests, over the cluster's authenticated gRPC), and every value
a member writes is signed with it (HMAC-SHA256 of key and value,
``SignedStore``): a value that a stranger wrote is never taken, its reader
waits for a signed one until the deadline. A stranger cannot redirect a
member to an address of its own, so it can neither read the weights nor
send its own; it can still delay a channel's formation, as a flood of its
port would.

Every collective has the channel's deadline: a member that does not show up
makes the call fail with ``TimeoutError`` instead of hanging. ``abandon``
(from any thread) ends the transfers on the group at once, here and at the
other members, with ``ConnectionError``: it pokes a member with a send that
nothing receives (``POKE_TAG``), whose timeout makes gloo close every
connection of the group.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import socket
import threading
import time

import torch
import torch.distributed as dist


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def rendezvous_host(bound_host: str, coordinator: str) -> str:
    """Where a service's rendezvous stores listen, and members reach them: the address the service is bound to;
    for a service bound to every interface, its address towards the coordinator (the network the cluster's
    members share). Never every interface: a store there would take anyone's keys from any network."""
    if bound_host not in WILDCARDS:
        return bound_host.strip("[]")
    return address_towards(coordinator.rpartition(":")[0].strip("[]") or "127.0.0.1")


def prepare_gloo_rendezvous(host: str, timeout_s: float) -> tuple[dist.TCPStore, bytes]:
    """Open the store that a gloo channel meets at, listening on ``host`` only (``rendezvous_host``), where
    members reach it, on a free port.

    Returns the store (keep it alive until the channel is joined) and the
    rendezvous bytes that members pass to ``GlooChannel``: its address and a
    fresh secret, ``host:port secret``.
    """
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128)
    store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    return store, f"{host}:{store.port} {secrets.token_hex(16)}".encode()


def parse_rendezvous(rendezvous: bytes) -> tuple[str, int, bytes]:
    """(host, port, secret) of a gloo rendezvous ``host:port secret``; ValueError naming the form otherwise."""
    address, _, secret = rendezvous.decode(errors="replace").partition(" ")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not secret:
        raise ValueError(f"gloo rendezvous must be 'host:port secret', got {rendezvous[:80]!r}")
    return host, int(port), secret.encode()


class SignedStore(dist.Store):
    """The rendezvous store as the members use it: every value is written with an HMAC-SHA256 of its key and
    value under the channel's secret, and read only with a valid one. A value without (a stranger's) is passed
    over: the reader waits for the key to be written again, by a member, until the deadline.

    gloo calls ``set``, ``wait`` and ``get`` only. Keep a reference to this object for as long as the group
    uses it: torch holds the C++ side only."""

    POLL_S = 0.01

    def __init__(self, store: dist.Store, secret: bytes, timeout: datetime.timedelta):
        super().__init__()
        self.store, self.secret, self.timeout_s = store, secret, timeout.total_seconds()

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes) -> None:  # type: ignore[override]  # torch's stub: str; Store takes bytes
        self.store.set(key, self._mac(key, value) + value)  # type: ignore[arg-type]  # as above

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            signed = self.store.get(key)
            mac, value = signed[:32], signed[32:]
            if hmac.compare_digest(mac, self._mac(key, value)):
                return value
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"rendezvous key {key!r} holds a value not signed with the channel's "
                                          f"secret (written by a stranger), and no member wrote it again within "
                                          f"{self.timeout_s} s")
            time.sleep(self.POLL_S)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.store.wait(keys, timeout or datetime.timedelta(seconds=self.timeout_s))


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: where the other members, which reach ``host``, reach
    this one too (the rendezvous host is the root's; a member on another machine cannot listen on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a UDP connect only picks the route and source address: nothing is sent
        return probe.getsockname()[0]


POKE_TAG = (1 << 31) - 1  # a point-to-point tag that no transfer uses: nothing ever receives a poke


class GlooChannel:
    """A torch.distributed gloo group of its own (not the process's default group)."""

    def __init__(self, channel_id: str, rendezvous: bytes, rank: int, *, world_size: int, timeout_s: float):
        host, port, secret = parse_rendezvous(rendezvous)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.channel_id, self.rank, self.world_size, self.timeout = channel_id, rank, world_size, timeout
        self.device = torch.device("cpu")
        self.abandoned = False
        self._lock = threading.Lock()  # a transfer is started on the group, or the channel abandoned, not both
        self._signed = SignedStore(dist.TCPStore(host, port, is_master=False, timeout=timeout), secret, timeout)
        store = dist.PrefixStore(f"channel/{channel_id}/", self._signed)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(host))]
        try:
            self._group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(store, rank, world_size, options)
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
                group.send([torch.zeros(1)],  # type: ignore[attr-defined]  # missing from torch's stubs
                           (self.rank + peer) % self.world_size, POKE_TAG).wait(
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
