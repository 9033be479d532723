"""CPU tests of services/common/wire.py: the tensor codec, the chunked batch stream and its limits."""

from __future__ import annotations

import asyncio
import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.v1 import common_pb2, rollout_pb2
from services.common.errors import ResourceExhausted
from services.common.limits import MESSAGE_FLOOR_BYTES, StreamLimits
from services.common.wire import (
    CHUNK_BYTES,
    DTYPES,
    MAX_TENSOR_BYTES,
    BatchAssembler,
    batch_to_chunks,
    read_stream,
    tensor_bytes,
    tensor_from_pb,
    tensor_to_pb,
)

FUZZ = settings(max_examples=200, deadline=None, database=None)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with varied values (negative, fractional, True and False)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 40)), min(info.max, 1 << 40), shape, generator=generator, dtype=dtype)


def chunk(name="x", dtype="float32", shape=(2,), offset=0, data=b"") -> common_pb2.TensorChunk:
    return common_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset, data=data)


def assemble(*chunks: common_pb2.TensorChunk, required=()) -> dict[str, torch.Tensor]:
    assembler = BatchAssembler()
    assembler.add(chunks)
    return assembler.result(required)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------
# tensor_to_pb / tensor_from_pb


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (4, 0, 2), (1,)], ids=["3x5", "scalar", "empty", "4x0x2", "one"])
def test_tensor_round_trip_every_dtype(dtype_name, shape):
    tensor = sample(DTYPES[dtype_name], shape)
    message = tensor_to_pb(tensor)
    assert message.dtype == dtype_name
    assert list(message.shape) == list(shape)
    assert len(message.data) == math.prod(shape) * DTYPES[dtype_name].itemsize
    assert_same(tensor_from_pb(common_pb2.Tensor.FromString(message.SerializeToString())), tensor)


def test_bfloat16_keeps_its_bits():
    # Values that float16 could not hold (1e30) and that bfloat16 rounds: the bytes must be bfloat16's own.
    tensor = torch.tensor([1e30, -3.140625, 0.0, float("inf")], dtype=torch.bfloat16)
    message = tensor_to_pb(tensor)
    assert message.data == tensor.view(torch.int16).numpy().tobytes()
    assert_same(tensor_from_pb(message), tensor)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "bool"])
def test_non_contiguous_input_is_sent_in_logical_order(dtype_name):
    base = sample(DTYPES[dtype_name], (4, 6))
    for view in (base.t(), base[:, ::2], base[1:3, 1::3], base.expand(2, 4, 6)):
        assert not view.is_contiguous()
        message = tensor_to_pb(view)
        assert message.data == tensor_bytes(view.contiguous())
        assert_same(tensor_from_pb(message), view.contiguous())


def test_decoded_tensor_owns_its_memory():
    message = tensor_to_pb(torch.arange(4, dtype=torch.int32))
    decoded = tensor_from_pb(message)
    decoded += 1  # must neither fail on a read-only buffer nor change the message
    assert tensor_from_pb(message).tolist() == [0, 1, 2, 3]


def test_tensor_from_pb_unknown_dtype_names_the_tensor():
    with pytest.raises(ValueError, match=r"weights: unknown dtype 'complex64'"):
        tensor_from_pb(common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), name="weights")


def test_tensor_from_pb_negative_dim_names_the_tensor():
    with pytest.raises(ValueError, match=r"weights: negative dimension"):
        tensor_from_pb(common_pb2.Tensor(dtype="float32", shape=[-1, 2], data=b""), name="weights")


@pytest.mark.parametrize("length", [0, 7, 9, 16])
def test_tensor_from_pb_wrong_byte_count_names_the_tensor(length):
    with pytest.raises(ValueError, match=r"weights: %d bytes for shape \[2\] float32 \(expected 8\)" % length):
        tensor_from_pb(common_pb2.Tensor(dtype="float32", shape=[2], data=b"\0" * length), name="weights")


# ---------------------------------------------------------------------------
# batch_to_chunks + BatchAssembler


def test_batch_round_trip_with_a_large_tensor_in_messages_of_about_a_chunk():
    big = sample(torch.float32, (1024, 1000), seed=1)  # 4,096,000 bytes: over 3 MiB
    batch = {
        "small_first": sample(torch.int64, (3, 7), seed=2),
        "big": big,
        "half": sample(torch.bfloat16, (700, 1024), seed=3),  # 1,433,600 bytes: one full chunk and a tail
        "flags": sample(torch.bool, (5,), seed=4),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "transposed": sample(torch.float16, (8, 9), seed=5).t(),
    }
    messages = list(batch_to_chunks(batch))
    chunks = [c for message in messages for c in message]

    assert len(messages) >= 5
    for message in messages:
        assert all(len(c.data) <= CHUNK_BYTES for c in message)
        # A list is closed once it holds CHUNK_BYTES, so at most one chunk past that.
        assert sum(len(c.data) for c in message) < 2 * CHUNK_BYTES
        assert message[0].ByteSize() < 2 * CHUNK_BYTES
    assert sorted({c.name for c in chunks}) == sorted(batch)
    assert [c.offset for c in chunks if c.name == "big"] == [0, CHUNK_BYTES, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES]
    assert len([c for c in chunks if c.name == "empty"]) == 1  # empty tensors arrive too

    assembler = BatchAssembler()
    for message in messages:  # as a stream of serialized messages
        assembler.add(common_pb2.TensorChunk.FromString(c.SerializeToString()) for c in message)
    result = assembler.result(required=list(batch))
    assert list(result) == list(batch)
    for name, tensor in batch.items():
        assert_same(result[name], tensor.contiguous())


def test_small_chunk_size_splits_and_reassembles():
    batch = {"a": sample(torch.int16, (37,)), "b": sample(torch.float32, (11,))}
    messages = list(batch_to_chunks(batch, chunk_bytes=16))
    assert all(len(c.data) <= 16 for m in messages for c in m)
    assembler = BatchAssembler()
    for message in messages:
        assembler.add(message)
    result = assembler.result()
    for name, tensor in batch.items():
        assert_same(result[name], tensor)


def test_empty_batch_yields_nothing():
    assert list(batch_to_chunks({})) == []
    assert BatchAssembler().result() == {}


def test_unsendable_dtype_names_the_tensor():
    with pytest.raises(ValueError, match=r"^cplx: dtype torch.complex64 cannot be sent"):
        list(batch_to_chunks({"cplx": torch.zeros(2, dtype=torch.complex64)}))


def test_assembler_unknown_dtype_names_the_tensor():
    with pytest.raises(ValueError, match=r"^logits: unknown dtype 'float8'"):
        assemble(chunk("logits", dtype="float8"))


def test_assembler_negative_dim_names_the_tensor():
    with pytest.raises(ValueError, match=r"^logits: negative dimension in shape \[3, -2\]"):
        assemble(chunk("logits", shape=(3, -2)))


def test_assembler_wrong_byte_count_names_the_tensor():
    with pytest.raises(ValueError, match=r"^logits: got 4 of 8 bytes"):
        assemble(chunk("logits", shape=(2,), data=b"\0" * 4))


def test_assembler_out_of_order_offset_names_the_tensor():
    with pytest.raises(ValueError, match=r"^logits: chunk at byte 8, expected byte 4"):
        assemble(chunk("logits", shape=(4,), data=b"\0" * 4), chunk("logits", shape=(4,), offset=8, data=b"\0" * 4))
    with pytest.raises(ValueError, match=r"^logits: chunk at byte 4, expected byte 0"):
        assemble(chunk("logits", shape=(4,), offset=4, data=b"\0" * 4))


def test_assembler_duplicate_chunk_is_refused():
    first = chunk("logits", shape=(4,), data=b"\0" * 8)
    with pytest.raises(ValueError, match=r"^logits: chunk at byte 0, expected byte 8"):
        assemble(first, first)


def test_assembler_more_bytes_than_shape_names_the_tensor():
    with pytest.raises(ValueError, match=r"^logits: more bytes than shape \[2\] float32 holds"):
        assemble(chunk("logits", shape=(2,), data=b"\0" * 12))
    with pytest.raises(ValueError, match=r"^logits: more bytes than shape"):
        assemble(chunk("logits", shape=(2,), data=b"\0" * 4), chunk("logits", shape=(2,), offset=4, data=b"\0" * 8))


@pytest.mark.parametrize("second", [
    dict(dtype="float32", shape=(2, 2)),
    dict(dtype="int32", shape=(4,)),
])
def test_assembler_shape_or_dtype_change_between_chunks_names_the_tensor(second):
    with pytest.raises(ValueError, match=r"^logits: chunk says .* earlier ones float32 \[4\]"):
        assemble(chunk("logits", shape=(4,), data=b"\0" * 8), chunk("logits", offset=8, data=b"\0" * 8, **second))


def test_assembler_incomplete_tensor_names_the_tensor():
    messages = list(batch_to_chunks({"big": torch.zeros(3 * CHUNK_BYTES, dtype=torch.uint8)}))
    assembler = BatchAssembler()
    for message in messages[:-1]:
        assembler.add(message)
    with pytest.raises(ValueError, match=r"^big: got %d of %d bytes" % (2 * CHUNK_BYTES, 3 * CHUNK_BYTES)):
        assembler.result()


def test_assembler_missing_required_tensor_is_named():
    assembler = BatchAssembler()
    assembler.add([chunk("prompt_ids", dtype="int64", shape=(1,), data=b"\0" * 8)])
    with pytest.raises(ValueError, match=r"batch is missing tensors \['response_ids'\]"):
        assembler.result(required=["prompt_ids", "response_ids"])


def test_assembler_refuses_oversize_claim_before_allocating():
    # 2**31 float32 elements = 2**33 bytes: exactly the limit is allowed (nothing is allocated yet)...
    assembler = BatchAssembler()
    assembler.add([chunk("at_limit", shape=(1 << 31,), data=b"")])
    # ...one element more, or an absurd shape, is refused at once, before any buffer is made.
    for shape in [(1 << 31) + 1], [1 << 40, 1 << 40], [1 << 62, 1 << 62, 1 << 62]:
        with pytest.raises(ValueError, match=r"^huge: shape \[[\d, ]+\] is over the %d-byte limit" % MAX_TENSOR_BYTES):
            BatchAssembler().add([chunk("huge", shape=shape, data=b"\0" * 4)])


def test_assembler_unnamed_chunk_is_called_unnamed():
    with pytest.raises(ValueError, match=r"^<unnamed>: unknown dtype"):
        assemble(chunk("", dtype="nope"))


def test_assembler_zero_size_tensor_with_huge_dims_raises_value_error():
    # torch.zeros([0, 2**62, 2**62]) would raise RuntimeError (stride overflow): refused when the chunk arrives
    with pytest.raises(ValueError, match=r"^odd: "):
        BatchAssembler().add([chunk("odd", shape=(0, 1 << 62, 1 << 62), data=b"")])


# ---------------------------------------------------------------------------
# fuzz

NUMPY_DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16, "int64": np.int64, "int32": np.int32,
    "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}


@st.composite
def random_tensors(draw) -> torch.Tensor:
    name = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    if name == "bfloat16":
        values = draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False)))
        tensor = torch.from_numpy(values).to(torch.bfloat16)
    else:
        tensor = torch.from_numpy(draw(hnp.arrays(NUMPY_DTYPES[name], shape)))
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, -1)
    return tensor


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaNs of any payload must come back bit for bit, so compare bytes, not values.
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


@FUZZ
@given(random_tensors())
def test_fuzz_tensor_round_trip(tensor):
    assert same_bits(tensor_from_pb(tensor_to_pb(tensor)), tensor)


@FUZZ
@given(st.lists(random_tensors(), max_size=5), st.integers(1, 64))
def test_fuzz_batch_round_trip(tensors, chunk_bytes):
    batch = {f"t{i}": tensor for i, tensor in enumerate(tensors)}
    assembler = BatchAssembler()
    for message in batch_to_chunks(batch, chunk_bytes=chunk_bytes):
        assert all(len(c.data) <= chunk_bytes for c in message)
        assembler.add(message)
    result = assembler.result(required=list(batch))
    assert list(result) == list(batch)
    assert all(same_bits(result[name], tensor) for name, tensor in batch.items())


# Garbage kept to dims whose nonzero product fits in int64: the overflow case is the xfail test above.
garbage_chunks = st.builds(
    common_pb2.TensorChunk,
    name=st.sampled_from(["", "a", "b"]) | st.text(st.characters(exclude_categories=["Cs"]), max_size=8),
    dtype=st.sampled_from(sorted(DTYPES)) | st.text(max_size=10, alphabet="abfilnotu0123468"),
    shape=st.lists(st.integers(-3, 12) | st.integers(-(1 << 62), 1 << 62), max_size=4).filter(
        lambda dims: math.prod(abs(d) for d in dims if d) < 1 << 62),
    offset=st.integers(-4, 48) | st.integers(-(1 << 63), (1 << 63) - 1),
    data=st.binary(max_size=48),
)


@FUZZ
@given(st.lists(garbage_chunks, max_size=12), st.lists(st.sampled_from(["", "a", "b", "c"]), max_size=2))
def test_fuzz_garbage_chunks_only_raise_value_error(chunks, required):
    assembler = BatchAssembler()
    try:
        assembler.add(chunks)
        result = assembler.result(required)
    except ValueError:
        return
    for tensor in result.values():  # whatever got through is a whole, well-formed tensor
        assert isinstance(tensor, torch.Tensor)


def stream_of(messages: list, pulled: list):
    async def stream():
        for message in messages:
            pulled.append(message)
            yield message
    return stream()


def prompt_message(index: int, piece: int = 1 << 10) -> rollout_pb2.GenerateRequest:
    chunk = common_pb2.TensorChunk(name="prompt_ids", dtype="uint8", shape=[1 << 30], offset=index * piece,
                                   data=bytes(piece))
    return rollout_pb2.GenerateRequest(chunks=[chunk])


class CountingAssembler(BatchAssembler):
    def __init__(self):
        super().__init__()
        self.taken = 0

    def add(self, chunks):
        self.taken += 1
        super().add(chunks)


def test_read_stream_holds_nothing_of_a_stream_past_its_byte_limit_and_refuses_it_at_its_end():
    pulled, assembler = [], CountingAssembler()
    messages = [prompt_message(index) for index in range(100)]
    with pytest.raises(ResourceExhausted, match="limit of 10000 bytes .setting max_request_bytes"):
        asyncio.run(read_stream(stream_of(messages, pulled), assembler, StreamLimits(10_000, 10.0)))
    assert (assembler.taken, len(pulled)) == (9, 100)  # each just over 1 KiB: the tenth passes 10,000


def test_read_stream_counts_each_empty_message_as_a_kibibyte():
    pulled = []
    assembler = CountingAssembler()
    with pytest.raises(ResourceExhausted):
        asyncio.run(read_stream(stream_of([rollout_pb2.GenerateRequest()] * 100, pulled), assembler,
                                StreamLimits(10 * MESSAGE_FLOOR_BYTES, 10.0)))
    assert assembler.taken == 10


def test_read_stream_refuses_a_stream_past_its_limit_at_its_deadline_if_it_does_not_end():
    async def never_ending():
        for index in range(20):
            yield prompt_message(index)
        await asyncio.Event().wait()

    with pytest.raises(ResourceExhausted):
        asyncio.run(read_stream(never_ending(), BatchAssembler(), StreamLimits(10_000, 0.2)))


def test_read_stream_ends_a_stream_still_open_at_its_deadline():
    async def never_ending():
        yield prompt_message(0)
        await asyncio.Event().wait()

    with pytest.raises(TimeoutError, match="did not end within 0.2 s .setting request_stream_timeout_s"):
        asyncio.run(read_stream(never_ending(), BatchAssembler(), StreamLimits(1 << 20, 0.2)))


def test_read_stream_drains_a_stream_within_its_limit_before_refusing_a_bad_chunk():
    pulled = []
    bad = common_pb2.TensorChunk(name="x", dtype="complex64", shape=[1], data=b"")
    messages = [rollout_pb2.GenerateRequest(chunks=[bad]), *[prompt_message(index) for index in range(5)]]
    with pytest.raises(ValueError, match="unknown dtype"):
        asyncio.run(read_stream(stream_of(messages, pulled), BatchAssembler(), StreamLimits(1 << 20, 10.0)))
    assert len(pulled) == 6
