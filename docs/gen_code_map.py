"""The "Where the code is" part of docs/architecture/overview.md, written from each module's opening docstring.

    python docs/gen_code_map.py           # write the part
    python docs/gen_code_map.py --check   # exit 1 if the part is not what the docstrings say (CI)

Each package under services/ (in PACKAGES' order) becomes a heading with its ``__init__.py`` docstring, and a
table of its modules, each with the first paragraph of its docstring. A module without a docstring is refused by
name. The part sits between the two MARKERS in the page; the rest of the page is written by hand.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture" / "overview.md"
SERVICES = REPO / "services"
# The packages in the order a newcomer reads them: the coordinator and its wings top to bottom, the other
# services, what describes a run, the plumbing, and the RL math at services/'s top.
PACKAGES = ("coordinator", "coordinator/runs", "coordinator/step", "coordinator/agent/gateway", "coordinator/agent",
            "coordinator/fleet", "rollout", "trainer", "reward", "env", "coordctl", "run", "run/sections", "common", "")
TOP = "The RL math, pure functions on tensors, and the registries that name the estimators and losses."
MARKERS = ("<!-- code map: written by docs/gen_code_map.py from the modules' docstrings; do not edit -->",
           "<!-- end of the code map -->")


def docstring(path: Path) -> str:
    text = ast.get_docstring(ast.parse(path.read_text()))
    if not text:
        raise SystemExit(f"{path.relative_to(REPO)} has no opening docstring: say what the module is for")
    return text


def first_paragraph(text: str) -> str:
    """The docstring's first paragraph as one line, safe in a table cell."""
    paragraph = " ".join(line.strip() for line in text.strip().split("\n\n")[0].splitlines())
    return paragraph.replace("|", "\\|").replace("<", "&lt;")


def package_part(package: str) -> str:
    folder = SERVICES / package if package else SERVICES
    init = folder / "__init__.py"
    about = first_paragraph(docstring(init)) if package else TOP
    rows = [f"| `{path.name}` | {first_paragraph(docstring(path))} |"
            for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]
    heading = f"### `services/{package}/`" if package else "### `services/`"
    return "\n".join([heading, "", about, "", "| module | what |", "| --- | --- |", *rows, ""])


def code_map() -> str:
    unlisted = sorted(str(init.parent.relative_to(SERVICES)) for init in SERVICES.rglob("__init__.py")
                      if init.parent != SERVICES and str(init.parent.relative_to(SERVICES)) not in PACKAGES)
    if unlisted:
        raise SystemExit(f"packages not in docs/gen_code_map.py's PACKAGES: {unlisted}")
    return "\n".join([MARKERS[0], "", *map(package_part, PACKAGES), MARKERS[1]])


def page(current: str) -> str:
    start, end = current.index(MARKERS[0]), current.index(MARKERS[1]) + len(MARKERS[1])
    return current[:start] + code_map() + current[end:]


def main(argv: list[str]) -> int:
    current = PAGE.read_text()
    text = page(current)
    if argv == ["--check"]:
        if current == text:
            return 0
        print(f"{PAGE.relative_to(REPO)} is stale: run python docs/gen_code_map.py", file=sys.stderr)
        return 1
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
