"""The run config's reference page, docs/reference/config.md, written from the config's own field docstrings.

    python docs/gen_config_reference.py           # write the page
    python docs/gen_config_reference.py --check   # exit 1 if the page is not what the config says (CI)

It imports only ``RunConfig`` and walks its pydantic fields: each field holding a section (through Optional too)
becomes a heading of its dotted key, each other field a row (key, type, default, its docstring).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

import pydantic

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's services, when run as a script

from services.run.config import RunConfig  # noqa: E402

PAGE = REPO / "docs" / "reference" / "config.md"
HEAD = """# Run config reference

Every key of a run config, section by section, with its type, its default and what it does. A run config is
YAML with these keys ([Run configs](../getting-started/run-configs.md) says how it is read and overridden).

This page is generated from the field docstrings in `services/run/config.py` and `services/run/sections/` by `python
docs/gen_config_reference.py`; `tests/unit/test_docs.py` checks that it is fresh.
"""
BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def sections_in(annotation) -> list[type[pydantic.BaseModel]]:
    """The config sections an annotation holds directly or through Optional."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [section for arg in typing.get_args(annotation) for section in sections_in(arg)]
    return []


def type_name(annotation) -> str:
    """An annotation as a reader writes it: ``int``, ``list[str]``, ``"hf" | "vllm"``, ``int | None``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(arg).replace("'", '"') for arg in args)
    if origin is typing.Annotated:
        return type_name(args[0]) + bounds(args[1:])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    return "None" if annotation is type(None) else annotation.__name__


def bounds(metadata) -> str:
    """Numeric bounds of a field's metadata: `` (> 0)``, `` (>= 0, <= 1)``; empty without any."""
    found = [f"{sign} {getattr(item, name)}" for item in metadata for name, sign in BOUNDS.items()
             if getattr(item, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def yaml_value(value) -> str:
    """A default as the YAML of a run config writes it: ``true``, ``null``, ``"prompt"``, ``[0.9, 0.999]``."""
    return json.dumps(value)


def cell(text: str) -> str:
    """Text fit for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def section_lines(model: type[pydantic.BaseModel], key: str, about: str) -> list[str]:
    """The heading, description and table of section ``key``, then its subsections'."""
    lines = [f"## `{key}`", ""]
    if about.strip():
        lines += [cell(about), ""]
    rows, nested = [], []
    for name, field in model.model_fields.items():
        sections = sections_in(field.annotation)
        if sections:
            nested += [(section, f"{key}.{name}", field.description or section.__doc__ or "") for section in sections]
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(f"| `{name}` | `{cell(type_name(field.annotation) + bounds(field.metadata))}` | "
                    f"`{cell(yaml_value(default))}` | {cell(field.description or '')} |")
    if rows:
        lines += ["| key | type | default | what |", "| --- | --- | --- | --- |", *rows, ""]
    for section, subkey, subabout in nested:
        lines += section_lines(section, subkey, subabout)
    return lines


def page() -> str:
    """The whole reference page."""
    lines = [HEAD]
    for name, field in RunConfig.model_fields.items():
        for section in sections_in(field.annotation):
            lines += section_lines(section, name, field.description or section.__doc__ or "")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = page()
    if argv == ["--check"]:
        if PAGE.exists() and PAGE.read_text() == text:
            return 0
        print(f"{PAGE.relative_to(REPO)} is stale: run python docs/gen_config_reference.py", file=sys.stderr)
        return 1
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
