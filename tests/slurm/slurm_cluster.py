"""A real single-node SLURM cluster with accounting, started for the tests and stopped after them.

Debian 12's packages (SLURM 22.05): munge, MariaDB, slurmdbd, slurmctld, slurmd, each a foreground process of
this one (so the tests stop exactly the daemons they started), all their state, sockets, logs and configuration
under one folder, on ports picked free at start (two pytest workers can each run a cluster of their own). The
configuration below is the one seen to work on these machines (docs/slurm.md, "A cluster for the tests").

``start(root)`` installs the packages when missing (root and apt-get only), starts the daemons, registers the
cluster with accounting, and waits until ``sinfo`` shows the node idle and ``sacct`` answers. Anything in the way
raises ``Unavailable`` with the precise reason, which the fixture turns into a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: Debian packages of a single-node cluster with accounting.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")

#: The programs ``start`` runs, all from ``PACKAGES``.
PROGRAMS = ("munged", "mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "slurmctld", "slurmd", "sacctmgr")

#: The partition the node is in (the cluster's default one). Its node has no GPUs (no gres).
PARTITION = "cpu"

#: slurm.conf. Every daemon and client finds this cluster's munged through ``AuthInfo`` (and the accounting
#: connection through ``AccountingStoragePass``). Process tracking by /proc and no task plugin: no cgroups needed
#: in a container. SIGUSR2 before a time limit is sent by slurmctld's periodic check (every 30 s); ``KillWait`` is
#: the grace after SIGTERM before SIGKILL.
SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CryptoType=crypto/munge
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/slurmd
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={root}/munge/munge.sock
KillWait=15
MinJobAge=300
NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""

#: slurmdbd.conf: mode 600, next to slurm.conf (slurmdbd finds it through ``SLURM_CONF``'s folder; it ignores -f).
SLURMDBD_CONF = """\
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
LogFile={root}/log/slurmdbd.log
PidFile={root}/slurmdbd.pid
"""


class Unavailable(Exception):
    """The cluster cannot run here; the message says why (one line), for ``pytest.skip``."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_packages(timeout_s: float = 600) -> None:
    """``apt-get install`` ``PACKAGES`` when one of ``PROGRAMS`` is missing. Raises ``Unavailable`` when not root,
    without apt-get, or when the install fails (its last line of output said)."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing)} missing) and this is not root to apt-get it")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{' '.join(cmd[:2])} did not finish within {timeout_s:.0f} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            raise Unavailable(f"{' '.join(cmd[:2])} {' '.join(PACKAGES)} failed: {last}")


@dataclass
class Cluster:
    """A running cluster: ``root`` (its folder), ``conf`` (slurm.conf: ``SLURM_CONF`` for every client command),
    ``partition``, ``node`` (its one node's name), ``cpus`` (the node's CPUs), ``setup_s`` (seconds ``start`` took,
    set by the fixture), ``procs`` (the daemons, by name)."""

    root: Path
    conf: Path
    partition: str
    node: str
    cpus: int
    setup_s: float = 0.0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` naming this cluster's configuration."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout_s: float = 30, check: bool = True) -> str:
        """Run a client command (``sinfo``, ``squeue``, ``scancel``, ...) against this cluster; its stdout.
        Raises ``RuntimeError`` naming the command and its stderr when it fails and ``check``."""
        r = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def next_job_id(self) -> int:
        """The id slurmctld gives the next job submitted (``scontrol show config``'s ``NEXT_JOB_ID``): it moves
        with every submission, including one that ended before anyone looked at ``squeue``."""
        for line in self.run("scontrol", "show", "config").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "NEXT_JOB_ID":
                return int(value)
        raise RuntimeError("scontrol show config has no NEXT_JOB_ID")

    def log(self, name: str) -> str:
        """The tail of a daemon's log (``slurmctld``, ``slurmd``, ``slurmdbd``, ``munged``, ``mariadbd``)."""
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else f"(no {path})"

    def _daemon(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon holds it)
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def _wait(self, name: str, what: str, ok, timeout_s: float) -> None:
        """Poll ``ok()`` until true; ``Unavailable`` naming the daemon (and its log) after ``timeout_s`` or when
        a daemon this cluster started has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ok():
                    return
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                pass
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0]} exited {self.procs[dead[0]].returncode}" if dead else f"not within {timeout_s:.0f} s"
                tail = (self.log(dead[0] if dead else name).strip().splitlines() or ["(empty log)"])[-1]
                raise Unavailable(f"{name} did not start ({what}: {why}); its log ends: {tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel this cluster's jobs (their processes end with them), then stop the daemons it started (SIGTERM,
        then SIGKILL after 10 s), newest first."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--partition", self.partition, check=False)
                deadline = time.monotonic() + 30
                while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        self.procs.clear()


def start(root: Path, timeout_s: float = 60) -> Cluster:
    """Install (``install_packages``) and start a cluster under ``root`` (made if missing); each daemon gets
    ``timeout_s`` to answer. Returns the running ``Cluster`` (node idle in ``sinfo``, ``sacct`` answering).
    Raises ``Unavailable`` (the daemons started so far stopped) when it cannot run here."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise Unavailable("a SLURM cluster for the tests needs root (its daemons run as root)")
    install_packages()
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "log", "ctld", "slurmd", "db"):
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    host = socket.gethostname().split(".")[0]
    suffix = uuid.uuid4().hex[:6]
    values = {
        "root": root,
        "host": host,
        "cluster": f"lab{suffix}",
        "node": f"n{suffix}",
        "partition": PARTITION,
        "cpus": os.cpu_count() or 1,
        "ctld_port": free_port(),
        "slurmd_port": free_port(),
        "dbd_port": free_port(),
        "db_port": free_port(),
    }
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(**values))
    dbd = root / "slurmdbd.conf"
    dbd.write_text(SLURMDBD_CONF.format(**values))
    os.chmod(dbd, 0o600)
    c = Cluster(root, conf, PARTITION, values["node"], values["cpus"])
    try:
        _start(c, values, timeout_s)
    except BaseException:
        c.stop()
        raise
    return c


def _start(c: Cluster, v: dict, timeout_s: float) -> None:
    root = c.root
    sock = root / "munge" / "munge.sock"
    c._daemon(
        "munged",
        [
            "munged", "--foreground", "--force", f"--socket={sock}", f"--pid-file={root}/munge/munged.pid",
            f"--seed-file={root}/munge/munged.seed", f"--log-file={root}/log/munged.log", "--num-threads=4",
        ],
    )  # fmt: skip
    c._wait("munged", f"socket {sock}", sock.exists, timeout_s)

    r = subprocess.run(
        ["mariadb-install-db", "--user=root", f"--datadir={root}/db", "--auth-root-authentication-method=normal"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise Unavailable(f"mariadb-install-db failed: {last}")
    db_sock = root / "mysql.sock"
    c._daemon(
        "mariadbd",
        [
            "mariadbd", "--user=root", f"--datadir={root}/db", f"--socket={db_sock}", "--bind-address=127.0.0.1",
            f"--port={v['db_port']}", f"--log-error={root}/log/mariadbd.log", f"--pid-file={root}/mariadbd.pid",
            "--skip-log-bin", "--innodb-buffer-pool-size=32M",
        ],
    )  # fmt: skip
    mariadb = ["mariadb", "-S", str(db_sock), "-u", "root", "-e"]
    c._wait("mariadbd", "answering on its socket", lambda: c.run(*mariadb, "select 1", timeout_s=5) != "", timeout_s)
    c.run(*mariadb, "create database if not exists slurm_acct_db")

    c._daemon("slurmdbd", ["slurmdbd", "-D"])
    c._wait("slurmdbd", "sacctmgr list cluster", lambda: c.run("sacctmgr", "-n", "list", "cluster") or True, timeout_s)
    c.run("sacctmgr", "-i", "add", "cluster", v["cluster"])

    c._daemon("slurmctld", ["slurmctld", "-D", "-i"])
    c._wait("slurmctld", "sinfo", lambda: c.run("sinfo", "-h", timeout_s=5) is not None, timeout_s)
    c._daemon("slurmd", ["slurmd", "-D", "-N", v["node"]])

    def idle() -> bool:
        return c.run("sinfo", "-h", "-N", "-o", "%N %t", timeout_s=5).split() == [v["node"], "idle"]

    c._wait("slurmd", f"node {v['node']} idle in sinfo", idle, timeout_s)
    c._wait("slurmctld", "sacct answering", lambda: c.run("sacct", "-n", "-a", timeout_s=5) is not None, timeout_s)
