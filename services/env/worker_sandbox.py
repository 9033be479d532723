"""Env workers started as processes: each in a sandbox of its own, or (the operator's choice) plainly.

A sandboxed worker is built from the code sandbox's parts (services/common/sandbox.py), held for the worker's life
rather than one call:

- ``bwrap``'s new user, mount, pid, network, IPC, UTS and cgroup namespaces, no user namespaces inside: the network
  namespace has only ``lo``, so no socket reaches the host (its loopback, the coordinator, included); its only way
  out is the socket it was given, on which the service reads JSON, never pickle (services/env/worker.py);
- a root holding only what the worker needs to run, read-only: ``/usr``; the Python installation and virtualenv
  the service runs from (``sys.prefix``, ``sys.base_prefix``); the folders of the ``services`` and ``meshrl``
  packages; the folder of each user's class file (``path/to/file.py:Class``) or the package a
  ``package.module:Class`` comes from. Not there: the host's ``/etc``, ``/root``, ``/home``, ``/work`` (besides
  the folders above), ``/var``, ``/run``, the service's state folder and so the cluster token and TLS keys (a
  service whose readable folders would hold one of them, or its ports file, refuses to start: ``check_hidden``);
- nothing of the service's environment: bwrap starts with ``LAUNCH_ENVIRONMENT`` only (its pid 1 keeps that
  environment, readable in ``/proc/1/environ``), and the worker gets PATH, HOME, LANG and PYTHONPATH; nor of its
  settings beyond the environments and their limits (``worker_config``: no ports file, so no state folder's
  path);
- a private tmpfs at ``/tmp`` (``worker_tmp_mb``), the working directory, the only place it can write;
- a uid of the pool, held for the worker's life, under ``worker_processes`` (RLIMIT_NPROC counts per uid, so a fork
  bomb exhausts its own quota) and ``worker_memory_mb`` (services/env/worker.py ``contain``);
- ``--die-with-parent``: the service's end (kill -9 included) ends it; replacing it kills the sandbox's pid 1,
  which takes every process of its pid namespace, whatever its code started, with it.

A plain worker (``sandbox: false``) runs as the service's user: the cluster's credentials are left out of its
environment, it leads a process group of its own and adopts what it starts (both killed whole when it is
replaced) and is bounded in memory, but it can read and write what the service can and open sockets.

Sandboxed or not, a worker ends what an episode's code started when the episode closes (services/env/worker.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from services.common.auth import TLS_VARIABLES
from services.common.config import ServeConfig
from services.common.lifetime import end_descendants
from services.common.sandbox import BWRAP, LAUNCH_ENVIRONMENT, SandboxUnavailable, clear_uid, pool_uid
from services.env.config import EnvServiceConfig
from services.env.tools import environment_tools, user_classes

WORKDIR = "/tmp"
WORKER_UID_BASE = 621_000
"""The first uid of the workers' pool (apart from the code sandbox's, whose calls are short); ``WORKER_UID_SLOTS``
uids from here must belong to no one else on the host."""
WORKER_UID_SLOTS = 2048
"""As many sandboxed workers may run on one host at once (each holds its uid for its life)."""
UNSHARE = "/usr/bin/unshare"
SETPRIV = "/usr/bin/setpriv"
STAGE = "/run/meshrl-env-worker"
"""Where a worker's start binds what its sandbox reads, in a mount namespace of its own (see ``staged_command``)."""
STAGE_SCRIPT = """set -e
stage=$1; count=$2; shift 2
mount -t tmpfs -o mode=755,size=64k meshrl-stage "$stage"
index=0
while [ "$index" -lt "$count" ]; do
    mkdir "$stage/$index"; mount --bind "$1" "$stage/$index"; shift; index=$((index + 1))
done
exec "$@"
"""
CREDENTIAL_VARIABLES = ("MESHRL_TOKEN", "MESHRL_TOKEN_FILE", *TLS_VARIABLES)
"""Environment variables that name the cluster's credentials: a plain worker is started without them."""
SECRET_FILES = ("MESHRL_TOKEN_FILE", *TLS_VARIABLES)
"""Environment variables naming files that no worker's sandbox may show."""


def worker_config(config: EnvServiceConfig) -> EnvServiceConfig:
    """The settings a worker gets: each environment's tools listed in full (a tool config file is read here, not in
    the worker) and each class file's path absolute (the worker's working directory is its own); the service's
    own settings (ServeConfig's: its address, coordinator, ports file) at their defaults, so that code in a worker
    learns nothing of where the service keeps its state."""
    environments = {}
    for name, environment in config.environments.items():
        if environment.environment is not None:
            environments[name] = environment.model_copy(update={"environment": absolute(environment.environment)})
        elif environment.agent is not None:
            environments[name] = environment.model_copy(update={"agent": absolute(environment.agent)})
        elif environment.agent_command is not None:
            environments[name] = environment.model_copy(update={"agent_command": [
                os.path.abspath(arg) if Path(arg).is_file() else arg for arg in environment.agent_command]})
            # (abspath, not resolve: a virtualenv's python is a link that must be run as the link to be that venv)
        else:
            tools = [tool.model_copy(update={"class_name": absolute(tool.class_name)})
                     for tool in environment_tools(environment)]
            environments[name] = environment.model_copy(update={"tools": tools, "tool_config_path": None})
    served = {name: field.get_default(call_default_factory=True) for name, field in ServeConfig.model_fields.items()}
    return config.model_copy(update={**served, "environments": environments})


def absolute(ref: str) -> str:
    """``path/to/file.py:name`` with the path made absolute; any other reference as it is."""
    target, _, name = ref.rpartition(":")
    return f"{Path(target).resolve()}:{name}" if target.endswith(".py") else ref


def hosts_user_code(config: EnvServiceConfig) -> bool:
    return any(user_classes(environment) or environment.agent_command
               for environment in config.environments.values())


def readable_paths(config: EnvServiceConfig) -> list[str]:
    """What a sandboxed worker may read (besides /usr): the Python it runs on, meshrl's packages, and the users'
    classes that ``config`` names; parents before children, none twice. ValueError where one of them is a folder
    the sandbox must not show (/, /tmp) or holds the cluster's token file or TLS key."""
    paths = {sys.prefix, sys.base_prefix, *(package_folder(name) for name in ("services", "meshrl"))}
    for environment in config.environments.values():
        for ref in user_classes(environment):
            target = ref.rpartition(":")[0]
            paths.add(str(Path(target).resolve().parent) if target.endswith(".py") else package_folder(target))
        paths.update(os.path.dirname(os.path.abspath(arg)) for arg in environment.agent_command or []
                     if Path(arg).is_file())
    resolved = sorted({os.path.realpath(path) for path in paths} | paths, key=lambda path: (len(path), path))
    readable = [path for path in resolved if os.path.exists(path)]
    check_hidden(readable, secret_files(config))
    return readable


def secret_files(config: EnvServiceConfig) -> dict[str, str]:
    """What no worker's sandbox may show, by what names it: the files of SECRET_FILES that are set, and the
    service's ports file (in its state folder, beside the logs and, under coordctl --local, the token)."""
    named = {name: os.environ.get(name, "") for name in SECRET_FILES}
    return {name: path for name, path in {**named, "ports_file": config.ports_file}.items() if path}


def check_hidden(paths: list[str], secrets: dict[str, str]) -> None:
    """ValueError where ``paths`` would show a worker the host's root or /tmp, or one of ``secrets`` (what names
    it -> its path)."""
    for path in paths:
        if path in ("/", WORKDIR):
            raise ValueError(f"{path} would be readable in the env workers' sandbox (a class file sits there?): "
                             f"put users' classes in a folder of their own")
        for name, secret in secrets.items():
            if os.path.realpath(secret).startswith(path + "/"):
                raise ValueError(f"{name} {secret} lies in {path}, which the env workers' sandbox shows to users' "
                                 f"code: keep users' classes and the cluster's secrets in different folders")


def package_folder(module: str) -> str:
    """The folder holding the top-level package (or module file) of ``module``, as this process finds it."""
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise ValueError(f"{module} cannot be found")
    where = list(spec.submodule_search_locations or [])
    return where[0] if where else str(Path(str(spec.origin)).parent)


def import_roots(paths: list[str]) -> str:
    """PYTHONPATH inside the sandbox: the folders above meshrl's packages and above users' packages, in the order
    this process searches them."""
    return os.pathsep.join(entry for entry in sys.path if entry and any(
        path.startswith(entry.rstrip("/") + "/") for path in paths) and entry not in (sys.prefix, sys.base_prefix))


def staged_command(paths: list[str], uid: int) -> list[str]:
    """What starts bwrap as ``uid`` where it can read ``paths``, which that uid may not reach on the host (a Python
    under /root, for one): in a mount namespace of its own, still root, it binds each of them at STAGE/<index>
    (on a tmpfs it mounts there), then becomes ``uid`` and runs what follows. The same process throughout (each
    step execs the next), so bwrap's parent is the service."""
    return [UNSHARE, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", STAGE_SCRIPT, "stage", STAGE,
            str(len(paths)), *paths, SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def sandbox_command(config: EnvServiceConfig, paths: list[str]) -> list[str]:
    """bwrap's namespaces and mounts for a worker, each of ``paths`` bound read-only from where ``staged_command``
    put it, the worker's command left to append."""
    mounts = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
              "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
              "--size", str(config.worker_tmp_mb << 20), "--tmpfs", WORKDIR]
    for index, path in enumerate(paths):
        mounts += ["--ro-bind", f"{STAGE}/{index}", path]
    environment = {"PATH": "/usr/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "PYTHONPATH": import_roots(paths),
                   "PYTHONDONTWRITEBYTECODE": "1"}
    return [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--hostname", "env-worker", "--clearenv", *(item for name, value in environment.items()
                                                      for item in ("--setenv", name, value)),
            *mounts, "--remount-ro", "/", "--chdir", WORKDIR]


def worker_command(fd: int, sandboxed: bool) -> list[str]:
    return [sys.executable, "-B", "-m", "services.env.worker", str(fd), str(os.getpid()),
            *(["sandboxed"] if sandboxed else [])]


class WorkerProcess:
    """One started worker: its process (bwrap's, when sandboxed), and what ends it whole."""

    def __init__(self, process: subprocess.Popen, sandbox_init: int | None, uid: ExitStack | None, *, uid_number: int):
        self.process, self._sandbox_init, self._uid, self._uid_number = process, sandbox_init, uid, uid_number

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (its sandbox's pid namespace; or, unsandboxed, its
        descendants, which it adopts, and its process group), reap it and give its uid back."""
        if self._sandbox_init is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._sandbox_init, signal.SIGKILL)  # pid 1: its namespace goes with it
            os.close(self._sandbox_init)
            self._sandbox_init = None
        if self._uid is None and self.process.returncode is None:  # not reaped: its pid is still its own
            with contextlib.suppress(ProcessLookupError):  # stopped, it starts nothing more and still adopts
                os.kill(self.process.pid, signal.SIGSTOP)
            end_descendants(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            if self._uid is None:
                os.killpg(self.process.pid, signal.SIGKILL)  # its pid is its group's (start_new_session)
            else:
                self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self._uid is not None:
            clear_uid(self._uid_number)
            self._uid.close()
            self._uid = None


def start_worker(config: EnvServiceConfig, fd: int, paths: list[str] | None) -> WorkerProcess:
    """A worker on socket ``fd``: in a sandbox that can read ``paths`` (see ``readable_paths``), or plainly where
    ``paths`` is None. SandboxUnavailable when its sandbox could not be built."""
    if paths is None:
        variables = {name: value for name, value in os.environ.items() if name not in CREDENTIAL_VARIABLES}
        process = subprocess.Popen(worker_command(fd, sandboxed=False), pass_fds=(fd,), env=variables,
                                   start_new_session=True)
        return WorkerProcess(process, None, None, uid_number=0)
    held = ExitStack()
    uid = held.enter_context(pool_uid(WORKER_UID_BASE, WORKER_UID_SLOTS))
    info_read, info_write = os.pipe()
    os.makedirs(STAGE, mode=0o755, exist_ok=True)
    try:
        process = subprocess.Popen([*staged_command(paths, uid), *sandbox_command(config, paths),
                                    "--info-fd", str(info_write), "--", *worker_command(fd, sandboxed=True)],
                                   pass_fds=(fd, info_write), env=LAUNCH_ENVIRONMENT)
    except OSError as error:
        held.close()
        raise SandboxUnavailable(f"could not start a worker's sandbox as uid {uid}: {error}") from None
    finally:
        os.close(info_write)
    with os.fdopen(info_read, "rb") as info:  # bwrap writes it once the sandbox stands
        pid = json.loads(info.read() or b"{}").get("child-pid")
    sandbox_init = None
    with contextlib.suppress(ProcessLookupError):
        sandbox_init = os.pidfd_open(pid) if pid is not None else None
    return WorkerProcess(process, sandbox_init, held, uid_number=uid)
