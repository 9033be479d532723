"""The code sandbox on real processes: what code inside can do, what it cannot, and that the host is unharmed."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from services.common import sandbox
from services.common.auth import TLS_VARIABLES
from services.common.sandbox import (BWRAP, UID_BASE, UID_SLOTS, SandboxLimits, SandboxResult, SandboxUnavailable,
                                     check_sandbox, run_in_sandbox)
from tests.integration.plugins.hostile_tools import secrets_probe

pytestmark = pytest.mark.skipif(not os.access(BWRAP, os.X_OK), reason=f"{BWRAP} missing (Debian package bubblewrap)")

SHORT = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, processes=8, output_bytes=4096, tmp_mb=8)


@pytest.fixture
def held_uids(monkeypatch) -> Iterator[list[int]]:
    """The pool uids this test's sandboxes ran as, each held (its lock, as a call holds it) until the test ends: no
    sandbox of another test on this host (an xdist worker beside this one) can run as them meanwhile, so what runs
    as them is this test's alone."""
    take = sandbox.pool_uid
    uids: list[int] = []
    with contextlib.ExitStack() as held:

        @contextlib.contextmanager
        def pool_uid_held_past_the_call() -> Iterator[int]:
            uid = held.enter_context(take())
            uids.append(uid)
            yield uid

        monkeypatch.setattr(sandbox, "pool_uid", pool_uid_held_past_the_call)
        yield uids


def sandbox_processes(uids: list[int], zombies: bool) -> list[str]:
    """Processes on the host (their state letter and name) running as one of ``uids``, all of the sandbox's pool."""
    assert uids and all(UID_BASE <= uid < UID_BASE + UID_SLOTS for uid in uids), uids
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{name}").st_uid in uids:
                with open(f"/proc/{name}/stat") as stat:
                    command, state = stat.read().split(" (", 1)[1].rsplit(") ", 1)
                    found += [f"{state[0]} {command}"] if zombies or state[0] != "Z" else []
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def wait_until_no_sandbox_process(uids: list[int], seconds: float) -> list[str]:
    """The processes left running as ``uids``, zombies included, once none is left or ``seconds`` have passed (the
    host's init reaps the zombies of a killed pid namespace in its own time)."""
    deadline = time.monotonic() + seconds
    while (left := sandbox_processes(uids, zombies=True)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_the_sandbox_is_available_here():
    assert check_sandbox() is None


def test_without_bwrap_the_sandbox_is_refused_and_nothing_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    assert "/nonexistent/bwrap is missing" in check_sandbox()
    with pytest.raises(SandboxUnavailable, match="missing"):
        run_in_sandbox("print(1)", SHORT)


def test_code_prints_reads_stdin_and_its_files():
    code = "import sys\nprint(input()[::-1])\nprint(open('data/x.txt').read())\nprint('warn', file=sys.stderr)\n"
    result = run_in_sandbox(code, SHORT, stdin="abc\n", files={"data/x.txt": "hello"})
    assert (result.stdout, result.stderr, result.exit_code, result.stopped) == ("cba\nhello\n", "warn\n", 0, "exited")
    assert not result.truncated
    failed = run_in_sandbox("raise SystemExit(3)", SHORT)
    assert (failed.exit_code, failed.stopped) == (3, "exited")


def test_file_paths_stay_inside_the_working_directory():
    for name in ("/etc/x", "../x", "a/../../x", "main.py"):
        with pytest.raises(ValueError, match="relative path"):
            run_in_sandbox("", SHORT, files={name: ""})


def test_the_working_directory_holds_only_tmp_mb():
    code = "try:\n    open('big', 'wb').write(b'x' * (16 << 20))\nexcept OSError as error:\n    print('full')\n"
    assert run_in_sandbox(code, SHORT).stdout == "full\n"
    with pytest.raises(ValueError, match="do not fit"):
        run_in_sandbox("", SHORT, files={"big.txt": "x" * (9 << 20)})


def test_an_endless_loop_is_stopped_by_the_cpu_or_wall_limit():
    result = run_in_sandbox("while True:\n    pass\n", SHORT)
    assert result.stopped in ("cpu", "timeout") and result.seconds < 30
    asleep = run_in_sandbox("import time\ntime.sleep(600)\n", SHORT)
    assert (asleep.stopped, asleep.exit_code) == ("timeout", None) and asleep.seconds < 30


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(held_uids):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_in_sandbox(bomb, SHORT)
    assert result.stopped in ("timeout", "cpu", "killed") and result.seconds < 60
    assert sandbox_processes(held_uids, zombies=False) == []
    assert wait_until_no_sandbox_process(held_uids, seconds=30) == []
    assert run_in_sandbox("print('still here')", SHORT).stdout == "still here\n"


def test_a_fork_bomb_does_not_starve_a_sandbox_beside_it():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    beside = threading.Thread(target=run_in_sandbox, args=(bomb, replace(SHORT, wall_s=4)))
    beside.start()
    time.sleep(1)
    answers = [run_in_sandbox(f"import subprocess\nprint({index})\nsubprocess.run(['true'])\n", SHORT).stdout
               for index in range(3)]
    beside.join()
    assert answers == ["0\n", "1\n", "2\n"]


def test_the_process_limit_holds():
    code = ("import os, time\nforked = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n        forked += 1\n    except OSError:\n        break\nprint(forked)\n")
    result = run_in_sandbox(code, SHORT)
    assert result.stopped == "exited" and 0 < int(result.stdout) < SHORT.processes


def test_allocating_100_gb_fails_as_memory():
    result = run_in_sandbox("x = bytearray(100 * 10**9)\n", SHORT)
    assert result.stopped == "memory" and "MemoryError" in result.stderr


def test_nothing_outside_the_working_directory_is_writable():
    code = ("import os\nfor path in ('/x', '/usr/x', '/proc/x', '/dev/x'):\n    try:\n        open(path, 'w')\n"
            "        print('wrote', path)\n    except OSError as error:\n        print('refused', path)\n"
            "open('ok.txt', 'w').write('fine')\nprint(open('ok.txt').read())\n")
    result = run_in_sandbox(code, SHORT)
    assert "wrote" not in result.stdout and result.stdout.count("refused") == 4
    assert result.stdout.endswith("fine\n")


def test_the_cluster_token_the_host_home_and_the_repository_cannot_be_read(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    monkeypatch.setenv("MESHRL_TOKEN_FILE", str(token))
    monkeypatch.setenv("MESHRL_TOKEN", "secret-token")
    targets = [str(token), "/root", os.getcwd(), "/etc", "/home", "/work"]
    code = ("import os, sys\nprint(os.environ.get('MESHRL_TOKEN'), os.environ.get('MESHRL_TOKEN_FILE'))\n"
            "for path in sys.stdin.read().split('\\n'):\n    try:\n"
            "        print(open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
            "    except OSError as error:\n        print('refused', type(error).__name__)\n")
    result = run_in_sandbox(code, SHORT, stdin="\n".join(targets))
    assert "secret-token" not in result.stdout + result.stderr
    assert result.stdout.splitlines() == ["None None"] + ["refused FileNotFoundError"] * len(targets)


def test_nothing_of_the_callers_environment_shows_inside(tmp_path, monkeypatch):
    """bwrap's own process stays in the sandbox as its pid 1, whose environment code can read (/proc/1/environ):
    neither the token, nor the names or paths of the caller's credential variables show anywhere inside."""
    variables = {"MESHRL_TOKEN": f"token-{os.getpid()}-secret", "MESHRL_TOKEN_FILE": str(tmp_path / "token"),
                 **{name: str(tmp_path / f"{name.lower()}.pem") for name in TLS_VARIABLES}}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
        if value.startswith(str(tmp_path)):
            Path(value).write_text("secret")
    secrets = [variables["MESHRL_TOKEN"], str(tmp_path), "MESHRL_"]
    result = run_in_sandbox(secrets_probe(secrets, [str(tmp_path), *variables.values()]), SHORT)
    assert (json.loads(result.stdout), result.stopped) == ([], "exited"), result.stderr


def test_a_socket_to_the_hosts_loopback_fails():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "    print('connected')\nexcept OSError as error:\n    print('refused')\n")
        result = run_in_sandbox(code, SHORT)
        assert result.stdout == "refused\n"
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_10_mb_of_output_is_truncated_to_the_cap():
    result = run_in_sandbox("import sys\nsys.stdout.write('x' * 10_000_000)\n", SHORT)
    assert result.truncated and result.stopped == "output" and result.stdout == "x" * SHORT.output_bytes


def test_many_concurrent_calls_each_get_their_own_answer():
    results: dict[int, SandboxResult] = {}

    def call(index: int) -> None:
        results[index] = run_in_sandbox(f"print({index} * {index})", SandboxLimits(wall_s=30))

    threads = [threading.Thread(target=call, args=(index,)) for index in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {index: result.stdout for index, result in results.items()} == {i: f"{i * i}\n" for i in range(12)}


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match=r"SandboxLimits\.memory_mb"):
        SandboxLimits(memory_mb=0)
