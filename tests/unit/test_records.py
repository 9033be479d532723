"""Records of more than three fields are built by keyword (STYLE.md, habit 12): a dataclass of more than three
fields is ``kw_only``, and a NamedTuple of more than three fields is built in services/ with three positional
arguments at most. (A function's own parameters past the third are keyword-only by ruff's PLR0917.)"""

from __future__ import annotations

import ast
from pathlib import Path

import services

ROOT = Path(services.__file__).parent


def fields_of(node: ast.ClassDef) -> list[str]:
    """The class's annotated fields that its constructor takes (not ClassVars, not ``field(init=False)``)."""
    return [statement.target.id for statement in node.body
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            and "ClassVar" not in ast.unparse(statement.annotation)
            and not (statement.value is not None and "init=False" in ast.unparse(statement.value))]


def records(tree: ast.AST) -> dict[str, tuple[str, int, bool]]:
    """Each record class of more than three fields: its kind (dataclass, namedtuple), fields, and whether a
    dataclass is kw_only."""
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list if "dataclass" in ast.unparse(d)]
        named_tuple = any("NamedTuple" in ast.unparse(base) for base in node.bases)
        if (decorators or named_tuple) and len(fields_of(node)) > 3:
            found[node.name] = ("namedtuple" if named_tuple else "dataclass", len(fields_of(node)),
                                any("kw_only=True" in d for d in decorators))
    return found


def positional_builds(tree: ast.AST, names: set[str]) -> list[tuple[str, int]]:
    """Calls of ``names`` with more than three positional arguments (or a starred one): (name, line)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in names and (len(node.args) > 3 or any(isinstance(a, ast.Starred) for a in node.args)):
                found.append((name, node.lineno))
    return found


def test_dataclasses_past_three_fields_are_kw_only_and_namedtuples_past_three_are_built_by_keyword():
    trees = {path: ast.parse(path.read_text()) for path in ROOT.rglob("*.py")}
    everywhere = {name: record for tree in trees.values() for name, record in records(tree).items()}
    positional = sorted(f"{path.relative_to(ROOT.parent)}: {name}" for path, tree in trees.items()
                        for name, (kind, _, kw_only) in records(tree).items() if kind == "dataclass" and not kw_only)
    assert positional == []
    tuples = {name for name, (kind, _, _) in everywhere.items() if kind == "namedtuple"}
    built = sorted(f"{path.relative_to(ROOT.parent)}:{line} {name}" for path, tree in trees.items()
                   for name, line in positional_builds(tree, tuples))
    assert built == []


def test_the_record_checks_see_a_positional_dataclass_and_a_positional_build():
    tree = ast.parse("from dataclasses import dataclass\nfrom typing import NamedTuple\n\n"
                     "@dataclass(frozen=True)\nclass A:\n    a: int\n    b: int\n    c: int\n    d: int\n\n"
                     "class B(NamedTuple):\n    a: int\n    b: int\n    c: int\n    d: int\n\n"
                     "B(1, 2, 3, 4)\nB(1, 2, 3, d=4)\n")
    assert records(tree) == {"A": ("dataclass", 4, False), "B": ("namedtuple", 4, False)}
    assert positional_builds(tree, {"B"}) == [("B", 17)]
