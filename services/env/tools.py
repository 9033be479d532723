"""Tools an environment's step runs: the built-ins that verl's tool class names resolve to, and users' classes.

A tool is a class built once per episode and called once per tool call of the model::

    class MyTool:
        def __init__(self, config: dict, create_kwargs: dict): ...   # at the episode's reset
        def call(self, arguments: dict) -> str | tuple[str, float]: ...  # the reply, and optionally a reward

``config`` is the tool's ``config`` from the tool config; ``create_kwargs`` is the row's
``extra_info.tools_kwargs[<tool name>].create_kwargs`` (verl's per-row tool arguments), with the row's
``reward_model.ground_truth`` as ``ground_truth`` where the row gives none there. A user's class is named
``path/to/file.py:Class`` or ``package.module:Class``; a class that cannot be imported refuses the service at
start. Tool code runs in the episode's worker process (services/env/episodes.py), never in the service's own.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

from services.common.config import read_yaml, validate
from services.common.plugins import load_named
from services.env.config import EnvironmentConfig, ToolConfig
from services.common.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_in_sandbox

CodeRunner = Callable[[str, SandboxLimits], SandboxResult]
"""How the code interpreter runs a call's code: ``run_in_sandbox`` itself, or a sandboxed worker's request to its
service (services/env/worker.py), which cannot start a sandbox of its own."""


class ToolReply(NamedTuple):
    """What one tool call gave: the text the model reads, and the reward it earned."""

    text: str
    reward: float = 0.0


def as_reply(value: Any) -> ToolReply:
    """A tool's return value: a string, or (string, finite number); ValueError for anything else."""
    if isinstance(value, str):
        return ToolReply(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        reward = value[1]
        if isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward):
            return ToolReply(value[0], float(reward))
    raise ValueError(f"returned {_short(repr(value))}, not a string or (string, finite number)")


class AnswerCheckTool:
    """Checks a GSM8K answer against the row's ground truth: reward 1 when the numbers are equal, else 0.

    Arguments: ``{"answer": "72"}`` (commas, a leading ``$`` and a leading ``####`` are ignored)."""

    def __init__(self, config: dict, create_kwargs: dict):
        self.ground_truth = _number(str(create_kwargs.get("ground_truth", "")))

    def call(self, arguments: dict) -> ToolReply:
        answer = str(arguments.get("answer", ""))
        right = self.ground_truth is not None and _number(answer) == self.ground_truth
        reward = 1.0 if right else 0.0
        return ToolReply(f"Current parsed answer={_short(answer)} reward={reward}", reward)


def _number(text: str) -> str | None:
    """The number ``text`` states, commas and a currency sign dropped; None when it states none."""
    cleaned = text.strip().removeprefix("####").strip().lstrip("$").replace(",", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(\.\d+)?", cleaned):
        return None
    return cleaned.rstrip("0").rstrip(".") if "." in cleaned else cleaned


class CodeInterpreterTool:
    """Runs the model's Python code in the sandbox (services/common/sandbox.py) and replies with what it printed.

    Arguments: ``{"code": "print(1 + 1)"}``. The reply is what it printed, then its standard error; a run that was
    stopped (time, memory or output limit) or exited with a status other than 0 starts with a line saying so,
    which survives however long the output is. Config (verl's SandboxFusionTool keys): ``default_timeout`` (wall
    seconds, default 10) and ``memory_limit_mb`` (default 512); its other keys (``sandbox_fusion_url``,
    ``num_workers``, ...) name verl's remote sandbox and are ignored: the code runs here, sandboxed."""

    def __init__(self, config: dict, create_kwargs: dict, run: CodeRunner = run_in_sandbox):
        self.limits = SandboxLimits(wall_s=float(config.get("default_timeout", 10.0)),
                                    memory_mb=int(config.get("memory_limit_mb", 512)))
        self.run = run

    def call(self, arguments: dict) -> ToolReply:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError('the arguments need "code", a string of Python')
        result = self.run(code, self.limits)
        text = result.stdout + (f"\nstderr:\n{result.stderr}" if result.stderr else "")
        if result.stopped != "exited" or result.exit_code:  # first: a reply cut to its limit keeps its start
            text = f"(stopped: {result.stopped}, exit code {result.exit_code})\n{text}"
        return ToolReply(text)


BUILTINS: dict[str, type] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": AnswerCheckTool,
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": CodeInterpreterTool,
    "meshrl.gsm8k_answer": AnswerCheckTool,
    "meshrl.code_interpreter": CodeInterpreterTool,
}
"""verl's tool class names (those its examples' tool configs use) and meshrl's own names, to the built-ins."""


def load_class(ref: str, what: str) -> type:
    """The class named by ``path/to/file.py:Class`` or ``package.module:Class``; ValueError naming ``what`` and
    the error if it cannot be had."""
    return load_named(ref, what, "class", accept=lambda found: isinstance(found, type))


def tool_class(tool: ToolConfig) -> type:
    """The class that runs ``tool``: a built-in for a name in BUILTINS, else the user's class it names."""
    return BUILTINS.get(tool.class_name) or load_class(tool.class_name, f"tool {tool.name}")


def user_classes(environment: EnvironmentConfig) -> list[str]:
    """The users' classes ``environment`` names (its environment class, its tools that are no built-in), or its
    agent function."""
    if environment.environment is not None:
        return [environment.environment]
    if environment.agent is not None:
        return [environment.agent]
    if environment.agent_command is not None:
        return []
    return [tool.class_name for tool in environment_tools(environment) if tool.class_name not in BUILTINS]


def check_tools(tools: list[ToolConfig]) -> None:
    """Refuse at start: a class that cannot be loaded, or a code interpreter where no sandbox can be had (with
    the reason ``check_sandbox`` gives: code never runs unsandboxed)."""
    for tool in tools:
        if tool_class(tool) is CodeInterpreterTool and (reason := check_sandbox()) is not None:
            raise ValueError(f"tool {tool.name} ({tool.class_name}) needs the code sandbox, which this host cannot "
                             f"give: {reason}")


def create_kwargs(row: dict, tool_name: str) -> dict:
    """What the row gives the tool at its creation: ``extra_info.tools_kwargs[tool_name].create_kwargs``, with
    the row's ``reward_model.ground_truth`` as ``ground_truth`` unless given there."""
    extra = row.get("extra_info")
    tools_kwargs = extra.get("tools_kwargs") if isinstance(extra, dict) else None
    entry = tools_kwargs.get(tool_name) if isinstance(tools_kwargs, dict) else None
    given = entry.get("create_kwargs") if isinstance(entry, dict) else None
    kwargs = dict(given) if isinstance(given, dict) else {}
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        kwargs.setdefault("ground_truth", reward_model["ground_truth"])
    return kwargs


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def read_tool_config(path: str) -> list[ToolConfig]:
    """The tools of a verl tool-config file (``tools: [{class_name, config, tool_schema}, ...]``); ConfigError or
    ValueError naming the file and the field otherwise. A class named by a relative file path
    (``lookup.py:LookupTool``) is found beside the tool config."""
    data = read_yaml(path)
    tools = data.get("tools")
    if not isinstance(tools, list):
        raise ValueError(f"{path}: a tool config holds a list under tools:")
    read = [validate(ToolConfig, tool, section=f"{path}: tools[{index}]") for index, tool in enumerate(tools)]
    return [tool.model_copy(update={"class_name": beside(Path(path).parent, tool.class_name)}) for tool in read]


def beside(folder: Path, class_name: str) -> str:
    """``class_name`` with a relative ``file.py:Class`` path made absolute under ``folder``; others as they are."""
    file, _, name = class_name.rpartition(":")
    if not file.endswith(".py") or Path(file).is_absolute():
        return class_name
    return f"{(folder / file).resolve()}:{name}"


def environment_tools(environment: EnvironmentConfig) -> list[ToolConfig]:
    """An environment's tools: those it lists, then those of its tool_config_path; ValueError if two share a name."""
    tools = [*environment.tools, *(read_tool_config(environment.tool_config_path)
                                   if environment.tool_config_path else [])]
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must differ, got {names}")
    return tools
