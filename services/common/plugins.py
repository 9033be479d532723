"""Users' code named ``path/to/file.py:name`` or ``package.module:name``: a reward function, a tool or
environment class; or a whole module named ``path/to/file.py`` or ``package.module`` (one that registers
advantage estimators or policy losses). Loaded where it runs (a worker process) and once at a service's start,
so that a name that cannot be had refuses the service with the file and the error."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


def import_target(target: str, what: str, ref: str | None = None) -> ModuleType:
    """The module ``target`` names: a path/to/file.py or a module. ValueError naming ``what`` (and ``ref``, the
    whole reference, where ``target`` is part of one) and the error where it fails to import."""
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.exists():
                raise FileNotFoundError(f"no such file {path}")
            spec = importlib.util.spec_from_file_location(f"meshrl_plugin_{path.stem}", path)
            if spec is None or spec.loader is None:  # (a .py path always has a loader)
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except Exception as error:  # noqa: BLE001 - any import failure refuses the plugin
        raise ValueError(f"{what} {ref or target}: {target} failed to import: {type(error).__name__}: "
                         f"{error}") from None


def load_named(ref: str, what: str, kind: str, *, accept: Callable[[Any], bool]) -> Any:
    """The object ``ref`` names, which ``accept`` must take; ValueError naming ``what`` (e.g. "reward function")
    and saying what is wrong otherwise: ``ref`` is not ``target:name``, the target fails to import, or it has no
    such ``kind`` (function, class)."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{what} {ref!r} must look like path/to/file.py:{kind} or module:{kind}")
    module = import_target(target, what, ref)
    found = getattr(module, name, None)
    if not accept(found):
        raise ValueError(f"{what} {ref}: {target} has no {kind} {name!r}")
    return found


def import_modules(targets: list[str], setting: str) -> None:
    """Import each module ``setting`` names (path/to/file.py or package.module), for what importing it does (a
    module of @register_... functions); ValueError naming ``setting``, the module and the error where one fails."""
    for target in targets:
        import_target(target, setting)
