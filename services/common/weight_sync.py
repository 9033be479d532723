"""Weights over a TensorChannel, in buckets, each verified by a checksum.

Protocol (rank 0 sends, every other rank receives the same broadcasts):
1. a header (int64 [2]): the weight version and the manifest's length, 0
   when the manifest is the one the last broadcast on this channel carried
   (every member of a channel has seen the same broadcasts); then, if new,
   the manifest (uint8, JSON): per bucket, its size and the name, dtype,
   shape and byte offset of each tensor in it;
2. per bucket: the bucket (uint8 [size], tensors packed at 16-byte aligned
   offsets), then its checksum (int64 [1]), which the receiver recomputes.

The receiver hands each bucket to ``load`` as (name, tensor) pairs while the
next bucket is on its way, and compares the checksums once every bucket is
in (``WeightReceiver.receive`` says what that asks of a receiver loading
straight into its model). A ``WeightSender`` and a ``WeightReceiver`` keep
what a service's channels carried from sync to sync (manifests, buffers).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services.common.channel import TensorChannel
from services.common.timing import StageTimer
from services.common.wire import DTYPE_NAMES, DTYPES

ALIGN = 16


class MadeWhenSent(Protocol):
    """A tensor a sender makes only as it sends it (``full`` calls ``full_tensor``, as it gathers a DTensor), e.g.
    a LoRA layer's merged weight (``adapters.MergedWeight``): a sync then holds one such tensor at a time."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def numel(self) -> int: ...

    def full_tensor(self) -> torch.Tensor: ...


Sendable = torch.Tensor | MadeWhenSent  # what a weight sync sends under a name


@dataclass(frozen=True, kw_only=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Bucket:
    size: int
    entries: tuple[Entry, ...]


def plan_buckets(named: list[tuple[str, Sendable]], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> list[Bucket]:
    """Pack tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor gets one alone), as
    ``dtype`` if given (a DTensor counts with its global shape).

    Each tensor takes its size rounded up to 16 bytes."""
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    size = 0
    for name, tensor in named:
        sent_dtype = dtype or tensor.dtype
        padded = -(-tensor.numel() * sent_dtype.itemsize // ALIGN) * ALIGN
        if entries and size + padded > bucket_bytes:
            buckets.append(Bucket(size, tuple(entries)))
            entries, size = [], 0
        entries.append(Entry(name=name, dtype=DTYPE_NAMES[sent_dtype], shape=tuple(tensor.shape), offset=size))
        size += padded
    if entries:
        buckets.append(Bucket(size, tuple(entries)))
    return buckets


CHECKSUM_PERIOD = 256


def checksum_tensor(buffer: torch.Tensor) -> torch.Tensor:
    """Sum of the bucket's 32-bit words, the word at position i weighted by (i mod 256) + 1, as an int64
    [1] tensor on the buffer's device (int64 arithmetic wraps around, alike on every device).

    Computed from column sums of the words laid out in rows of 256 * 256 (256 for a small bucket), so no copy
    of the bucket is made and the GPU has 65536 columns to sum at once; column c carries weight (c mod 256) + 1.
    """
    words = buffer.view(torch.int32)
    width = CHECKSUM_PERIOD * CHECKSUM_PERIOD if words.numel() >= 64 * CHECKSUM_PERIOD ** 2 else CHECKSUM_PERIOD
    rows = words.numel() // width
    weights = torch.arange(width, device=buffer.device, dtype=torch.int64) % CHECKSUM_PERIOD + 1
    columns = words[: rows * width].view(rows, width).sum(dim=0, dtype=torch.int64)
    tail = words[rows * width :].to(torch.int64)
    return ((columns * weights).sum() + (tail * weights[: tail.numel()]).sum()).reshape(1)


def checksum(buffer: torch.Tensor) -> int:
    """``checksum_tensor`` as a Python int."""
    return int(checksum_tensor(buffer))


def full(tensor: Sendable, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor (a DTensor shard is all-gathered: a collective of its mesh; a ``MadeWhenSent`` is made),
    cast to ``dtype``; called under no_grad."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def gather_weights(named: list[tuple[str, Sendable]]) -> None:
    """A sharded trainer's ranks other than the sender: take part in each all-gather of ``WeightSender.send``, in
    its order (every rank must call ``full_tensor`` for every parameter in the same order)."""
    for _, tensor in named:
        full(tensor)


def _space_ends(bucket: Bucket) -> list[int]:
    """Where each tensor's space in the bucket ends: at the next tensor's offset (its padding included)."""
    return [entry.offset for entry in bucket.entries[1:]] + [bucket.size]


def padding(bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
    """The stretches of the buffer between the bucket's tensors (none where every size is a multiple of 16)."""
    return [buffer[entry.offset + entry.nbytes : end] for entry, end in zip(bucket.entries, _space_ends(bucket))
            if end > entry.offset + entry.nbytes]


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of the bucket as a view of the buffer."""
    sizes = []  # each tensor's bytes, then the padding up to the next one
    for entry, end in zip(bucket.entries, _space_ends(bucket)):
        sizes += [entry.nbytes, end - entry.offset - entry.nbytes]
    pieces = torch.split(buffer, sizes)
    return [(e.name, pieces[2 * i].view(DTYPES[e.dtype]).view(e.shape)) for i, e in enumerate(bucket.entries)]


def _manifest_json(buckets: list[Bucket]) -> bytes:
    return json.dumps([{"size": b.size, "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in b.entries]}
                       for b in buckets]).encode()


def _manifest_from_json(data: bytes) -> list[Bucket]:
    return [
        Bucket(b["size"], tuple(Entry(name=name, dtype=dtype, shape=tuple(shape), offset=offset)
                                for name, dtype, shape, offset in b["entries"]))
        for b in json.loads(data)
    ]


BUCKETS_ON_WIRE = 2  # buckets on the wire at once: one transfers while the next is packed (or loaded)


class BucketBuffers:
    """Buffers for the buckets of one manifest, kept from sync to sync with each bucket's tensor views made
    once (making ~300 views costs milliseconds of Python per sync). ``slots`` buffers of the largest bucket's
    size (fewer if there are fewer buckets), made when a bucket is first placed, take turns: bucket k lives in
    buffer k mod slots."""

    def __init__(self, buckets: list[Bucket], slots: int, device: torch.device | str):
        self.buckets = buckets
        self._slots, self.device = min(slots, len(buckets)), device
        self._buffers: list[torch.Tensor] = []
        self._placed: dict[int, tuple] = {}

    def place(self, index: int) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """Bucket ``index``'s buffer, the views of its tensors in it, and the padding between them."""
        if not self._buffers:
            size = max(b.size for b in self.buckets)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self._slots)]
        if index not in self._placed:
            bucket = self.buckets[index]
            buffer = self._buffers[index % self._slots][: bucket.size]
            self._placed[index] = buffer, unpack(bucket, buffer), padding(bucket, buffer)
        return self._placed[index]

    @torch.no_grad()
    def pack(self, index: int, tensors: dict[str, Sendable], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Bucket ``index``'s tensors (whole, as ``dtype`` if given) copied into its buffer at their offsets in
        one batched copy, the padding zeroed (another bucket may have used the buffer since); the buffer."""
        buffer, views, gaps = self.place(index)
        torch._foreach_copy_([view for _, view in views], [full(tensors[name], dtype) for name, _ in views])
        if gaps:
            torch._foreach_zero_(gaps)
        return buffer


class WeightSender:
    """The sending side of a service's weight channels, kept from sync to sync: the manifest each channel last
    carried (sent again only when it changes) and the bucket buffers, one set shared by the channels on one
    device that carry one manifest (a sender's channels, one per transport, e.g. CUDA IPC to a rollout on its
    GPU and NCCL to the others, are sent into in turn, each send done before the next begins)."""

    def __init__(self) -> None:
        self._sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # channel -> (manifest, its buffers)

    @torch.no_grad()
    def send(
        self, channel: TensorChannel, named: list[tuple[str, Sendable]], version: int, *, bucket_bytes: int,
        dtype: torch.dtype | None = None, timer: StageTimer | None = None,
    ) -> tuple[int, int]:
        """Broadcast the tensors from rank 0, as ``dtype`` if given; returns (bytes, buckets). ``timer``, if
        given, gets the time spent on each stage: manifest, pack (gather, copy), transfer (waiting).

        Pipelined: bucket k+1 is gathered (DTensors, in order) and packed on the channel's device while bucket k
        is on the wire; each bucket's checksum is computed while the bucket is on the wire and follows it without
        waiting for the host. ``BUCKETS_ON_WIRE`` bucket buffers are kept between syncs."""
        timer = timer or StageTimer()
        device = channel.device
        with timer("manifest"):
            buckets = plan_buckets(named, bucket_bytes, dtype)
            manifest = _manifest_json(buckets)
            new = channel not in self._sent or self._sent[channel][0] != manifest
            channel.broadcast(torch.tensor([version, len(manifest) if new else 0], dtype=torch.int64, device=device))
            if new:
                channel.broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(device))
                self._sent[channel] = manifest, self._buffers(manifest, buckets, device)
        buffers = self._sent[channel][1]
        tensors = dict(named)
        on_wire: list[tuple] = []
        for index in range(len(buckets)):
            with timer("pack"):
                buffer = buffers.pack(index, tensors, dtype)
            sending = channel.start_broadcast(buffer)
            total = checksum_tensor(buffer)
            on_wire.append((sending, channel.start_broadcast(total), buffer, total))
            if len(on_wire) >= BUCKETS_ON_WIRE:
                with timer("transfer"):
                    finish(on_wire.pop(0))
        with timer("transfer"):
            for transfers in on_wire:
                finish(transfers)
        return sum(b.size for b in buckets), len(buckets)

    def _buffers(self, manifest: bytes, buckets: list[Bucket], device: torch.device) -> BucketBuffers:
        """The buffers of another channel on ``device`` that carries ``manifest``, else new ones."""
        shared = (buffers for carried, buffers in list(self._sent.values())
                  if carried == manifest and torch.device(buffers.device) == device)
        return next(shared, None) or BucketBuffers(buckets, BUCKETS_ON_WIRE, device)


def finish(transfers: tuple) -> None:
    """Wait for a bucket's transfers (the tensors they carry stay referenced until then)."""
    for transfer in transfers[:2]:
        transfer.wait()


class WeightReceiver:
    """The receiving side of a service's weight channels, kept from sync to sync: per channel, the buckets of
    the last manifest it carried (a broadcast carries the manifest only when it changed) and their buffers."""

    def __init__(self) -> None:
        self._received: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # channel -> its BucketBuffers

    def receive(self, channel: TensorChannel, load: Callable[[list[tuple[str, torch.Tensor]]], None],
                timer: StageTimer | None = None, *, keep_buffers: bool = False) -> int:
        """Receive one broadcast, ``load`` each bucket and verify each bucket's checksum; returns the weight
        version. ``timer``, if given, gets the time spent on each stage: manifest, transfer (waiting for
        buckets), verify, load.

        The checksums are computed on the channel's device as the buckets arrive and compared once all are in,
        so the host never waits for one bucket's checksum before loading it: ``load`` may have been given a
        bucket that then fails, and a receiver that loads straight into its model must count the model damaged
        when this raises (as it must when the transfer breaks off halfway).

        With ``keep_buffers`` (``load`` is done with a bucket's tensors when it returns) the buckets arrive in
        ``BUCKETS_ON_WIRE`` + 1 buffers kept between syncs; otherwise each in a new buffer, which ``load`` may
        keep. Pipelined: bucket k+1 arrives while bucket k is checksummed and loaded."""
        timer = timer or StageTimer()
        device = channel.device
        with timer("manifest"):
            version, kept = self._manifest(channel)
            buckets = kept.buckets

        def start(index: int) -> tuple:
            if keep_buffers:
                buffer, views, _ = kept.place(index)
            else:
                buffer = torch.empty(buckets[index].size, dtype=torch.uint8, device=device)
                views = unpack(buckets[index], buffer)
            expected = torch.empty(1, dtype=torch.int64, device=device)
            return channel.start_broadcast(buffer), channel.start_broadcast(expected), buffer, expected, views

        arriving = [start(index) for index in range(min(BUCKETS_ON_WIRE, len(buckets)))]
        computed, sent = [], []
        for index in range(len(buckets)):
            transfers = arriving.pop(0)
            with timer("transfer"):
                finish(transfers)
            if index + BUCKETS_ON_WIRE < len(buckets):  # kept buffers: into the one bucket index - 1 was loaded from
                arriving.append(start(index + BUCKETS_ON_WIRE))
            _, _, buffer, expected, views = transfers
            with timer("verify"):  # before the load, in stream order: the buffer is reused only after both
                computed.append(checksum_tensor(buffer))
                sent.append(expected)
            with timer("load"):
                load(views)
        with timer("verify"):
            failed = (torch.cat(computed) != torch.cat(sent)).nonzero().flatten().tolist() if buckets else []
        if failed:
            raise ValueError(f"weight buckets {failed} of version {version} failed their checksums")
        return version

    def _manifest(self, channel: TensorChannel) -> tuple[int, BucketBuffers]:
        """A broadcast's header and, if it carries one, its manifest: its weight version, and the buffers of
        the manifest it is sent under (kept from the last broadcast on ``channel`` if it carries none)."""
        device = channel.device
        header = torch.zeros(2, dtype=torch.int64, device=device)
        channel.broadcast(header)
        version, length = header.tolist()
        if length:
            manifest = torch.zeros(length, dtype=torch.uint8, device=device)
            channel.broadcast(manifest)
            buckets = _manifest_from_json(manifest.cpu().numpy().tobytes())
            self._received[channel] = BucketBuffers(buckets, BUCKETS_ON_WIRE + 1, device)  # one more: one loads
        if channel not in self._received:
            raise ValueError(f"weights of version {version} came without a manifest, and none came before on "
                             "this channel")
        return version, self._received[channel]


class StagedWeights:
    """One weight broadcast received (by ``receiver``) on a thread of its own, kept in the verified buckets it
    arrived in, while the caller goes on (generating); ``buckets`` are then swapped in by whoever owns the model.

    On a CUDA channel the thread works on a stream of its own, so the transfer runs beside the model's
    kernels; its buckets are complete on the device once ``wait`` says so."""

    def __init__(self, channel: TensorChannel, receiver: WeightReceiver):
        self.channel, self.receiver = channel, receiver
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []
        self.version: int | None = None
        self.error: BaseException | None = None
        self.timer = StageTimer()  # WeightReceiver.receive's stages, and the whole receive
        self._thread = threading.Thread(target=self._receive, name="weights-staging", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        device = self.channel.device
        stream = torch.cuda.stream(staging_stream(device)) if device.type == "cuda" else contextlib.nullcontext()
        try:
            with stream, self.timer("receive"):
                self.version = self.receiver.receive(self.channel, self.buckets.append, self.timer)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except BaseException as error:  # noqa: BLE001 - handed to the caller by wait()
            self.error = error

    def wait(self, seconds: float | None) -> bool:
        """Whether the broadcast has fully arrived (waiting up to ``seconds``); raises what the transfer raised."""
        self._thread.join(seconds)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True


@functools.cache
def staging_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream that staged receives on ``device`` run on. One, not a new one per receive: torch's
    caching allocator reuses a freed block only on the stream that allocated it, and hands out its 32 pooled
    streams in turn, so with a stream per receive each receive's freed buckets stayed reserved for a stream
    not used again until 32 receives later: a model's size more reserved GPU memory at every sync."""
    return torch.cuda.Stream(device)


def tensor_checksum(tensor: torch.Tensor) -> int:
    """``checksum`` of one tensor's bytes (zero-padded to whole 32-bit words)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    padding = (-raw.numel()) % 4
    if padding:
        raw = torch.cat([raw, torch.zeros(padding, dtype=torch.uint8, device=raw.device)])
    return checksum(raw)
