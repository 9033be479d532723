"""``coordctl start-run --local``: the whole mesh on this machine.

1. Build, once into the cache folder, the tiny model and the synthetic data
   that the ``local`` section of coordctl's config describes (``config.py``).
2. Start the coordinator, then one trainer, one rollout and one reward
   service, as subprocesses on loopback, each with one torch thread
   (on 2 cores, several torch processes with 2 threads each slow each other
   3-20x), each logging to ``<state_dir>/logs/<kind>.log``.
3. Make a fresh cluster token (unless MESHRL_TOKEN or MESHRL_TOKEN_FILE is
   set) that the services demand and this process's clients present, in
   ``<state_dir>/token`` (mode 0600), so that ``coordctl status`` in another
   terminal, or a service started by hand, can present it too.
4. Give each a Prometheus ``/metrics`` port of its own on loopback, listed
   in ``<state_dir>/prometheus-targets.json`` (Prometheus's file_sd format,
   each labelled with its job: meshrl-coordinator, meshrl-trainer, ...).
   Every port, gRPC and metrics alike, is bound as port 0 by the service
   itself, which writes the ports it got to ``<state_dir>/ports/<name>.json``
   (``ports_file``), where this process reads them: no port is picked free
   here and bound later there, when another process may have taken it. A
   coordinator started again binds the port it had (its services know it).
5. Stop them all on the way out, the coordinator first (SIGTERM, then
   SIGKILL after a grace period); a child also gets SIGTERM if coordctl
   itself dies. The children run in their own session, so Ctrl-C in the
   terminal reaches coordctl alone, which first stops the run at a step
   boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.auth import cluster_token, write_token
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig, TaskConfig, TinyModelConfig
from services.coordctl.control import CoordinatorClient
from services.coordctl.synthetic import arithmetic_task_rows, lookup_task_rows, reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import build_tiny_model

@dataclass(frozen=True, kw_only=True)
class ServiceSpec:
    """One service process to start: its kind, group, extra key=value settings and environment."""

    kind: str
    group: str = "default"
    settings: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ranks: int = 1  # more than one: started under torchrun with this many ranks (a trainer)


ONE_OF_EACH = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"))
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SERVICES_FILE = "services.json"  # in a --local state_dir: the services started there, which resume --local restarts


def cache_dir() -> Path:
    return Path(os.environ.get("MESHRL_CACHE", Path.home() / ".cache" / "meshrl"))


def save_services(state_dir: Path, services: tuple[ServiceSpec, ...]) -> None:
    """Record in ``state_dir`` the services a --local run started (its local section and run config chose them:
    an env service for a multi-turn run, a vLLM rollout's settings), for ``resume --local`` to start again."""
    state_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": s.kind, "group": s.group, "settings": list(s.settings), "env": [list(pair) for pair in s.env],
             "ranks": s.ranks} for s in services]
    (state_dir / SERVICES_FILE).write_text(json.dumps(rows, indent=1) + "\n")


def saved_services(state_dir: Path) -> tuple[ServiceSpec, ...] | None:
    """The services ``save_services`` recorded in ``state_dir`` (None: none recorded, a state_dir from before
    they were); ValueError naming the file if it is not what it wrote."""
    path = state_dir / SERVICES_FILE
    if not path.exists():
        return None
    try:
        return tuple(ServiceSpec(kind=row["kind"], group=row["group"], settings=tuple(row["settings"]),
                                 env=tuple((name, value) for name, value in row["env"]), ranks=row["ranks"])
                     for row in json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} does not list the services of a --local run: {error!r}") from None


def tiny_model_name(tiny: TinyModelConfig) -> str:
    """The cache folder's name of the tiny model ``tiny`` describes (one per shape, seed and variant)."""
    family = f"qwen3moe-e{tiny.num_experts}k{tiny.experts_per_token}" if tiny.num_experts else "qwen2"
    return (f"tiny-{family}-char-h{tiny.hidden_size}-l{tiny.num_layers}-a{tiny.num_heads}-s{tiny.seed}"
            f"{'-chat' if tiny.chat else ''}")


def prepare_assets(config: RunConfig, local: LocalConfig, cache: Path) -> list[str]:
    """Build the tiny model and synthetic data that ``local`` describes if the run names no model or data and
    they are not in ``cache`` yet; overrides that point the run at them."""
    overrides = []
    tiny = local.tiny_model
    if not config.actor_rollout_ref.model.path:
        if local.task == "lookup" and not tiny.chat:
            raise ValueError("local.task lookup needs local.tiny_model.chat: true (its tool calls need the chat "
                             "vocabulary and template)")
        folder = cache / "models" / tiny_model_name(tiny)
        if not (folder / "config.json").exists():
            build_tiny_model(folder, tiny.hidden_size, tiny.num_layers, num_heads=tiny.num_heads, seed=tiny.seed,
                             chat=tiny.chat,
                             num_experts=tiny.num_experts, experts_per_token=tiny.experts_per_token)
        overrides.append(f"actor_rollout_ref.model.path={folder}")
    if not config.data.train_files:
        train, test = task_files(local, cache)
        overrides.append(f"data.train_files=[{train}]")
        if test is not None and not config.data.val_files:
            overrides.append(f"data.val_files=[{test}]")
    return overrides


def task_files(local: LocalConfig, cache: Path) -> tuple[Path, Path | None]:
    """The training and held-out files of the local task (None: no held-out rows), built if missing."""
    task: TaskConfig  # the chosen task's; each closure below reads its own task's config, typed as such
    if local.task == "lookup":
        lookup = task = local.lookup_task
        name = f"lookup-k{lookup.key_letters}-s{lookup.seed}-h{lookup.held_out_share:g}"

        def rows(count: int, seed: int, split: str) -> list[dict]:
            return lookup_task_rows(count, lookup.key_letters, seed, split=split, held_out_share=lookup.held_out_share)
    elif local.task == "arithmetic":
        arithmetic = task = local.arithmetic_task
        name = (f"arithmetic-s{arithmetic.min_steps}-{arithmetic.max_steps}-n{arithmetic.largest}-s{arithmetic.seed}"
                f"-h{arithmetic.held_out_share:g}")

        def rows(count: int, seed: int, split: str) -> list[dict]:
            return arithmetic_task_rows(count, arithmetic.min_steps, arithmetic.max_steps, largest=arithmetic.largest,
                                        seed=seed,
                                        split=split, held_out_share=arithmetic.held_out_share)
    else:
        reverse = task = local.synthetic_task
        name = f"reverse-d{reverse.min_digits}-{reverse.max_digits}-s{reverse.seed}-h{reverse.held_out_share:g}"

        def rows(count: int, seed: int, split: str) -> list[dict]:
            return reverse_task_rows(count, reverse.min_digits, reverse.max_digits, seed=seed, split=split,
                                     held_out_share=reverse.held_out_share)
    train = cache / "data" / f"{name}-train{task.rows}.jsonl"
    test = cache / "data" / f"{name}-test{task.val_rows}.jsonl"
    if not train.exists():
        write_jsonl(rows(task.rows, task.seed, "train"), train)
    if not task.val_rows:
        return train, None
    if not test.exists():
        write_jsonl(rows(task.val_rows, task.seed + 1, "test"), test)
    return train, test


class LocalCluster:
    """The four services as subprocesses: ``start`` them, ``stop`` them."""

    def __init__(self, state_dir: Path, services: tuple[ServiceSpec, ...] = ONE_OF_EACH, log_level: str = "info",
                 *, coordinator_settings: tuple[str, ...] = ()):
        """``services``: each service to start besides the coordinator; ``coordinator_settings``: its extra
        key=value settings."""
        self.services = services
        self.coordinator_settings = coordinator_settings
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.log_level = log_level
        self.coordinator = ""  # host:port, once start_coordinator has seen it listen
        self.processes: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, tuple[str, int]] = {}  # name -> (kind, its /metrics port)
        self.ports_dir = state_dir / "ports"
        self.unread_ports: dict[str, str] = {}  # name -> kind of each started service whose ports are not read yet
        self.targets_file = state_dir / "prometheus-targets.json"
        self.own_token_file: str | None = None  # the token file this cluster made and this process presents
        if cluster_token() is None:  # the local services take calls from holders of the token file only
            self.own_token_file = os.environ["MESHRL_TOKEN_FILE"] = str(write_token(state_dir / "token"))
            cluster_token.cache_clear()

    def command(self, name: str, kind: str, settings: tuple[str, ...], *, ranks: int) -> list[str]:
        """The command line that starts service ``name`` (bound to loopback)."""
        launcher = (["-m", "services.coordctl.torchrun", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1
                    else [])
        return [sys.executable, *launcher, "-m", f"services.{kind}", "host=127.0.0.1", f"log_level={self.log_level}",
                *settings]

    def _spawn(self, name: str, kind: str, *settings: str, env: tuple[tuple[str, str], ...] = (),
               ranks: int = 1) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        ports_file = self.ports_dir / f"{name}.json"
        ports_file.unlink(missing_ok=True)  # a restarted service's earlier ports
        self.unread_ports[name] = kind
        log = (self.log_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            self.command(name, kind, ("metrics_port=0", f"ports_file={ports_file}", *settings), ranks=ranks),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **CHILD_ENV, "MESHRL_PARENT_PID": str(os.getpid()), **dict(env)},
            start_new_session=True,  # a terminal's Ctrl-C reaches coordctl only, which stops the run first
        )

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start them all (before this process makes any gRPC object: gRPC and fork do not mix), wait for them."""
        self.start_coordinator(timeout_s)
        kinds = [spec.kind for spec in self.services]
        for index, spec in enumerate(self.services):
            name = spec.kind if kinds.count(spec.kind) == 1 else f"{spec.kind}-{index}"
            self._spawn(name, spec.kind, "port=0", f"coordinator={self.coordinator}", f"group={spec.group}",
                        "torch_threads=1", *self._roots(spec.kind), *spec.settings, env=spec.env, ranks=spec.ranks)
        self.wait_listening(timeout_s)
        client = CoordinatorClient(self.coordinator)
        try:
            await asyncio.wait_for(self._wait(client.wait_ready(timeout_s)), timeout_s)
            await asyncio.wait_for(self._wait(self._registered(client)), timeout_s)
        finally:
            await client.close()

    def start_coordinator(self, timeout_s: float = 60.0) -> None:
        """Start the coordinator on its state dir: the first time on a port it picks, waiting until it listens
        (``coordinator`` then holds its address); again, after it died, on the port it had (it resumes its
        active runs), its new /metrics port listed once ``wait_listening`` has seen it listen."""
        port = self.coordinator.rpartition(":")[2] or "0"
        self._spawn("coordinator", "coordinator", f"port={port}", f"state_dir={self.state_dir}",
                    *self.coordinator_settings)
        if not self.coordinator:
            self.coordinator = f"{self.coordinator_host()}:{self.wait_listening(timeout_s)['coordinator']}"

    def coordinator_host(self) -> str:
        """The address the coordinator binds (``command`` binds every service to loopback)."""
        return "127.0.0.1"

    def wait_listening(self, timeout_s: float) -> dict[str, int]:
        """Wait until every service started since the last call listens (RuntimeError if one exits first); the
        gRPC port of each. Their /metrics ports go into ``metrics_ports`` and the targets file."""
        deadline, ports = time.monotonic() + timeout_s, {}
        while unread := list(self.unread_ports):
            self.check_alive()
            for name in unread:
                if (self.ports_dir / f"{name}.json").exists():
                    ports[name] = self._take_ports(name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(unread)} did not listen within {timeout_s} s")
            time.sleep(0.1)
        return ports

    def _take_ports(self, name: str) -> int:
        """Read the ports service ``name`` wrote; list its /metrics port; its gRPC port."""
        ports = json.loads((self.ports_dir / f"{name}.json").read_text())
        kind = self.unread_ports.pop(name)
        if ports["metrics_port"] is not None:
            self.metrics_ports[name] = (kind, ports["metrics_port"])
            write_targets(self.targets_file, scrape_targets(self.metrics_ports))
        return ports["port"]

    def _roots(self, kind: str) -> tuple[str, ...]:
        """A trainer saves and loads checkpoints inside the state folder, where the runs keep them."""
        return (f"checkpoint_root={self.state_dir}",) if kind == "trainer" else ()

    def add_service(self, spec: ServiceSpec, name: str) -> None:
        """Start one more service (it registers by itself), e.g. to replace one that died; its /metrics port is
        listed once ``wait_listening`` has seen it listen."""
        self._spawn(name, spec.kind, "port=0", f"coordinator={self.coordinator}", f"group={spec.group}",
                    "torch_threads=1", *self._roots(spec.kind), *spec.settings, env=spec.env, ranks=spec.ranks)

    async def _wait(self, ready):
        """Await ``ready`` while checking that no child has died."""
        task = asyncio.ensure_future(ready)
        while not task.done():
            self.check_alive()
            await asyncio.wait({task}, timeout=0.2)
        return task.result()

    async def _registered(self, client: CoordinatorClient) -> None:
        while len([s for s in await client.list_services() if s.state == "up"]) < len(self.services):  # noqa: ASYNC110 - polls the coordinator
            await asyncio.sleep(0.2)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the local {name} exited with code {process.returncode}; its log ends:\n{tail}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the coordinator, then the services; SIGKILL whatever outlives the grace period. The coordinator
        goes first: it then sees no service go, so it records no failure or recovery for them (a run still
        active is stopped by its shutdown, and resumes from its last checkpoint)."""
        terminate([p for kind, p in self.processes.items() if kind == "coordinator"], grace_s)
        terminate([p for kind, p in self.processes.items() if kind != "coordinator"], grace_s)
        self._forget_token()

    def _forget_token(self) -> None:
        """Stop presenting the token this cluster made, so that a later cluster in this process makes its own
        (this one's folder may be gone by then)."""
        if self.own_token_file is not None and os.environ.get("MESHRL_TOKEN_FILE") == self.own_token_file:
            del os.environ["MESHRL_TOKEN_FILE"]
            cluster_token.cache_clear()
        self.own_token_file = None


def scrape_targets(metrics_ports: dict[str, tuple[str, int]]) -> list[dict]:
    """Prometheus's file_sd groups for services named ``name -> (kind, port)`` on loopback: one group per
    service, its job meshrl-KIND, its name the label service."""
    return [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": f"meshrl-{kind}", "service": name}}
            for name, (kind, port) in sorted(metrics_ports.items())]


def write_targets(path: Path, groups: list[dict]) -> None:
    """Replace ``path`` with Prometheus's file_sd ``groups`` at once (Prometheus may read it at any time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(groups, indent=1) + "\n")
    partial.replace(path)


def job_targets(ports_dir: Path) -> list[dict]:
    """Prometheus's file_sd groups for the services of a Slurm job (deploy/slurm/node.sh): each wrote its ports
    to ``ports_dir``/KIND@ADDRESS[-MORE].json; one group per service that serves /metrics, at its address, its
    job meshrl-KIND, its name (the file's) the label service."""
    groups = []
    for path in sorted(ports_dir.glob("*@*.json")):
        kind, _, rest = path.stem.partition("@")
        address = rest.partition("-")[0]
        try:
            metrics_port = json.loads(path.read_text())["metrics_port"]
        except (OSError, ValueError, KeyError):
            continue  # being written, or not a ports file: the next look sees it
        if metrics_port:
            groups.append({"targets": [f"{address}:{metrics_port}"],
                           "labels": {"job": f"meshrl-{kind}", "service": path.stem}})
    return groups


def terminate(processes: list[subprocess.Popen], grace_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
