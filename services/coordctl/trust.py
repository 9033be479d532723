"""``coordctl checkpoint trust PATH``: adopt a checkpoint saved before meshrl signed its checkpoints.

A trainer's checkpoint folder is loaded (resume, ``coordctl export``) only once its signed manifest matches its
files (``services.common.manifest``), so one saved before manifests existed is refused. An operator who knows
where such a folder came from signs it here: the files are listed with their sizes for the operator to confirm,
then the manifest is written as a trainer writes it, with the key of the folder the checkpoints are kept under.

Only a folder that looks like a finished save is signed: a torch.distributed.checkpoint folder (``.metadata``)
with the trainer's state beside it, plain files only, no manifest yet (one that exists and does not match is a
damaged or altered checkpoint, which signing would hide), not a save in progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.manifest import EXTRA, KEY_FILE, MANIFEST, STAGING

DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class Unsigned:
    """A trainer's checkpoint folder to sign, and what is in it."""

    folder: Path
    files: dict[str, int]  # path inside the folder -> bytes


def trainer_folders(path: Path) -> list[Path]:
    """The trainer checkpoint folders ``path`` names: itself when it holds a checkpoint (step_N/<roles>), else
    each folder in it that does (step_N); ValueError naming ``path`` when there is none."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    if (path / DCP_METADATA).exists():
        return [path]
    found = sorted(folder for folder in path.iterdir() if folder.is_dir() and (folder / DCP_METADATA).exists())
    if not found:
        raise ValueError(f"{path} is not a checkpoint folder: neither it nor a folder in it holds {DCP_METADATA} "
                         "(give a step_<N> folder or a trainer's folder in it)")
    return found


def unsigned(folder: Path) -> Unsigned:
    """``folder`` with its files, once it is a finished save without a manifest; else ValueError saying why."""
    if (folder / MANIFEST).exists():
        raise ValueError(f"{folder / MANIFEST} exists: this checkpoint is signed already (if it is refused, it "
                         "does not match its files or another cluster's key signed it; trust signs only a "
                         "checkpoint that has no manifest)")
    if folder.name.endswith(".tmp") or (folder / STAGING).exists():
        raise ValueError(f"{folder} is a save that did not finish (a .tmp folder, or {STAGING} in it): it cannot "
                         "be trusted")
    if not (folder / EXTRA).is_file():
        raise ValueError(f"{folder} holds no {EXTRA}: not a whole meshrl checkpoint")
    files = {}
    for entry in sorted(folder.rglob("*")):
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            raise ValueError(f"{entry} is not a plain file: a checkpoint holds plain files and folders only")
        if entry.is_file():
            files[str(entry.relative_to(folder))] = entry.stat().st_size
    return Unsigned(folder, files)


def key_folder(path: Path, given: Path | None) -> Path:
    """The folder whose checkpoint.key signs ``path``: ``given`` (the state_dir, or a trainer's checkpoint_root),
    else the nearest folder above ``path`` holding one; ValueError when neither."""
    if given is not None:
        if not (given / KEY_FILE).is_file():
            raise ValueError(f"{given / KEY_FILE} does not exist: give the folder the checkpoints are kept under "
                             "(the coordinator's state_dir, a trainer's checkpoint_root)")
        return given
    for folder in path.resolve().parents:
        if (folder / KEY_FILE).is_file():
            return folder
    raise ValueError(f"no {KEY_FILE} in a folder above {path}: give --state-dir (the folder the checkpoints are "
                     "kept under, whose services made the key)")


def run_of(path: Path, given: str | None) -> str:
    """The run whose checkpoint ``path`` is: ``given``, else the <run_id> of a .../runs/<run_id>/ it lies in;
    ValueError asking for --run otherwise."""
    if given:
        return given
    resolved = path.resolve()
    for folder in [resolved, *resolved.parents]:
        if folder.parent.name == "runs":
            return folder.name
    raise ValueError(f"{path} is not inside a runs/<run_id> folder: give --run RUN_ID (the run it belongs to)")


def describe(folders: list[Unsigned], run_id: str, key: Path) -> str:
    """What signing will vouch for, for the operator to confirm: each folder's files and sizes."""
    lines = []
    for each in folders:
        lines.append(f"{each.folder} ({len(each.files)} files, {sum(each.files.values()):,} bytes):")
        lines += [f"  {size:>14,}  {name}" for name, size in each.files.items()]
    lines.append(f"signed as a checkpoint of run {run_id} with {key / KEY_FILE}")
    return "\n".join(lines)
