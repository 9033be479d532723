"""Paths that a request or a run config names, held inside the folder their service was given.

A service writes and reads only under its configured root (the coordinator's
state_dir, a trainer's checkpoint_root): a path named from outside is
resolved (symbolic links and ``..`` followed) and refused, naming the field,
unless it lands inside that root. Names that become a folder's name (a run's
experiment_name) are names: no separator, no ``..``.
"""

from __future__ import annotations

from pathlib import Path

NAME_LIMIT = 100  # characters: a run id adds 21 to the name, and a file name may hold 255 bytes


def inside(root: str | Path, path: str | Path, field: str) -> Path:
    """``path`` resolved (a relative one under ``root``), if it lies in ``root`` or is ``root``; else ValueError
    naming ``field``."""
    base = Path(root).resolve()
    resolved = (base / path).resolve()  # an absolute ``path`` stays itself
    if not resolved.is_relative_to(base):
        raise ValueError(f"{field}: {path} is outside {base}, the folder this service writes and reads in")
    return resolved


def check_name(name: str) -> str:
    """``name`` if it can name a folder of its own (no path separator, not . or .., not empty); else ValueError
    (a config's validator adds the field)."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > NAME_LIMIT:
        raise ValueError(f"{name!r} is not a name (at most {NAME_LIMIT} characters, no '/', '\\' or NUL, "
                         "not '.' or '..')")
    return name
