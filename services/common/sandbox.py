"""Run untrusted Python code under limits: one call, one sandbox, stdout, stderr, exit status and why it stopped.

Code that a model wrote (a tool call of the env service, a code-contest answer the reward service judges, a
user's reward function checking a program) runs here, never in a service's own process::

    from services.common.sandbox import SandboxLimits, check_sandbox, run_in_sandbox

    reason = check_sandbox()          # at start: a service refuses what needs the sandbox when this is not None
    result = run_in_sandbox("print(input()[::-1])", SandboxLimits(wall_s=2), stdin="abc\\n")
    result.stdout, result.stopped     # 'cba\\n', 'exited'

``run_in_sandbox`` blocks until the program ends or is stopped; callers that must stay responsive call it from a
worker thread or process. Concurrent calls from several threads are safe: each gets its own namespaces and its own
uid.

What one call gets (``bwrap`` from Debian's ``bubblewrap``):

- new user, mount, pid, network, IPC, UTS and cgroup namespaces; the network namespace has only ``lo``, so nothing
  on the host (its loopback included) can be reached; no further user namespaces inside (``--disable-userns``);
- a root with only ``/usr`` (read-only; ``/bin``, ``/lib``, ``/lib64`` are links into it), a fresh ``/proc`` and
  a minimal ``/dev``; the host's ``/etc``, ``/root``, ``/home``, ``/work``, ``/var``, ``/run`` and ``/tmp`` are not
  there, so neither is the cluster token (``MESHRL_TOKEN_FILE``, a state folder's ``token``) nor the TLS keys
  (``MESHRL_TLS_*``) nor any state folder;
- no environment of the service's: bwrap itself starts with ``LAUNCH_ENVIRONMENT`` only (its process stays in the
  sandbox as pid 1, whose ``/proc/1/environ`` the code can read), and the program gets PATH, HOME and LANG, so
  neither ``MESHRL_TOKEN`` nor the names and paths of the other variables reach it;
- a private, size-limited tmpfs at ``/tmp`` as the working directory, holding the program (``main.py``) and the
  caller's files; nothing else is writable;
- the distribution's interpreter, ``/usr/bin/python3 -I`` (stdlib and Debian's packages only: the service's
  virtualenv and the repository are not exposed);
- its own unprivileged uid from a pool (``UID_BASE`` on, one lock file per uid under ``/run``, held for the
  call), so that ``RLIMIT_NPROC``, which Linux counts per real uid across the whole host, counts this
  call's processes and nothing else: a fork bomb exhausts its own quota, not the host's nor another sandbox's;
- rlimits: CPU seconds per process (SIGXCPU, then SIGKILL a second later), address space per process
  (allocations fail with MemoryError), processes and threads, file size, open files, no core dumps;
- a wall-clock timeout and an output cap per stream, enforced from outside: either kills the sandbox's pid 1,
  which takes every process of the pid namespace with it (``--die-with-parent`` covers the caller dying).

Why bubblewrap: it is a small setuid-free binary packaged by Debian, used by Flatpak, that builds exactly the
namespaces and mounts asked for on its command line, starts in milliseconds, and needs no daemon. nsjail would do
the same (and adds seccomp policies and cgroups) but is not in Debian bookworm's archive and must be built; firejail is
setuid-root with a large profile language and a history of privilege escalations; plain rlimits without namespaces
leave the filesystem, the network and the host's processes reachable; containers (docker, podman) need a daemon or
an image store and cost hundreds of milliseconds a call. Known gaps, to close where the host allows it: no seccomp
filter, and memory is bounded per process (``memory_mb``), so the sandbox's total is at most ``processes`` times
that; a cgroup (``memory.max``, ``pids.max``) would bound the sum.

Needs root (or CAP_SETUID) to switch each call to its pool uid, and unprivileged user namespaces for that uid.
Where either is missing, ``check_sandbox`` says why and ``run_in_sandbox`` raises ``SandboxUnavailable``; code
never runs unsandboxed.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

BWRAP = "/usr/bin/bwrap"
PRLIMIT = "/usr/bin/prlimit"
SETPRIV = "/usr/bin/setpriv"
PYTHON = "/usr/bin/python3"
UID_BASE = 620_000
"""The first uid of the pool; ``UID_SLOTS`` uids from here must belong to no one else on the host."""
UID_SLOTS = 64
UID_LOCKS = Path("/run/meshrl-sandbox-uids")
"""One lock file per pool uid, held by the call using it (in /run: only root can make it, so no one else can hold
them all)."""
WORKDIR = "/tmp"
PROGRAM = "main.py"
SANDBOXED = [PYTHON, "-I", "-B", f"{WORKDIR}/{PROGRAM}"]
"""What runs inside: the distribution's interpreter, isolated from the environment and user site, on the program."""
LAUNCH_ENVIRONMENT = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of what starts a sandbox (setpriv, prlimit, bwrap): bwrap's pid 1 keeps it for the
sandbox's life, readable from inside, so none of the service's variables is passed on."""
HELPER_PROCESSES = 2
"""bwrap's own processes that count against the uid's RLIMIT_NPROC: the outer bwrap and the sandbox's pid 1."""

_starts = itertools.count()
"""Where each call's search of the uid pool starts (``next`` on it is atomic)."""

Stopped = Literal["exited", "timeout", "cpu", "memory", "output", "killed"]


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be built (this host lacks what it needs, or every pool uid is busy: the message says
    which); the code was not run."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one call may use. Defaults fit a code-contest answer or a tool call."""

    cpu_s: float = 5.0
    """CPU seconds per process (rounded up to whole seconds); past them the process gets SIGXCPU (stopped 'cpu')."""
    wall_s: float = 10.0
    """Wall-clock seconds from the sandbox's start; past them every process of the sandbox is killed
    (stopped 'timeout')."""
    memory_mb: int = 512
    """Address space per process, in MiB; allocations past it fail (MemoryError, stopped 'memory')."""
    processes: int = 16
    """Processes and threads the program may have at once (the interpreter counts as one)."""
    output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; past them the sandbox is killed (stopped 'output', truncated)."""
    tmp_mb: int = 64
    """Size of the writable /tmp (the working directory, which holds the program and the files given), in MiB."""

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "tmp_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = SandboxLimits()
"""The limits of a call that names none."""


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """What one call of ``run_in_sandbox`` saw."""

    stdout: str
    """The program's standard output (UTF-8, undecodable bytes replaced), at most ``output_bytes`` of it."""
    stderr: str
    """Its standard error, likewise capped."""
    exit_code: int | None
    """The program's exit status; 128 + N when signal N ended it; None when the sandbox killed it (timeout,
    output)."""
    stopped: Stopped
    """Why it ended: 'exited' (on its own, whatever the status), 'timeout' (wall clock), 'cpu' (CPU limit),
    'memory' (an allocation failed: MemoryError), 'output' (past the output cap), 'killed' (another signal)."""
    seconds: float
    """Wall-clock seconds the sandbox ran, setup included."""
    truncated: bool
    """Whether stdout or stderr lost bytes to the cap."""


def check_sandbox() -> str | None:
    """Why code cannot be sandboxed on this host, or None when it can (a trial run prints and exits)."""
    for path, package in ((BWRAP, "bubblewrap"), (PRLIMIT, "util-linux"), (SETPRIV, "util-linux"),
                          (PYTHON, "python3")):  # what the sandbox runs, and the Debian package of each
        if not os.access(path, os.X_OK):
            return f"{path} is missing: install the package {package} (Debian, Ubuntu: apt-get install {package})"
    if os.geteuid() != 0:
        return "the sandbox runs each call as a uid of its own and needs root (CAP_SETUID) to switch to it"
    try:
        result = run_in_sandbox("print('ok')", SandboxLimits(wall_s=10))
    except SandboxUnavailable as error:
        return str(error)
    if result.stdout != "ok\n":
        return f"a trial run printed {result.stdout!r}, stopped {result.stopped}: {result.stderr[-500:]}"
    return None


def run_in_sandbox(code: str, limits: SandboxLimits = DEFAULT_LIMITS, stdin: str = "",
                   *, files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` with ``files`` (relative path -> text) beside it in /tmp, ``stdin`` as input.

    Raises ValueError for a file path that is absolute, leaves /tmp or names the program, or files larger than the
    tmpfs; SandboxUnavailable when bwrap could not start or create the namespaces (the code did not run). A mount
    failing inside the new namespaces (none does where ``check_sandbox`` passed) ends the call as exit 1 with bwrap's
    message in stderr: the program cannot be told apart from one that prints it, so it is no exception here.
    """
    files = {PROGRAM: code, **_checked_files(files or {})}
    if sum(len(text.encode()) for text in files.values()) > limits.tmp_mb << 20:
        raise ValueError(f"the program and its files do not fit the sandbox's {limits.tmp_mb} MiB /tmp")
    if os.geteuid() != 0 or not os.access(BWRAP, os.X_OK):
        raise SandboxUnavailable(check_sandbox() or "sandbox unavailable")
    with pool_uid() as uid, _memory_files(files) as fds:
        started = time.monotonic()
        process, sandbox_init = _start(_command(limits, fds), uid, fds)
        try:
            return _watch(process, sandbox_init, limits, stdin=stdin, started=started)
        finally:
            if sandbox_init is not None:
                os.close(sandbox_init)
            clear_uid(uid)


def _start(command: list[str], uid: int, fds: dict[str, int]) -> tuple[subprocess.Popen, int | None]:
    """bwrap started as ``uid``, and a pidfd of the sandbox's pid 1 (None when the program has ended already).

    A pidfd rather than the pid: signalling it after that process has gone cannot hit another that took its pid.
    ``setpriv`` switches to ``uid`` rather than Popen's ``user=``: with it Popen must fork() rather than vfork(),
    and a fork() of a gRPC server's process runs gRPC's fork handlers in the child, which crashed it (SIGSEGV)."""
    info_read, info_write = os.pipe()
    try:
        process = subprocess.Popen([SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command,
                                    "--info-fd", str(info_write), "--", *SANDBOXED], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(info_write, *fds.values()),
                                   env=LAUNCH_ENVIRONMENT)
    except OSError as error:
        os.close(info_read)
        raise SandboxUnavailable(f"could not start bwrap as uid {uid}: {error}") from None
    finally:
        os.close(info_write)
    with os.fdopen(info_read, "rb") as info:  # bwrap writes it once the sandbox stands, then closes it
        pid = json.loads(info.read() or b"{}").get("child-pid")
    if pid is None:
        _, stderr = process.communicate(timeout=10)
        raise SandboxUnavailable(f"bwrap could not build the sandbox: {stderr.decode(errors='replace').strip()[-500:]}")
    try:
        return process, os.pidfd_open(pid)
    except ProcessLookupError:  # the program has already ended; bwrap has reaped its pid 1
        return process, None


def _checked_files(files: dict[str, str]) -> dict[str, str]:
    for name in files:
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not path.parts or str(path) == PROGRAM:
            raise ValueError(f"sandbox file {name!r}: must be a relative path inside {WORKDIR}, not {PROGRAM}")
    return {str(PurePosixPath(name)): text for name, text in files.items()}


def _command(limits: SandboxLimits, fds: dict[str, int]) -> list[str]:
    """prlimit's limits around bwrap's namespaces and mounts, the sandboxed command left to append."""
    memory = limits.memory_mb << 20
    tmp = limits.tmp_mb << 20
    cpu = math.ceil(limits.cpu_s)
    rlimits = [f"--cpu={cpu}:{cpu + 1}", f"--as={memory}", f"--nproc={limits.processes + HELPER_PROCESSES}",
               f"--fsize={tmp}", "--nofile=256", "--core=0"]
    mounts = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
              "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
              "--size", str(tmp), "--tmpfs", WORKDIR, "--remount-ro", "/dev"]
    parents = sorted({str(parent) for name in fds for parent in PurePosixPath(name).parents if str(parent) != "."})
    for parent in parents:
        mounts += ["--dir", f"{WORKDIR}/{parent}"]
    for name, fd in fds.items():
        mounts += ["--file", str(fd), f"{WORKDIR}/{name}"]
    sandbox = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", WORKDIR,
               "--setenv", "LANG", "C.UTF-8", *mounts, "--remount-ro", "/", "--chdir", WORKDIR]
    return [PRLIMIT, *rlimits, "--", BWRAP, *sandbox]


def _watch(process: subprocess.Popen, sandbox_init: int | None, limits: SandboxLimits, *, stdin: str,
           started: float) -> SandboxResult:
    """Feed stdin, read both streams under the cap, kill the sandbox at the wall limit or the cap, classify."""
    overflow = threading.Event()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            if sandbox_init is not None:
                signal.pidfd_send_signal(sandbox_init, signal.SIGKILL)  # pid 1: the whole pid namespace goes too
        with contextlib.suppress(ProcessLookupError):
            process.kill()

    def on_overflow() -> None:
        overflow.set()
        kill()

    threads = [threading.Thread(target=_feed, args=(process.stdin, stdin.encode()), daemon=True)]
    streams = [_CappedStream(process.stdout, limits.output_bytes, on_overflow),
               _CappedStream(process.stderr, limits.output_bytes, on_overflow)]
    threads += [threading.Thread(target=stream.drain, daemon=True) for stream in streams]
    for thread in threads:
        thread.start()
    timed_out = False
    try:
        process.wait(timeout=max(0.0, started + limits.wall_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill()
        process.wait()
    for thread in threads:
        thread.join()
    stdout, stderr = (stream.text() for stream in streams)
    stopped = _stopped(process.returncode, stderr, timed_out=timed_out, overflowed=overflow.is_set())
    return SandboxResult(stdout=stdout, stderr=stderr,
                         exit_code=None if stopped in ("timeout", "output") else process.returncode,
                         stopped=stopped, seconds=time.monotonic() - started,
                         truncated=any(stream.truncated for stream in streams))


def _stopped(returncode: int, stderr: str, *, timed_out: bool, overflowed: bool) -> Stopped:
    if overflowed:
        return "output"
    if timed_out:
        return "timeout"
    if returncode == 128 + signal.SIGXCPU:
        return "cpu"
    if returncode != 0 and stderr.rstrip().rsplit("\n", 1)[-1].startswith("MemoryError"):
        return "memory"
    if returncode > 128 or returncode < 0:
        return "killed"
    return "exited"


def _feed(pipe, data: bytes) -> None:
    """Write stdin and close it; a program that exits without reading it all is no error."""
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.close()


class _CappedStream:
    """One output pipe read to its end, keeping ``cap`` bytes; past them ``on_overflow`` is called once."""

    def __init__(self, pipe, cap: int, on_overflow):
        self._pipe, self._cap, self._on_overflow = pipe, cap, on_overflow
        self._kept = bytearray()
        self.truncated = False

    def drain(self) -> None:
        while chunk := self._pipe.read1(1 << 16):
            room = self._cap - len(self._kept)
            self._kept += chunk[:room]
            if len(chunk) > room and not self.truncated:
                self.truncated = True
                self._on_overflow()
        self._pipe.close()

    def text(self) -> str:
        return self._kept.decode("utf-8", errors="replace")


@contextlib.contextmanager
def pool_uid(first: int = UID_BASE, slots: int = UID_SLOTS) -> Iterator[int]:
    """A uid of the pool (``slots`` uids from ``first``) that no other call on this host holds (a lock file per
    uid), held until the call ends.

    The search starts past the uid this process took last, so a uid rests between calls while the host's init reaps
    the zombies its last call left (they still count against its process quota)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    start = next(_starts) % slots
    for slot in ((start + step) % slots for step in range(slots)):
        handle = open(UID_LOCKS / str(first + slot), "a")  # noqa: SIM115 (closed below, or held by the with)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        with handle:
            yield first + slot
        return
    raise SandboxUnavailable(f"all {slots} sandbox uids from {first} are in use")


def clear_uid(uid: int, seconds: float = 5.0) -> None:
    """Kill whatever still runs as ``uid`` (processes of a killed pid namespace still exiting) and wait until none
    does. Zombies are left to the host's init, which reaps them; the pool's rotation rests the uid meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in _pids() if _running_as(pid, uid)]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _running_as(pid: int, uid: int) -> bool:
    """Whether ``pid`` runs as ``uid`` and is not a zombie."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return False
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@contextlib.contextmanager
def _memory_files(files: dict[str, str]) -> Iterator[dict[str, int]]:
    """Each file's text in a memory file (bwrap --file copies it into the sandbox's /tmp), closed afterwards."""
    fds: dict[str, int] = {}
    try:
        for name, text in files.items():
            fds[name] = os.memfd_create(f"sandbox-{len(fds)}")
            with open(fds[name], "wb", closefd=False) as memory_file:
                memory_file.write(text.encode())
            os.lseek(fds[name], 0, os.SEEK_SET)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)
