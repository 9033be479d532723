"""The command line every service shares: ``python -m services.<kind> --config FILE key=value ...``."""

from __future__ import annotations

import argparse
import sys
from typing import TypeVar

from services.common.config import ConfigError, ServeConfig, load_config, to_yaml

Config = TypeVar("Config", bound=ServeConfig)
REFUSED_EXIT_CODE = 2  # a bad config, an open bind, a taken port, a refused token or a damaged file: restarts mend none


class CannotStart(Exception):
    """What a service finds at start that a restart would find again (a damaged run DB): it exits with
    REFUSED_EXIT_CODE and this message, which names the file and what to do."""


def parse_service_config(kind: str, model: type[Config], argv: list[str] | None = None) -> Config:
    """Read ``--config`` plus overrides; on a bad config exit (REFUSED_EXIT_CODE) with the message naming the
    field."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{kind}", description=f"Run a meshrl {kind} service.")
    parser.add_argument("--config", help="YAML file with this service's settings")
    parser.add_argument("--port", type=int, help="shorthand for port=N")
    parser.add_argument("--coordinator", help="shorthand for coordinator=host:port")
    parser.add_argument("overrides", nargs="*", help="key=value settings, applied after the file")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.port is not None:
        overrides.append(f"port={args.port}")
    if args.coordinator is not None:
        overrides.append(f"coordinator={args.coordinator}")
    try:
        return load_config(model, args.config, overrides)
    except ConfigError as error:
        print(f"{kind}: bad config: {error}", file=sys.stderr)
        sys.exit(REFUSED_EXIT_CODE)


def log_config(log, config: ServeConfig) -> None:
    log.info("config", config=to_yaml(config))
