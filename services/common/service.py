"""Running a service process: the gRPC server, health, registration, SIGTERM.

Every service's ``__main__`` builds its servicer and calls ``run_service``,
which:
0. refuses to start (exit code 2), before it binds, when it would listen
   beyond loopback without a cluster token and ``allow_open`` is not set;
1. starts a grpc.aio server (on uvloop) with the RPC metrics interceptor,
   the token check, the error interceptor, the response write deadline and
   the standard health service,
   on the configured host and port (0 = any free port), over mTLS when it is
   configured, and Prometheus's /metrics on ``metrics_port`` when it is set
   (either port taken: exit code 2, naming the port and its setting); a
   streamed response whose client takes no message for
   ``response_write_timeout_s`` is ended (handlers.ResponseWriteDeadline);
   once both listen, writes the ports it got to ``ports_file`` when set (a
   launcher that starts it on port 0 reads them there: no port is picked
   free by one process and bound later by another);
2. registers with the coordinator (with its host name, meshrl version and
   GPUs) and heartbeats (with the weight version it holds), registering
   again whenever the coordinator has forgotten it (it restarted) and
   retrying while it is unreachable; a coordinator that refuses this
   process's cluster token ends the service (exit code 2), as retrying
   cannot mend the token;
3. on SIGTERM or SIGINT, marks itself NOT_SERVING, deregisters, lets the
   calls in flight finish within the grace period, releases what it holds
   and exits; a process still there RELEASE_S after the grace period (a
   thread stuck in a call that does not return: a read of a hung mount, a
   collective whose peer is gone) logs which threads hold it and exits at
   once with code 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.about import describe_gpus, meshrl_version
from services.common.cli import REFUSED_EXIT_CODE, CannotStart, log_config, parse_service_config
from services.common.config import ServeConfig
from services.common.errors import ErrorInterceptor
from services.common.handlers import ResponseWriteDeadline
from services.common.lifetime import die_with_parent
from services.common.logging import configure_logging
from services.common.auth import TokenServerInterceptor, cluster_token, is_loopback, metrics_tls, server_credentials
from services.common.rpc import SERVER_OPTIONS, open_channel
from services.common.telemetry import MetricsServer, RpcMetricsInterceptor

PROTOCOL_VERSION = 1
RELEASE_S = 5.0
"""After the grace period of a stop, how long a service may take to release what it holds (engines, channels, its
run DB) before it exits at once, whatever its threads are doing."""
OVERDUE_EXIT_CODE = 1
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
Config = TypeVar("Config", bound=ServeConfig)
log = structlog.get_logger()


class TokenRefused(Exception):
    """The coordinator refused this process's cluster token (missing or wrong): the service cannot take part."""


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """Where a service listens and whom it reports to."""

    kind: str
    host: str
    port: int
    group: str
    coordinator: str  # host:port, or "" for the coordinator itself
    grace_s: float = 10.0
    gpu: str = "cpu"  # its GPUs, described (about.describe_gpus)
    metrics_port: int | None = None  # of its Prometheus /metrics (None: none served)
    response_write_timeout_s: float = 60.0  # how long a response stream may wait for its client to read
    ports_file: str = ""  # where to write the ports it got once it listens ("": nowhere)


def identity_for(endpoint: Endpoint, port: int) -> common_pb2.ServiceIdentity:
    hostname = socket.gethostname()
    host = endpoint.host if endpoint.host not in ("0.0.0.0", "::", "[::]") else hostname
    return common_pb2.ServiceIdentity(
        service_id=f"{endpoint.kind}-{hostname}-{port}-{os.getpid()}",
        kind=endpoint.kind,
        address=f"{host}:{port}",
        group=endpoint.group,
        protocol_version=PROTOCOL_VERSION,
        pid=os.getpid(),
        hostname=hostname,
        meshrl_version=meshrl_version(),
        gpu=endpoint.gpu,
    )


async def keep_registered(identity: common_pb2.ServiceIdentity, coordinator: str, stop: asyncio.Event,
                          *, weight_version: Callable[[], int | None]) -> None:
    """Register, then heartbeat until ``stop``; re-register when forgotten or after an outage. Each Register and
    Heartbeat carries ``weight_version()``, the version the service holds then (None: none).

    Raises TokenRefused, after setting ``stop``, when the coordinator refuses the token."""
    channel = open_channel(coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    interval, registered = 1.0, False
    try:
        while not stop.is_set():
            try:
                if not registered:
                    request = coordinator_pb2.RegisterRequest(identity=identity, weight_version=weight_version())
                    reply = await stub.Register(request, timeout=5)
                    interval, registered = reply.heartbeat_interval_s, True
                    log.info("registered", coordinator=coordinator, service_id=identity.service_id)
                else:
                    beat = await stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
                        service_id=identity.service_id, weight_version=weight_version()), timeout=5)
                    registered = beat.known
            except grpc.aio.AioRpcError as error:
                if error.code() in REFUSALS:
                    stop.set()
                    raise _token_refused(coordinator, error.code()) from None
                registered = False
                log.warning("coordinator_unreachable", coordinator=coordinator, code=error.code().name)
            with _suppress_timeout():
                await asyncio.wait_for(stop.wait(), timeout=interval)
        with _suppress_timeout():
            await stub.Deregister(coordinator_pb2.HeartbeatRequest(service_id=identity.service_id), timeout=2)
    finally:
        await channel.close()


def _token_refused(coordinator: str, code: grpc.StatusCode) -> TokenRefused:
    """Log the refusal and say what to do about it."""
    presented = "a wrong cluster token" if cluster_token() else "no cluster token"
    fix = "set MESHRL_TOKEN to the cluster's token, or MESHRL_TOKEN_FILE to a file holding it"
    log.error("token_refused", coordinator=coordinator, code=code.name, presented=presented, fix=fix)
    return TokenRefused(f"the coordinator at {coordinator} refused this process ({code.name}: {presented}); {fix}")


class _suppress_timeout:
    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        return kind is not None and issubclass(kind, (asyncio.TimeoutError, grpc.aio.AioRpcError))


class Attached(Protocol):
    def weight_version(self) -> int | None:
        """The actor weight version the service holds (trainer) or serves (rollout) now, or None where it holds
        none; read on the event loop at each heartbeat, so it must not block."""

    async def close(self) -> None:
        """Release what the servicer holds (channels, engines) after the server stopped."""


async def serve(endpoint: Endpoint, attach: Callable[[grpc.aio.Server, common_pb2.ServiceIdentity], Attached]) -> None:
    """Serve until SIGTERM/SIGINT. ``attach`` adds the servicer to the server and returns it."""
    token, credentials = cluster_token(), server_credentials()
    interceptors = [RpcMetricsInterceptor(), *([TokenServerInterceptor(token)] if token else []), ErrorInterceptor(),
                    ResponseWriteDeadline(endpoint.response_write_timeout_s)]
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    port = _bind(server, endpoint, credentials)
    identity = identity_for(endpoint, port)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    servicer = attach(server, identity)
    metrics = (MetricsServer(endpoint.host, endpoint.metrics_port, servicer.weight_version, token=token,
                             tls=metrics_tls()) if endpoint.metrics_port is not None else None)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if endpoint.ports_file:
        write_ports(Path(endpoint.ports_file), port, metrics.port if metrics else None)
    structlog.contextvars.bind_contextvars(service_id=identity.service_id)
    log.info("serving", address=identity.address, kind=endpoint.kind, pid=os.getpid(), gpu=identity.gpu,
             metrics_address=metrics.address if metrics else None,
             meshrl_version=identity.meshrl_version, authentication="cluster token" if token else "none",
             transport="mtls" if credentials else "plaintext")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    heartbeat = (asyncio.create_task(keep_registered(identity, endpoint.coordinator, stop=stop,
                                                     weight_version=servicer.weight_version))
                 if endpoint.coordinator else None)
    await stop.wait()
    log.info("stopping", grace_s=endpoint.grace_s)
    exit_after(endpoint.grace_s + RELEASE_S)
    await health_servicer.enter_graceful_shutdown()
    if heartbeat is not None:
        await asyncio.wait({heartbeat})
    await server.stop(endpoint.grace_s)
    if metrics is not None:
        metrics.close()
    await servicer.close()
    log.info("stopped")
    if heartbeat is not None:
        heartbeat.result()  # raises TokenRefused if that is what stopped us


def exit_after(seconds: float) -> None:
    """End the process ``seconds`` from now unless it has ended by then, from a daemon thread: a thread busy in a
    call that does not return cannot hold it (Python waits for every worker thread when it exits)."""

    def overdue() -> None:
        busy = [thread.name for thread in threading.enumerate() if not thread.daemon and thread.is_alive()]
        log.error("stop_overdue", seconds=seconds, busy_threads=busy)
        os._exit(OVERDUE_EXIT_CODE)

    timer = threading.Timer(seconds, overdue)
    timer.daemon = True
    timer.start()


def _bind(server: grpc.aio.Server, endpoint: Endpoint, credentials: grpc.ServerCredentials | None) -> int:
    """The port ``server`` listens on; CannotStart naming the address and the setting where it cannot bind."""
    address = f"{endpoint.host}:{endpoint.port}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address"
        port = 0
    if port == 0:
        raise CannotStart(f"cannot listen on {address} (setting port): the port is in use or the host is not an "
                          "address of this machine; choose another port (0 picks a free one) or stop what holds it")
    return port


def write_ports(path: Path, port: int, metrics_port: int | None) -> None:
    """Replace ``path`` at once with the ports this process listens on (its launcher may read it at any time)."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps({"port": port, "metrics_port": metrics_port}) + "\n")
    partial.replace(path)


def die_with_launcher() -> None:
    """Started by a launcher that set MESHRL_PARENT_PID (coordctl --local, a torchrun agent): get SIGTERM when it
    dies, and stop as on any SIGTERM.

    Done here, in the child, rather than in a preexec_fn: running Python between fork and exec in a
    process that holds gRPC threads can deadlock the child."""
    parent = os.environ.get("MESHRL_PARENT_PID")
    if parent:
        die_with_parent(int(parent), signal.SIGTERM)


def refuse_open_bind(kind: str, config: ServeConfig) -> None:
    """Exit (code 2) if the service would listen beyond loopback with no cluster token, unless ``allow_open``
    asks for exactly that; say both fixes."""
    try:
        token = cluster_token()
    except ValueError as error:  # MESHRL_TOKEN_FILE unreadable or empty
        sys.stderr.write(f"{kind}: cannot start: {error}\n")
        sys.exit(REFUSED_EXIT_CODE)
    if token is not None or is_loopback(config.host):
        return
    if config.allow_open:
        log.warning("serving_open", host=config.host, reason="allow_open=true and no cluster token")
        return
    fix = ("set MESHRL_TOKEN_FILE to a file holding the cluster's token (or MESHRL_TOKEN to the token), or set "
           "allow_open=true to serve without one on purpose")
    log.error("open_bind_refused", host=config.host, fix=fix)
    sys.stderr.write(f"{kind}: cannot start: host={config.host} listens beyond loopback and no cluster token is "
                     f"set, so anyone who can reach this machine could call every RPC; {fix}\n")
    sys.exit(REFUSED_EXIT_CODE)


def limit_torch_threads(config: ServeConfig) -> None:
    """Give torch ``torch_threads`` intra- and inter-op threads where it is set, in a service that computes with
    torch: one that does not (``computes_with_torch``) never imports it."""
    if config.torch_threads and config.computes_with_torch():
        import torch

        torch.set_num_threads(config.torch_threads)
        torch.set_num_interop_threads(config.torch_threads)


def run_service(kind: str, config_model: type[Config],
                attach: Callable[[grpc.aio.Server, Config, common_pb2.ServiceIdentity], Attached]) -> None:
    """The whole ``__main__`` of a service: parse the config, log it, check its bind, serve on uvloop."""
    die_with_launcher()
    config = parse_service_config(kind, config_model)
    log_config(configure_logging(kind, config.log_level), config)
    refuse_open_bind(kind, config)
    limit_torch_threads(config)
    endpoint = Endpoint(kind=kind, host=config.host, port=config.port, group=config.group,
                        coordinator=config.coordinator, grace_s=config.grace_s,
                        gpu=describe_gpus(config.compute_devices()), metrics_port=config.metrics_port,
                        response_write_timeout_s=config.response_write_timeout_s, ports_file=config.ports_file)
    try:
        uvloop.run(serve(endpoint, lambda server, identity: attach(server, config, identity)))
    except (ValueError, CannotStart) as refused:  # what the servicer refuses to start with (a plugin that fails to
        # import, a sandbox this host cannot give, a damaged run DB): a restart would find it again
        log.error("cannot_start", reason=str(refused))
        sys.stderr.write(f"{kind}: cannot start: {refused}\n")
        sys.exit(REFUSED_EXIT_CODE)
    except TokenRefused as refused:  # logged already; this line is for a person at a terminal
        sys.stderr.write(f"{kind}: {refused}\n")
        sys.exit(REFUSED_EXIT_CODE)
