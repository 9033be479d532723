"""The structure drawn from the imports: five service rooms and the CLI over run and common, no import circles.

Every ``import services...`` / ``from services... import`` in services/, at any depth of a module (a
function-level import counts), is an edge. A room (coordinator, rollout, trainer, reward, env) imports only
itself, ``services.run`` (what describes a run: its config, data, checks, model), ``services.common`` (plumbing)
and the RL math (``services.algos``, pure functions, with the built-in estimators and losses and the registries
that name them: ``services.estimators``, ``services.policy_losses``, ``services.algo_registry``); coordctl, the
CLI, imports only itself, run, common and the registries' names (it starts the services as processes, by module
name, and checks a run's algorithm names against the built-ins); run imports only itself, common and the names
of the math's built-in choices (``services.algo_names``, no torch: the config sections validate against them),
which any room may import; common imports no room, algos only those names, and the names nothing.

Inside the coordinator, the wings (sub-packages by what changes together) stand on each other in one order, top
to bottom: the entry (``server``, ``__main__``), ``runs`` (a run's lifetime), ``step`` (one step of the loop),
``agent`` (the agent loop, and the gateway users' own agents call), ``fleet`` (the services a run uses) and the base (the package's other top-level
modules: settings, store, registry, waiting, disk, telemetry, config). A module imports only its own wing and
those below it, never one above; the base imports only the base. Counting each wing as one room and each top-level
module as its own, the longest import chain is 7 floors (it was 13 modules before the wings).
"""

from __future__ import annotations

import ast
from pathlib import Path

import services

ROOT = Path(services.__file__).parent
ROOMS = ("coordinator", "rollout", "trainer", "reward", "env")
ALGOS = ("algos", "algo_registry", "estimators", "policy_losses")  # the modules of the RL math
NAMES = "algo_names"  # the names of the math's built-in choices (services/algo_names.py), a room of its own
ALLOWED = {**{room: {room, "run", "common", "algos", NAMES} for room in ROOMS},
           "coordctl": {"coordctl", "run", "common", "algos", NAMES}, "run": {"run", "common", NAMES},
           "common": {"common"}, "algos": {"algos", NAMES}, NAMES: {NAMES}}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``services`` that the file imports (``from pkg import module`` counts as the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("services.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("services"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found - {"services"}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    return {name: imported_modules(path, set(files)) for name, path in files.items()}


def room(module: str) -> str:
    name = module.split(".")[1] if "." in module else ""
    return "algos" if name in ALGOS else name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle found by a depth-first walk (each reported once, from where it was entered)."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_each_room_imports_only_itself_run_common_and_algos():
    graph = import_graph()
    crossings = sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                       if room(source) and room(target) not in ALLOWED[room(source)])
    assert crossings == []
    assert {room(module) for module in graph} == {*ROOMS, "coordctl", "run", "common", "algos", NAMES, ""}


def test_the_checks_see_a_circle_and_a_crossing():
    graph = {"services.rollout.a": {"services.rollout.b"}, "services.rollout.b": {"services.rollout.a"},
             "services.common.c": set()}
    assert cycles(graph) == [["services.rollout.a", "services.rollout.b", "services.rollout.a"]]
    assert "rollout" not in ALLOWED["common"] and "coordinator" not in ALLOWED["coordctl"]
    assert "run" not in ALLOWED["common"] and "trainer" not in ALLOWED["run"] and "algos" not in ALLOWED["run"]


# ---------------------------------------------------------------- the coordinator's wings

COORDINATOR = "services.coordinator"
WINGS = ("entry", "runs", "step", "agent", "fleet", "base")  # top to bottom: a wing imports only those after it
ENTRY = ("server", "__main__")
MAX_FLOORS = 7


def wing(module: str) -> str:
    """The wing of a coordinator module: its sub-package, the entry, or the base (the other top-level modules)."""
    name = module.removeprefix(COORDINATOR + ".").split(".")[0]
    if name in WINGS:
        return name
    return "entry" if name in ENTRY else "base"


def coordinator_graph() -> dict[str, set[str]]:
    return {source: {target for target in targets if target.startswith(COORDINATOR + ".")}
            for source, targets in import_graph().items() if source.startswith(COORDINATOR + ".")}


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a wing into one above it (WINGS' order), as 'source -> target'."""
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if WINGS.index(wing(target)) < WINGS.index(wing(source)))


def floors(graph: dict[str, set[str]]) -> int:
    """The longest import chain, each wing one room and each top-level module (entry, base) its own."""
    def room_of(module: str) -> str:
        return wing(module) if wing(module) not in ("entry", "base") else module

    rooms: dict[str, set[str]] = {}
    for source, targets in graph.items():
        rooms.setdefault(room_of(source), set()).update(room_of(t) for t in targets if room_of(t) != room_of(source))
    depth: dict[str, int] = {}

    def height(room: str) -> int:
        if room not in depth:
            depth[room] = 1 + max((height(below) for below in rooms.get(room, ())), default=0)
        return depth[room]

    return max(map(height, rooms), default=0)


def test_every_coordinator_module_is_in_a_wing_or_the_named_base():
    """A new module goes into the wing it changes with; the top of the package is only the entry and the base."""
    graph = coordinator_graph()
    assert {module.split(".")[2] for module in graph if module.count(".") >= 3} == {"runs", "step", "agent", "fleet"}
    assert {module.split(".")[2] for module in graph if wing(module) == "base"} == {
        "config", "settings", "store", "registry", "waiting", "disk", "telemetry"}


def test_no_wing_imports_one_above_it():
    graph = coordinator_graph()
    assert arrows_up(graph) == []
    assert floors(graph) <= MAX_FLOORS


def test_the_wing_checks_see_an_arrow_up_and_count_floors():
    graph = {"services.coordinator.fleet.a": {"services.coordinator.step.b"},
             "services.coordinator.step.b": {"services.coordinator.agent.c"},
             "services.coordinator.agent.c": {"services.coordinator.settings"},
             "services.coordinator.settings": set()}
    assert arrows_up(graph) == ["services.coordinator.fleet.a -> services.coordinator.step.b"]
    assert floors(graph) == 4
    assert wing("services.coordinator.server") == "entry" and wing("services.coordinator.store") == "base"


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages a ``pip install .`` takes: a sub-package left out installs without it."""
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(repo).parts) for init in (repo / "services").rglob("__init__.py")}
    assert found - listed == set()
