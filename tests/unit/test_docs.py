"""The docs as a site: ``mkdocs build --strict`` passes (no broken link, anchor or page), the run config's
reference page is what the config's docstrings say, the architecture page's code map is what the modules'
docstrings say, and every code block is fenced with its language."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path):
    done = run("-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_config_reference_is_fresh():
    done = run("docs/gen_config_reference.py", "--check")
    assert done.returncode == 0, done.stderr


def test_the_code_map_is_fresh():
    """docs/architecture/overview.md's "Where the code is" is what the modules' opening docstrings say."""
    done = run("docs/gen_code_map.py", "--check")
    assert done.returncode == 0, done.stderr


def unfenced_code(text: str) -> list[str]:
    """Indented code blocks (four spaces after a blank line, outside a fence) and fences opened without a
    language, as 'line N: ...'."""
    found, fenced, previous = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if not fenced and line.strip() == "```":
                found.append(f"line {number}: a fence without a language")
            fenced = not fenced
        elif not fenced and line.startswith("    ") and not previous.strip():
            found.append(f"line {number}: an indented code block")
        previous = line
    return found


def test_every_code_block_is_fenced_with_its_language():
    found = {page.relative_to(REPO).as_posix(): unfenced_code(page.read_text()) for page in PAGES}
    assert not {page: lines for page, lines in found.items() if lines}


def test_the_unfenced_code_check_sees_both_kinds():
    text = "Run:\n\n    pytest\n\n```\nplain\n```\n\n```bash\n    indented inside a fence\n```\n"
    assert unfenced_code(text) == ["line 3: an indented code block", "line 5: a fence without a language"]
