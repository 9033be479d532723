"""CPU tests of services/env/config.py and the tool-config reading of services/env/tools.py: verl's format taken
as it is, its tool class names resolved to the built-ins, bad configs refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, load_config
from services.env.config import EnvironmentConfig, EnvServiceConfig, ToolConfig
from services.env.tools import (AnswerCheckTool, CodeInterpreterTool, ToolReply, as_reply, create_kwargs,
                                environment_tools, load_class, tool_class)

GSM8K_TOOL = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
              "tool_schema": {"type": "function", "function": {
                  "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k",
                  "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                                 "required": ["answer"]}}}}
SANDBOX_TOOL = {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                "config": {"sandbox_fusion_url": "https://example/run_code", "num_workers": 10,
                           "default_timeout": 30, "memory_limit_mb": 1024},
                "tool_schema": {"type": "function", "function": {"name": "code_interpreter", "parameters": {
                    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}}


def test_a_verl_tool_config_file_is_read_as_it_is_and_its_classes_are_the_builtins(tmp_path: Path):
    path = tmp_path / "tool_config.yaml"
    path.write_text(yaml.safe_dump({"tools": [GSM8K_TOOL, SANDBOX_TOOL]}))
    environment = EnvironmentConfig(tool_config_path=str(path))
    tools = environment_tools(environment)
    assert [tool.name for tool in tools] == ["calc_gsm8k_reward", "code_interpreter"]
    assert [tool_class(tool) for tool in tools] == [AnswerCheckTool, CodeInterpreterTool]
    assert tools[1].config["default_timeout"] == 30
    assert CodeInterpreterTool(dict(tools[1].config), {}).limits.wall_s == 30.0


def test_the_service_config_loads_from_yaml_with_overrides(tmp_path: Path):
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump({"environments": {"gsm8k": {"tools": [GSM8K_TOOL]}}, "workers": 2}))
    config = load_config(EnvServiceConfig, path, ["call_timeout_s=3"])
    assert (config.workers, config.call_timeout_s) == (2, 3.0)
    assert config.environments["gsm8k"].tools[0].name == "calc_gsm8k_reward"


@pytest.mark.parametrize(("environment", "message"), [
    ({}, "either tools"),
    ({"tools": [GSM8K_TOOL], "environment": "env.py:Env"}, "either tools"),
    ({"tools": [GSM8K_TOOL], "options": {"a": 1}}, "options are for an environment class only"),
    ({"tools": [GSM8K_TOOL, GSM8K_TOOL]}, "tool names must differ"),
    ({"tools": [dict(GSM8K_TOOL, tool_schema={"type": "function"})]}, "OpenAI function schema"),
    ({"tools": [dict(GSM8K_TOOL, extra=1)]}, "extra"),
])
def test_bad_environments_are_refused_naming_the_field(environment: dict, message: str):
    with pytest.raises(ConfigError, match=message) as refused:
        flow = yaml.safe_dump(environment, default_flow_style=True).strip()
        load_config(EnvServiceConfig, None, [f"environments={{e: {flow}}}"])
    assert "environments" in str(refused.value)


@pytest.mark.parametrize("override", ["workers=0", "call_timeout_s=-1", "max_parallel_calls=0", "max_steps=0"])
def test_limits_must_be_positive(override: str):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(EnvServiceConfig, None, [override])


def test_a_tool_config_file_without_a_tools_list_or_with_a_bad_tool_is_refused_naming_it(tmp_path: Path):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tool": [GSM8K_TOOL]}))
    with pytest.raises(ValueError, match="a tool config holds a list under tools"):
        environment_tools(EnvironmentConfig(tool_config_path=str(path)))
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "x.py:X"}]}))
    with pytest.raises(ConfigError, match=r"tools\[0\].*tool_schema"):
        environment_tools(EnvironmentConfig(tool_config_path=str(path)))


def test_user_classes_that_cannot_be_loaded_are_refused_naming_them(tmp_path: Path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no luck')\n")
    with pytest.raises(ValueError, match=r"broken\.py failed to import: ImportError: no luck"):
        load_class(f"{broken}:Tool", "tool t")
    with pytest.raises(ValueError, match="has no class 'Missing'"):
        load_class("json:Missing", "tool t")
    with pytest.raises(ValueError, match="must look like"):
        load_class("no_colon", "tool t")


def test_answer_check_reads_the_rows_ground_truth_and_compares_numbers():
    row = {"reward_model": {"ground_truth": "1,200"}}
    tool = AnswerCheckTool({}, create_kwargs(row, "calc_gsm8k_reward"))
    assert tool.call({"answer": "#### $1200"}).reward == 1.0
    assert tool.call({"answer": "1200.0"}).reward == 1.0
    assert tool.call({"answer": "12"}) == ToolReply("Current parsed answer=12 reward=0.0", 0.0)
    given = {"extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}}, **row}
    assert create_kwargs(given, "calc_gsm8k_reward") == {"ground_truth": "5"}


def test_a_tools_return_value_is_a_string_or_a_string_and_a_finite_reward():
    assert as_reply("4") == ToolReply("4") and as_reply(("4", 1)) == ToolReply("4", 1.0)
    for garbage in (None, 4, ("4", float("nan")), ("4", True), ["4"]):
        with pytest.raises(ValueError, match="not a string"):
            as_reply(garbage)


def test_a_code_interpreter_is_refused_where_the_sandbox_cannot_be_had(monkeypatch):
    from services.env import tools

    monkeypatch.setattr(tools, "check_sandbox", lambda: "the sandbox needs root")
    code = ToolConfig.model_validate(SANDBOX_TOOL)
    with pytest.raises(ValueError, match=r"code_interpreter .* needs the code sandbox.*: the sandbox needs root"):
        tools.check_tools([ToolConfig.model_validate(GSM8K_TOOL), code])
    tools.check_tools([ToolConfig.model_validate(GSM8K_TOOL)])  # no code, no sandbox needed
