"""Config loading: YAML plus verl-style dotted overrides, validated by pydantic.

``load_config(Model, path, ["data.train_batch_size=64"])`` reads the YAML,
applies each ``key.path=value`` (the value parsed as YAML, so ``1e-3``,
``true`` and ``[a,b]`` mean what they say), and validates the result. Any
problem raises ``ConfigError`` whose message names the field:
``data.train_batch_size: Input should be greater than 0``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from pydantic import Field


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending field."""


class Section(pydantic.BaseModel):
    """Base of every config section: unknown keys are refused, values are frozen."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


Model = TypeVar("Model", bound=pydantic.BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, not {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML)."""
    result = yaml.safe_load(yaml.safe_dump(data))
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r} must look like key.path=value")
        node = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {part} is not a section")
            node = child
        try:
            node[parts[-1]] = parse_value(raw)
        except yaml.YAMLError as error:
            raise ConfigError(f"override {override!r}: value is not valid YAML ({error})") from error
    return result


def parse_value(raw: str) -> Any:
    """A command-line value as YAML, except that 1e-3 is a number (YAML 1.1 wants 1.0e-3)."""
    if not raw.strip():
        return ""
    value = yaml.safe_load(raw)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def describe_errors(error: pydantic.ValidationError, section: str = "") -> str:
    """Every error of ``error``, each naming its field (from ``section``, if the model is a part of a config)."""
    lines = []
    for item in error.errors():
        field = ".".join([*filter(None, [section]), *(str(part) for part in item["loc"])]) or "(top level)"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{field}: {message}")
    return "; ".join(lines)


def validate(model: type[Model], data: dict[str, Any], section: str = "") -> Model:
    """``data`` as a ``model``; ConfigError naming every bad field (as ``section.field`` if ``section`` is given)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise ConfigError(describe_errors(error, section)) from None


def load_config(model: type[Model], path: str | Path | None, overrides: list[str] = ()) -> Model:
    data = read_yaml(path) if path else {}
    return validate(model, apply_overrides(data, list(overrides)))


def to_yaml(config: pydantic.BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


class ServeConfig(Section):
    """Where a service process listens and whom it reports to (every service has these)."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 for every interface."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (the registry then tells the coordinator)."""
    coordinator: str = ""
    """host:port of the coordinator to register with."""
    group: str = "default"
    """Pool name; runs pick services by group."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default). Give each of several local services 1."""
    log_level: str = "info"
    """Least severe level logged, a Python logging level name in any case: debug, info, warning, error."""
    grace_s: float = Field(10.0, ge=0)
    """On SIGTERM, how long calls in flight may take to finish."""
