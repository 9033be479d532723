"""Settings of an env service process: the environments it hosts, their workers and their limits."""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import Field, PositiveFloat, PositiveInt

from services.common.config import Section, ServeConfig
from services.common.limits import MAX_ENV_WORKERS


class ToolConfig(Section):
    """One tool in verl's tool-config format, as verl's ``tool_config_path`` files list them."""

    class_name: str
    """A verl tool class that has a meshrl built-in (services/env/tools.py BUILTINS: verl.tools.gsm8k_tool.Gsm8kTool,
    verl.tools.sandbox_fusion_tools.SandboxFusionTool), or a user's class: path/to/file.py:Class or
    package.module:Class."""
    config: dict[str, Any] = {}
    """Keyword settings the tool is built with (verl's ``type: native`` and the like are accepted and ignored by
    the built-ins)."""
    tool_schema: dict[str, Any]
    """Its OpenAI function schema: ``{"type": "function", "function": {"name": ..., "description": ...,
    "parameters": {...}}}``; the model calls the tool by ``function.name``."""

    @pydantic.field_validator("tool_schema")
    @classmethod
    def _named_function(cls, schema: dict[str, Any]) -> dict[str, Any]:
        function = schema.get("function")
        if schema.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise ValueError('must be an OpenAI function schema: {"type": "function", "function": {"name": ...}}')
        return schema

    @property
    def name(self) -> str:
        return str(self.tool_schema["function"]["name"])


class EnvironmentConfig(Section):
    """One hosted environment: tools whose calls its steps run, or a user's environment class."""

    tools: list[ToolConfig] = []
    """The tools of a tool environment (verl's ``tools:`` list), each named once."""
    tool_config_path: str | None = None
    """A verl tool-config YAML file (``tools: [{class_name, config, tool_schema}, ...]``) whose tools are added to
    ``tools``."""
    environment: str | None = None
    """A user's environment class, path/to/file.py:Class or package.module:Class, with ``reset(row) -> messages``
    and ``step(message) -> StepResult`` (services/env/environment.py)."""
    options: dict[str, Any] = {}
    """Keyword arguments the user's environment class is built with."""
    agent: str | None = None
    """A user's agent program, path/to/file.py:function or package.module:function, ``async def run(client, row)
    -> float | None``: once per episode, given an ``openai.AsyncOpenAI`` pointed at the run's gateway for that
    episode and the dataset row, it returns the reward (None: the run's reward service scores its last
    completion). Its calls are what trains (services/env/agent_runner.py, docs/guides/existing-agents.md)."""
    agent_command: list[str] | None = None
    """A user's agent as a command (its argv), run once per episode with OPENAI_BASE_URL, OPENAI_API_KEY,
    OPENAI_MODEL and MESHRL_ROW (the row as JSON, also on its stdin) set; the last line it prints, where it is a
    number, is its reward (otherwise the reward service scores its last completion). An argument that names a file
    is made absolute, and its folder readable in the sandbox."""
    # An agent environment may list tools (tools or tool_config_path): the schemas of the tools its agent passes, which
    # the service describes (Info) and never runs, so that a run renders its warm start's worked trajectories with them.
    agent_timeout_s: PositiveFloat = 300.0
    """Longest one episode's agent may run (an agent environment's); past it the agent is stopped and the episode
    failed (scored 0, counted by the run as agent/episodes_failed/timed_out)."""

    @property
    def runs_agent(self) -> bool:
        return self.agent is not None or self.agent_command is not None

    @pydantic.model_validator(mode="after")
    def _one_kind(self) -> EnvironmentConfig:
        has_tools = bool(self.tools) or self.tool_config_path is not None
        kinds = [self.environment is not None, self.agent is not None, self.agent_command is not None]
        if sum(kinds) > 1 or (sum(kinds) == 0 and not has_tools) or (self.environment is not None and has_tools):
            raise ValueError("an environment names either tools (tools or tool_config_path), an environment class "
                             "(environment), an agent function (agent) or an agent command (agent_command): one of "
                             "them (an agent may list the tools it passes)")
        if self.agent_command is not None and not self.agent_command:
            raise ValueError("agent_command must name a program")
        if self.options and self.environment is None:
            raise ValueError("options are for an environment class only")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must differ, got {names}")
        return self


class EnvServiceConfig(ServeConfig):
    environments: dict[str, EnvironmentConfig] = {}
    """The environments this service hosts, by the name a Reset asks for."""
    workers: PositiveInt = Field(4, le=MAX_ENV_WORKERS)
    """Worker processes; each holds one open episode, so this many episodes may be open at once."""
    call_timeout_s: PositiveFloat = 10.0
    """Longest one tool call (or one step of a user's environment, or a reset) may take; past it the worker is
    replaced, the model is told in an error reply, and the episode goes on from a fresh reset of its row."""
    max_parallel_calls: PositiveInt = Field(8, le=1024)
    """Tool calls run of one assistant turn; the rest are answered with one error reply."""
    max_call_bytes: PositiveInt = 64 << 10
    """Largest tool call (its JSON, UTF-8) that is parsed; a larger one is answered with an error reply unread."""
    max_reply_chars: PositiveInt = 16 << 10
    """Characters kept of one tool reply; the rest is cut off."""
    max_message_chars: PositiveInt = 1 << 20
    """Longest assistant message a Step may carry, and longest row a Reset may; longer ones are refused."""
    max_steps: PositiveInt = 64
    """Steps one episode may take; past them the episode is done."""
    worker_memory_mb: PositiveInt | None = 4096
    """Private memory (RLIMIT_DATA, MiB) of each worker process, and of each process its code starts: past it an
    allocation fails (MemoryError in Python) and the call gets an error reply. Raise it for environments that
    load large data or models; null: unbounded. Code in an unsandboxed worker of a service run as root could
    raise it again (root may raise its own limits); in a sandbox it cannot."""
    sandbox: bool = True
    """Run each worker in a sandbox of its own (bubblewrap: no network, a read-only view of only the Python, meshrl
    and the users' class folders, a private /tmp, a uid of its own; services/env/worker_sandbox.py), so that users'
    tools and environments cannot read the cluster's token, write outside their /tmp, open sockets or start
    processes without bound. Where this host cannot give the sandbox, a service hosting users' classes refuses to
    start with the reason. false: workers run as the service's user, unsandboxed (logged as a warning at start);
    for trusted code only."""
    worker_processes: PositiveInt = Field(256, le=65536)
    """Processes and threads that code in a sandboxed worker may have at once (RLIMIT_NPROC of its uid); past it
    a fork or a new thread fails (BlockingIOError in Python) and the call gets an error reply."""
    worker_tmp_mb: PositiveInt = 256
    """Size of a sandboxed worker's private /tmp (its working directory and the only place it can write), in MiB;
    it holds memory while it holds files."""

    def computes_with_torch(self) -> bool:
        return False  # users' environments and tools run in worker processes of their own, which it starts afresh
