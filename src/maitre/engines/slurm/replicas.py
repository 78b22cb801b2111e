"""An elastic job's replicas as Slurm batch jobs, each running one node's ``maitre agent``.

A replica job is named ``maitre-<job>-<index>``: the first ``minReplicas`` indices run in the
job's own partition (and QOS, if given), the rest in the scavenger partition, where Slurm may
preempt them. Each is ``sbatch --requeue --exclusive -N1 --wrap "srun maitre agent --slurm
... && exec sleep infinity"``: the agent takes the node as a maitre node named after Slurm's,
and on Slurm's SIGTERM drains it (its workers leave at a step boundary) within the partition's
``GraceTime``. The ``sleep`` that follows keeps the job until Slurm ends it: a preempted job is
then requeued (``PreemptMode=REQUEUE``) rather than completed, and its agent joins again when
Slurm starts it again; a cancelled one is gone. An agent that fails (a wrong token, say) ends
its job at once. The agent's node takes the job's own workers only (``--label
reserved_for=<job>``): Slurm's accounting (``sacct``) of each replica job, under the job's name,
partition, QOS and account, is that job's usage and no other's.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass

from maitre.engines.slurm.commands import Slurm

PREFIX = "maitre-"
_NAME = re.compile(r"maitre-(?P<job>[a-z0-9-]+)-(?P<index>\d+)")
ACTIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "COMPLETING",
}


def name(job: str, index: int) -> str:
    return f"{PREFIX}{job}-{index}"


def parse_name(text: str) -> tuple[str, int] | None:
    m = _NAME.fullmatch(text)
    return (m.group("job"), int(m.group("index"))) if m else None


@dataclass(frozen=True, slots=True)
class ReplicaJob:
    slurm_id: str
    job: str
    index: int
    partition: str
    state: str
    """Slurm's state (``PENDING``, ``RUNNING``, ...)."""
    node: str
    """The node it runs on ('' while pending)."""
    reason: str


@dataclass(frozen=True, slots=True)
class AgentCommand:
    """How a replica job's agent reaches the coordinator."""

    coordinator: str
    token_file: str
    nproc_per_node: int = 1
    tls_ca: str | None = None
    python: str = sys.executable

    def line(self, job: str, grace_s: float, scavenger: bool) -> str:
        """The agent of one of ``job``'s replica jobs: its node takes that job's workers only
        (``reserved_for``), so Slurm's record of the replica job is the job's own usage."""
        cmd = [
            self.python,
            "-m",
            "maitre.cli",
            "agent",
            "--slurm",
            "--coordinator",
            self.coordinator,
            "--token-file",
            self.token_file,
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--sigterm-notice",
            f"{max(grace_s, 1.0):g}",
            "--label",
            f"reserved_for={job}",
        ]
        if self.tls_ca:
            cmd += ["--tls-ca", self.tls_ca]
        if scavenger:
            cmd += ["--label", "capacity_type=spot"]
        return shlex.join(cmd)


def submit(
    slurm: Slurm,
    job: str,
    index: int,
    *,
    partition: str,
    agent: AgentCommand,
    grace_s: float,
    scavenger: bool,
    log_dir: str,
    qos: str | None = None,
    account: str | None = None,
    gpus: int = 0,
) -> str:
    """``sbatch`` one replica job; its Slurm job id (:class:`SlurmError` if sbatch refuses)."""
    wrap = f"srun --kill-on-bad-exit=0 {agent.line(job, grace_s, scavenger)} && exec sleep infinity"
    cmd = [
        "sbatch",
        "--parsable",
        "--requeue",
        "--exclusive",
        "-N",
        "1",
        "-J",
        name(job, index),
        "-p",
        partition,
        "-o",
        f"{log_dir}/%x-%j.log",
        "--open-mode=append",
    ]
    if qos:
        cmd += ["--qos", qos]
    if account:
        cmd += ["--account", account]
    if gpus:
        cmd += [f"--gres=gpu:{gpus}"]
    out = slurm(*cmd, "--wrap", wrap)
    return out.strip().split(";")[0]


def listed(slurm: Slurm) -> list[ReplicaJob]:
    """Every replica job of this user that Slurm still has (``squeue --me``)."""
    out = slurm("squeue", "--me", "-h", "-o", "%i|%j|%P|%T|%N|%r")
    found = []
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) != 6:
            continue
        owner = parse_name(parts[1])
        if owner is None or parts[3] not in ACTIVE:
            continue
        found.append(ReplicaJob(parts[0], owner[0], owner[1], parts[2], parts[3], parts[4], parts[5]))
    return found


def cancel(slurm: Slurm, slurm_id: str) -> None:
    """``scancel`` a replica job: SIGTERM to its agent (which drains), then Slurm ends it."""
    slurm("scancel", slurm_id)
