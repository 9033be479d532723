"""A real Slurm cluster on one machine: slurmctld on one host of ``Hosts`` and one slurmd on each other (network
namespaces on a bridge, tests/integration/hosts.py), with munge, from Debian's packages (slurmctld, slurmd, slurm-client, munge).

- munged runs in the root namespace with a key made here and its socket in this cluster's folder; every daemon
  and command reaches it there (a socket in the file system is reached from every network namespace).
- slurmctld runs on a host of its own (``controller``, a network namespace like the nodes', under that host
  name: slurmctld insists that its host name is the SlurmctldHost), on Slurm's usual port: no other process
  listens in that namespace, so the port is free by construction, not picked free here and bound later there.
- each other host runs one slurmd, under the host's name and on its address (``NodeAddr``), with its own spool,
  pid and log files (``%n`` in slurm.conf); the job steps it starts inherit the host's network, name and
  ``/etc/hosts``.
- no cgroups (a container, PID 1 is not systemd): processes are tracked by parent (proctrack/linuxproc), tasks
  are not bound (task/none); everything runs as root (SlurmUser=root).

Each node declares the CPUs ``slurmd -C`` finds on this machine: they all share them. ``SLURM_CONF`` in
``env`` points sbatch, squeue, scancel and the jobs' srun at this cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from tests.integration import hosts as hosts_module
from tests.integration.hosts import Hosts

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "squeue", "scancel",
           "scontrol", "sinfo")
SBIN = ("/usr/sbin", "/sbin")
FINAL_JOB_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                    "BOOT_FAIL", "DEADLINE")


def which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be made here, or None when it can."""
    missing = [tool for tool in DAEMONS if which(tool) is None]
    if missing:
        return (f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge; .ci/run installs them where "
                "apt-get works)")
    return hosts_module.unavailable()


class SlurmCluster:
    """slurmctld on host ``controller`` of ``hosts`` plus a slurmd on each of the others (``nodes``), one
    partition of them all; a context manager that stops every daemon (and cancels what jobs are left) on the
    way out."""

    def __init__(self, hosts: Hosts, controller: str, folder: Path, kill_wait_s: int = 30):
        self.hosts, self.folder, self.kill_wait_s = hosts, folder, kill_wait_s
        self.controller = controller
        self.nodes = [name for name in hosts.names if name != controller]
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "socket"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(parents=True, mode=0o700)
        subprocess.run([which("mungekey"), "--create", f"--keyfile={munge / 'key'}"], check=True)
        self._spawn("munged", [which("munged"), "--foreground", "--force", f"--key-file={munge / 'key'}",
                               f"--socket={self.munge_socket}", f"--pid-file={munge / 'pid'}",
                               f"--seed-file={munge / 'seed'}", f"--log-file={munge / 'log'}"])
        self._wait(lambda: self.munge_socket.exists(), 20, "munged made no socket")
        self.conf.write_text(self.slurm_conf())
        (self.folder / "state").mkdir()
        for name in self.nodes:
            (self.folder / "spool" / name).mkdir(parents=True)
        self._spawn("slurmctld", self.node_command(self.controller, [which("slurmctld"), "-D", "-i", "-f",
                                                                     str(self.conf)]))
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", self.node_command(name, [which("slurmd"), "-D", "-N", name, "-f",
                                                                   str(self.conf)]))
        self._wait(self._all_idle, 60, "the nodes did not all come up idle")

    def node_command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` on host ``name`` as ``Hosts.command`` runs it (its network, host name and /etc/hosts), but
        keeping this machine's /sys: ``ip netns exec`` mounts a fresh one, without the cgroup file systems under
        /sys/fs/cgroup, and slurmd refuses to start without them (it sets up its cgroup plugin whatever the
        proctrack and task plugins)."""
        namespace = self.hosts.namespaces[name]
        return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "sh", "-c",
                'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
                str(hosts_module.NETNS_ETC / namespace / "hosts"), name, *argv]

    def slurm_conf(self) -> str:
        found = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        node = " ".join(word for word in found.split()
                        if word.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                                  "ThreadsPerCore"))
        tag = self.hosts.bridge.removeprefix("mrlbr")
        folder = self.folder
        nodes = "".join(f"NodeName={name} NodeAddr={self.hosts.address(name)} {node} RealMemory=1000 State=UNKNOWN\n"
                        for name in self.nodes)
        return f"""\
ClusterName=mrl{tag}
SlurmctldHost={self.controller}({self.hosts.address(self.controller)})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
KillWait={self.kill_wait_s}
InactiveLimit=0
MinJobAge=600
{nodes}PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.folder / f"{name}.out").open("ab")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env)

    def _wait(self, ready, timeout_s: float, failure: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {process.returncode}: {self.tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{failure} within {timeout_s} s: {self.tail('slurmctld')}")
            time.sleep(0.5)

    def tail(self, name: str) -> str:
        """The end of daemon ``name``'s output and, for slurmctld and slurmd, log."""
        logs = [self.folder / f"{name}.out", self.folder / f"{name}.log"]
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs if log.exists())

    def _all_idle(self) -> bool:
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command (sbatch, squeue, scancel, scontrol, ...) against this cluster."""
        done = subprocess.run([which(tool), *args], capture_output=True, text=True, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)}: {done.stderr.strip()}")
        return done

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit a job (``args``: sbatch's options, the script and its arguments) with this process's environment
        and ``env``; its job id."""
        done = subprocess.run([which("sbatch"), "--parsable", *args], capture_output=True, text=True,
                              env={**self.env, **(env or {})})
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of the job (JobState, NodeList, ExitCode, ...)."""
        shown = self.run("scontrol", "--oneliner", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Until the job has ended; its fields then."""
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["JobState"] not in FINAL_JOB_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout_s} s")
            time.sleep(0.2)
        return job

    def __exit__(self, *exc) -> None:
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            jobs = self.run("squeue", "--noheader", "--format=%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + self.kill_wait_s + 30
                while (self.run("squeue", "--noheader", "--format=%i", check=False).stdout.split()
                       and time.monotonic() < deadline):
                    time.sleep(1)
        for name in [n for n in self.processes if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
