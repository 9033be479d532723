"""Settings of the coordinator process."""

from __future__ import annotations

from pydantic import PositiveFloat, PositiveInt

from services.common.config import ServeConfig


class CoordinatorServiceConfig(ServeConfig):
    state_dir: str = "meshrl-state"
    """Folder of the run DB (meshrl.db) and of each run's folder (runs/<run_id>/)."""
    heartbeat_interval_s: PositiveFloat = 1.0
    """How often services heartbeat."""
    heartbeat_misses: PositiveInt = 5
    """Heartbeats a service may miss before it is marked down."""
    adv_estimator_modules: list[str] = []
    """Python files (path/to/file.py) or modules (package.module) to import at start, whose @register_adv_est
    functions this coordinator then offers besides the built-ins (services/estimators.py); runs choose one by
    algorithm.adv_estimator. One that fails to import, or reuses a registered name, stops the coordinator at start
    with the module and the error."""
