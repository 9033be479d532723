"""An env service as a real process beside a coordinator: it registers and shows in ``coordctl services``; episodes
of a built-in tool environment (verl's GSM8K tool config), of users' tools and of a user's environment class
reset, step and close; tools that hang or raise get error replies within their timeout while the service keeps
answering; the code interpreter's code runs sandboxed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from meshrl.v1 import common_pb2, env_pb2, env_pb2_grpc
from services.common.rpc import open_channel, retry_after_s
from services.coordctl.cli import app
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.common.cli import REFUSED_EXIT_CODE
from services.common.sandbox import BWRAP, check_sandbox
from services.env.episodes import BUSY_RETRY_AFTER_S

PLUGINS = Path(__file__).resolve().parent / "plugins"
USER = PLUGINS / "user_env.py"
GSM8K_TOOL = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
              "tool_schema": {"type": "function", "function": {
                  "name": "calc_gsm8k_reward", "description": "Checks the answer to the GSM8K problem",
                  "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                                 "required": ["answer"]}}}}
CODE_TOOL = {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
             "config": {"sandbox_fusion_url": "unused", "default_timeout": 5},
             "tool_schema": {"type": "function", "function": {"name": "code_interpreter", "parameters": {
                 "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}}
SANDBOXED = check_sandbox() is None


def user_tool(name: str, cls: str, **config) -> dict:
    return {"class_name": f"{USER}:{cls}", "config": config,
            "tool_schema": {"type": "function", "function": {"name": name}}}


@pytest.fixture(scope="module")
def env_cluster(tmp_path_factory):
    """Coordinator and one env service: gsm8k (verl's tool config file, and the code interpreter where this host
    can sandbox), user_tools (users' tools), guess (a user's environment class); 2 s per call."""
    root = tmp_path_factory.mktemp("env")
    tool_config = root / "gsm8k_tool_config.yaml"
    tool_config.write_text(yaml.safe_dump({"tools": [GSM8K_TOOL, *([CODE_TOOL] if SANDBOXED else [])]}))
    environments = {
        "gsm8k": {"tool_config_path": str(tool_config)},
        "user_tools": {"tools": [user_tool("lookup", "Lookup", table={"a": 1}), user_tool("hangs", "Hangs"),
                                 user_tool("raises", "Raises"), user_tool("garbage", "Garbage"),
                                 user_tool("undecodable", "Undecodable")]},
        "guess": {"environment": f"{USER}:GuessNumber", "options": {"tries": 3}},
    }
    config = root / "env.yaml"
    config.write_text(yaml.safe_dump({"environments": environments, "workers": 3, "call_timeout_s": 2.0,
                                      "sandbox": SANDBOXED}))  # users' classes run unsandboxed only where asked
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="env", settings=("--config", str(config))),))
    asyncio.run(cluster.start(timeout_s=90))
    yield cluster
    cluster.stop()


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def assistant(content: str) -> env_pb2.ChatMessage:
    return env_pb2.ChatMessage(role="assistant", content=content)


async def env_address(coordinator: str) -> str:
    control = CoordinatorClient(coordinator)
    [service] = await control.list_services()
    await control.close()
    assert service.kind == "env"
    return service.address


def with_env(coordinator: str, body):
    """Run ``body(stub)`` against the env service the coordinator lists."""
    async def run():
        channel = open_channel(await env_address(coordinator))
        try:
            return await body(env_pb2_grpc.EnvStub(channel))
        finally:
            await channel.close()
    return asyncio.run(run())


def test_the_env_service_registers_shows_in_coordctl_services_and_describes_its_tools(env_cluster):
    listed = CliRunner().invoke(app, ["services", "--coordinator", env_cluster.coordinator])
    assert listed.exit_code == 0, listed.output
    assert any(line.split()[1:2] == ["env"] for line in listed.output.splitlines()), listed.output
    info = with_env(env_cluster.coordinator, lambda stub: stub.Info(common_pb2.InfoRequest(), timeout=10))
    assert info.identity.kind == "env" and info.open_episodes == 0
    tools = {e.name: [t.name for t in e.tools] for e in info.environments}
    assert tools["gsm8k"][0] == "calc_gsm8k_reward" and tools["guess"] == []
    assert json.loads(info.environments[0].tools[0].schema_json) == GSM8K_TOOL["tool_schema"]


def test_a_gsm8k_tool_episode_rewards_the_right_answer_and_ends_on_a_final_answer(env_cluster):
    row = {"prompt": [{"role": "user", "content": "How many?"}], "reward_model": {"ground_truth": "72"},
           "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}

    async def episode(stub):
        reset = await stub.Reset(env_pb2.ResetRequest(episode_id="g1", row_json=json.dumps(row), env_name="gsm8k"),
                                 timeout=30)
        wrong = await stub.Step(env_pb2.StepRequest(episode_id="g1", message=assistant(
            call("calc_gsm8k_reward", {"answer": "71"}))), timeout=30)
        right = await stub.Step(env_pb2.StepRequest(episode_id="g1", message=assistant(
            "so " + call("calc_gsm8k_reward", {"answer": "72"}))), timeout=30)
        final = await stub.Step(env_pb2.StepRequest(episode_id="g1", message=assistant("#### 72")), timeout=30)
        closed = [await stub.Close(env_pb2.CloseRequest(episode_id="g1"), timeout=30) for _ in range(2)]
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.Step(env_pb2.StepRequest(episode_id="g1", message=assistant("x")), timeout=30)
        return reset, wrong, right, final, closed, gone.value.code()

    reset, wrong, right, final, closed, gone = with_env(env_cluster.coordinator, episode)
    assert list(reset.messages) == [] and reset.service_id
    assert (wrong.reward, wrong.done, wrong.messages[0].role, wrong.messages[0].name) == (
        0.0, False, "tool", "calc_gsm8k_reward")
    assert (right.reward, right.done, right.messages[0].content) == (1.0, False, "Current parsed answer=72 reward=1.0")
    assert (final.done, list(final.messages)) == (True, [])
    assert [c.closed for c in closed] == [True, False] and gone == grpc.StatusCode.NOT_FOUND


def test_a_user_environment_class_keeps_its_state_across_steps(env_cluster):
    async def episode(stub):
        reset = await stub.Reset(env_pb2.ResetRequest(episode_id="u1", row_json='{"secret": 5}', env_name="guess"),
                                 timeout=30)
        steps = [await stub.Step(env_pb2.StepRequest(episode_id="u1", message=assistant(guess)), timeout=30)
                 for guess in ("3", "5")]
        await stub.Close(env_pb2.CloseRequest(episode_id="u1"), timeout=30)
        return reset, steps

    reset, (low, right) = with_env(env_cluster.coordinator, episode)
    assert [(m.role, m.content) for m in reset.messages] == [("user", "Guess my number; 3 tries.")]
    assert (low.messages[0].content, low.done, json.loads(low.info_json)) == ("higher", False, {"guesses": 1})
    assert (right.messages[0].content, right.reward, right.done) == ("right", 1.0, True)


def test_tools_that_hang_raise_or_return_garbage_get_error_replies_and_the_service_keeps_answering(env_cluster):
    hostile = (call("lookup", {"key": "a"}) + call("raises", {}) + call("garbage", {}) + "<tool_call>{oops</tool_call>"
               + call("hangs", {}))

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="h1", row_json="{}", env_name="user_tools"), timeout=30)
        started = time.monotonic()
        step = await stub.Step(env_pb2.StepRequest(episode_id="h1", message=assistant(hostile)), timeout=30)
        elapsed = time.monotonic() - started
        after = await stub.Step(env_pb2.StepRequest(episode_id="h1", message=assistant(
            call("lookup", {"key": "a"}))), timeout=30)
        huge = await stub.Step(env_pb2.StepRequest(episode_id="h1", message=assistant(
            call("lookup", {"key": "x" * 100_000}) + call("lookup", {"key": "a"}) * 5000)), timeout=30)
        await stub.Close(env_pb2.CloseRequest(episode_id="h1"), timeout=30)
        return step, elapsed, after, huge

    step, elapsed, after, huge = with_env(env_cluster.coordinator, episode)
    replies = [m.content for m in step.messages]
    assert replies[0] == "1"
    assert "RuntimeError: the tool broke" in replies[1] and "not a string" in replies[2]
    assert "not valid JSON" in replies[3] and "hangs did not return within 2.0 s" in replies[4]
    assert not step.done and json.loads(step.info_json)["restarted"] and elapsed < 10
    assert (after.messages[0].content, after.reward) == ("1", 0.5)
    huge_replies = [m.content for m in huge.messages]
    assert "at most 65536" in huge_replies[0] and "5001 tool calls in one turn" in huge_replies[-1]
    assert len(huge_replies) == 9  # max_parallel_calls (8) and one error for the rest


def escaped(data: bytes) -> str:
    """``data`` as JSON ``\\u`` escapes, two bytes a UTF-16 code unit: any code unit, lone surrogates among them."""
    return "".join(f"\\u{int.from_bytes(data[index:index + 2], 'big'):04x}" for index in range(0, len(data) - 1, 2))


def lookup_of(key: str) -> str:
    """A lookup call whose key is ``key`` written into the JSON as it is (which may break the JSON)."""
    return '<tool_call>{"name": "lookup", "arguments": {"key": "' + key + '"}}</tool_call>'


MODEL_TEXTS = {  # how bytes a model emitted may land in its turn (the rollout decodes them, bad bytes replaced)
    "the turn": lambda data: data.decode("utf-8", "replace"),
    "a call's body": lambda data: f"<tool_call>{data.decode('utf-8', 'replace')}</tool_call>",
    "a key as it is": lambda data: lookup_of(data.decode("utf-8", "replace")),
    "a key escaped": lambda data: lookup_of(escaped(data)),
    "a tool name escaped": lambda data: '<tool_call>{"name": "' + escaped(data) + '", "arguments": {}}</tool_call>',
    "arguments in a string": lambda data: ('<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"'
                                           + escaped(data).replace("\\", "\\\\") + '\\"}"}</tool_call>'),
}


def lone_surrogate_key(data: bytes) -> bool:
    """Whether ``lookup_of(escaped(data))`` asks for a key holding a lone surrogate."""
    key = json.loads(f'"{escaped(data)}"')
    return key != key.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def test_any_bytes_a_model_emits_get_replies_and_the_episode_goes_on(env_cluster):
    """Through the real service, for byte strings hypothesis picks, each landing in a turn in each way of
    MODEL_TEXTS: the Step is answered (never an RPC error), a call of a lone surrogate is told so, and the next
    call in the episode is answered as ever. A tool replying with a lone surrogate (a file name the host could
    not decode) reaches the model as its escape."""
    loop = asyncio.new_event_loop()

    async def connect():
        return open_channel(await env_address(env_cluster.coordinator))

    channel = loop.run_until_complete(connect())
    stub = env_pb2_grpc.EnvStub(channel)

    async def episode(text: str) -> tuple[env_pb2.StepResponse, env_pb2.StepResponse]:
        await stub.Reset(env_pb2.ResetRequest(episode_id="bytes", row_json="{}", env_name="user_tools"), timeout=30)
        try:
            return tuple([await stub.Step(env_pb2.StepRequest(episode_id="bytes", message=assistant(content)),
                                          timeout=30) for content in (text, call("lookup", {"key": "a"}))])
        finally:
            await stub.Close(env_pb2.CloseRequest(episode_id="bytes"), timeout=30)

    @settings(max_examples=60, deadline=None)
    @given(data=st.binary(max_size=48), way=st.sampled_from(sorted(MODEL_TEXTS)))
    @example(data=b"\xd8\x00", way="a key escaped").via("a lone high surrogate")
    @example(data=b"\xdc\x80\x00a", way="arguments in a string").via("a lone low surrogate, nested")
    def answered(data: bytes, way: str) -> None:
        first, after = loop.run_until_complete(episode(MODEL_TEXTS[way](data)))
        assert all(message.role == "tool" for message in first.messages)
        if way == "a key escaped" and lone_surrogate_key(data):
            assert "half a surrogate pair" in first.messages[0].content, first.messages[0].content
        assert (after.messages[0].content, after.reward) == ("1", 0.5)

    try:
        answered()
        replied, _ = loop.run_until_complete(episode(call("undecodable", {})))
        assert [message.content for message in replied.messages] == ["name-\\udcff"]
    finally:
        loop.run_until_complete(channel.close())
        loop.close()


def test_a_reset_can_lower_the_tool_calls_run_per_turn_and_the_bound_survives_a_fresh_worker(env_cluster):
    four = call("lookup", {"key": "a"}) * 4

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="p1", row_json="{}", env_name="user_tools",
                                              max_parallel_calls=2), timeout=30)
        first = await stub.Step(env_pb2.StepRequest(episode_id="p1", message=assistant(four)), timeout=30)
        hung = await stub.Step(env_pb2.StepRequest(episode_id="p1", message=assistant(call("hangs", {}))), timeout=30)
        after = await stub.Step(env_pb2.StepRequest(episode_id="p1", message=assistant(four)), timeout=30)
        await stub.Close(env_pb2.CloseRequest(episode_id="p1"), timeout=30)
        return first, hung, after

    first, hung, after = with_env(env_cluster.coordinator, episode)
    assert json.loads(hung.info_json)["restarted"]  # the episode went on in a fresh worker
    for step in (first, after):
        replies = [m.content for m in step.messages]
        assert replies[:2] == ["1", "1"] and len(replies) == 3 and "4 tool calls in one turn" in replies[2]


@pytest.mark.skipif(not SANDBOXED, reason=f"no code sandbox here: {check_sandbox()}")
def test_the_code_interpreter_runs_code_sandboxed(env_cluster):
    code = ("print(6 * 7)\n"
            "try:\n    open('/etc/shadow').read()\nexcept OSError as e:\n    print('file', type(e).__name__)\n"
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
            "except OSError as e:\n    print('net', type(e).__name__)\n")

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="c1", row_json="{}", env_name="gsm8k"), timeout=30)
        step = await stub.Step(env_pb2.StepRequest(episode_id="c1", message=assistant(
            call("code_interpreter", {"code": code}))), timeout=60)
        await stub.Close(env_pb2.CloseRequest(episode_id="c1"), timeout=30)
        return step

    step = with_env(env_cluster.coordinator, episode)
    [reply] = step.messages
    assert reply.content.splitlines()[:3] == ["42", "file FileNotFoundError", "net OSError"], reply.content


@pytest.mark.skipif(not SANDBOXED, reason=f"no code sandbox here: {check_sandbox()}")
def test_the_model_is_told_its_code_was_stopped_however_much_it_printed(env_cluster):
    """Past the output cap, past the time limit after printing much, exiting 3 after printing much: each reply is
    cut to max_reply_chars (16 KiB) and still starts with why the run ended."""
    codes = ["import sys\nsys.stdout.write('x' * 5_000_000)\n",
             "import time\nprint('y' * 100_000, flush=True)\ntime.sleep(60)\n",
             "print('z' * 100_000)\nraise SystemExit(3)\n"]

    async def episode(stub):
        await stub.Reset(env_pb2.ResetRequest(episode_id="s1", row_json="{}", env_name="gsm8k"), timeout=30)
        step = await stub.Step(env_pb2.StepRequest(episode_id="s1", message=assistant("".join(
            call("code_interpreter", {"code": code}) for code in codes))), timeout=60)
        await stub.Close(env_pb2.CloseRequest(episode_id="s1"), timeout=30)
        return step

    replies = [message.content for message in with_env(env_cluster.coordinator, episode).messages]
    assert [reply.split("\n", 1)[0] for reply in replies] == [
        "(stopped: output, exit code None)", "(stopped: timeout, exit code None)", "(stopped: exited, exit code 3)"]
    assert all("characters cut)" in reply and len(reply) < (16 << 10) + 100 for reply in replies)


def worker_pids(service_pid: int) -> list[int]:
    """The host's running (not zombie) worker processes of the env service ``service_pid``: each is started as
    ``python -B -m services.env.worker FD SERVICE_PID [sandboxed]``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            running = (entry / "stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
        except (OSError, IndexError):
            continue
        if running and argv[2:4] == [b"-m", b"services.env.worker"] and argv[5:6] == [str(service_pid).encode()]:
            found.append(int(entry.name))
    return found


def test_resets_after_every_idle_worker_was_killed_are_answered_by_their_replacements(env_cluster):
    [service] = [process for name, process in env_cluster.processes.items() if name.startswith("env")]
    workers = worker_pids(service.pid)
    assert len(workers) == 3, workers  # workers: 3, all idle
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while set(worker_pids(service.pid)) & set(workers):
        assert time.monotonic() < deadline, "killed workers still running after 30 s"
        time.sleep(0.1)

    async def episodes(stub):
        ids = [f"k{index}" for index in range(3)]
        for episode_id in ids:
            await stub.Reset(env_pb2.ResetRequest(episode_id=episode_id, row_json='{"reward_model": '
                                                  '{"ground_truth": "7"}}', env_name="gsm8k"), timeout=60)
        steps = [await stub.Step(env_pb2.StepRequest(episode_id=episode_id, message=assistant(
            call("calc_gsm8k_reward", {"answer": "7"}))), timeout=30) for episode_id in ids]
        for episode_id in ids:
            await stub.Close(env_pb2.CloseRequest(episode_id=episode_id), timeout=30)
        return steps

    assert [step.reward for step in with_env(env_cluster.coordinator, episodes)] == [1.0, 1.0, 1.0]


def test_a_tool_class_that_fails_to_import_refuses_the_service_at_start(tmp_path: Path):
    config = tmp_path / "env.yaml"
    broken = {"class_name": f"{PLUGINS / 'broken_import.py'}:Tool",
              "tool_schema": {"type": "function", "function": {"name": "broken"}}}
    config.write_text(yaml.safe_dump({"environments": {"e": {"tools": [broken]}}}))
    result = subprocess.run([sys.executable, "-m", "services.env", "--config", str(config), "port=0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "broken_import.py" in result.stderr and "a_module_that_does_not_exist" in result.stderr


def test_bad_requests_are_refused_with_their_status_and_a_full_service_says_so(env_cluster):
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"

    async def refused(call) -> tuple[grpc.StatusCode, float | None]:
        """The refusal's status, and when the service says to send it again (None: never, the same is refused)."""
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        return error.value.code(), retry_after_s(error.value)

    async def requests(stub):
        codes = [await refused(stub.Reset(env_pb2.ResetRequest(episode_id="b", row_json=deep, env_name="gsm8k"),
                                          timeout=30)),
                 await refused(stub.Reset(env_pb2.ResetRequest(episode_id="b", env_name="nowhere"), timeout=30))]
        for index in range(3):  # workers: 3
            await stub.Reset(env_pb2.ResetRequest(episode_id=f"b{index}", env_name="gsm8k"), timeout=30)
        codes += [await refused(stub.Reset(env_pb2.ResetRequest(episode_id="b3", env_name="gsm8k"), timeout=30)),
                  await refused(stub.Step(env_pb2.StepRequest(episode_id="b0", message=assistant("x" * (2 << 20))),
                                          timeout=30))]
        for index in range(3):
            await stub.Close(env_pb2.CloseRequest(episode_id=f"b{index}"), timeout=30)
        return codes

    # a full service is busy (ask again later); a request over a limit is refused for good, with the same status
    assert with_env(env_cluster.coordinator, requests) == [
        (grpc.StatusCode.INVALID_ARGUMENT, None), (grpc.StatusCode.INVALID_ARGUMENT, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_RETRY_AFTER_S), (grpc.StatusCode.RESOURCE_EXHAUSTED, None)]


def without_bwrap(command: list[str]) -> list[str]:
    """``command`` run where /usr/bin/bwrap cannot be executed: in a mount namespace of its own, /dev/null bound
    over it (the host keeps its bwrap)."""
    return ["/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
            f'mount --bind /dev/null {BWRAP} && exec "$@"', "without-bwrap", *command]


@pytest.mark.skipif(not SANDBOXED, reason=f"no code sandbox here: {check_sandbox()}")
@pytest.mark.parametrize("kind", ["env_user_tool", "env_code_interpreter", "reward_code_rule"])
def test_a_service_that_must_sandbox_without_bubblewrap_refuses_with_exit_2_naming_the_package(tmp_path: Path,
                                                                                               kind: str):
    settings = {"env_user_tool": {"environments": {"e": {"tools": [user_tool("lookup", "Lookup")]}}},
                "env_code_interpreter": {"environments": {"e": {"tools": [CODE_TOOL]}}},
                "reward_code_rule": {"scorers": {"apps": [{"rule": "apps"}]}}}[kind]
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(settings))
    service = kind.split("_")[0]
    result = subprocess.run(without_bwrap([sys.executable, "-m", f"services.{service}", "--config", str(config),
                                           "port=0"]), capture_output=True, text=True, timeout=120)
    assert result.returncode == REFUSED_EXIT_CODE, result.stderr[-2000:]
    assert f"{service}: cannot start:" in result.stderr
    assert f"{BWRAP} is missing: install the package bubblewrap" in result.stderr, result.stderr[-2000:]
