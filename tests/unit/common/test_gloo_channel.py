"""Who can reach a gloo channel: the rendezvous store on the service's own address only (never every
interface), values in it taken only when signed with the channel's secret, each member on its address towards
the rendezvous."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist

from services.common.gloo_channel import (GlooChannel, SignedStore, address_towards, parse_rendezvous,
                                          prepare_gloo_rendezvous, rendezvous_host)
from tests.unit.common.test_weight_sync import run_ranks


def this_machines_other_address() -> str | None:
    """A non-loopback address of this machine (the source address towards a public one), if it has one."""
    try:
        address = address_towards("192.0.2.1")  # TEST-NET-1: nothing is sent
    except OSError:
        return None
    return None if address.startswith("127.") else address


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses on which a TCP socket of this machine listens on ``port`` (/proc/net/tcp)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_a_member_listens_on_its_address_towards_the_rendezvous():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    other = this_machines_other_address()
    if other is not None:
        assert address_towards(other) == other


def test_the_rendezvous_store_listens_on_the_services_address_only():
    store, rendezvous = prepare_gloo_rendezvous(rendezvous_host("127.0.0.1", "127.0.0.1:4000"), 10)
    host, port, secret = parse_rendezvous(rendezvous)
    assert (host, port) == ("127.0.0.1", store.port) and len(secret) == 32
    assert listening_addresses(store.port) == {"127.0.0.1"}  # not 0.0.0.0
    other = this_machines_other_address()
    if other is not None:
        with pytest.raises(ConnectionRefusedError):  # a store on every interface would answer here
            socket.create_connection((other, store.port), timeout=5)
    # a service bound to every interface: its stores listen on its address towards the coordinator
    assert rendezvous_host("0.0.0.0", "127.0.0.1:4000") == "127.0.0.1"
    assert rendezvous_host("[::]", "localhost:4000") == "127.0.0.1"
    if other is not None:
        assert rendezvous_host("0.0.0.0", f"{other}:4000") == other
    assert rendezvous_host("10.1.2.3", "127.0.0.1:4000") == "10.1.2.3"


def test_keys_a_stranger_writes_into_the_store_are_passed_over_and_the_channel_forms():
    """The stranger reaches the store (it listens where the members reach it), lists its keys and writes the ones
    gloo reads, with addresses of its own, before the members join; rank 1 joins late, so rank 0 reads rank 1's
    key before rank 1 writes it (unsigned, gloo took the stranger's and failed: std::bad_alloc). Each member
    waits for a signed value."""
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    run_ranks(2, lambda rank: GlooChannel("seen", rendezvous, rank, world_size=2, timeout_s=10).close())
    keys = [key.replace("channel/seen/", "channel/weights/") for key in stranger.list_keys()]
    assert len(keys) == 2  # one per rank: each member's address
    for key in keys:
        stranger.set(key, b"10.66.66.66:6666 (the stranger's)")

    def rank_main(rank):
        time.sleep(0.5 * rank)
        channel = GlooChannel("weights", rendezvous, rank, world_size=2, timeout_s=10)
        try:
            received = torch.full((4,), float(rank))
            channel.broadcast(received)
            return received
        finally:
            channel.close()

    outcomes = run_ranks(2, rank_main)
    assert all(torch.equal(outcomes[rank], torch.zeros(4)) for rank in (0, 1)), outcomes


def test_a_value_overwritten_by_a_stranger_is_refused_naming_the_key():
    store, _ = prepare_gloo_rendezvous("127.0.0.1", 10)
    timeout = datetime.timedelta(seconds=0.3)
    member = SignedStore(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout), b"s3cret", timeout)
    member.set("channel/c//0/1", b"10.0.0.2:5000")
    assert member.get("channel/c//0/1") == b"10.0.0.2:5000"
    store.set("channel/c//0/1", b"10.66.66.66:6666")  # after the member's: nothing signs it again
    with pytest.raises(dist.DistStoreError, match="'channel/c//0/1' holds a value not signed with the channel's"):
        member.get("channel/c//0/1")
    wrong = SignedStore(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout), b"guess", timeout)
    wrong.set("channel/c//0/1", b"10.66.66.66:6666")  # signed with another secret
    with pytest.raises(dist.DistStoreError, match="not signed with the channel's secret"):
        member.get("channel/c//0/1")


@pytest.mark.parametrize("rendezvous", [b"127.0.0.1:1", b"no-port secret", b"127.0.0.1:http secret"])
def test_a_rendezvous_without_address_or_secret_is_refused_at_once(rendezvous):
    with pytest.raises(ValueError, match="gloo rendezvous must be 'host:port secret'"):
        GlooChannel("x", rendezvous, 0, world_size=2, timeout_s=1)
