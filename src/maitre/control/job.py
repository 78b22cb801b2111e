"""A managed job: its record, and the verbs that are the only writers of its lifecycle.

A job submitted to the coordinator is a :class:`ManagedJob`: its manifest, the scheduler's view
of it (:class:`~maitre.scheduling.model.Job`: state, bounds, placement), its current run's
membership and the earlier ones. Its *lifecycle* is what the store must have as soon as it
changes (:meth:`ManagedJob.record_key`): the placement (replicas per node the coordinator
granted), the bounds, the admission, suspension and end, the user's hold. This module is the
only one that writes them; everybody else (the cluster's pass, the drain, the repair, the
coordinator's user requests) calls a verb below (``tests/test_layering.py`` holds the code to
it). The job's state moves through :meth:`~maitre.scheduling.model.Job.move`, from here (admit,
cancel) and from its running membership (epochs, its end, a suspension), which also owns its
own ``target``.

Pure data and logic, no clock and no I/O: callers pass ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from maitre.control.membership import Membership
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Job
from maitre.scheduling.spec import JobManifest, manifest_record


@dataclass(slots=True)
class ManagedJob:
    """A submitted job: its manifest, the policy's view of it and its current incarnation."""

    manifest: JobManifest
    job: Job
    incarnation: int = 0
    """Admissions so far; each runs a fresh membership (a resume after a suspension is one)."""
    workers_started: int = 0
    """Worker ids taken by its runs so far (a new run's workers are numbered after them)."""
    suspended_run: int = 0
    """The last incarnation whose suspension the cluster acted on (freed its slots, logged)."""
    held: bool = False
    """Suspended by a user (``maitre suspend``): not admitted again until resumed."""
    generation: int = 0
    """How many earlier jobs had this name (each gets its own data ledger)."""
    suspend_deadline: float | None = None
    """When a suspension's grace period ends (its workers are killed then)."""
    admitted_at: float | None = None
    ended_at: float | None = None
    """When the cluster saw the job end (COMPLETED, FAILED or CANCELLED) and freed its slots."""
    productive_s: float = 0.0
    """Wall seconds the job spent in steps that committed (its effective training time)."""
    history: list[Membership] = field(default_factory=list)
    """Earlier incarnations (their workers' time still counts in the accounting)."""
    env: dict[str, str] = field(default_factory=dict)
    """Its workers' environment beyond the cluster's (given by the submitter in process, as
    ``maitre run`` gives its checkpoint settings and ledger; not part of the manifest)."""
    seen_trained: dict[str, float] = field(default_factory=dict)
    window: tuple[int, int, int, float] | None = None
    """(incarnation, epoch, step, time) where the current throughput sample began: the time
    that step was reached, NaN until the epoch's first step is."""
    last_waiting: str = ""

    @property
    def id(self) -> str:
        return self.job.id

    # -- runs --------------------------------------------------------------------------------------
    def admit(
        self, placement: dict[str, int], now: float, run: Callable[[], Membership], old: Membership | None
    ) -> Membership:
        """A new run (incarnation) on ``placement``: ``run`` makes its membership (for the
        incarnation this counts up to); ``old``, the run before, goes to the history."""
        self.incarnation += 1
        ms = run()
        ms.target = sum(placement.values())
        if old is not None:
            old.archive()
            self.history.append(old)
        self.job.move(JobState.ADMITTED)
        self.job.placement, self.job.last_resize_at = dict(placement), now
        if self.admitted_at is None:
            self.admitted_at = now
        self.window = None
        return ms

    def started(self, ms: Membership) -> None:
        """Its run started workers: their ids are taken."""
        self.workers_started = max(self.workers_started, ms.workers_added)

    def ended(self, now: float) -> None:
        """The run ended (completed, failed, or cancelled): its slots are free."""
        self.ended_at, self.job.placement = now, {}

    def cancel(self, ms: Membership | None, now: float) -> None:
        """Cancelled by request: a run is told to stop; a queued or suspended job ends here."""
        if self.job.state.ended:
            raise ValueError(f"job {self.id} is already {self.job.state.value}")
        if ms is not None and not ms.over:
            ms.cancel("cancelled by request", now)  # tells its workers to stop
        else:
            self.job.move(JobState.CANCELLED)
        self.ended(now)

    # -- suspension --------------------------------------------------------------------------------
    def suspending(self, deadline: float) -> None:
        """Its run was asked to checkpoint and stop, by ``deadline`` at the latest."""
        self.suspend_deadline = deadline

    def suspended(self) -> bool:
        """The run checkpointed and stopped: its slots are free. Returns whether this is news
        (each run's suspension is acted on once)."""
        if self.suspended_run == self.incarnation:
            return False
        self.suspended_run, self.job.placement, self.suspend_deadline = self.incarnation, {}, None
        return True

    def grace_expired(self, now: float) -> bool:
        """Whether a suspension's grace period ran out just now (once: the deadline is gone)."""
        if self.job.state != JobState.SUSPENDING or self.suspend_deadline is None or now <= self.suspend_deadline:
            return False
        self.suspend_deadline = None
        return True

    def hold(self, deadline: float | None) -> None:
        """Suspended by a user (until :meth:`release`); ``deadline``: its run's grace period's
        end, when it has a run to stop."""
        if deadline is not None:
            self.suspend_deadline = deadline
        self.held = True

    def release(self) -> None:
        self.held = False

    # -- placement and bounds ----------------------------------------------------------------------
    def resize(self, placement: dict[str, int], now: float) -> None:
        """The policy grew or shrank it (damped: the resize cool-down counts from ``now``)."""
        self.job.placement, self.job.last_resize_at = dict(placement), now

    def place(self, placement: dict[str, int]) -> None:
        """Its allocation is now ``placement`` (a drain gave a node up, a repair, a shrink to a
        new ceiling)."""
        self.job.placement = {n: r for n, r in placement.items() if r}

    def grow(self, where: dict[str, int]) -> None:
        """Replicas added on ``where`` (a repair outside the pass)."""
        for n, r in where.items():
            self.job.placement[n] = self.job.placement.get(n, 0) + r

    def give_up(self, node: str, replicas: int = 1) -> None:
        """``replicas`` of its allocation on ``node`` are given up (an eviction, a spare that
        took a lost worker's place elsewhere)."""
        left = self.job.placement.get(node, 0) - replicas
        if left > 0:
            self.job.placement[node] = left
        else:
            self.job.placement.pop(node, None)

    def lose_nodes(self, lost: list[str]) -> None:
        """Nodes lost (dead, drained, shrunk) take their allocation with them."""
        for node in lost:
            self.job.placement.pop(node, None)

    def retarget(self, ms: Membership) -> None:
        """Its live run aims at the allocation it has (within its bounds)."""
        if not ms.over:
            ms.target = max(ms.spec.min_workers, min(ms.spec.max_workers, self.job.replicas))

    def set_max(self, replicas: int, ms: Membership | None) -> None:
        """A new ceiling from a user (``maitre scale``): not damped by the resize cool-down; its
        live run (``ms``) may grow past its manifest's."""
        if self.job.state.ended:
            raise ValueError(f"job {self.id} is {self.job.state.value}")
        if not self.job.min_replicas <= replicas:
            raise ValueError(f"job {self.id}: {replicas} is below its minReplicas {self.job.min_replicas}")
        self.job.max_replicas = replicas
        self.job.last_resize_at = -math.inf
        if ms is not None and not ms.over:
            ms.spec.max_workers = max(replicas, ms.spec.min_workers)

    def shrink_to_max(self, placement: dict[str, int], ms: Membership) -> None:
        """Down to the ceiling at once (after :meth:`set_max`): its run's bound too."""
        ms.spec.max_workers = self.job.max_replicas
        self.place(placement)

    # -- the store ---------------------------------------------------------------------------------
    def record_key(self) -> tuple[Any, ...]:
        """What the store must have of the job as soon as it changes (its progress and
        accounting wait for the next save of progress): a pass saves the jobs whose key it
        moved."""
        j = self.job
        return (
            self.incarnation,
            self.workers_started,
            self.generation,
            self.suspended_run,
            self.held,
            self.admitted_at,
            self.ended_at,
            self.suspend_deadline,
            j.state,
            j.max_replicas,
            j.last_resize_at,
            tuple(sorted(j.placement.items())),
        )

    def record(self, ms: Membership | None) -> dict[str, Any]:
        """Everything of the job beside the scheduler's view, as the store keeps it (read back
        by :meth:`from_record`); ``ms``: its current run."""
        if ms is not None:
            self.started(ms)
        return {
            "manifest": manifest_record(self.manifest),
            "incarnation": self.incarnation,
            "workers_started": self.workers_started,
            "generation": self.generation,
            "suspended_run": self.suspended_run,
            "held": self.held,
            "admitted_at": self.admitted_at,
            "ended_at": self.ended_at,
            "productive_s": self.productive_s,
            "attained_slot_s": self.job.attained_slot_s,
            "suspend_deadline": self.suspend_deadline,
            "env": dict(self.env),
            "membership": None if ms is None else ms.to_json(),
            "history": [h.to_json() for h in self.history],
        }

    @classmethod
    def from_record(cls, manifest: JobManifest, job: Job, record: dict[str, Any]) -> "ManagedJob":
        """The job as :meth:`record` kept it (its memberships are the caller's to restore)."""
        job.attained_slot_s = record.get("attained_slot_s", 0.0)
        return cls(
            manifest,
            job,
            incarnation=record["incarnation"],
            workers_started=record["workers_started"],
            suspended_run=record["suspended_run"],
            held=record["held"],
            admitted_at=record["admitted_at"],
            ended_at=record["ended_at"],
            productive_s=record["productive_s"],
            suspend_deadline=record["suspend_deadline"],
            generation=record.get("generation", 0),
            env=record.get("env", {}),
        )
