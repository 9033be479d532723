"""CPU tests of services/coordctl/tables.py: the aligned tables coordctl prints."""

from __future__ import annotations

from services.coordctl.control import ServiceEntry
from services.coordctl.tables import SERVICE_COLUMNS, aligned, service_rows


def test_columns_are_as_wide_as_their_widest_cell_and_numbers_align_right():
    lines = aligned(("NAME", "N", "NOTE"), [("a", "10", "x"), ("longer", "2", "")], right=("N",))
    assert lines == ["NAME     N  NOTE",
                     "a       10  x",
                     "longer   2"]  # the last column unpadded


def test_a_service_row_says_what_is_unknown_and_what_holds_no_weights():
    entries = [
        ServiceEntry(kind="trainer", address="node2:7071", group="default", state="up", last_seen_s=0.44,
                     service_id="trainer-node2", hostname="node2", gpu="cuda:0 NVIDIA H200",
                     meshrl_version="0.1.0", weight_version=0),
        ServiceEntry(kind="reward", address="node1:7073", group="default", state="up", last_seen_s=1.06,
                     service_id="reward-node1", hostname="node1", gpu="cpu", meshrl_version="0.1.0",
                     weight_version=None),
        ServiceEntry(kind="rollout", address="node1:7072", group="fast", state="down", last_seen_s=12.0,
                     service_id="rollout-node1"),  # too old to say
    ]
    rows = service_rows(entries)
    assert rows == [  # by host, then kind
        ("?", "rollout", "fast", "node1:7072", "?", "?", "-", "12.0 s", "down", "rollout-node1"),
        ("node1", "reward", "default", "node1:7073", "cpu", "0.1.0", "-", "1.1 s", "up", "reward-node1"),
        ("node2", "trainer", "default", "node2:7071", "cuda:0 NVIDIA H200", "0.1.0", "0", "0.4 s", "up",
         "trainer-node2"),  # version 0 (a model loaded, not yet updated) is a version
    ]
    header, *_ = aligned(SERVICE_COLUMNS, rows)
    assert header.split() == ["HOST", "KIND", "GROUP", "ADDRESS", "GPU", "VERSION", "WEIGHTS", "SEEN", "STATE", "ID"]
