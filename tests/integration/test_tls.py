"""With MESHRL_TLS_* set, the services speak mTLS and still demand the token: only a caller with a certificate
from the cluster CA and the token gets answers, from their gRPC ports and their /metrics alike."""

from __future__ import annotations

import asyncio
import http.client
import os
import secrets
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from typer.testing import CliRunner

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, reward_pb2_grpc
from services.common.auth import cluster_tls, cluster_token
from services.common.rpc import open_channel
from services.coordctl.cli import app
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec


def make_certs(out_dir, host: str):
    result = CliRunner().invoke(app, ["certs", str(out_dir), "--host", host])
    assert result.exit_code == 0, result.output
    return out_dir


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "cluster", "node1")


@pytest.fixture(scope="module")
def other_ca_certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "other", "node1")


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, certs):
    """Coordinator and a reward service over mTLS with a token; this process has the same settings."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MESHRL_TOKEN", secrets.token_urlsafe(32))
        env.setenv("MESHRL_TLS_CERT", str(certs / "node1.pem"))
        env.setenv("MESHRL_TLS_KEY", str(certs / "node1-key.pem"))
        env.setenv("MESHRL_TLS_CA", str(certs / "ca.pem"))
        cluster_token.cache_clear()
        cluster_tls.cache_clear()
        cluster = LocalCluster(tmp_path_factory.mktemp("tls") / "state", (ServiceSpec(kind="reward"),))
        try:
            asyncio.run(cluster.start(timeout_s=120))
            yield cluster
        finally:
            cluster.stop()
    cluster_token.cache_clear()
    cluster_tls.cache_clear()


def credentials(ca, key=None, cert=None) -> grpc.ChannelCredentials:
    """Client TLS that trusts the CA file ``ca`` and presents the ``cert`` file with ``key`` (if given)."""
    return grpc.ssl_channel_credentials(ca.read_bytes(), key and key.read_bytes(), cert and cert.read_bytes())


async def list_services(address: str, tls: grpc.ChannelCredentials | None, token: str) -> list[str]:
    """ListServices over a channel with ``tls`` (None: plaintext), presenting ``token``."""
    channel = grpc.aio.insecure_channel(address) if tls is None else grpc.aio.secure_channel(address, tls)
    async with channel:
        reply = await coordinator_pb2_grpc.CoordinatorStub(channel).ListServices(
            coordinator_pb2.ListServicesRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        return [service.identity.kind for service in reply.services]


def refusal(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(call)
    return refused.value.code()


def test_the_right_certificate_and_token_get_answers(tls_cluster, certs):
    right = credentials(certs / "ca.pem", certs / "node1-key.pem", certs / "node1.pem")
    assert asyncio.run(list_services(tls_cluster.coordinator, right, cluster_token())) == ["reward"]


def test_the_services_own_channels_and_coordctl_speak_mtls(tls_cluster):
    async def reward_info() -> str:
        coordinator = CoordinatorClient(tls_cluster.coordinator)
        try:
            (reward,) = await coordinator.list_services()
        finally:
            await coordinator.close()
        channel = open_channel(reward.address)  # the address it registered, dialled as the coordinator does
        try:
            return (await reward_pb2_grpc.RewardStub(channel).Info(common_pb2.InfoRequest(), timeout=10)).identity.kind
        finally:
            await channel.close()

    assert asyncio.run(reward_info()) == "reward"
    listed = CliRunner().invoke(app, ["services", "--coordinator", tls_cluster.coordinator])
    assert listed.exit_code == 0, listed.output
    header, row = listed.output.split("\n\n")[0].splitlines()  # the table; the registered algorithms follow it
    assert header.split()[:2] == ["HOST", "KIND"] and row.split()[1] == "reward" and " up " in row


def test_a_plaintext_client_is_refused(tls_cluster):
    assert refusal(list_services(tls_cluster.coordinator, None, cluster_token())) == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_is_refused(tls_cluster, certs):
    no_client_cert = credentials(certs / "ca.pem")
    code = refusal(list_services(tls_cluster.coordinator, no_client_cert, cluster_token()))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_client_whose_certificate_comes_from_another_ca_is_refused(tls_cluster, certs, other_ca_certs):
    foreign = credentials(certs / "ca.pem", other_ca_certs / "node1-key.pem", other_ca_certs / "node1.pem")
    assert refusal(list_services(tls_cluster.coordinator, foreign, cluster_token())) == grpc.StatusCode.UNAVAILABLE


def test_the_right_certificate_with_a_wrong_token_is_refused(tls_cluster, certs):
    right = credentials(certs / "ca.pem", certs / "node1-key.pem", certs / "node1.pem")
    code = refusal(list_services(tls_cluster.coordinator, right, "not-the-token"))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_are_https_for_a_certificate_of_the_cluster_ca_with_the_token_only(tls_cluster, certs):
    """Each service's /metrics, as Prometheus's scheme https, tls_config and authorization scrape it."""
    context = ssl.create_default_context(cafile=certs / "ca.pem")
    context.load_cert_chain(certs / "node1.pem", certs / "node1-key.pem")
    bare = ssl.create_default_context(cafile=certs / "ca.pem")  # no client certificate

    def scrape(scheme: str, port: int, tls: ssl.SSLContext | None, token: str | None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=tls) as reply:
                return reply.status if b"meshrl_rpc_duration_seconds" in reply.read() else -1
        except urllib.error.HTTPError as refused:
            return refused.code
        except (OSError, http.client.HTTPException):  # the handshake or the connection refused
            return 0

    for kind, port in tls_cluster.metrics_ports.values():
        assert scrape("https", port, context, cluster_token()) == 200, kind
        assert scrape("https", port, context, None) == 401, kind
        assert scrape("https", port, context, "not-the-token") == 401, kind
        assert scrape("https", port, bare, cluster_token()) == 0, kind
        assert scrape("http", port, None, cluster_token()) == 0, kind


def test_a_service_with_a_partial_tls_setting_does_not_start(tmp_path, certs):
    env = {key: value for key, value in os.environ.items() if not key.startswith("MESHRL_TLS_")}
    env |= {"MESHRL_TLS_CERT": str(certs / "node1.pem"), "MESHRL_TLS_KEY": str(certs / "node1-key.pem")}
    started = subprocess.run([sys.executable, "-m", "services.coordinator", "host=127.0.0.1", "port=0",
                              f"state_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode != 0
    assert "cannot start: MESHRL_TLS_CERT, MESHRL_TLS_KEY set but MESHRL_TLS_CA not" in started.stderr
