"""The Slurm engine of ``maitre up --slurm``: keeps each maitre job's replica jobs in line.

Every ``interval_s`` it reads the coordinator's jobs and nodes (its HTTP API) and Slurm's
replica jobs (``squeue``) and idle scavenger nodes (``sinfo``), then :func:`plan` decides by the
rule Kubernetes' replica pods follow too (:mod:`maitre.engines.units`): each job's first
``minReplicas`` replica jobs in its partition (Slurm queues them: the gang waits there, not in
maitre); its surplus, up to ``maxReplicas``, in the scavenger partition, one replica job per idle
node Slurm reports there (never while one of them is still pending): growing is Slurm seeing
idle capacity, and the coordinator grows the job onto each agent that joins; scaled down, the
pending ones go first, then those whose node the coordinator has already left at a step
boundary; a finished job's replica jobs are cancelled.

A preempted replica job needs little from here: its agent drains on SIGTERM, Slurm requeues
the job and starts it again when it can, and its agent joins again. Slurm holds a requeued
batch job for two minutes (pending, reason ``BeginTime``); the engine releases it
(``scontrol update JobId=N StartTime=now``) so that it runs as soon as Slurm has a node. A job left with no replica
is suspended by the coordinator (with a checkpoint) and resumes from it when its minimum is back.

Errors: a Slurm command that fails is one line (:class:`SlurmError`: the command and Slurm's
message) in the log and in ``errors``; the maitre job stays pending; nothing is lost, and the
next pass tries again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from maitre import protocol
from maitre.engines.units import Unit
from maitre.engines.units import plan as shared_plan
from maitre.engines.slurm import inventory, replicas
from maitre.engines.slurm.commands import Slurm, SlurmError
from maitre.engines.slurm.replicas import AgentCommand, ReplicaJob
from maitre.wire import ApiError, Client, CoordinatorUnreachable

log = logging.getLogger("maitre.slurm")

FINISHED = {"COMPLETED", "FAILED", "CANCELLED"}


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    partition: str = "normal"
    """Where each job's minimum runs (never preempted by maitre's surplus)."""
    scavenger: str | None = None
    """The preemptible partition for the surplus (None: no elastic surplus on Slurm)."""
    qos: str | None = None
    account: str | None = None
    gpus_per_replica: int = 0
    """``--gres=gpu:N`` on each replica job (0: none asked; nodes are taken whole anyway)."""
    nproc_per_node: int = 1
    interval_s: float = 2.0
    log_dir: str = "."

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"the Slurm engine's interval must be positive, got {self.interval_s}")
        if self.scavenger is not None and self.scavenger == self.partition:
            raise ValueError(f"--slurm-scavenger {self.scavenger} is the job partition itself")


@dataclass(frozen=True, slots=True)
class Submit:
    job: str
    index: int
    scavenger: bool


@dataclass(frozen=True, slots=True)
class Plan:
    submit: list[Submit] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    """Requeued replica jobs Slurm holds back (``BeginTime``): to run as soon as there is room."""


def plan(
    jobs: list[dict[str, Any]],
    nodes: dict[str, list[str]],
    have: list[ReplicaJob],
    idle_scavenger: int,
    *,
    scavenger: bool = True,
) -> Plan:
    """What to submit and cancel (:func:`maitre.engines.units.plan`, one surplus replica
    job per idle scavenger node), and which requeued replica jobs to release. ``jobs``: the
    coordinator's job summaries; ``nodes``: each maitre node's workers; ``have``: the replica
    jobs Slurm has; ``idle_scavenger``: idle nodes in the scavenger partition."""
    units = [Unit(r.slurm_id, r.job, r.index, r.state == "PENDING", r.node) for r in have]
    changes = shared_plan(jobs, nodes, units, surplus=idle_scavenger if scavenger else 0)
    live = {j["job_id"] for j in jobs if j["state"] not in FINISHED}
    return Plan(
        submit=[Submit(a.job, a.index, a.surplus) for a in changes.add],
        cancel=changes.remove,
        release=[r.slurm_id for r in have if r.job in live and r.state == "PENDING" and r.reason == "BeginTime"],
    )


def check(slurm: Slurm, cfg: SlurmConfig) -> inventory.Inventory:
    """Slurm answers and has the partitions: the start-up check (:class:`SlurmError`)."""
    inv = inventory.read(slurm)
    inv.partition(cfg.partition)
    if cfg.scavenger is not None:
        inv.partition(cfg.scavenger)
    return inv


class SlurmEngine:
    """The loop (a thread of ``maitre up --slurm``) that applies :func:`plan` every interval."""

    def __init__(
        self,
        client: Client,
        cfg: SlurmConfig,
        agent: AgentCommand,
        slurm: Slurm | None = None,
        inv: inventory.Inventory | None = None,
    ) -> None:
        self.client = client
        self.cfg = cfg
        self.agent = agent
        self.slurm = slurm or Slurm()
        self.errors: list[str] = []
        """Every Slurm failure's line, in order (each is also logged once)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.inventory = inv or check(self.slurm, cfg)

    def _grace_s(self, partition: str) -> float:
        """The notice a replica job's agent gets on SIGTERM: the partition's ``GraceTime``
        where it has one (preemption), else ``KillWait`` (``scancel``), else 30 s."""
        p = self.inventory.partitions.get(partition)
        if p is not None and p.grace_s > 0:
            return p.grace_s
        return self.inventory.kill_wait_s or 30.0

    def _idle(self, partition: str) -> int:
        out = self.slurm("sinfo", "-h", "-N", "-p", partition, "-t", "idle", "-o", "%N")
        return len({ln.strip() for ln in out.splitlines() if ln.strip()})

    def once(self) -> Plan:
        """One pass; raises :class:`SlurmError` or :class:`CoordinatorUnreachable`."""
        jobs = self.client.get(protocol.JOBS)["jobs"]
        nodes = {n["node"]: n["workers"] for n in self.client.get(protocol.NODES)["nodes"] if n["alive"]}
        have = replicas.listed(self.slurm)
        idle = self._idle(self.cfg.scavenger) if self.cfg.scavenger else 0
        todo = plan(jobs, nodes, have, idle, scavenger=self.cfg.scavenger is not None)
        for slurm_id in todo.cancel:
            log.info("scancel %s", slurm_id)
            replicas.cancel(self.slurm, slurm_id)
        for slurm_id in todo.release:
            self.slurm("scontrol", "update", f"JobId={slurm_id}", "StartTime=now")
        for s in todo.submit:
            part = self.cfg.scavenger if s.scavenger else self.cfg.partition
            assert part is not None
            sid = replicas.submit(
                self.slurm,
                s.job,
                s.index,
                partition=part,
                agent=self.agent,
                grace_s=self._grace_s(part),
                scavenger=s.scavenger,
                log_dir=self.cfg.log_dir,
                qos=self.cfg.qos,
                account=self.cfg.account,
                gpus=self.cfg.gpus_per_replica,
            )
            log.info("sbatch %s in %s: Slurm job %s", replicas.name(s.job, s.index), part, sid)
        return todo

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.once()
            except SlurmError as exc:
                if not self.errors or self.errors[-1] != str(exc):
                    log.error("maitre: %s (the job stays pending; retrying)", exc)
                self.errors.append(str(exc))
            except (CoordinatorUnreachable, ApiError) as exc:
                log.warning("the Slurm engine cannot reach the coordinator: %s", exc)
            self._stop.wait(self.cfg.interval_s)

    def start(self) -> "SlurmEngine":
        self._thread = threading.Thread(target=self._run, name="maitre-slurm", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (the replica jobs stay: a restarted ``maitre up`` finds them again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
