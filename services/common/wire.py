"""Tensors on the wire: ``Tensor`` messages and batches streamed as ``TensorChunk``s.

A batch (a dict of named tensors) is cut into chunks of at most
``CHUNK_BYTES`` and grouped into messages of about that size, so no message
is ever large (one 64 MB message moved at about 190 MB/s on loopback, a
stream of 1 MB chunks at about 750 MB/s). ``BatchAssembler`` puts the chunks
back together and refuses anything inconsistent with a ``ValueError`` that
names the tensor.
"""

from __future__ import annotations

import asyncio
import math
from typing import Iterable, Iterator

import torch

from meshrl.v1 import common_pb2
from services.common.errors import ResourceExhausted
from services.common.limits import MESSAGE_FLOOR_BYTES, StreamLimits

CHUNK_BYTES = 1 << 20
MAX_TENSOR_BYTES = 1 << 33  # 8 GiB: anything claiming more is refused before allocation

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def check_shape(name: str, dtype_name: str, shape: list[int] | tuple[int, ...]) -> torch.dtype:
    """The dtype, once the dtype name and shape are known to be sendable; ValueError naming the tensor if not."""
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"{name}: unknown dtype {dtype_name!r}; expected one of {sorted(DTYPES)}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}: negative dimension in shape {list(shape)}")
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > MAX_TENSOR_BYTES:
        raise ValueError(f"{name}: shape {list(shape)} is over the {MAX_TENSOR_BYTES}-byte limit")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor, C-contiguous (any dtype, bfloat16 included)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_from_bytes(data: bytes | bytearray, dtype_name: str, shape: list[int], *,
                      name: str = "tensor") -> torch.Tensor:
    dtype = check_shape(name, dtype_name, shape)
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(data):
        raise ValueError(f"{name}: {len(data)} bytes for shape {list(shape)} {dtype_name} (expected {expected})")
    if expected == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def tensor_to_pb(tensor: torch.Tensor) -> common_pb2.Tensor:
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent")
    return common_pb2.Tensor(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), data=tensor_bytes(tensor))


def tensor_from_pb(message: common_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    return tensor_from_bytes(message.data, message.dtype, list(message.shape), name=name)


def batch_to_chunks(batch: dict[str, torch.Tensor],
                    chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[common_pb2.TensorChunk]]:
    """Group the batch's tensors into lists of chunks, each list about ``chunk_bytes``.

    Every tensor yields at least one chunk, so empty tensors arrive too.
    """
    pending: list[common_pb2.TensorChunk] = []
    pending_bytes = 0
    for name, tensor in batch.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be sent")
        data = tensor_bytes(tensor)
        for offset in range(0, max(len(data), 1), chunk_bytes):
            piece = data[offset : offset + chunk_bytes]
            pending.append(common_pb2.TensorChunk(
                name=name, dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), offset=offset, data=piece
            ))
            pending_bytes += len(piece)
            if pending_bytes >= chunk_bytes:
                yield pending
                pending, pending_bytes = [], 0
    if pending:
        yield pending


async def read_stream(request_iterator, assembler: BatchAssembler, limits: StreamLimits):
    """Read a whole request stream into ``assembler``; returns its first message (for its other fields), or None.

    The stream is counted as it arrives, each message at least MESSAGE_FLOOR_BYTES: once past
    ``limits.max_bytes`` nothing more of it is held, and the call is refused with ResourceExhausted. A bad chunk
    is refused with its ValueError. Either refusal waits for the caller's stream to end (its rest read and
    dropped), so that the caller gets the refusal: a gRPC client still sending when the call ends sees a
    broken stream (INTERNAL) instead. A stream still open ``limits.timeout_s`` after it began is refused then
    (TimeoutError, or the refusal it had earned).
    """
    error: Exception | None
    first, error, received = None, None, 0
    try:
        async with asyncio.timeout(limits.timeout_s):
            async for message in request_iterator:
                received += max(message.ByteSize(), MESSAGE_FLOOR_BYTES)
                if error is None and received > limits.max_bytes:
                    error = ResourceExhausted(f"the request stream passed this service's limit of "
                                              f"{limits.max_bytes} bytes (setting max_request_bytes)")
                if error is None:
                    first = first or message
                    try:
                        assembler.add(message.chunks)
                    except ValueError as bad:
                        error = bad
    except TimeoutError:
        if error is None:
            raise TimeoutError(f"the request stream did not end within {limits.timeout_s} s "
                               "(setting request_stream_timeout_s)") from None
    if error is not None:
        raise error
    return first


class BatchAssembler:
    """Collects streamed chunks into whole tensors."""

    def __init__(self) -> None:
        self._buffers: dict[str, bytearray] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def add(self, chunks: Iterable[common_pb2.TensorChunk]) -> None:
        for chunk in chunks:
            self._add(chunk)

    def _add(self, chunk: common_pb2.TensorChunk) -> None:
        name = chunk.name or "<unnamed>"
        shape = tuple(chunk.shape)
        if name not in self._meta:
            total = math.prod(shape) * check_shape(name, chunk.dtype, shape).itemsize
            self._meta[name] = (chunk.dtype, shape, total)
            self._buffers[name] = bytearray()
        dtype_name, known_shape, total = self._meta[name]
        if (chunk.dtype, shape) != (dtype_name, known_shape):
            raise ValueError(f"{name}: chunk says {chunk.dtype} {list(shape)}, "
                             f"earlier ones {dtype_name} {list(known_shape)}")
        buffer = self._buffers[name]
        if chunk.offset != len(buffer):
            raise ValueError(f"{name}: chunk at byte {chunk.offset}, expected byte {len(buffer)}")
        if len(buffer) + len(chunk.data) > total:
            raise ValueError(f"{name}: more bytes than shape {list(shape)} {dtype_name} holds")
        buffer.extend(chunk.data)

    def result(self, required: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """The assembled tensors; ValueError if one is incomplete or a required one is missing."""
        missing = [name for name in required if name not in self._meta]
        if missing:
            raise ValueError(f"batch is missing tensors {missing}")
        batch = {}
        for name, (dtype_name, shape, total) in self._meta.items():
            if len(self._buffers[name]) != total:
                raise ValueError(f"{name}: got {len(self._buffers[name])} of {total} bytes")
            batch[name] = tensor_from_bytes(self._buffers[name], dtype_name, list(shape), name=name)
        return batch
