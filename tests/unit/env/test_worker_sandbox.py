"""CPU tests of what an env worker's sandbox is built from (services/env/worker_sandbox.py), of the JSON its worker
answers in (services/env/worker.py), and of when a service runs its workers sandboxed (services/env/server.py)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs

import meshrl.v1
import services.env
from services.env.config import EnvServiceConfig
from services.env.environment import Message, StepResult
from services.env.episodes import check_reports
from services.env.server import workers_sandboxed
from services.env.worker import decode, encode
from services.env.worker_sandbox import readable_paths, worker_config

PLUGINS = Path(__file__).resolve().parents[2] / "integration" / "plugins"
CHECK = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "tool_schema": {"type": "function",
                                                                        "function": {"name": "check"}}}


def user_config(tmp_path: Path) -> EnvServiceConfig:
    """Users' classes three ways: a tool file named relative to the working directory, an environment class file, a
    package.module class; and a tool config file."""
    tool_config = tmp_path / "tools.yaml"
    tool_config.write_text(yaml.safe_dump({"tools": [CHECK]}))
    lookup = {"class_name": f"{os.path.relpath(PLUGINS / 'user_env.py')}:Lookup",
              "tool_schema": {"type": "function", "function": {"name": "lookup"}}}
    return EnvServiceConfig.model_validate({"environments": {
        "tools": {"tool_config_path": str(tool_config), "tools": [lookup]},
        "game": {"environment": f"{PLUGINS / 'user_env.py'}:GuessNumber"},
        "module": {"environment": "yaml:YAMLObject"}}})


def test_a_worker_gets_its_tools_listed_and_class_files_absolute(tmp_path: Path):
    environments = worker_config(user_config(tmp_path)).environments
    assert environments["tools"].tool_config_path is None
    assert [tool.class_name for tool in environments["tools"].tools] == [
        f"{PLUGINS / 'user_env.py'}:Lookup", CHECK["class_name"]]
    assert environments["game"].environment == f"{PLUGINS / 'user_env.py'}:GuessNumber"
    assert environments["module"].environment == "yaml:YAMLObject"


def test_a_sandboxed_worker_reads_python_meshrl_and_the_users_class_folders_only(tmp_path: Path):
    paths = readable_paths(user_config(tmp_path))
    packages = [Path(module.__file__ or "").parent for module in (services.env, meshrl.v1)]
    assert set(paths) == {sys.prefix, sys.base_prefix, str(packages[0].parent), str(packages[1].parent),
                          str(PLUGINS), str(Path(yaml.__file__).parent)}  # not tmp_path: the service reads tools.yaml


@pytest.mark.parametrize("secret", ["MESHRL_TOKEN_FILE", "MESHRL_TLS_KEY", "MESHRL_TLS_CERT", "MESHRL_TLS_CA",
                                    "ports_file"])
def test_a_class_folder_that_holds_a_secret_file_or_the_state_folder_refuses_the_service(tmp_path: Path, monkeypatch,
                                                                                       secret: str):
    (tmp_path / "tool.py").write_text("class Tool:\n    pass\n")
    path = tmp_path / "state" / "secret"
    settings = {"environments": {"e": {"environment": f"{tmp_path / 'tool.py'}:Tool"}}}
    if secret == "ports_file":
        settings["ports_file"] = str(path)
    else:
        monkeypatch.setenv(secret, str(path))
    with pytest.raises(ValueError, match=f"{secret} {path} lies in {tmp_path}"):
        readable_paths(EnvServiceConfig.model_validate(settings))


def test_a_worker_is_not_told_the_services_own_settings(tmp_path: Path):
    """Its address, coordinator and ports file (which lies in its state folder) stay in the service."""
    served = {"host": "10.1.2.3", "port": 7001, "coordinator": "10.1.2.4:7000",
              "ports_file": str(tmp_path / "state" / "ports" / "env.json")}
    sent = worker_config(user_config(tmp_path).model_copy(update=served)).model_dump_json()
    assert [value for value in map(str, served.values()) if value in sent] == []


def test_a_workers_answers_are_json_and_anything_else_is_refused():
    step = StepResult(messages=[Message("tool", "1", "lookup")], reward=0.5, info={"calls": []})
    assert decode(encode("done", step), "step") == ("done", step)
    assert decode(encode("done", [Message("user", "hi")]), "reset") == ("done", [Message("user", "hi")])
    assert decode(encode("reply", Message("tool", "x", "t")), "step") == ("reply", Message("tool", "x", "t"))
    with pytest.raises(ValueError):
        decode(pickle.dumps(("done", None)), "close")
    with pytest.raises(ValueError, match="sent 'exec'"):
        decode(json.dumps(["exec", "x"]).encode(), "step")
    with pytest.raises(ValueError, match="not a list of messages"):
        decode(json.dumps(["done", {"x": 1}]).encode(), "reset")


def test_a_worker_reporting_more_than_one_step_can_make_is_refused():
    check_reports(calls=8, replies=9, code_runs=8, max_parallel_calls=8)  # 8 calls run, the rest one error reply
    for calls, replies, code_runs in ((9, 0, 0), (8, 10, 0), (1, 1, 2)):
        with pytest.raises(ValueError, match="in one step"):
            check_reports(calls, replies, code_runs, max_parallel_calls=8)


def test_users_classes_refuse_a_service_that_cannot_sandbox_them_unless_the_operator_says_sandbox_false(tmp_path):
    with_users = user_config(tmp_path)
    with pytest.raises(ValueError, match=r"cannot give: no bwrap here .*sandbox: false"):
        workers_sandboxed(with_users, "no bwrap here")
    assert workers_sandboxed(with_users, None)
    with capture_logs() as logs:
        assert not workers_sandboxed(with_users.model_copy(update={"sandbox": False}), None)
    assert [(log["event"], log["log_level"]) for log in logs] == [("workers_unsandboxed", "warning")]
    assert "the cluster token included" in logs[0]["consequence"]
    builtins_only = EnvServiceConfig.model_validate({"environments": {"e": {"tools": [CHECK]}}})
    assert not workers_sandboxed(builtins_only, "no bwrap here")  # only meshrl's own code runs in its workers
