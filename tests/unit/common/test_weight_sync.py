"""CPU tests of services/common/weight_sync.py and the gloo channel of services/common/gloo_channel.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.channel import ChannelTable, open_weight_channel
from services.common.errors import NotFound
from services.common.gloo_channel import GlooChannel, prepare_gloo_rendezvous
from services.common.timing import StageTimer
from services.common.weight_sync import (ALIGN, BucketBuffers, StagedWeights, WeightReceiver, WeightSender, checksum,
                                         plan_buckets, unpack)


def weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(10, 7, generator=generator)),                       # 280 bytes
        ("norm.weight", torch.randn(5, generator=generator).to(torch.bfloat16)),         # 10 bytes
        ("step", torch.tensor(123456789012, dtype=torch.int64)),                         # 0-dim, 8 bytes
        ("layer.0.w", torch.randn(3, 3, generator=generator).to(torch.float16)),         # 18 bytes
        ("mask", torch.tensor([True, False, True])),                                      # 3 bytes
        ("empty", torch.zeros(0, 4)),                                                     # 0 bytes
        ("ids", torch.randint(-(1 << 40), 1 << 40, (6,), generator=generator)),          # int64, 48 bytes
        ("head.weight", torch.randn(4, 16, generator=generator).to(torch.bfloat16)),     # 128 bytes
        ("bias", torch.randn(3, generator=generator, dtype=torch.float64)),               # 24 bytes
    ]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------
# plan_buckets


def check_plan(named, bucket_bytes):
    buckets = plan_buckets(named, bucket_bytes)
    entries = [e for b in buckets for e in b.entries]
    assert [e.name for e in entries] == [name for name, _ in named]  # order kept, nothing lost
    for bucket in buckets:
        assert bucket.entries
        assert bucket.size % ALIGN == 0
        end = 0
        for entry in bucket.entries:
            assert entry.offset % ALIGN == 0
            assert entry.offset >= end  # no overlap
            end = entry.offset + entry.nbytes
        assert end <= bucket.size
        if len(bucket.entries) > 1:
            assert bucket.size <= bucket_bytes
    return buckets


def test_plan_by_hand():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(5)), ("c", torch.zeros(30)), ("d", torch.zeros(1)),
             ("e", torch.zeros(2, dtype=torch.int64))]
    # 40 -> 48, 20 -> 32 ... a + b = 80 <= 96; c (120 bytes) is larger than 96 so it goes alone; d + e fit together.
    buckets = check_plan(named, 96)
    assert [[(e.name, e.offset) for e in b.entries] for b in buckets] == [
        [("a", 0), ("b", 48)], [("c", 0)], [("d", 0), ("e", 16)]
    ]
    assert [b.size for b in buckets] == [80, 128, 32]


def test_tensor_larger_than_the_limit_goes_alone():
    named = [("small", torch.zeros(4)), ("huge", torch.zeros(1000)), ("small2", torch.zeros(4))]
    buckets = check_plan(named, 64)
    assert [[e.name for e in b.entries] for b in buckets] == [["small"], ["huge"], ["small2"]]
    assert buckets[1].size == 4000


def test_each_tensor_of_the_model_lands_in_some_bucket():
    named = weights()
    for bucket_bytes in (16, 64, 128, 4096):
        buckets = check_plan(named, bucket_bytes)
        assert (len(buckets) == 1) == (bucket_bytes == 4096)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32,
                                                                torch.int64])), max_size=12),
       st.integers(1, 20).map(lambda n: n * ALIGN))
def test_fuzz_plan_respects_limit_alignment_and_order(sizes, bucket_bytes):
    named = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (n, dtype) in enumerate(sizes)]
    check_plan(named, bucket_bytes)


def test_limit_that_is_not_a_multiple_of_the_alignment_is_respected():
    buckets = plan_buckets([("a", torch.zeros(1)), ("b", torch.zeros(1))], bucket_bytes=20)
    assert all(b.size <= 20 for b in buckets if len(b.entries) > 1)


# ---------------------------------------------------------------------------
# pack / unpack / checksum


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_pack_unpack_round_trip(bucket_bytes):
    named = weights()
    named[0] = ("embed.weight", named[0][1].t())  # a non-contiguous source
    tensors = dict(named)
    buckets = plan_buckets(named, bucket_bytes)
    buffers = BucketBuffers(buckets, 1, "cpu")  # one buffer: every bucket is packed where the one before was
    got = {}
    for index, bucket in enumerate(buckets):
        buffer = buffers.pack(index, tensors)
        assert buffer.dtype == torch.uint8 and buffer.numel() == bucket.size
        got.update((name, tensor.clone()) for name, tensor in unpack(bucket, buffer))
    assert list(got) == list(tensors)
    for name, tensor in tensors.items():
        assert_same(got[name], tensor.contiguous())


def test_pack_puts_bytes_at_the_offsets_and_zero_padding_between():
    a, b = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([-1], dtype=torch.int64)
    dirt = torch.full((32,), 255, dtype=torch.uint8)
    buckets = plan_buckets([("dirt", dirt)], 64) + plan_buckets([("a", a), ("b", b)], 64)
    buffers = BucketBuffers(buckets, 1, "cpu")  # the two buckets take turns in one buffer
    buffers.pack(0, {"dirt": dirt})
    buffer = buffers.pack(1, {"a": a, "b": b})
    assert buffer.tolist() == [1, 2, 3] + [0] * 13 + [255] * 8 + [0] * 8


def random_buffer(size=4096, seed=0) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_checksum_by_hand():
    words = torch.tensor([1, -2, 3, 7], dtype=torch.int32)
    assert checksum(words.view(torch.uint8)) == 1 * 1 + (-2) * 2 + 3 * 3 + 7 * 4
    big = torch.full((300,), 2, dtype=torch.int32)  # weights 1..256, then 1..44 again
    assert checksum(big.view(torch.uint8)) == 2 * (sum(range(1, 257)) + sum(range(1, 45)))
    rows = torch.arange(1024, dtype=torch.int32)  # four whole rows of 256 words: sum of i * ((i mod 256) + 1)
    assert checksum(rows.view(torch.uint8)) == sum(i * (i % 256 + 1) for i in range(1024))


@pytest.mark.parametrize("position", [0, 1, 2, 3, 1000, 4095])
@pytest.mark.parametrize("delta", [1, 128, 255])
def test_checksum_changes_when_one_byte_changes(position, delta):
    buffer = random_buffer()
    changed = buffer.clone()
    changed[position] = (int(changed[position]) + delta) % 256
    assert checksum(changed) != checksum(buffer)


@pytest.mark.parametrize(("i", "j"), [(0, 1), (10, 11), (0, 250), (5, 700), (1023, 1022)])
def test_checksum_changes_when_two_words_are_swapped(i, j):
    buffer = random_buffer()
    words = buffer.clone().view(torch.int32)
    assert words[i] != words[j]
    words[[i, j]] = words[[j, i]]
    assert checksum(words.view(torch.uint8)) != checksum(buffer)


def test_checksum_of_an_empty_bucket_is_zero():
    assert checksum(torch.zeros(0, dtype=torch.uint8)) == 0


# ---------------------------------------------------------------------------
# over a real gloo channel, ranks in threads


def run_ranks(world_size: int, target, timeout_s: float = 20.0) -> dict[int, object]:
    """Run ``target(rank)`` in one thread per rank; the outcome (result or exception) of each rank."""
    outcomes: dict[int, object] = {}

    def run(rank):
        try:
            outcomes[rank] = target(rank)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcomes[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return outcomes


def test_weights_over_gloo_to_two_receivers_in_several_buckets():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    named = weights()
    expected_buckets = len(plan_buckets(named, 64))
    assert expected_buckets >= 4

    def rank_main(rank):
        channel = GlooChannel("weights", rendezvous, rank, world_size=3, timeout_s=10)
        assert (channel.rank, channel.world_size) == (rank, 3)
        try:
            if rank == 0:
                return WeightSender().send(channel, named, version=42, bucket_bytes=64)
            loaded: list[list[tuple[str, torch.Tensor]]] = []
            version = WeightReceiver().receive(channel, lambda pairs: loaded.append([(n, t.clone()) for n, t in pairs]))
            return version, loaded
        finally:
            channel.close()

    outcomes = run_ranks(3, rank_main)
    for outcome in outcomes.values():
        if isinstance(outcome, BaseException):
            raise outcome
    total, buckets = outcomes[0]
    assert buckets == expected_buckets
    assert total == sum(b.size for b in plan_buckets(named, 64))
    for rank in (1, 2):
        version, loaded = outcomes[rank]
        assert version == 42
        assert len(loaded) == expected_buckets  # load is called once per bucket
        got = [pair for bucket in loaded for pair in bucket]
        assert [name for name, _ in got] == [name for name, _ in named]
        for (_, tensor), (_, want) in zip(got, named):
            assert_same(tensor, want)
    del store


class Recording:
    """A real channel that also records the size of each broadcast it carries."""

    def __init__(self, channel):
        self.channel, self.device, self.sizes = channel, channel.device, []

    def broadcast(self, tensor, root=0):
        self.sizes.append(tensor.numel())
        self.channel.broadcast(tensor, root)

    def start_broadcast(self, tensor, root=0):
        self.sizes.append(tensor.numel())
        return self.channel.start_broadcast(tensor, root)


def test_the_manifest_crosses_a_channel_again_only_when_it_changes_and_kept_buffers_take_turns():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    named = weights()
    changed = [(name, ~tensor if tensor.dtype == torch.bool else tensor + 1) for name, tensor in named]
    fewer = named[:2]
    channels = run_ranks(2, lambda rank: GlooChannel("manifests", rendezvous, rank, world_size=2, timeout_s=10))
    sender, sending, receiving = Recording(channels[0]), WeightSender(), WeightReceiver()
    for version, tensors in enumerate((named, changed, fewer, fewer), start=1):
        loaded: list[tuple[str, torch.Tensor]] = []
        outcomes = run_ranks(2, lambda rank: sending.send(sender, tensors, version, bucket_bytes=64) if rank == 0
                             else receiving.receive(channels[1], lambda pairs: loaded.extend((n, t.clone()) for n,
                                                                                             t in pairs),
                                                    keep_buffers=version > 1))  # buffers kept from the second on
        assert outcomes[1] == version
        assert [name for name, _ in loaded] == [name for name, _ in tensors]
        for (_, tensor), (_, want) in zip(loaded, tensors):
            assert_same(tensor, want)
        buckets = len(plan_buckets(tensors, 64))
        with_manifest = version in (1, 3)  # the first broadcast and the one whose tensors changed carry it
        assert len(sender.sizes) == 1 + with_manifest + 2 * buckets  # header, [manifest], (bucket, checksum) each
        assert sender.sizes[0] == 2
        sender.sizes.clear()
    del store


class Corrupting:
    """A receiver's real channel that flips one byte of the ``nth`` broadcast it receives (counting from 0), as a
    bad link or a bad buffer would."""

    def __init__(self, channel, nth: int):
        self.channel, self.device, self.nth, self.count = channel, channel.device, nth, 0

    def broadcast(self, tensor, root=0):
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor, root=0):
        transfer, corrupt = self.channel.start_broadcast(tensor, root), self.count == self.nth
        self.count += 1

        class Arriving:
            def wait(self):
                transfer.wait()
                if corrupt:
                    tensor.view(torch.uint8)[3] ^= 0x10

        return Arriving()


@pytest.mark.parametrize("keep_buffers", [False, True])
def test_a_bucket_that_arrives_damaged_fails_the_receive_naming_it(keep_buffers):
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    named = weights()
    assert len(plan_buckets(named, 64)) >= 3
    channels = run_ranks(2, lambda rank: GlooChannel(f"damaged-{keep_buffers}", rendezvous, rank, world_size=2,
                                                     timeout_s=10))
    loaded: list[list[tuple[str, torch.Tensor]]] = []
    # broadcasts: header, manifest, then (bucket, checksum) per bucket: the 6th is bucket 2
    outcomes = run_ranks(2, lambda rank: WeightSender().send(channels[0], named, 3, bucket_bytes=64) if rank == 0 else
                         WeightReceiver().receive(Corrupting(channels[1], nth=6), loaded.append,
                                                  keep_buffers=keep_buffers))
    assert isinstance(outcomes[1], ValueError)
    assert str(outcomes[1]) == "weight buckets [2] of version 3 failed their checksums"
    del store


def test_staged_weights_arrive_on_their_own_thread_while_the_caller_goes_on():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    named = weights()
    channels = run_ranks(2, lambda rank: GlooChannel("staged", rendezvous, rank, world_size=2, timeout_s=10))
    staged = StagedWeights(channels[1], WeightReceiver())
    assert not staged.wait(0.2)  # nothing sent yet: the receiver is not blocked, it is told "not yet"
    sent = StageTimer()
    WeightSender().send(channels[0], named, version=7, bucket_bytes=64, timer=sent)
    assert set(sent.seconds) == {"manifest", "pack", "transfer"}  # where a sync's time goes, for the benchmark
    assert staged.wait(10)
    assert staged.version == 7
    assert set(staged.timer.seconds) == {"receive", "manifest", "transfer", "verify", "load"}
    got = [pair for bucket in staged.buckets for pair in bucket]
    assert [name for name, _ in got] == [name for name, _ in named]
    for (_, tensor), (_, want) in zip(got, named):
        assert_same(tensor, want)
    del store


def test_staged_weights_hand_back_the_transfer_error():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    channels = run_ranks(2, lambda rank: GlooChannel("staged-quiet", rendezvous, rank, world_size=2, timeout_s=1))
    staged = StagedWeights(channels[1], WeightReceiver())
    with pytest.raises(TimeoutError, match="did not finish within 1.0 s"):
        staged.wait(10)
    del store


def test_join_where_a_rank_never_comes_times_out():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    started = time.monotonic()
    outcomes = run_ranks(2, lambda rank: GlooChannel("lonely", rendezvous, rank, world_size=3,
                                                     timeout_s=2))  # rank 2 never joins
    elapsed = time.monotonic() - started
    for rank in (0, 1):
        assert isinstance(outcomes[rank], TimeoutError), outcomes[rank]
        assert "channel lonely: not all 3 members joined within 2" in str(outcomes[rank])
    assert 1.5 < elapsed < 9  # the channel's 2 s, not the store's 10 s
    del store


def test_receive_with_no_sender_times_out():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    channels = run_ranks(2, lambda rank: GlooChannel("quiet", rendezvous, rank, world_size=2, timeout_s=1))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"broadcast from rank 0 did not finish within 1.0 s"):
        WeightReceiver().receive(channels[1], lambda pairs: None)
    assert time.monotonic() - started < 9  # the channel's 1 s, not the store's 10 s
    del store


@pytest.mark.parametrize(("rendezvous", "rank", "message"), [
    (b"no-port secret", 0, "gloo rendezvous must be 'host:port secret'"),
    (b"127.0.0.1:1 secret", 3, "rank 3 is outside world_size 3"),
    (b"127.0.0.1:1 secret", -1, "rank -1 is outside world_size 3"),
])
def test_bad_join_arguments_are_refused_at_once(rendezvous, rank, message):
    with pytest.raises(ValueError, match=message):
        GlooChannel("x", rendezvous, rank, world_size=3, timeout_s=1)


async def test_channel_table_joins_gets_and_replaces():
    tables = [ChannelTable(), ChannelTable()]

    async def join_both(channel_id):
        store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
        await asyncio.gather(*(t.join(channel_id, "gloo", rendezvous, rank=rank, world_size=2, timeout_s=5) for rank,
                               t in enumerate(tables)))
        return store

    first = await join_both("c")
    old = tables[1].get("c")
    assert old.rank == 1
    second = await join_both("c")  # joining again (fresh rendezvous) replaces the old channel
    assert tables[1].get("c") is not old and old._group is None
    for table in tables:
        table.close_all()
        with pytest.raises(NotFound, match=r"channel 'c' not joined"):
            table.get("c")
    del first, second


def test_channel_table_get_unknown_raises_not_found():
    with pytest.raises(NotFound, match=r"channel 'missing' not joined"):
        ChannelTable().get("missing")


async def test_channel_table_refuses_other_backends_and_bad_timeouts():
    table = ChannelTable()  # on the CPU
    with pytest.raises(ValueError, match=r"channel backend nccl needs a CUDA device, this service runs on 'cpu'"):
        await table.join("c", "nccl", b"127.0.0.1:1", rank=0, world_size=2, timeout_s=5)
    with pytest.raises(ValueError, match=r"channel backend cuda_ipc needs a CUDA device, this service runs on 'cpu'"):
        await table.join("c", "cuda_ipc", b"127.0.0.1:1", rank=0, world_size=1, timeout_s=5)
    with pytest.raises(ValueError, match=r"channel backend must be gloo, nccl or cuda_ipc, got 'mpi'"):
        await table.join("c", "mpi", b"127.0.0.1:1", rank=0, world_size=2, timeout_s=5)
    with pytest.raises(ValueError, match=r"timeout_s must be positive"):
        await table.join("c", "gloo", b"127.0.0.1:1", rank=0, world_size=2, timeout_s=0)


def test_a_member_that_died_fails_the_broadcast_at_once_naming_that():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    member = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from services.common.gloo_channel import GlooChannel; "
        f"GlooChannel('gone', {rendezvous!r}, 1, world_size=2, timeout_s=10); os._exit(0)")])
    channel = GlooChannel("gone", rendezvous, 0, world_size=2, timeout_s=30)
    member.wait(10)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="broadcast from rank 0 failed: a member is gone"):
        for _ in range(100):  # the first sends may still land in the socket's buffer
            channel.broadcast(torch.zeros(1 << 16))
    assert time.monotonic() - started < 10  # not the 30 s deadline
    del store



@pytest.mark.parametrize("end", ["abandon", "close"])
def test_abandoning_a_channel_ends_a_broadcast_waiting_for_a_member_that_never_comes(end):
    """A member stopped mid-sync (rank 2 here never takes part) holds the sender and the other members until the
    deadline (30 s); abandoning (or closing) the sender's channel from another thread, as a trainer replacing the
    channel does, ends the broadcast there and at the members at once, not at the deadline."""
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    channels = run_ranks(3, lambda rank: GlooChannel("stalled", rendezvous, rank, world_size=3, timeout_s=30))
    ended: dict[int, float] = {}

    def rank_main(rank):
        try:
            if rank == 0:
                return WeightSender().send(channels[0], weights(), version=1, bucket_bytes=64)
            if rank == 1:
                return WeightReceiver().receive(channels[1], lambda pairs: None)
            time.sleep(0.5)  # rank 2 is stopped: the others wait for it by now
            getattr(channels[0], end)()
        finally:
            ended[rank] = time.monotonic()

    outcomes = run_ranks(3, rank_main)
    assert isinstance(outcomes[0], ConnectionError), outcomes[0]
    assert ("channel stalled: broadcast from rank 0 ended: the channel was abandoned while it was on the wire"
            in str(outcomes[0]))
    assert isinstance(outcomes[1], ConnectionError), outcomes[1]  # the sender's connections are closed
    assert ended[0] - ended[2] < 10 and ended[1] - ended[2] < 10  # not the 30 s deadline
    with pytest.raises(ConnectionError, match="channel stalled was abandoned: nothing more can be sent on it"):
        channels[0].start_broadcast(torch.zeros(1))
    started = time.monotonic()
    for channel in channels.values():  # nothing is left waiting on the groups: closing them is quick
        channel.close()
    assert time.monotonic() - started < 10  # not the 30 s deadline of a group still waiting
    del store


def test_a_rendezvous_not_reached_in_time_is_a_timeout_which_may_pass():
    """The store gone (its root left): a TimeoutError (DEADLINE_EXCEEDED, retried), not torch's DistNetworkError,
    a RuntimeError that would read as the request's own fault (INTERNAL, never retried)."""
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    del store
    with pytest.raises(TimeoutError, match=r"channel c: rank 1 did not reach the rendezvous within 0.2 s"):
        open_weight_channel("c", "gloo", rendezvous=rendezvous, rank=1, world_size=2, timeout_s=0.2, device="cpu")


def test_a_senders_channels_carrying_one_manifest_share_its_bucket_buffers():
    """One channel per transport (e.g. CUDA IPC to the rollout on the trainer's GPU, NCCL to the others): the
    trainer sends into them in turn, so they share one set of buffers, and each receiver gets the weights whole."""
    named = weights()
    channels = {}
    for name in ("beside", "apart"):
        store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
        channels[name] = store, run_ranks(2, lambda rank: GlooChannel(name, rendezvous, rank, world_size=2,
                                                                      timeout_s=10))
    sending = WeightSender()
    for _, ranks in channels.values():
        sender, receiver = ranks[0], ranks[1]
        loaded: list[tuple[str, torch.Tensor]] = []
        outcomes = run_ranks(2, lambda rank: sending.send(sender, named, 7, bucket_bytes=64) if rank == 0
                             else WeightReceiver().receive(receiver,
                                                           lambda pairs: loaded.extend((n, t.clone()) for n,
                                                                                       t in pairs)))
        assert outcomes[1] == 7
        for (_, tensor), (_, want) in zip(loaded, named, strict=True):
            assert_same(tensor, want)
    assert sending._sent[channels["beside"][1][0]][1] is sending._sent[channels["apart"][1][0]][1]
    for channel in (ranks[rank] for _, ranks in channels.values() for rank in (0, 1)):
        channel.close()
