"""Every script and command answers --help: usage on stdout, exit 0, and nothing started.

The scripts are found, not listed: each .py file of bench/ and examples/ with a ``__main__`` block, run as a person
runs it (``python bench/x.py --help``), and each module of services/ with one, run as ``python -m``; all from
another folder than the repository's, which must stay empty (no run folder made). coordctl's commands, every
sub-command at every depth, are asked in this process (typer's runner: coordctl's own parsing, without a Python
start per command).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from services.coordctl.cli import app

ROOT = Path(__file__).resolve().parents[2]


def has_main(path: Path) -> bool:
    return 'if __name__ == "__main__"' in path.read_text()


def scripts() -> list[list[str]]:
    """The command line of each script and module with a ``__main__`` block, as a person starts it."""
    files = [path for folder in ("bench", "examples") for path in sorted((ROOT / folder).rglob("*.py"))
             if has_main(path)]
    modules = [".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
               for path in sorted((ROOT / "services").rglob("*.py")) if has_main(path)]
    return [[sys.executable, str(path)] for path in files] + [[sys.executable, "-m", module] for module in modules]


def commands(group: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of a click command: itself and, for a group, each of its sub-commands' paths."""
    found = [path]
    for name, command in getattr(group, "commands", {}).items():
        found += commands(command, (*path, name))
    return found


def test_the_scripts_are_found():
    found = {" ".join(line[1:]).removeprefix(str(ROOT) + "/") for line in scripts()}
    assert {"bench/local_default.py", "bench/lookup_warm_start.py", "bench/trainer_step.py",
            "-m services.coordctl.cli", "-m services.coordinator", "-m services.trainer"} <= found


def installed_packages(folder: Path) -> Path:
    """A folder on which this checkout's import packages (services, meshrl) are found, as an install puts them,
    and nothing else of the repository (bench is not a package a user has installed)."""
    folder.mkdir()
    (folder / "services").symlink_to(ROOT / "services")
    (folder / "meshrl").symlink_to(ROOT / "protos" / "meshrl")
    return folder


def test_every_script_answers_help_with_its_usage_and_starts_nothing(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "MESHRL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(installed_packages(tmp_path / "site"))}

    def ask(line: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*line, "--help"], cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env)

    lines = scripts()
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(ask, lines))
    failed = {" ".join(line): f"exit {answer.returncode}: {(answer.stdout + answer.stderr)[-600:]}"
              for line, answer in zip(lines, answers)
              if answer.returncode != 0 or "usage:" not in answer.stdout.lower()}
    assert not failed
    assert not list(elsewhere.iterdir()) and not (tmp_path / "cache").exists()  # nothing began


@pytest.mark.parametrize("path", commands(typer.main.get_command(app)), ids=" ".join)
def test_every_coordctl_command_answers_help(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and not list(tmp_path.iterdir())
