"""From what a user types to the run config coordctl sends: a config file (laid over the embedded default with
--local), verl-style overrides, the ``local`` section, and the checks that run before anything starts."""

from __future__ import annotations

import copy
import functools
import importlib.resources
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from services.common.config import ConfigError, apply_overrides, read_yaml, to_yaml, validate
from services.common.limits import MAX_ENV_WORKERS
from services.run.checks import RunData, load_run_data
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig


def default_config() -> dict:
    """The embedded default of --local (services/coordctl/defaults/local.yaml)."""
    return yaml.safe_load(importlib.resources.files("services.coordctl").joinpath("defaults/local.yaml").read_text())


def merge(base: dict, top: dict) -> dict:
    """``top`` laid over ``base``, section by section."""
    merged = dict(base)
    for key, value in top.items():
        merged[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def hydra_config_file(config_path: str | None, config_name: str | None) -> str | None:
    """The config file Hydra's ``--config-path DIR --config-name NAME`` pair names, as verl's scripts give it:
    DIR/NAME, with .yaml added unless NAME ends in .yaml or .yml (DIR: the current folder if not given); None
    without a --config-name. ConfigError naming the file if there is none."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError(f"--config-path {config_path} names the folder of a --config-name: give both")
        return None
    name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
    path = Path(config_path or ".") / name
    if not path.is_file():
        raise ConfigError(f"--config-name {config_name}: there is no config file {path}")
    return str(path)


VERL_BASE_CONFIGS = ("ppo_trainer", "_self_")
"""What a verl config file's Hydra ``defaults:`` may list: verl's base config, whose meaning meshrl's defaults
carry, and the file itself."""


def without_hydra(data: dict, file: str) -> dict:
    """A config file's run config without Hydra's composition keys, as verl's named configs have them: ``hydra:``
    (where Hydra looks for configs) is dropped, and ``defaults:`` may list only VERL_BASE_CONFIGS; ConfigError
    naming the file and the entry for any other (meshrl does not compose Hydra config groups)."""
    data = dict(data)
    data.pop("hydra", None)
    defaults = data.pop("defaults", [])
    for entry in defaults if isinstance(defaults, list) else [defaults]:
        if entry not in VERL_BASE_CONFIGS:
            raise ConfigError(f"{file}: defaults: {entry!r} is a Hydra config meshrl cannot compose; only verl's "
                              f"base config (ppo_trainer, which meshrl's defaults stand for) and _self_ are taken")
    return data


READ_PATH_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_adapter_path", "critic.model.path",
                  "data.train_files", "data.val_files", "actor_rollout_ref.rollout.multi_turn.tool_config_path")
"""The keys naming files and folders a run reads (one path, or a list of them). A relative one written in a config
file is taken from that file's folder (the file and what it names move together); one given on the command line
(``key=value``) from the current folder, as verl's scripts expect. Both are sent as absolute paths."""


def absolute_paths(data: dict, folder: Path, keys: Collection[str] = READ_PATH_KEYS) -> dict:
    """A copy of ``data`` (a config's nested sections) whose relative paths under ``keys`` (those it holds) are
    taken from ``folder``; ``~`` is the user's home."""
    data = copy.deepcopy(data)
    for key in keys:
        *sections, name = key.split(".")
        section: Any = data
        for part in sections:
            section = section.get(part) if isinstance(section, dict) else None
        if not isinstance(section, dict) or not section.get(name):
            continue
        value = section[name]
        if isinstance(value, str):
            section[name] = from_folder(value, folder)
        elif isinstance(value, list):
            section[name] = [from_folder(item, folder) if isinstance(item, str) else item for item in value]
    return data


def from_folder(path: str, folder: Path) -> str:
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else folder / expanded)


def overridden_keys(overrides: list[str]) -> set[str]:
    """The keys that ``overrides`` set (``key=value``, ``+key=value``, ``++key=value``)."""
    return {override.split("=", 1)[0].lstrip("+") for override in overrides if "=" in override}


def resolve_config(args: list[str], local: bool,
                   config_file: str | None = None) -> tuple[RunConfig, LocalConfig | None]:
    """The run config from an optional YAML file and overrides, and (with ``local``) the ``local`` section;
    ConfigError naming the field if bad.

    The file is the one argument that is not an override, or ``config_file`` (``hydra_config_file``); with
    neither, the overrides apply to meshrl's defaults (those of RunConfig), as verl's main_ppo applies them to
    its own. With ``local``, the file and overrides are laid over the embedded default, and their ``local``
    section (what to build, how to start the services) is taken off before the rest is validated as the run
    config; the paths it reads are made absolute (``READ_PATH_KEYS``); the model and data it names are built if
    missing, and unless trainer.save_freq is given the run
    saves a checkpoint of its last step (what ``coordctl export`` reads)."""
    files = [a for a in args if "=" not in a and not a.startswith("~")] + ([config_file] if config_file else [])
    overrides = [a for a in args if "=" in a or a.startswith("~")]
    if len(files) > 1:
        raise ConfigError(f"one config file at most, got {files}")
    data = without_hydra(read_yaml(files[0]), files[0]) if files else {}
    if files:
        data = absolute_paths(data, Path(files[0]).resolve().parent)
    if local:  # a file given with --local is laid over the embedded default
        data = merge(default_config(), data)
    data = apply_overrides(data, overrides)
    data = absolute_paths(data, Path.cwd(), overridden_keys(overrides).intersection(READ_PATH_KEYS))
    local_section = data.pop("local", None)
    if local_section is not None and not local:
        raise ConfigError("local: only `coordctl start-run --local` reads this section (what it builds)")
    config = validate(RunConfig, data)
    local_config = validate(LocalConfig, local_section or {}, "local") if local else None
    if local_config is not None:
        from services.coordctl.local import cache_dir, prepare_assets

        assets = prepare_assets(config, local_config, cache_dir())
        if "save_freq" not in data.get("trainer", {}) and config.trainer.total_training_steps is not None:
            assets.append(f"trainer.save_freq={config.trainer.total_training_steps}")  # its last step: to export
        config = validate(RunConfig, apply_overrides(config.model_dump(mode="json"), assets))
    config.require_paths()
    return config, local_config


def readable_here(config: RunConfig) -> bool:
    """Whether every path the run reads is on this machine (else only the coordinator's host can check them)."""
    paths = [config.actor_rollout_ref.model.path, *config.data.train_files, *config.data.val_files]
    return all(Path(path).exists() for path in paths)


def checked(config: RunConfig) -> tuple[RunConfig, RunData]:
    """Read the model folder and the data as the coordinator will (ValueError naming the key, file or row), and
    the config with the steps its total_epochs comes to."""
    data = load_run_data(config)
    return config.steps_for(len(data.prompts)), data


def local_services(local: LocalConfig, config: RunConfig) -> tuple:
    """The ServiceSpecs --local starts: local.services' settings, the rollout's vLLM settings verl's keys give
    (rollout.gpu_memory_utilization, tensor_model_parallel_size; prefix caching for a multi-turn run, so that a
    turn does not recompute the conversation before it) when the run asks for vLLM, and for a multi-turn run an
    env service hosting its tools (``env_settings``) with a worker per trajectory of a step, up to
    LOCAL_ENV_WORKERS of its engine; ValueError naming the key if its tool config is missing."""
    from services.coordctl.local import ServiceSpec

    rollout, specs = config.actor_rollout_ref.rollout, []
    kinds = ("trainer", "rollout", "reward", *(("env",) if rollout.multi_turn.enable else ()))
    for kind in kinds:
        for launch in local.launches(kind):
            settings = env_settings(config) if kind == "env" else []
            settings += list(launch.settings)
            if kind == "env" and not any(s.startswith("workers=") for s in settings):
                settings.append(f"workers={min(trajectories_per_step(config), LOCAL_ENV_WORKERS[engine_of(config)])}")
            if kind == "env" and unsandboxed_here() and not any(s.startswith("sandbox=") for s in settings):
                settings.append("sandbox=false")  # your own tools, on your own machine: said at start
            for key, value in (("gpu_memory_utilization", rollout.gpu_memory_utilization),
                               ("tensor_parallel_size", rollout.tensor_model_parallel_size),
                               ("enable_prefix_caching", "true" if rollout.multi_turn.enable else None)):
                if (kind == "rollout" and rollout.name == "vllm" and value is not None
                        and not any(s.startswith(f"{key}=") for s in settings)):
                    settings.append(f"{key}={value}")
            specs.append(ServiceSpec(kind=kind, settings=tuple(settings), env=tuple(sorted(launch.env.items()))))
    return tuple(specs)


def trajectories_per_step(config: RunConfig) -> int:
    return config.data.train_batch_size * config.actor_rollout_ref.rollout.n


def engine_of(config: RunConfig) -> str:
    """The engine a --local rollout runs: vLLM where the run asks for it, hf otherwise."""
    return "vllm" if config.actor_rollout_ref.rollout.name == "vllm" else "hf"


def env_workers_short(config: RunConfig, services: tuple) -> str | None:
    """What start-run says where the env services --local starts hold fewer workers than a step has trajectories
    (the rest wait for an episode to end), or None."""
    workers = sum(int(setting.split("=", 1)[1]) for spec in services if spec.kind == "env"
                  for setting in spec.settings if setting.startswith("workers="))
    wanted = trajectories_per_step(config)
    if not workers or workers >= wanted:
        return None
    services_needed = -(-wanted // MAX_ENV_WORKERS)
    fix = (f"local.services.env=[workers={wanted}]" if services_needed == 1 else
           f"local.services.env as a list of {services_needed} services of workers={MAX_ENV_WORKERS}, the most one "
           "holds (examples/gpu_tools.yaml)")
    return (f"the env services hold {workers} episodes at once, fewer than a step's {wanted} trajectories: the rest "
            f"wait for one to end ({fix} runs them all together, about 60 MB each)")


@functools.cache
def unsandboxed_here() -> str | None:
    """Why this host cannot run env workers in the sandbox (not root, no bubblewrap), or None where it can. The
    env service of --local then runs the user's own tools unsandboxed, and start-run says so; a cluster's env
    service refuses to, unless its operator sets sandbox: false. Found once per process (a trial run in the
    sandbox), however many env services --local starts."""
    from services.common.sandbox import check_sandbox

    return check_sandbox()


LOCAL_ENV_WORKERS = {"hf": 32, "vllm": 256}
"""Episodes the env service of --local holds open at most, by the rollout's engine (each in a worker process of
about 60 MB; an hf rollout samples one call at a time, vLLM hundreds of turns together): a step's trajectories
beyond them wait for one to end, which start-run says; local.services.env can say otherwise (workers=N)."""


def env_settings(config: RunConfig) -> list[str]:
    """The settings of the env service --local starts for a multi-turn run: it hosts the environment that
    multi_turn.environment names, with the tools of multi_turn.tool_config_path or the agent of multi_turn.agent
    (as an absolute path; ValueError naming the key and the file if there is none there)."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.agent is not None:
        target, _, function = multi_turn.agent.rpartition(":")
        agent = Path(target).resolve()
        if not target.endswith(".py") or not agent.is_file():
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.agent: no agent file at {agent} (path/to/file.py:"
                             f"function)")
        tools = [f"environments.{multi_turn.environment}.tool_config_path={Path(multi_turn.tool_config_path).resolve()}"
                 ] if multi_turn.tool_config_path is not None else []
        return [f"environments.{multi_turn.environment}.agent={agent}:{function}", *tools]
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    if multi_turn.tool_config_path is None:
        raise ValueError(f"{key}: a multi-turn run started with --local needs a tool config (or multi_turn.agent) for "
                         f"its env service")
    path = Path(multi_turn.tool_config_path).resolve()
    if not path.is_file():
        raise ValueError(f"{key}: no tool config file at {path}")
    return [f"environments.{multi_turn.environment}.tool_config_path={path}"]


def unregistered_algorithms(config: RunConfig, services: tuple | None) -> list[str]:
    """The estimator and policy loss the run names that meshrl does not build in, each with where it must come from.
    With --local (``services``: what it starts) one that no local service can register is a ValueError, as the run
    would be refused at its start: the local coordinator registers meshrl's estimators only, a local trainer the
    losses of the policy_loss_modules its local.services settings name. With remote services (``services`` None)
    they are said, not refused: the services' own configs are theirs to know."""
    from services.algo_registry import ADV_ESTIMATORS, POLICY_LOSSES

    said = []
    estimator = config.algorithm.adv_estimator
    if estimator not in ADV_ESTIMATORS.names():
        where = f"{ADV_ESTIMATORS.key}={estimator}: not one of meshrl's ({', '.join(ADV_ESTIMATORS.names())})"
        if services is not None:
            raise ValueError(f"{where}; the local coordinator registers meshrl's only: start a coordinator with "
                             "adv_estimator_modules naming its module (docs/guides/custom-algorithms.md)")
        said.append(f"{where}: the coordinator's adv_estimator_modules must register it, or the run is refused at "
                    "its start")
    loss = config.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss not in POLICY_LOSSES.names():
        where = f"{POLICY_LOSSES.key}={loss}: not one of meshrl's ({', '.join(POLICY_LOSSES.names())})"
        trainer_settings = [setting for spec in services or () if spec.kind == "trainer" for setting in spec.settings]
        if services is not None and not any(setting.startswith("policy_loss_modules=") for setting in
                                            trainer_settings):
            raise ValueError(f"{where}, and the local trainer registers no losses of its own: name its module with "
                             "'local.services.trainer=[\"policy_loss_modules=[path/to/losses.py]\"]'")
        said.append(f"{where}: the trainer's policy_loss_modules must register it, or the run is refused at its "
                    "start")
    return said


def start_notices(config: RunConfig, services: tuple | None) -> list[str]:
    """What start-run says before it starts (and --dry-run with the plan): the verl keys not acted on, the run's
    algorithms that are not meshrl's, and env services that hold fewer episodes than a step has trajectories.
    ValueError for an algorithm that no --local service could register."""
    short = env_workers_short(config, services) if services is not None else None
    return [*config.notices(), *unregistered_algorithms(config, services), *([short] if short else [])]


def plan(config: RunConfig, data: RunData | None, services: tuple | None, *, coordinator: str,
         notices: list[str]) -> str:
    """What start-run would do, for --dry-run: the resolved config, what was read, the ``notices``, and where it
    would run."""
    lines = ["# the resolved run config", to_yaml(config).rstrip(), ""]
    lines.append(f"# read: {data.describe()}, {config.trainer.steps} steps" if data is not None else
                 "# not read here: the model or data are not on this machine (the coordinator reads them)")
    lines += [f"# note: {notice}" for notice in notices]
    if services is not None:
        lines.append("# would start on this machine: a coordinator, then " + ", ".join(
            f"a {spec.kind}" + (f" ({' '.join([*(f'{k}={v}' for k, v in spec.env), *spec.settings])})"
                                if spec.settings or spec.env else "") for spec in services))
    else:
        lines.append(f"# would send it to the coordinator at {coordinator}")
    return "\n".join(lines)
