"""A real Slurm on this machine for the tests: munged, one slurmctld and four ``slurmd -N nodeX``.

Everything lives in a temporary directory: the generated ``slurm.conf`` (distinct ports,
``NodeAddr=127.0.0.1``, ``SlurmdParameters=config_overrides`` so four one-CPU nodes with a fake
GPU each fit on any host), ``gres.conf``, ``topology.conf`` (two switches of two nodes), munge's
key, socket, log and seed, the daemons' state and logs. Two partitions: ``normal`` (PriorityTier
10, never preempted) and ``scavenger`` (PriorityTier 1, ``PreemptMode=REQUEUE`` with a
``GraceTime``), under ``PreemptType=preempt/partition_prio``: a job in ``normal`` that needs a
node preempts a scavenger job there (SIGTERM, the grace time, then the job is requeued).

``ProctrackType=proctrack/pgid``: Slurm signals the process group of each step, so the workers
a ``maitre agent`` starts in their own sessions hear nothing from Slurm; the agent drains them.

The daemons run as root (Debian's packages; ``apt-get install slurm-wlm munge``). Where that is
not possible the tests skip, naming why; under CI (``CI=true``) they fail instead. Every daemon
is stopped by its pid afterwards, and the test checks that none is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import free_ports

NODES = ("node1", "node2", "node3", "node4")
SWITCHES = {"sw1": ("node1", "node2"), "sw2": ("node3", "node4")}
GRACE_S = 15
"""The scavenger partition's GraceTime: SIGTERM, then this long to leave, then SIGKILL."""
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
ACCOUNTING = ("mariadb-install-db", "mariadbd", "slurmdbd", "sacctmgr", "sacct")
"""What a cluster with accounting needs beyond those (``apt-get install slurmdbd mariadb-server``)."""
ACCOUNT, QOS = "research", "elastic"
"""The account and QOS the accounting cluster has (root's association may use both)."""


def missing(accounting: bool = False) -> str | None:
    """Why a Slurm cluster (with accounting: slurmdbd on a MariaDB) cannot be started here."""
    absent = [d for d in DAEMONS + (ACCOUNTING if accounting else ()) if shutil.which(d) is None]
    if absent:
        return (
            f"Slurm is not installed ({', '.join(absent)} missing): apt-get install "
            f"slurm-wlm munge{' slurmdbd mariadb-server' if accounting else ''}, as root"
        )
    if os.geteuid() != 0:
        return "the test Slurm cluster's daemons run as root; this is not root"
    return None


def require(accounting: bool = False) -> None:
    """Skip (or, under CI, fail) when no Slurm cluster can be started here."""
    why = missing(accounting)
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the Slurm tests: {why}")
    pytest.skip(why)


@dataclass
class SlurmCluster:
    """A running test cluster; ``env`` points Slurm's commands at it (``SLURM_CONF``)."""

    root: Path
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", "-p", "normal")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def jobs(self) -> list[dict[str, str]]:
        """Every job Slurm still knows, as {id, name, partition, state, reason}."""
        out = self.run("squeue", "-h", "-o", "%i|%j|%P|%T|%r|%N")
        keys = ("id", "name", "partition", "state", "reason", "nodes")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                last = self.states()
            except (RuntimeError, subprocess.TimeoutExpired):
                last = {}
            if sorted(last) == list(NODES) and all(s == "idle" for s in last.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm's nodes are not idle after {timeout_s:.0f} s: {last}; logs in {self.root}")

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def ours(self) -> list[int]:
        """Every live process started with this cluster's ``SLURM_CONF`` in its environment
        (the daemons' children: slurmstepd, the jobs, their agents and workers)."""
        needle = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0") and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
        return found

    def stop(self) -> None:
        """Cancel every job and wait for them to end, then stop the daemons by pid (slurmd,
        slurmctld, any slurmstepd left, munged last)."""
        if "slurmctld" in self.pids:
            self.run("scancel", "-u", "root", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if not self.jobs():
                        break
                except (RuntimeError, subprocess.TimeoutExpired):
                    break
                time.sleep(0.5)
        order = [n for n in self.pids if n.startswith("slurmd-")] + ["slurmctld", "slurmdbd", "mariadbd"]
        for name in order:
            pid = self.pids.pop(name, None)
            if pid is not None:
                _kill_and_wait(pid)
        for pid in self.ours():  # a step whose slurmd went first
            if pid != self.pids.get("munged"):
                _kill_and_wait(pid, grace_s=5)
        pid = self.pids.pop("munged", None)
        if pid is not None:
            _kill_and_wait(pid)


def _kill_and_wait(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _read_pid(path: Path, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no pid file {path} after {timeout_s:.0f} s")


def write_config(root: Path, accounting: bool = False) -> Path:
    """The cluster's configuration files in ``root``; returns the path of ``slurm.conf``. With
    ``accounting``, ``slurmdbd.conf`` too (its MariaDB on a port of its own, in ``root/db``)."""
    ctld_port, dbd_port, db_port, *node_ports = free_ports(3 + len(NODES))
    for d in ("munge", "log", "state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    nodes = "\n".join(
        f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={p} CPUs=1 "
        f"RealMemory=500 Gres=gpu:1 Feature=rack{1 + i // 2}"
        for i, (n, p) in enumerate(zip(NODES, node_ports))
    )
    if accounting:
        accounting_lines = (
            f"AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=localhost\nAccountingStoragePort={dbd_port}\n"
            # (with munge, the socket slurmdbd's clients sign with)
            f"AccountingStoragePass={root}/munge/munge.socket\n"
            "AccountingStorageEnforce=associations,qos\n"
            "JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=5"
        )
        dbd = root / "slurmdbd.conf"
        dbd.write_text(f"""\
DbdHost=localhost
DbdPort={dbd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
LogFile={root}/log/slurmdbd.log
PidFile={root}/slurmdbd.pid
""")
        dbd.chmod(0o600)  # (slurmdbd refuses a config others may read)
        (root / "db.port").write_text(str(db_port))
    else:
        accounting_lines = "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none"
    (root / "slurm.conf").write_text(f"""\
ClusterName=maitretest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
GresTypes=gpu
TopologyPlugin=topology/tree
ReturnToService=2
{accounting_lines}
JobCompType=jobcomp/none
MinJobAge=300
KillWait=5
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PartitionName=normal Nodes=ALL Default=YES PriorityTier=10 PreemptMode=OFF State=UP
PartitionName=scavenger Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S} State=UP
""")
    (root / "gres.conf").write_text(
        "AutoDetect=off\n" + "".join(f"NodeName={n} Name=gpu Count=1 File=/dev/null\n" for n in NODES)
    )
    (root / "topology.conf").write_text(
        "".join(f"SwitchName={s} Nodes={','.join(ns)}\n" for s, ns in SWITCHES.items())
        + f"SwitchName=top Switches={','.join(SWITCHES)}\n"
    )
    return root / "slurm.conf"


def _start_accounting(cluster: SlurmCluster) -> None:
    """A MariaDB of its own (``root/db``, no grant tables: only this host's root reaches its
    port), slurmdbd on it, and the cluster, account, QOS and root's association in it."""
    root = cluster.root
    db = root / "db"
    subprocess.run(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={db}",
            "--user=root",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    port = (root / "db.port").read_text()
    subprocess.Popen(
        [
            "mariadbd",
            "--no-defaults",
            f"--datadir={db}",
            "--user=root",
            "--bind-address=127.0.0.1",
            f"--port={port}",
            f"--socket={root}/db.sock",
            f"--pid-file={root}/mariadb.pid",
            "--skip-grant-tables",
            "--innodb-buffer-pool-size=32M",
            f"--log-error={root}/log/mariadb.log",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cluster.pids["mariadbd"] = _read_pid(root / "mariadb.pid", 60)
    subprocess.run(["slurmdbd"], check=True, capture_output=True, timeout=30, env=cluster.env)
    cluster.pids["slurmdbd"] = _read_pid(root / "slurmdbd.pid")
    deadline = time.monotonic() + 60
    while True:  # slurmdbd makes its tables first
        done = subprocess.run(
            ["sacctmgr", "-i", "add", "cluster", "maitretest"],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0 or "already exists" in done.stdout + done.stderr:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"slurmdbd does not answer: {done.stderr or done.stdout}")
        time.sleep(0.5)
    for cmd in (
        ["add", "qos", QOS],
        ["add", "account", ACCOUNT, "cluster=maitretest"],
        ["add", "user", "root", f"account={ACCOUNT}", "cluster=maitretest"],
        ["modify", "user", "root", "set", f"qos+={QOS}"],
    ):
        cluster.run("sacctmgr", "-i", *cmd)


def start(root: Path, accounting: bool = False) -> SlurmCluster:
    """Start munged, slurmctld and the four slurmd in ``root`` (with ``accounting``, a MariaDB
    and slurmdbd first); wait until all are idle."""
    conf = write_config(root, accounting)
    cluster = SlurmCluster(root=root, conf=conf)
    m = root / "munge"
    try:
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={m}/munge.key",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            check=True,
            capture_output=True,
            timeout=20,
            env=cluster.env,
        )
        cluster.pids["munged"] = _read_pid(m / "munged.pid")
        if accounting:
            _start_accounting(cluster)
        subprocess.run(
            ["slurmctld", "-c", "-i"], check=True, capture_output=True, timeout=30, env=cluster.env
        )  # -c: a clean start, no state from another run
        cluster.pids["slurmctld"] = _read_pid(root / "slurmctld.pid")
        for n in NODES:
            (root / "spool" / n).mkdir(parents=True, exist_ok=True)
            subprocess.run(["slurmd", "-N", n], check=True, capture_output=True, timeout=30, env=cluster.env)
            cluster.pids[f"slurmd-{n}"] = _read_pid(root / f"slurmd-{n}.pid")
        cluster.wait_idle()
    except BaseException as exc:
        cluster.stop()
        if isinstance(exc, subprocess.CalledProcessError):
            raise RuntimeError(
                f"{exc.cmd[0]} did not start: {exc.stderr or exc.stdout}; logs in {root / 'log'}"
            ) from exc
        raise
    return cluster


def told(log: Path, state: Path) -> str:
    """What ``maitre up`` and its replica jobs (their agents and workers) printed last: the
    detail of a story's timeout, where the coordinator's view alone cannot say why a worker
    ended."""
    parts = [f"--- {log.name}\n" + (log.read_text()[-3000:] if log.exists() else "")]
    for replica in sorted((state / "slurm").glob("*.log")):
        parts.append(f"--- {replica.name}\n" + replica.read_text(errors="replace")[-2500:])
    return "\n".join(parts)


@contextlib.contextmanager
def maitre_up(cluster, tmp_path: Path, *flags: str):
    """``maitre up --slurm FLAGS`` on the test Slurm, its state in ``tmp_path/state`` and its
    output in ``tmp_path/up.log``: yields (a client, the state directory, the log). Afterwards
    it is stopped (SIGINT) and every process it or its replica jobs started is killed; one left
    is a failure."""
    from conftest import ROOT, TAG_VAR, _tagged_pids, announced_address, kill_tagged, wait_for
    from maitre.wire import Client

    tag = os.urandom(8).hex()
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update(
        {
            TAG_VAR: tag,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        }
    )
    state, log = tmp_path / "state", tmp_path / "up.log"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maitre.cli",
            "up",
            "--slurm",
            "--state-dir",
            str(state),
            "--queue",
            "q",
            "--slots-per-node",
            "1",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        address = wait_for(lambda: announced_address(log), 60, "the coordinator", log)
        yield Client(address, timeout_s=5.0, token=(state / "token").read_text().strip()), state, log
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            up.kill()
        time.sleep(1.0)  # the last agents' exits after their replica jobs were cancelled
        named = {pid: _command_line(pid) for pid in _tagged_pids(tag)}
        left = kill_tagged(tag)  # never leak one; the assertion below says if any was
    assert not left, "processes left behind:\n" + "\n".join(f"{pid}: {named.get(pid, '?')}" for pid in left)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


@contextlib.contextmanager
def running(root: Path, accounting: bool = False):
    """A started cluster in ``root`` (skipped, or failed under CI, where none can be), stopped
    afterwards: a daemon or a process of it left running is a failure."""
    require(accounting)
    cluster = start(root, accounting)
    try:
        yield cluster
    finally:
        pids = list(cluster.pids.values())
        cluster.stop()
        assert not leftovers(pids), "Slurm daemons left running"
        assert not cluster.ours(), f"processes of the test Slurm left: {cluster.ours()}"


def leftovers(pids: list[int]) -> list[int]:
    return [p for p in pids if _alive(p)]
