"""Where a gloo channel listens: the rendezvous store on the service's own address only, each member on its
address towards the rendezvous."""

from __future__ import annotations

import socket

import pytest

from services.common.gloo_channel import address_towards, prepare_gloo_rendezvous


def this_machines_other_address() -> str | None:
    """A non-loopback address of this machine (the source address towards a public one), if it has one."""
    try:
        address = address_towards("192.0.2.1")  # TEST-NET-1: nothing is sent
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_member_listens_on_its_address_towards_the_rendezvous():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    other = this_machines_other_address()
    if other is not None:
        assert address_towards(other) == other


def test_the_rendezvous_store_listens_on_the_services_address_only():
    other = this_machines_other_address()
    if other is None:
        pytest.skip("this machine has no address but loopback to try the store from")
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    assert rendezvous == f"127.0.0.1:{store.port}".encode()
    socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # a store on every interface would answer here
        socket.create_connection((other, store.port), timeout=5)
    reachable, _ = prepare_gloo_rendezvous("127.0.0.1", 10, listen_host="0.0.0.0")  # a service bound to all
    socket.create_connection((other, reachable.port), timeout=5).close()
