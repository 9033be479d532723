"""A checkpoint's signed manifest: what passes and what is refused, naming the file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from services.common.manifest import KEY_FILE, MANIFEST, DamagedCheckpoint, checkpoint_key, verify, write_manifest

KEY = b"k" * 32


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "step_000002" / "actor"
    (folder / "shards").mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"\x80\x04metadata")
    (folder / "shards" / "__0_0.distcp").write_bytes(os.urandom(4096))
    write_manifest(folder, "run-1", KEY)
    return folder


def test_a_saved_folder_verifies_and_names_its_run(folder):
    assert verify(folder, KEY)["run_id"] == "run-1"


@pytest.mark.parametrize("damage, named", [
    (lambda f: (f / "shards" / "__0_0.distcp").write_bytes(b"cut"), "__0_0.distcp does not match"),
    (lambda f: (f / ".metadata").write_bytes(b"\x80\x04metadatb"), ".metadata does not match"),
    (lambda f: (f / ".metadata").unlink(), ".metadata is missing"),
    (lambda f: (f / "extra.pt").write_bytes(b"x"), "extra.pt is not in the checkpoint's manifest"),
    (lambda f: (f / MANIFEST).unlink(), f"{MANIFEST} does not exist"),
    (lambda f: (f / MANIFEST).write_text("{"), "cannot be read as a manifest"),
])
def test_a_damaged_folder_is_refused_naming_the_file(folder, damage, named):
    damage(folder)
    with pytest.raises(DamagedCheckpoint, match=named.replace(".", r"\.")):
        verify(folder, KEY)


def test_a_manifest_altered_or_signed_with_another_key_is_refused(folder):
    signed = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**signed, "run_id": "run-2"}))  # its body changed, its signature not
    with pytest.raises(DamagedCheckpoint, match="not signed with this cluster's key"):
        verify(folder, KEY)
    (folder / ".metadata").write_bytes(b"crafted pickle")
    write_manifest(folder, "run-1", b"an attacker's key")  # digests that match, signed without the cluster's key
    with pytest.raises(DamagedCheckpoint, match="not signed with this cluster's key"):
        verify(folder, KEY)


def test_the_key_is_made_once_owner_only_and_read_by_every_later_caller(tmp_path):
    root = tmp_path / "state"
    made = checkpoint_key(root)
    assert len(made) == 32 and checkpoint_key(root) == made
    assert stat.S_IMODE((root / KEY_FILE).stat().st_mode) == 0o600
    assert sorted(p.name for p in root.iterdir()) == [KEY_FILE]  # nothing half-made left beside it
