"""How the suite spreads over pytest-xdist's workers (`pytest -n 2`, the README's command).

Each test module is one unit of work, run on one worker from top to bottom: an integration module's tests share
the cluster its module-scoped fixture started, in the order written, and a unit module's module-scoped model is
built once. The GPU tests are one unit: each takes the machine's GPUs for itself. The slowest modules go first,
so that the two workers end together rather than one waiting on the last long module. (xdist's own
``--dist loadgroup`` cannot do this under pytest 9.2: the group it appends to a test's id no longer changes the
id, so every test became a unit of its own.)"""

from __future__ import annotations

import pytest

SLOWEST_FIRST = tuple(f"tests/integration/{name}" for name in (  # seconds on a worker of `pytest -n 2`, Dec 8
    "test_cli.py", "test_slurm.py", "test_hosts.py", "test_faults.py", "test_model_out.py", "test_agent_faults.py",
    "test_async.py",
))


def work_unit(nodeid: str) -> str:
    """The unit of work of the test ``nodeid``: its module, or "gpu" for every GPU test."""
    module = nodeid.partition("::")[0]
    return "gpu" if module.startswith("tests/gpu/") else module


@pytest.hookimpl(optionalhook=True)  # a plain `pytest`, without xdist, runs everything in one process
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Each worker takes a whole ``work_unit`` at a time, the units in the order collected."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # xdist would order the units by their count of tests instead
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a stable sort: the modules named above first, in that order, then the rest as collected
    first = {name: rank for rank, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))
