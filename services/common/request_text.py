"""The YAML and JSON a request carries, read under the limits of ``limits.py`` before anything expands them.

YAML can be small as written and huge as read: an alias (``*name``) stands for the whole value its anchor
(``&name``) marks, so 9 levels of 9 aliases, 500 characters, are 9^9 values once written out, and OmegaConf's
interpolations (``${other.key}``) do the same when they are resolved. So a request's YAML is composed by a
loader that counts, before any Python value is built:

- its length (MAX_YAML_CHARS) and how deep it nests (MAX_NESTING);
- what its aliases add once written out, which counts against MAX_YAML_CHARS as the text itself does;
- the time it takes (MAX_YAML_PARSE_S);

and a run config's interpolations (``request_yaml``) may only name another key (``${data.max_prompt_length}``:
no resolvers, which would read the service's environment or files), their values written out counted against
MAX_YAML_CHARS too. Anything past a limit is a ValueError (INVALID_ARGUMENT) naming the limit.
JSON has no aliases: it is only bounded in depth (``json_object``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, NamedTuple

import yaml

from services.common.limits import MAX_NESTING, MAX_YAML_CHARS, MAX_YAML_PARSE_S, nesting_depth

INTERPOLATION_START = re.compile(r"(?<!\\)\$\{")
"""Where an interpolation starts in a string (``\\${`` is OmegaConf's escaped literal)."""
KEY_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w-]*(?:\.[\w-]+)*)\}")
"""An interpolation that names another key by its full dotted path: ``${actor_rollout_ref.model.path}``."""


class Extent(NamedTuple):
    """How big a value is written out, its aliases or interpolations too: ``chars``, about the characters it takes
    (a scalar its length and a separator, a collection one more than its items), and ``depth``, the levels of
    collections it nests (0 for a scalar)."""

    chars: int
    depth: int


def extent_of(items: list[Extent]) -> Extent:
    """The extent of a collection of values of these extents."""
    return Extent(1 + sum(item.chars for item in items), 1 + max((item.depth for item in items), default=0))


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no tag builds an object or runs code) whose composer refuses, as it goes, a document
    nested deeper than MAX_NESTING, whose aliases written out would take it past MAX_YAML_CHARS or nest it past
    MAX_NESTING, or that takes longer than MAX_YAML_PARSE_S to compose. Composing shares each anchored node
    among its aliases, so until a limit is passed nothing has been expanded."""

    def __init__(self, text: str, what: str, budget_s: float):
        super().__init__(text)
        self.what = what
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.depth = 0  # of the node being composed
        self.chars = len(text)  # the text, and each alias's value once written out
        self.extents: dict[int, Extent] = {}  # id(node) -> its extent, once composed

    def compose_node(self, parent, index):
        if time.monotonic() > self.deadline:
            raise ValueError(f"{self.what} took longer than {self.budget_s:g} s to read (limit MAX_YAML_PARSE_S)")
        is_alias = self.check_event(yaml.AliasEvent)
        opens = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        self.depth += opens
        if self.depth > MAX_NESTING:
            raise ValueError(f"{self.what} nests deeper than {MAX_NESTING} levels (limit MAX_NESTING)")
        node = super().compose_node(parent, index)
        self.depth -= opens
        extent = self.extent(node)
        if is_alias:
            self.chars += extent.chars
            if self.chars > MAX_YAML_CHARS:
                raise ValueError(f"{self.what} is more than {MAX_YAML_CHARS} characters long once its aliases are "
                                 "written out (limit MAX_YAML_CHARS): write the values out, or alias less")
            if self.depth + extent.depth > MAX_NESTING:
                raise ValueError(f"{self.what} nests deeper than {MAX_NESTING} levels once its aliases are written "
                                 "out (limit MAX_NESTING)")
        return node

    def extent(self, node: yaml.Node) -> Extent:
        """The extent of ``node``, whose items are composed and measured already."""
        if id(node) not in self.extents:
            if isinstance(node, yaml.ScalarNode):
                self.extents[id(node)] = Extent(1 + len(node.value), 0)
            elif isinstance(node, yaml.SequenceNode):
                self.extents[id(node)] = extent_of([self.extents[id(item)] for item in node.value])
            else:
                self.extents[id(node)] = extent_of([self.extents[id(part)] for pair in node.value for part in pair])
        return self.extents[id(node)]


def yaml_value(text: str, what: str, budget_s: float = MAX_YAML_PARSE_S) -> Any:
    """``text`` read as one YAML document within the limits (BoundedLoader); ValueError naming ``what`` and the
    limit if it is not YAML or passes one."""
    if len(text) > MAX_YAML_CHARS:
        raise ValueError(f"{what} is {len(text)} characters long, more than {MAX_YAML_CHARS} (limit MAX_YAML_CHARS)")
    loader = BoundedLoader(text, what, budget_s)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as error:
        raise ValueError(f"{what} is not valid YAML: {error}") from None
    finally:
        loader.dispose()


def request_yaml(text: str, what: str) -> dict[str, Any]:
    """A run config a request carries: a YAML mapping within the limits (``yaml_value``) whose interpolations
    only name other keys, which resolved keep it within MAX_YAML_CHARS and MAX_NESTING; ValueError naming
    ``what``, the key and the limit otherwise. Empty text is the empty mapping."""
    data = yaml_value(text, what) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a mapping at the top, not {type(data).__name__}")
    if Interpolations(data, what, budget=MAX_YAML_CHARS - len(text)).measure(data, "", 0).depth > MAX_NESTING:
        raise ValueError(f"{what} nests deeper than {MAX_NESTING} levels once its interpolations are resolved "
                         "(limit MAX_NESTING)")
    return data


class Interpolations:
    """Measures what a config's ``${key}`` interpolations add once resolved, refusing any other interpolation
    (a resolver such as ``${oc.env:NAME}``), one that refers back to itself, and an addition past ``budget``."""

    def __init__(self, root: dict[str, Any], what: str, budget: int):
        self.root, self.what, self.budget = root, what, budget
        self.added = 0  # characters the interpolations add, resolved
        self.extents: dict[str, Extent] = {}  # key path -> its extent resolved, once measured
        self.open: set[str] = set()  # key paths being measured (a reference to one refers back to itself)

    def measure(self, value: Any, path: str, calls: int) -> Extent:
        """The extent of ``value`` (at key ``path``) resolved, measured once; ``calls`` deep in nested measures."""
        if calls > MAX_NESTING:  # Python's stack, like OmegaConf's resolver, takes only so many
            raise ValueError(f"{self.what}: {path} nests or follows interpolations more than {MAX_NESTING} levels "
                             "deep (limit MAX_NESTING)")
        if path not in self.extents:
            self.open.add(path)
            self.extents[path] = self.measure_new(value, path, calls)
            self.open.discard(path)
        return self.extents[path]

    def measure_new(self, value: Any, path: str, calls: int) -> Extent:
        if isinstance(value, dict):
            return extent_of([Extent(len(str(key)) + 1, 0) for key in value] +
                             [self.measure(item, join(path, key), calls + 1) for key, item in value.items()])
        if isinstance(value, list):
            return extent_of([self.measure(item, join(path, index), calls + 1) for index, item in enumerate(value)])
        if not isinstance(value, str) or not INTERPOLATION_START.search(value):
            return Extent(1 + len(str(value)), 0)
        references = list(KEY_REFERENCE.finditer(value))
        if len(references) != len(INTERPOLATION_START.findall(value)):
            raise ValueError(f"{self.what}: {path}: {value[:80]!r}: a request's interpolations may only name another "
                             "key, as ${section.key} (no resolvers, such as oc.env)")
        chars, depth = 1 + len(value) - sum(len(found[0]) for found in references), 0
        for found in references:
            if found[1] in self.open:
                raise ValueError(f"{self.what}: {path}: {found[0]} refers back to itself")
            exists, target = lookup(self.root, found[1])
            extent = self.measure(target, found[1], calls + 1) if exists else Extent(0, 0)  # OmegaConf names it
            self.added += extent.chars
            if self.added > self.budget:
                raise ValueError(f"{self.what} is more than {MAX_YAML_CHARS} characters long once its "
                                 f"interpolations are resolved (limit MAX_YAML_CHARS; at {path})")
            chars, depth = chars + extent.chars, max(depth, extent.depth)
        return Extent(chars, depth)


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def lookup(root: Any, key: str) -> tuple[bool, Any]:
    """Whether dotted ``key`` names a value in ``root`` (a list's items by index), and that value."""
    node = root
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def json_object(text: str, field: str) -> dict:
    """``text`` read as a JSON object nested at most MAX_NESTING deep; ValueError naming ``field`` otherwise."""
    too_deep = f"{field} nests deeper than {MAX_NESTING} levels"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{field} is not valid JSON: {error.msg}") from None
    except RecursionError:
        raise ValueError(too_deep) from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object")
    if nesting_depth(value) > MAX_NESTING:
        raise ValueError(too_deep)
    return value
