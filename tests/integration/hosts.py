"""Several hosts on one machine: network namespaces on a bridge, each with its own address, name and
certificate, and a cluster whose services are placed on them as real processes.

Each host is a network namespace with one interface (``eth0``) on a bridge in
the root namespace, where this test process lives and reaches them (the
bridge holds the subnet's last address). Its processes run with their own
host name (a UTS namespace) and an ``/etc/hosts`` that names every host (``ip
netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it). Taking a host's
link down on the bridge cuts it off as a pulled cable does: its packets are
dropped, no connection is reset. Making namespaces needs root (CI runs as
root); ``unavailable()`` says why they cannot be made.

Names carry this process's id and a count of the ``Hosts`` it made, so that
test sessions running side by side, and two modules (or two runs) in one
session, do not collide. Leaving removes every link, bridge and namespace
made, whatever happened meanwhile; ``left_behind`` says what is still there.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from services.coordctl.local import LocalCluster, ServiceSpec

NETNS_ETC = Path("/etc/netns")
MADE = itertools.count()  # the Hosts this process made: each takes names of its own


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces are Linux's ({sys.platform} here)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2 / util-linux)"
    probe = f"mrlprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except RuntimeError as error:
        return f"cannot make a network namespace (needs root or CAP_SYS_ADMIN): {error}"
    ip("netns", "del", probe)
    return None


class Hosts:
    """Hosts named ``names``, on one bridge; use as a context manager (everything is removed on the way out)."""

    def __init__(self, *names: str):
        number = (os.getpid() * 8 + next(MADE) % 8) % 25600  # the /24 below: 10.100.0 .. 10.199.255
        tag = f"{os.getpid() % 65536}x{number % 8}"  # with the suffixes below, within 15 characters (IFNAMSIZ)
        self.names = names
        self.subnet = f"10.{100 + number // 256}.{number % 256}"  # a /24 of this Hosts' own
        self.prefix = f"mrl{tag}"  # of every link and namespace made here
        self.bridge = f"mrlbr{tag}"
        self.namespaces = {name: f"mrl{tag}-{name}" for name in names}
        self.links = {name: f"mrl{tag}v{index}" for index, name in enumerate(names)}  # bridge ends of the cables
        self.addresses = {name: f"{self.subnet}.{index + 1}" for index, name in enumerate(names)}

    def __enter__(self) -> Hosts:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for name in self.names:
                self._add(name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add(self, name: str) -> None:
        namespace, link, inner = self.namespaces[name], self.links[name], f"{self.links[name]}n"
        ip("netns", "add", namespace)
        ip("link", "add", link, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", namespace)
        ip("-n", namespace, "link", "set", inner, "name", "eth0")
        ip("-n", namespace, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("link", "set", link, "master", self.bridge)
        ip("link", "set", link, "up")
        etc = NETNS_ETC / namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{address} {host}\n" for host, address in self.addresses.items()))

    def __exit__(self, *exc) -> None:
        """Remove the cables (deleting one end deletes both, even while a process still holds the namespace of
        the other, which deleting the namespace would not), the namespaces and the bridge."""
        for name, namespace in self.namespaces.items():
            subprocess.run(["ip", "link", "del", self.links[name]], capture_output=True)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def left_behind(self) -> list[str]:
        """The links, bridge and namespaces of these hosts still on the machine (none after leaving)."""
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
        names += [line.split()[0] for line in namespaces.splitlines() if line.strip()]
        return [name for name in names if name.startswith((self.prefix, self.bridge))]

    def address(self, name: str) -> str:
        return self.addresses[name]

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``name``: in its namespace, under its host name (the same process id: exec all along)."""
        return ["ip", "netns", "exec", self.namespaces[name], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', name, *argv]

    def cut(self, name: str) -> None:
        """Pull host ``name``'s cable: what it sends and what is sent to it is dropped, nothing is reset."""
        ip("link", "set", self.links[name], "down")

    def reconnect(self, name: str) -> None:
        ip("link", "set", self.links[name], "up")


class HostCluster(LocalCluster):
    """A LocalCluster whose coordinator and services each run on a host of ``hosts`` (``placement``: a service's
    name, as LocalCluster names them, to its host), bound to that host's address, with that host's certificate
    and key from ``certs`` (``coordctl certs``' folder: ``ca.pem``, ``<host>.pem``, ``<host>-key.pem``)."""

    def __init__(self, state_dir: Path, hosts: Hosts, certs: Path, placement: dict[str, str],
                 services: tuple[ServiceSpec, ...]):
        super().__init__(state_dir, services)
        self.hosts, self.certs, self.placement = hosts, certs, placement

    def coordinator_host(self) -> str:
        return self.hosts.address(self.placement["coordinator"])

    def command(self, name: str, kind: str, settings: tuple[str, ...], *, ranks: int) -> list[str]:
        host = self.placement[name]
        tls = [f"MESHRL_TLS_CERT={self.certs / f'{host}.pem'}", f"MESHRL_TLS_KEY={self.certs / f'{host}-key.pem'}",
               f"MESHRL_TLS_CA={self.certs / 'ca.pem'}"]
        return self.hosts.command(host, ["env", *tls, *super().command(name, kind, settings, ranks=ranks),
                                         f"host={self.hosts.address(host)}"])
