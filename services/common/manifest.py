"""A checkpoint's manifest: the SHA-256 of each of its files, signed with the cluster's secret.

Parts of a checkpoint are pickles (torch.distributed.checkpoint's
``.metadata``), and unpickling runs code. So a trainer writes
``meshrl_manifest.json`` last into each checkpoint folder it saves, and
whoever loads one (a trainer's LoadCheckpoint, ``coordctl export``) checks it
before anything in the folder is opened: the manifest's HMAC-SHA256 under the
cluster's key, then every file's size and digest, and no file beside them.
A folder that fails is refused (``DamagedCheckpoint``, naming the file and
what is wrong) and nothing in it is read. The manifest also says whose
checkpoint a folder is (its run), so that a save replaces only a checkpoint
of its own run.

The key is the cluster's checkpoint secret: 32 random bytes in
``checkpoint.key`` in the folder the checkpoints are kept under (a trainer's
checkpoint_root, the coordinator's state_dir), made with mode 0600 by the
first save, and read by every process that saves or loads them there (they
see that folder already). It is not the cluster token: a token is made
afresh for each Slurm job and each ``--local`` session, and a run resumed by
the next one must still load its checkpoints; whoever may read the key file
is trusted as the token's holders are (keep the folder's owner the
services').
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

MANIFEST = "meshrl_manifest.json"
EXTRA = "trainer_state.pt"  # a trainer's part of a checkpoint besides its weights: optimizer, schedule, RNG
STAGING = "meshrl_staging.json"  # in a folder being saved: whose run it is
KEY_FILE = "checkpoint.key"
FORMAT = 1
CHUNK = 1 << 20


class DamagedCheckpoint(ValueError):
    """A checkpoint folder whose manifest is missing, not signed with this cluster's key, or does not match its
    files."""


def checkpoint_key(root: Path) -> bytes:
    """The key manifests under ``root`` are signed with: ``root``/checkpoint.key, made (0600) when missing. Made
    whole under another name and linked into place, so that a process racing to make it reads the one that
    won."""
    path = root / KEY_FILE
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        fresh = root / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(secrets.token_bytes(32))
            os.link(fresh, path)
        except FileExistsError:
            pass  # another process made it first
        finally:
            fresh.unlink()
    return path.read_bytes()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _signature(body: dict, key: bytes) -> str:
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, run_id: str, key: bytes) -> None:
    """Sign the digest and size of every file now in ``folder`` as a checkpoint of ``run_id`` (written last)."""
    files = {name: {"sha256": file_digest(folder / name), "bytes": (folder / name).stat().st_size}
             for name in _files(folder)}
    body = {"format": FORMAT, "run_id": run_id, "files": files}
    (folder / MANIFEST).write_text(json.dumps({**body, "hmac": _signature(body, key)}, indent=1) + "\n")


def read_manifest(folder: Path, key: bytes) -> dict:
    """The manifest of ``folder`` once its signature is this cluster's (its files not yet checked)."""
    path = folder / MANIFEST
    try:
        signed = json.loads(path.read_text())
        body = {name: signed[name] for name in ("format", "run_id", "files")}
        signature = signed["hmac"]
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} does not exist: {folder} is not a complete meshrl checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DamagedCheckpoint(f"{path} cannot be read as a manifest ({type(error).__name__}: {error})") from None
    if not isinstance(signature, str) or not hmac.compare_digest(signature, _signature(body, key)):
        raise DamagedCheckpoint(f"{path} is not signed with this cluster's key ({KEY_FILE} of the checkpoints' "
                                "folder): written elsewhere, or altered")
    return body


def verify(folder: Path, key: bytes) -> dict:
    """The manifest of ``folder`` once it is signed by this cluster and every file matches it; else
    DamagedCheckpoint naming the first file that does not. Reads the files' bytes, never unpickles them."""
    body = read_manifest(folder, key)
    listed = body["files"]
    for name in _files(folder):
        if name not in listed:
            raise DamagedCheckpoint(f"{folder / name} is not in the checkpoint's manifest")
    for name, expected in sorted(listed.items()):
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpoint(f"{path} is missing (the checkpoint's manifest lists it)")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise DamagedCheckpoint(f"{path} does not match the checkpoint's manifest: {size} bytes where "
                                    f"{expected['bytes']} were saved (truncated, or written over)")
        if file_digest(path) != expected["sha256"]:
            raise DamagedCheckpoint(f"{path} does not match the checkpoint's manifest: its SHA-256 is not the one "
                                    "saved (altered)")
    return body
