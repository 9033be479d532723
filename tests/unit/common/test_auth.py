"""CPU tests of services/common/auth.py (what counts as loopback, the mTLS settings) and of ``coordctl certs``."""

from __future__ import annotations

import ipaddress
import socket
import stat
from pathlib import Path

import pytest
from cryptography import x509
from typer.testing import CliRunner

from services.common.auth import TLS_VARIABLES, channel_credentials, cluster_tls, is_loopback, server_credentials
from services.coordctl.cli import app


def make_certs(out_dir: Path, *hosts: str) -> Path:
    result = CliRunner().invoke(app, ["certs", str(out_dir), *[arg for host in hosts for arg in ("--host", host)]])
    assert result.exit_code == 0, result.output
    return out_dir


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs") / "cluster", "node1,node1.lan,10.0.0.5", "node2")


@pytest.fixture(autouse=True)
def tls_env(monkeypatch):
    """No MESHRL_TLS_* variable set unless the test sets it; settings read afresh in each test."""
    for name in TLS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cluster_tls.cache_clear()
    yield monkeypatch
    cluster_tls.cache_clear()


def set_tls(monkeypatch, cert: Path | None, key: Path | None, ca: Path | None) -> None:
    for name, path in zip(TLS_VARIABLES, (cert, key, ca)):
        if path is not None:
            monkeypatch.setenv(name, str(path))


def test_without_tls_variables_everything_stays_plaintext():
    assert cluster_tls() is None
    assert server_credentials() is None and channel_credentials() is None


def test_all_three_files_turn_mtls_on(tls_env, certs):
    set_tls(tls_env, certs / "node1.pem", certs / "node1-key.pem", certs / "ca.pem")
    assert cluster_tls().ca == (certs / "ca.pem").read_bytes()
    assert server_credentials() is not None and channel_credentials() is not None


@pytest.mark.parametrize("left_out", TLS_VARIABLES)
def test_a_partial_set_is_refused_naming_what_is_missing(tls_env, certs, left_out):
    paths = dict(zip(TLS_VARIABLES, (certs / "node1.pem", certs / "node1-key.pem", certs / "ca.pem")))
    paths[left_out] = None
    set_tls(tls_env, *paths.values())
    with pytest.raises(ValueError, match=f"but {left_out} not: mTLS needs all of"):
        cluster_tls()


def test_a_missing_file_is_refused_naming_the_variable_and_the_file(tls_env, certs, tmp_path):
    set_tls(tls_env, certs / "node1.pem", tmp_path / "gone-key.pem", certs / "ca.pem")
    with pytest.raises(ValueError, match=f"MESHRL_TLS_KEY {tmp_path / 'gone-key.pem'}: No such file"):
        cluster_tls()


def test_an_unreadable_file_is_refused_naming_the_variable_and_the_file(tls_env, certs, tmp_path):
    set_tls(tls_env, certs / "node1.pem", certs / "node1-key.pem", tmp_path)  # a folder, not a file
    with pytest.raises(ValueError, match=f"MESHRL_TLS_CA {tmp_path}: Is a directory"):
        cluster_tls()


def test_files_of_the_wrong_kind_are_refused(tls_env, certs, tmp_path):
    (tmp_path / "notes.txt").write_text("not a certificate")
    set_tls(tls_env, tmp_path / "notes.txt", certs / "node1-key.pem", certs / "ca.pem")
    with pytest.raises(ValueError, match=f"MESHRL_TLS_CERT {tmp_path / 'notes.txt'}: not a PEM certificate"):
        cluster_tls()
    cluster_tls.cache_clear()
    set_tls(tls_env, certs / "node1.pem", certs / "node1.pem", certs / "ca.pem")
    with pytest.raises(ValueError, match="MESHRL_TLS_KEY .*node1.pem: not a PEM unencrypted private key"):
        cluster_tls()


def test_a_key_that_is_not_the_certificates_is_refused(tls_env, certs):
    set_tls(tls_env, certs / "node1.pem", certs / "node2-key.pem", certs / "ca.pem")
    with pytest.raises(ValueError, match="MESHRL_TLS_KEY .*node2-key.pem is not the key of MESHRL_TLS_CERT .*node1"):
        cluster_tls()


def test_certs_writes_a_ca_and_one_pair_per_host_with_private_keys(certs):
    names = sorted(path.name for path in certs.iterdir())
    assert names == ["ca-key.pem", "ca.pem", "node1-key.pem", "node1.pem", "node2-key.pem", "node2.pem"]
    for name in names:
        mode = stat.S_IMODE((certs / name).stat().st_mode)
        assert mode == (0o600 if name.endswith("-key.pem") else 0o644), name


def test_host_certificates_name_the_host_its_aliases_and_loopback(certs):
    cert = x509.load_pem_x509_certificate((certs / "node1.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["node1", "node1.lan", "localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"),
                                                         ipaddress.ip_address("127.0.0.1")]
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)


def test_certs_never_overwrites(certs):
    before = (certs / "ca.pem").read_bytes()
    result = CliRunner().invoke(app, ["certs", str(certs), "--host", "node3"])
    assert result.exit_code == 2
    assert f"{certs / 'ca.pem'} exists" in result.output
    assert (certs / "ca.pem").read_bytes() == before and not (certs / "node3.pem").exists()


@pytest.mark.parametrize("hosts", [["../evil"], ["a", "a"], ["ca-key"], [","]])
def test_certs_refuses_host_names_that_make_bad_or_clashing_files(tmp_path, hosts):
    result = CliRunner().invoke(app, ["certs", str(tmp_path / "out"), *[arg for h in hosts for arg in ("--host", h)]])
    assert result.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_coordctl_names_a_broken_setting_before_connecting(tls_env, certs):
    set_tls(tls_env, certs / "node1.pem", None, None)
    result = CliRunner().invoke(app, ["runs", "--coordinator", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "MESHRL_TLS_CERT set but MESHRL_TLS_KEY, MESHRL_TLS_CA not" in result.output


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "127.255.255.254", "::1", "[::1]", "::ffff:127.0.0.1",
                                  " 127.0.0.1 "])
def test_loopback_addresses_are_loopback(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "10.0.0.5", "192.168.1.20", "fe80::1", "::ffff:10.0.0.5",
                                  "128.0.0.1"])
def test_the_wildcards_and_other_addresses_are_not(host):
    assert not is_loopback(host)


def resolving(monkeypatch, table: dict[str, list[str]]) -> None:
    """Names resolve through ``table`` only (an address a name; a name not in it does not resolve)."""
    def getaddrinfo(name, port, *args, **kwargs):
        if name not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[name]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_is_loopback_when_every_address_it_resolves_to_is(monkeypatch):
    resolving(monkeypatch, {"localhost": ["127.0.0.1", "::1"], "node1": ["127.0.1.1"], "node2": ["10.0.0.5"],
                            "mixed": ["127.0.0.1", "10.0.0.5"], "nothing": []})
    assert is_loopback("localhost") and is_loopback("node1")  # Debian names the machine 127.0.1.1
    assert not is_loopback("node2")
    assert not is_loopback("mixed")  # gRPC binds every address of the name
    assert not is_loopback("nothing") and not is_loopback("no-such-host")


def test_localhost_is_loopback_on_this_machine():
    assert is_loopback("localhost")
