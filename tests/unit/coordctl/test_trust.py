"""What `coordctl checkpoint trust` agrees to sign (services/coordctl/trust.py): a finished save without a
manifest, signed with the key of the folder above it, as a checkpoint of the run whose folder holds it; anything
else is refused naming the file (tests/integration/test_files.py signs a real one and resumes from it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.manifest import checkpoint_key, verify, write_manifest
from services.coordctl.trust import describe, key_folder, run_of, trainer_folders, unsigned


def saved(folder: Path) -> Path:
    """A trainer's checkpoint folder as a save leaves it, less the manifest."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"m" * 10)
    (folder / "__0_0.distcp").write_bytes(b"w" * 1234)
    (folder / "trainer_state.pt").write_bytes(b"s" * 7)
    return folder


def test_a_step_folders_trainer_folders_are_listed_with_their_sizes_and_signed_as_the_runs(tmp_path):
    checkpoint_key(tmp_path)
    step = tmp_path / "runs" / "r-1" / "checkpoints" / "step_000004"
    actor, critic = saved(step / "actor"), saved(step / "critic")
    assert trainer_folders(step) == [actor, critic] and trainer_folders(actor) == [actor]
    shown = unsigned(actor)
    assert shown.files == {".metadata": 10, "__0_0.distcp": 1234, "trainer_state.pt": 7}
    assert key_folder(step, None) == tmp_path and run_of(step, None) == "r-1" and run_of(step, "other") == "other"
    text = describe([shown], "r-1", tmp_path)
    assert f"{actor} (3 files, 1,251 bytes):" in text and "1,234  __0_0.distcp" in text
    assert text.endswith(f"signed as a checkpoint of run r-1 with {tmp_path}/checkpoint.key")
    write_manifest(actor, "r-1", checkpoint_key(tmp_path))
    assert verify(actor, checkpoint_key(tmp_path))["run_id"] == "r-1"


@pytest.mark.parametrize("spoil, words", [
    (lambda f: write_manifest(f, "r-1", b"k" * 32), "is signed already"),
    (lambda f: (f / "meshrl_staging.json").write_text("{}"), "a save that did not finish"),
    (lambda f: (f / "trainer_state.pt").unlink(), "holds no trainer_state.pt"),
    (lambda f: (f / "passwd").symlink_to("/etc/passwd"), "is not a plain file"),
])
def test_anything_but_a_finished_unsigned_save_is_refused_naming_why(tmp_path, spoil, words):
    folder = saved(tmp_path / "runs" / "r-1" / "checkpoints" / "step_000001" / "actor")
    spoil(folder)
    with pytest.raises(ValueError, match=words):
        unsigned(folder)


def test_a_folder_with_no_checkpoint_no_key_or_no_run_is_refused_saying_what_to_give(tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint folder"):
        trainer_folders(tmp_path)
    elsewhere = saved(tmp_path / "ckpt" / "step_000001" / "actor")
    with pytest.raises(ValueError, match="give --state-dir"):
        key_folder(elsewhere, None)
    with pytest.raises(ValueError, match=r"checkpoint\.key does not exist"):
        key_folder(elsewhere, tmp_path)
    with pytest.raises(ValueError, match="give --run RUN_ID"):
        run_of(elsewhere, None)
