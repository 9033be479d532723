"""Config loading: YAML plus verl-style dotted overrides, validated by pydantic.

``load_config(Model, path, ["data.train_batch_size=64"])`` reads the YAML,
applies each override in Hydra's syntax (``key.path=value``, ``+key=value``,
``~key``; values parsed as YAML, so ``1e-3``, ``true`` and ``[a,b]`` mean what
they say; ``${other.key}`` interpolated), and validates the result. Any
problem raises ``ConfigError`` whose message names the field, with the key
meant where a name is misspelt:
``data.train_batch_size: Input should be greater than 0``,
``data.train_bach_size: unknown key (did you mean train_batch_size?)``.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pydantic
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field

from services.common.limits import MAX_WAIT_S, StreamLimits
from services.common.request_text import yaml_value


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending field."""


class Section(pydantic.BaseModel):
    """Base of every config section: unknown keys are refused, values are frozen."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


Model = TypeVar("Model", bound=pydantic.BaseModel)


def parse_yaml(text: str, what: str) -> Any:
    """``text`` read as YAML by the safe loader (no tag builds an object or runs code) within the limits of a
    request's YAML (``request_text.yaml_value``: its length, nesting and aliases); ConfigError naming ``what``
    otherwise."""
    try:
        return yaml_value(text, what)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = parse_yaml(Path(path).read_text(), f"config file {path}") or {}
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top, not {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with Hydra's overrides applied, as verl's scripts write them (through OmegaConf):

    - ``a.b=value`` sets a key; the value is read as YAML (``1e-3``, ``true``, ``[a,b]``, ``null``);
    - ``+a.b=value`` and ``++a.b=value`` do the same (Hydra's "add" and "add or replace": the schema refuses an
      unknown key when the config is validated, naming it);
    - ``~a.b`` removes a key, so that its default applies;
    - ``${a.b}`` in any value, from a file or an override, becomes that key's value once all are applied.
    """
    config = OmegaConf.create(data)
    for override in overrides:
        if override.startswith("~"):
            remove_key(config, override[1:].partition("=")[0], override)
            continue
        key, sep, raw = override.lstrip("+").partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {override!r} must look like key.path=value (or +key.path=value, ~key.path)")
        config = set_key(config, key.strip(), raw.strip(), override=override)
    try:
        return cast(dict[str, Any], OmegaConf.to_container(config, resolve=True))  # a DictConfig's container
    except OmegaConfBaseException as error:
        raise ConfigError(f"{getattr(error, 'full_key', None) or '(a value)'}: {first_line(error)}") from None


def set_key(config: DictConfig, key: str, raw: str, *, override: str) -> DictConfig:
    """``config`` with ``key`` set to ``raw`` read as YAML (empty: the empty string); a key through a value that
    is not a section is refused."""
    node = config
    for part in key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, DictConfig) else None
        if node is not None and not isinstance(node, DictConfig):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    try:
        if not raw:
            OmegaConf.update(config, key, "", force_add=True)
            return config
        return cast(DictConfig, OmegaConf.merge(config, OmegaConf.from_dotlist([f"{key}={raw}"])))  # dict into dict
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({first_line(error)})") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"override {override!r}: {first_line(error)}") from None


def remove_key(config: DictConfig, key: str, override: str) -> None:
    *parents, last = key.strip().split(".")
    node = config
    for part in parents:
        node = node.get(part) if isinstance(node, DictConfig) else None
    if not isinstance(node, DictConfig) or last not in node:
        raise ConfigError(f"override {override!r}: there is no key {key.strip()} to remove")
    del node[last]


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def describe_errors(error: pydantic.ValidationError, section: str = "", model: type | None = None) -> str:
    """Every error of ``error``, each naming its field (from ``section``, if the model is a part of a config); an
    unknown key gets the nearest known ones of ``model`` at its place."""
    lines = []
    for item in error.errors():
        field = ".".join([*filter(None, [section]), *(str(part) for part in item["loc"])]) or "(top level)"
        if item["type"] == "extra_forbidden":
            near = known_keys_near(model, item["loc"]) if model is not None else []
            lines.append(f"{field}: unknown key" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
        else:
            lines.append(f"{field}: {item['msg']}")
    return "; ".join(lines)


def known_keys_near(model: type, loc: tuple) -> list[str]:
    """The keys of the section at ``loc[:-1]`` of ``model`` closest to ``loc[-1]`` (none when nothing is close)."""
    section: type | None = model
    for part in loc[:-1]:
        fields = getattr(section, "model_fields", {})
        if part not in fields:
            return []
        section = next((arg for arg in (fields[part].annotation, *typing.get_args(fields[part].annotation))
                        if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel)), None)
        if section is None:
            return []
    return difflib.get_close_matches(str(loc[-1]), list(getattr(section, "model_fields", {})), n=2, cutoff=0.6)


def validate(model: type[Model], data: dict[str, Any], section: str = "") -> Model:
    """``data`` as a ``model``; ConfigError naming every bad field (as ``section.field`` if ``section`` is given)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as error:
        raise ConfigError(describe_errors(error, section, model)) from None


def load_config(model: type[Model], path: str | Path | None, overrides: Sequence[str] = ()) -> Model:
    data = read_yaml(path) if path else {}
    return validate(model, apply_overrides(data, list(overrides)))


def to_yaml(config: pydantic.BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


class ServeConfig(Section):
    """Where a service process listens and whom it reports to (every service has these)."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 for every interface. Beyond loopback the service demands a cluster token
    (MESHRL_TOKEN_FILE or MESHRL_TOKEN) and refuses to start without one, unless allow_open says otherwise."""
    allow_open: bool = False
    """Serve without a cluster token on a host beyond loopback (0.0.0.0, a LAN address or name): anyone who
    reaches the port may call every RPC. Only for a network no one else uses; a token is the fix otherwise."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (the registry then tells the coordinator)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the Prometheus ``/metrics`` endpoint (plain HTTP, on ``host`` as the gRPC port is); unset: none is
    served; 0 picks a free one (logged as metrics_address). Anyone who reaches it can read the metrics."""
    ports_file: str = ""
    """A file this process writes once it listens, as JSON ``{"port": ..., "metrics_port": ...}`` (the ports it
    got; metrics_port null where none is served), replaced at once; for a launcher that started it on port 0 to
    learn them (coordctl --local). Empty: none is written."""
    coordinator: str = ""
    """host:port of the coordinator to register with."""
    group: str = "default"
    """Pool name; runs pick services by group."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op (and inter-op) threads (0 = torch's default). Give each of several local services 1. A
    service that computes nothing with torch (``computes_with_torch``) leaves it alone."""
    log_level: str = "info"
    """Least severe level logged, a Python logging level name in any case: debug, info, warning, error."""
    grace_s: float = Field(10.0, ge=0)
    """On SIGTERM, how long calls in flight may take to finish. The service then releases what it holds and exits;
    one still running 5 s later (a thread stuck in a call that does not return) exits at once, with code 1."""
    response_write_timeout_s: float = Field(60.0, gt=0, le=MAX_WAIT_S)
    """Seconds a streamed response (Generate, ComputeLogProbs, WatchRun, ...) may wait for its client to take
    the next message; a client that stops reading longer has its call ended with DEADLINE_EXCEEDED and the
    work the call drives cancelled."""

    def compute_devices(self) -> tuple[str, ...]:
        """The torch devices the service computes on, as its settings name them (none: the coordinator)."""
        return ()

    def computes_with_torch(self) -> bool:
        """Whether this process runs torch itself: if not, it never imports torch (seconds of CPU at each start),
        not even for ``torch_threads``."""
        return True


class StreamingServeConfig(ServeConfig):
    """A service that takes client-streamed batches (trainer, rollout): how much one stream may carry, and how
    long it may stay open. Both are checked as the stream arrives (``wire.read_stream``)."""

    max_request_bytes: int = Field(1 << 30, gt=0)
    """Bytes one streamed request may send in all (each message counting at least 1 KiB); what comes past it is
    dropped as it arrives, not held, and the call is refused with RESOURCE_EXHAUSTED."""
    request_stream_timeout_s: float = Field(300.0, gt=0, le=MAX_WAIT_S)
    """Seconds a client may take to send a streamed request to its end; a stream still open after that is
    refused with DEADLINE_EXCEEDED, whatever deadline the client set (or none)."""

    def stream_limits(self) -> StreamLimits:
        return StreamLimits(self.max_request_bytes, self.request_stream_timeout_s)
