"""deploy/systemd: the units pass ``systemd-analyze verify``, start services that exist with the config files beside
them (which validate), share the node's conventions, and read one environment file naming only what meshrl reads.

verify runs on copies of the units whose /opt/meshrl/venv/bin/ is this test's virtual environment, so that a
misspelt executable is caught like a misspelt directive; verify only warns about the latter (exit code 0), so any
output at all fails the test.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from services.common.config import load_config
from services.coordinator.config import CoordinatorServiceConfig
from services.reward.config import RewardServiceConfig
from services.rollout.config import RolloutServiceConfig
from services.trainer.config import TrainerServiceConfig

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
VENV_BIN = "/opt/meshrl/venv/bin/"
ENV_FILE = "/etc/meshrl/meshrl.env"
CONFIG_DIR = "/etc/meshrl/"
SERVICES = sorted(path.name for path in UNIT_DIR.glob("meshrl*.service"))
UNITS = [*SERVICES, "meshrl.target"]
MODELS = {"coordinator": CoordinatorServiceConfig, "trainer": TrainerServiceConfig, "rollout": RolloutServiceConfig,
          "reward": RewardServiceConfig}
# Variables of the environment file that a library meshrl loads reads, and the module that reads each.
LIBRARY_VARIABLES = {"HF_HUB_OFFLINE": "huggingface_hub.constants"}


def directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """Each section's directives of a unit file, the values of a repeated key in order (comments skipped; the units
    use no line continuations)."""
    sections: dict[str, dict[str, list[str]]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            section.setdefault(key.strip(), []).append(value.strip())
    return sections


def words(unit: dict, section: str, key: str) -> list[str]:
    """Every space-separated value of ``key`` (After=a b and a second After=c give [a, b, c])."""
    return [word for value in unit.get(section, {}).get(key, []) for word in value.split()]


def exec_start(name: str, gpu: int = 0) -> list[str]:
    """The command line systemd runs (a template's for instance ``gpu``, its %i)."""
    [command] = directives(UNIT_DIR / name)["Service"]["ExecStart"]
    return shlex.split(command.replace("%i", str(gpu)))


def instance(name: str) -> str:
    """The unit name systemd would start: a template as its instance for GPU 0."""
    return name.replace("@.", "@0.")


def verify(unit_dir: Path, tmp_path: Path) -> tuple[int, str]:
    """``systemd-analyze verify`` of the target and every service of ``unit_dir`` (templates as an instance), on
    copies whose executables are this virtual environment's; its exit code and all it printed."""
    copies = tmp_path / "units"
    copies.mkdir()
    for name in UNITS:
        (copies / name).write_text((unit_dir / name).read_text().replace(VENV_BIN, sysconfig.get_path("scripts") + "/"))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(copies / instance(name)) for name in UNITS)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, (done.stdout + done.stderr).strip()


CANNOT_VERIFY = ("systemd-analyze is not installed (it comes with systemd)" if shutil.which("systemd-analyze") is None
                 else "not run from a virtual environment, which the units' /opt/meshrl/venv/bin stands for"
                 if sys.prefix == sys.base_prefix else "")
needs_verify = pytest.mark.skipif(bool(CANNOT_VERIFY), reason=CANNOT_VERIFY)


@needs_verify
def test_the_units_pass_systemd_analyze_verify(tmp_path):
    code, output = verify(UNIT_DIR, tmp_path)
    assert (code, output) == (0, "")


@needs_verify
@pytest.mark.parametrize(("line", "mistake"), [("Restart=on-failure", "Restrat=on-failure"),
                                               ("[Service]", "[Servcie]"),
                                               ("KillMode=mixed", "KillMode=mixd"),
                                               ("bin/python -m", "bin/pyton -m")])
def test_verify_fails_on_a_mistake(tmp_path, line, mistake):
    broken = tmp_path / "broken"
    shutil.copytree(UNIT_DIR, broken)
    unit = broken / "meshrl-rollout@.service"
    assert line in unit.read_text()
    unit.write_text(unit.read_text().replace(line, mistake, 1))
    _, output = verify(broken, tmp_path)  # a warning's exit code is 0: the output tells
    assert "meshrl-rollout@" in output


def test_there_is_a_unit_per_service_kind_and_one_target():
    assert SERVICES == ["meshrl-coordinator.service", "meshrl-reward.service", "meshrl-rollout.service",
                        "meshrl-rollout@.service", "meshrl-trainer-torchrun.service", "meshrl-trainer.service"]
    assert sorted(path.name for path in UNIT_DIR.glob("*.target")) == ["meshrl.target"]


@pytest.mark.parametrize("name", SERVICES)
def test_each_unit_runs_a_service_with_a_config_from_beside_it(name):
    """The module exists, --config names one of deploy/systemd/*.yaml, and that file with the command line's
    overrides validates, binds every interface and (but for the coordinator) names the coordinator."""
    command = exec_start(name)
    assert command[0] in (VENV_BIN + "python", VENV_BIN + "torchrun")
    module = command[command.index("-m") + 1]
    kind = module.removeprefix("services.")
    assert module.startswith("services.") and importlib.util.find_spec(module) is not None
    config_at = command.index("--config") + 1
    installed = command[config_at]
    assert installed.startswith(CONFIG_DIR)
    source = UNIT_DIR / installed.removeprefix(CONFIG_DIR)
    config = load_config(MODELS[kind], source, command[config_at + 1:])
    assert config.host == "0.0.0.0"
    assert bool(config.coordinator) == (kind != "coordinator")
    assert float(directives(UNIT_DIR / name)["Service"]["TimeoutStopSec"][0]) > config.grace_s


def test_every_config_file_is_read_by_a_unit_and_each_gpu_rollout_binds_a_free_port():
    read = {exec_start(name)[exec_start(name).index("--config") + 1].removeprefix(CONFIG_DIR) for name in SERVICES}
    assert read == {path.name for path in UNIT_DIR.glob("*.yaml")}
    command = exec_start("meshrl-rollout@.service")
    assert load_config(RolloutServiceConfig, UNIT_DIR / "rollout.yaml", command[command.index("--config") + 2:]).port == 0
    assert directives(UNIT_DIR / "meshrl-rollout@.service")["Service"]["Environment"] == ["CUDA_VISIBLE_DEVICES=%i"]


@pytest.mark.parametrize("name", SERVICES)
def test_each_unit_keeps_the_node_conventions(name):
    unit = directives(UNIT_DIR / name)
    service = unit["Service"]
    assert (service["User"], service["WorkingDirectory"], service["StateDirectory"]) == (["meshrl"],
                                                                                       ["/var/lib/meshrl"], ["meshrl"])
    assert service["EnvironmentFile"] == [ENV_FILE]  # not "-/etc/...": without it a service would run open
    assert not [value for values in service.values() for value in values if "MESHRL_" in value]  # all in ENV_FILE
    assert "network-online.target" in words(unit, "Unit", "After") and "network-online.target" in words(unit, "Unit", "Wants")
    assert ("meshrl-coordinator.service" in words(unit, "Unit", "After")) == (name != "meshrl-coordinator.service")
    assert words(unit, "Unit", "PartOf") == ["meshrl.target"] and words(unit, "Install", "WantedBy") == ["meshrl.target"]
    assert (service["Restart"], service["KillSignal"]) == (["on-failure"], ["SIGTERM"])
    assert int(unit["Unit"]["StartLimitBurst"][0]) > 1 and int(service["RestartSec"][0]) > 0


def test_the_units_name_only_units_that_exist():
    here = {path.name for path in UNIT_DIR.iterdir()}
    named = {word for name in UNITS for section in directives(UNIT_DIR / name).values()
             for key in ("After", "Wants", "PartOf", "Conflicts", "WantedBy") for word in
             " ".join(section.get(key, [])).split() if word.startswith("meshrl")}
    assert named and named <= here
    target = directives(UNIT_DIR / "meshrl.target")
    assert words(target, "Install", "WantedBy") == ["multi-user.target"]
    assert "network-online.target" in words(target, "Unit", "After")


def test_the_environment_file_names_only_what_meshrl_reads():
    path = UNIT_DIR / Path(ENV_FILE).name
    assignments = re.findall(r"^(#?)([A-Za-z_][A-Za-z0-9_]*)=(.*)$", path.read_text(), re.MULTILINE)
    named = {name for _, name, _ in assignments}
    active = {name: value for commented, name, value in assignments if not commented}
    assert active["MESHRL_TOKEN_FILE"] == "/etc/meshrl/token"
    assert "MESHRL_TOKEN" not in named  # the token itself lives in its file only
    tls = {"MESHRL_TLS_CERT", "MESHRL_TLS_KEY", "MESHRL_TLS_CA"}
    assert tls <= named and len(tls & set(active)) in (0, 3)
    meshrl_source = "\n".join(path.read_text() for path in (ROOT / "services").rglob("*.py"))
    for name in named:
        if name.startswith("MESHRL_"):
            assert f'"{name}"' in meshrl_source, f"{name}: meshrl does not read it"
        else:
            assert name in inspect.getsource(importlib.import_module(LIBRARY_VARIABLES[name])), name
    # a shell reads it as systemd does
    shell = subprocess.run(["bash", "-c", f"set -a; . {shlex.quote(str(path))}; env -0"], capture_output=True,
                           text=True, check=True, env={})
    seen = dict(item.split("=", 1) for item in shell.stdout.split("\0") if "=" in item)
    assert {name: seen[name] for name in active} == active
