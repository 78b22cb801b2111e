"""Membership epochs of one run of an elastic job: the coordinator's rendezvous.

A run starts when the scheduler admits its job (ADMITTED); it opens epoch 1 once its minimum of
workers is ready, and from then on an epoch is either open (the job RUNNING) or closed while the
next one is agreed (RENDEZVOUS), until the run is COMPLETED, FAILED, SUSPENDED or CANCELLED::

    ADMITTED --(min workers ready)--> RUNNING(1) --(join/leave/failure)--> RENDEZVOUS(2)
        --(every expected member arrived)--> RUNNING(2) ... --> COMPLETED | FAILED | SUSPENDED

These are states of the job (:mod:`maitre.scheduling.lifecycle`, the one state machine): the run
moves the job it was given, and holds only whether its epoch is open (:attr:`Membership.open`,
which goes on while a job is SUSPENDING).

Suspending (preemption, the user stopping the job) is asked of the members through their
heartbeats: each one checkpoints after the current step, waits until it is durable, reports done
with ``suspended`` and exits; once no member is training the job is SUSPENDED, and a new run
resumes it from that checkpoint.

Only this object opens an epoch, so a member cut off from the coordinator can never form a group
of its own (no split brain). An epoch fixes the member list, each member's rank (ordered by node,
so ring neighbours share a node) and the store prefix the process group is built on.

Who is expected in the next epoch: the members of the current epoch that are alive and not asked
to leave, plus workers that are ready to join (they did their slow start-up first), up to the
job's target size. Members that die while the round is open drop out of it. Workers learn of a
closed epoch from their :meth:`~Membership.view` (their agent hands it over) and come to the round
themselves; a member that stopped (SIGSTOP, partition) is declared dead by
:meth:`Membership.detect_failures`, on what :mod:`maitre.control.detectors` finds in its
heartbeats (as its agent reports them with :meth:`~Membership.progress`).

Workers are counted by state as they change (:meth:`_set_state`), so what a node beat asks of a
job of thousands of workers (does it want more, is a change pending) costs O(1).

Warm spares (``spares`` in the job's spec): workers started beyond the job's size, on slots no
allocation holds (:meth:`add_spare`). A spare runs the script up to its first rendezvous (imports
done, model built) and waits there: READY, but held back from every epoch, and counted apart
(``_spares``), so none of the counts above sees it. When a worker the job counts on is lost (a
member dead, hung, evicted or on a dead node: :meth:`_mark_dead`), or when the health policy asks
(:meth:`promote_spare`), a spare becomes a plain joiner at once, and the next epoch, which the
loss opened anyway, has it: no cold start. Its state comes from a live peer like any joiner's,
so every sample is still seen once and the parameters are a fixed-size run's. The cluster then
moves the job's allocation to the spare's slot (:meth:`take_promotions`) and starts a new spare
in the background. A spare has no state: giving its slot to another job (:meth:`release_spare`)
costs nothing, and a lost spare is no failure of the job.

Pure logic: no I/O, no threads, time passed in. The server wraps it in a lock and a condition.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
import copy
from enum import Enum
from typing import Any

from maitre import protocol as p
from maitre.control import detectors
from maitre.control.detectors import DetectorConfig
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Job


class WorkerState(str, Enum):
    STARTING = "STARTING"  # the agent was asked to start it; not ready yet
    READY = "READY"  # built its model, waits for the next epoch
    ACTIVE = "ACTIVE"  # member of the current epoch
    LEAVING = "LEAVING"  # member asked to leave at the next step boundary
    LEFT = "LEFT"
    DONE = "DONE"
    DEAD = "DEAD"


LIVE = (WorkerState.STARTING, WorkerState.READY, WorkerState.ACTIVE, WorkerState.LEAVING)
_WATCHED = (WorkerState.READY, WorkerState.ACTIVE, WorkerState.LEAVING)


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One run (incarnation) of a job, as the cluster admits it (:meth:`ClusterState.incarnation_spec`)."""

    job_id: str
    command: list[str]
    """The worker command line (``python script.py args``), run by agents."""
    min_workers: int
    max_workers: int
    max_restarts: int = 3
    """Failure events (an epoch lost to a crash or hang) survived before the job is failed."""
    env: dict[str, str] = field(default_factory=dict)
    nproc_per_replica: int = 1
    """Processes of one worker (a replica that spans them, started together by its agent)."""
    mesh: str = ""
    """The replica's mesh (``MAITRE_MESH``), when it spans processes."""
    spares: int = 0
    """Warm spare workers kept started and waiting beyond the job's size (see the module
    docstring)."""
    store_scope: str = ""
    """Names this run of the job in the c10d store's keys: a job that runs again (resumed after
    a suspension, or submitted again under its name) counts epochs from 1 again, and must not
    meet its earlier run's keys (gloo would connect to dead peers' addresses)."""
    elastic: str = "inplace"
    """``inplace`` (the loop's: workers join and leave at step boundaries) or ``restart``
    (unmodified scripts, their gang stopped and started again at each change:
    :mod:`maitre.control.restarts`)."""
    grace_s: float = 30.0
    """A restart-mode worker's time between SIGTERM and SIGKILL when its gang stops."""
    success_marker: str | None = None
    """A restart-mode job's line of output that a successful worker prints (else exit 0 is
    success)."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """This run's credential: its workers present it to the API (for their own worker routes
    only) and, by challenge and response, at the door of its c10d store. It reaches them in
    their start orders and is never logged or shown."""

    @property
    def run_key(self) -> str:
        """Names this run's c10d store at the door (:mod:`maitre.control.storedoor`)."""
        return f"{self.job_id}/{self.store_scope}"

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the job has no command")
        if self.min_workers < 1:
            raise ValueError(f"min workers must be at least 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(f"max workers {self.max_workers} < min workers {self.min_workers}")
        if self.elastic not in ("inplace", "restart"):
            raise ValueError(f"elastic must be inplace or restart, got {self.elastic!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.spares <= self.max_workers:
            raise ValueError(f"spares must be in [0, {self.max_workers}] (max workers), got {self.spares}")


@dataclass(slots=True)
class Worker:
    id: str
    node: str
    slot: int
    state: WorkerState = WorkerState.STARTING
    epoch: int = 0
    rank: int = -1
    step: int = 0
    arrived_from: int | None = None
    """The epoch this worker asked to move past in a rendezvous call (None when not waiting)."""
    ready_at: float = 0.0
    last_heartbeat: float = 0.0
    vouched_until: float = 0.0
    """Until when its agent's last node beat vouches for it (:func:`detectors.silence`)."""
    gap_mean: float = 0.0
    gap_var: float = 0.0
    """The rhythm of its heartbeats (mean and variance of their gaps), as its agent sees it."""
    stalled: bool = False
    exit_code: int | None = None
    error: str | None = None
    slots: int = 1
    """Slots this worker holds on its node, from ``slot`` on (``gpusPerReplica``)."""
    started_at: float = 0.0
    ended_at: float | None = None
    """When the agent was asked to start it, and when it stopped holding its slots."""
    trained_s: float = 0.0
    """Seconds it spent in steps that committed (reported with its heartbeats)."""
    step_at: float = 0.0
    """When it was first heard at ``step``: the time of the worker heartbeat (to its agent)
    that carried the step, whatever the age of the node beat that brought it. The scheduler's
    throughput is timed by it (:func:`maitre.control.accounting.measure`)."""
    spare: bool = False
    """A warm spare: started beyond the job's size and held back from every epoch until it is
    promoted (then False: a joiner like any other)."""

    def reached(self, step: int, at: float) -> None:
        if step > self.step:
            self.step, self.step_at = step, at

    def seen(self, now: float) -> None:
        self.last_heartbeat = max(self.last_heartbeat, now)


_WORKER_FIELDS = tuple(f.name for f in fields(Worker))
"""What :meth:`Membership.to_json` saves of a worker (flat values: no ``asdict`` recursion, which
cost a tenth of a second a save for 2,000 workers)."""


@dataclass(slots=True)
class Assignment:
    epoch: int
    rank: int
    world_size: int
    store_prefix: str
    members: list[str]
    state_lost: bool = False
    """Nobody in this epoch holds the job's state: it restarts from a checkpoint or step 0."""

    def to_json(self) -> dict[str, Any]:
        return {
            "action": "train",
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "store_prefix": self.store_prefix,
            "members": self.members,
            "state_lost": self.state_lost,
        }


def _job_of(spec: JobSpec, state: JobState) -> Job:
    """A job of its own for a run that no scheduler admitted (tests), or an earlier run."""
    return Job(id=spec.job_id, queue="", min_replicas=spec.min_workers, max_replicas=spec.max_workers, state=state)


class Membership:
    """Rendezvous and failure bookkeeping of one job (see the module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        cfg: DetectorConfig | None = None,
        now: float = 0.0,
        first_worker: int = 0,
        job: Job | None = None,
    ) -> None:
        self.spec = spec
        self.cfg = cfg or DetectorConfig()
        self.job = job if job is not None else _job_of(spec, JobState.ADMITTED)
        """The job this run moves through its states (the scheduler's, when admitted by it)."""
        self.open = False
        """The current epoch is open: its members train (False before the first one, and
        between two epochs)."""
        self.epoch = 0
        self.members: list[str] = []
        self.workers: dict[str, Worker] = {}
        self.target = spec.max_workers
        self.failures = 0
        self.failure: str | None = None
        self.events: list[dict[str, Any]] = []
        self.closed_at: float | None = None
        self.close_reason = ""
        self.created_at = now
        self.suspending: str | None = None
        """Why the job is being suspended (members checkpoint and exit), or None."""
        self._failed_epoch = -1
        self._state_lost_epoch = -1
        self._node_order: dict[str, int] = {}
        self._next_worker = first_worker
        """Worker ids go on from here (a resumed job's new workers never reuse an old id)."""
        self._count: Counter[WorkerState] = Counter()
        """Workers by state, so that what a heartbeat asks (is a change pending, does the job
        want workers) costs the same for 2 workers and for 2,000."""
        self._spares: Counter[WorkerState] = Counter()
        """Spares by state (no count above includes them)."""
        self.spare_failures = 0
        """Spares lost on their own (not given back): past ``max_restarts`` no more are started
        (a script that cannot start would otherwise be started again and again)."""
        self._promoted: dict[str, tuple[str | None, float]] = {}
        """Spares promoted and not yet in an epoch: what they replace, and since when."""
        self.promotions: list[tuple[str, str | None]] = []
        """(spare, the worker it replaces) promoted since the cluster last took them."""
        self._leaving_members = 0
        self._arrivals = 0
        self._stalled = 0
        """Members reported stalled (never fewer than there are; a member lost while stalled
        may still be counted until the next epoch)."""
        """Workers waiting in a rendezvous (``arrived_from`` set): most arrivals of a large
        gang are told "not yet" from this count, without a pass over the workers."""

    @property
    def state(self) -> JobState:
        return self.job.state

    @property
    def over(self) -> bool:
        """This run has stopped: its job ended or was suspended."""
        return self.job.state.run_over

    def _finish(self, to: JobState) -> None:
        self.open = False
        self.job.move(to)

    def archive(self) -> None:
        """The job is admitted again: this run keeps a copy of the job as it ended, so that
        the next run moves the job on without this one seeing it move."""
        self.job = copy.copy(self.job)

    # -- workers come and go ---------------------------------------------------------------------
    def add_worker(self, node: str, slot: int, now: float, slots: int = 1) -> Worker:
        self._node_order.setdefault(node, len(self._node_order))
        self._next_worker += 1
        worker = Worker(
            id=f"{self.spec.job_id}-w{self._next_worker}",
            node=node,
            slot=slot,
            last_heartbeat=now,
            slots=slots,
            started_at=now,
        )
        self.workers[worker.id] = worker
        self._count[worker.state] += 1
        return worker

    def _is_member(self, w: Worker) -> bool:
        """Member of the current epoch (only members are ever given an epoch's number)."""
        return self.epoch > 0 and w.epoch == self.epoch

    def _set_state(self, w: Worker, state: WorkerState) -> None:
        """Every worker state change goes through here (it keeps the counts true)."""
        count = self._spares if w.spare else self._count
        count[w.state] -= 1
        count[state] += 1
        if self._is_member(w):
            self._leaving_members += (state == WorkerState.LEAVING) - (w.state == WorkerState.LEAVING)
        w.state = state

    def _set_arrived(self, w: Worker, from_epoch: int | None) -> None:
        self._arrivals += (from_epoch is not None) - (w.arrived_from is not None)
        w.arrived_from = from_epoch

    def _recount(self) -> None:
        self._stalled = sum(1 for w in self.workers.values() if w.stalled and self._is_member(w))
        self._arrivals = sum(1 for w in self.workers.values() if w.arrived_from is not None)
        self._count = Counter(w.state for w in self.workers.values() if not w.spare)
        self._spares = Counter(w.state for w in self.workers.values() if w.spare)
        self._leaving_members = sum(
            1 for w in self.workers.values() if w.state == WorkerState.LEAVING and self._is_member(w)
        )

    @property
    def workers_added(self) -> int:
        """Worker numbers used so far (a later incarnation's ids start after them)."""
        return self._next_worker

    def live_workers(self) -> list[Worker]:
        """Live workers the job counts on (spares are not: :meth:`live_spares`)."""
        return [w for w in self.workers.values() if w.state in LIVE and not w.spare]

    def live_spares(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.spare and w.state in LIVE]

    # -- warm spares -----------------------------------------------------------------------------
    def add_spare(self, node: str, slot: int, now: float, slots: int = 1) -> Worker:
        """A spare started on a slot outside the job's allocation (see the module docstring)."""
        self._node_order.setdefault(node, len(self._node_order))
        self._next_worker += 1
        worker = Worker(
            id=f"{self.spec.job_id}-w{self._next_worker}",
            node=node,
            slot=slot,
            last_heartbeat=now,
            slots=slots,
            started_at=now,
            spare=True,
        )
        self.workers[worker.id] = worker
        self._spares[worker.state] += 1
        self._log(now, "spare_started", worker=worker.id, node=node)
        return worker

    def spares_wanted(self) -> int:
        """How many more spares the job would start now."""
        if (
            self.over
            or self.suspending
            or self._count[WorkerState.DONE]
            or self.spare_failures > self.spec.max_restarts
        ):
            return 0
        live = self._spares[WorkerState.STARTING] + self._spares[WorkerState.READY]
        return max(0, self.spec.spares - live)

    def promote_spare(
        self, replacing: str | None, now: float, spare: str | None = None, avoid_node: str | None = None
    ) -> Worker | None:
        """Make a spare a joiner of the next epoch in place of ``replacing`` (a lost or evicted
        worker, or None for a larger size): ``spare``, else the warmest one (ready the longest),
        else one still starting. Returns it, or None without a spare. The epoch it joins is the next one: a
        loss closed the current one; for an eviction, ask the evicted member to leave (it then
        goes at the next step boundary, and the spare comes in at the same one). None on
        ``avoid_node`` (a suspect node's spare would be as slow as the worker it replaces)."""
        live = [w for w in self.live_spares() if (spare is None or w.id == spare) and w.node != avoid_node]
        if not live or self.over or self.suspending:
            return None
        w = min(live, key=lambda s: (s.state != WorkerState.READY, s.ready_at, s.started_at))
        self._spares[w.state] -= 1
        self._count[w.state] += 1
        w.spare = False
        self._promoted[w.id] = (replacing, now)
        self.promotions.append((w.id, replacing))
        return w

    def take_promotions(self) -> list[tuple[str, str | None]]:
        """The spares promoted since the last call, with whom they replace (the cluster moves
        the job's allocation onto their slots)."""
        out, self.promotions = self.promotions, []
        return out

    def release_spare(self, wid: str, reason: str, now: float) -> None:
        """Give a spare's slot up (another job needs it): it stops (its agent kills it), and
        that is no failure."""
        w = self._worker(wid)
        if not w.spare or w.state not in LIVE:
            raise ValueError(f"worker {wid} is no live spare")
        self._set_state(w, WorkerState.DEAD)
        self._set_arrived(w, None)
        w.error = reason
        self._log(now, "spare_released", worker=wid, node=w.node, reason=reason)

    def _refill(self, replacing: str | None, now: float) -> None:
        """Spares take the places of workers the job lost, while it has fewer than its size."""
        while self.staying() < self.target and self.promote_spare(replacing, now) is not None:
            pass

    def wants_workers(self) -> int:
        """How many more worker processes the job would start now."""
        # A member that finished its loop means the job is ending: the others finish the same
        # last step. Counted as gone, it made the agent start a replacement in its freed slot,
        # for the moment until the others' dones came in (tests/test_multihost.py saw one).
        if self.over or self.suspending or self._count[WorkerState.DONE]:
            return 0
        return max(0, self.target - self.staying())

    def staying(self) -> int:
        """Live workers not asked to leave (spares aside)."""
        c = self._count
        return c[WorkerState.STARTING] + c[WorkerState.READY] + c[WorkerState.ACTIVE]

    def view_key(self) -> tuple[Any, ...]:
        """Changes whenever any worker's :meth:`view` may have changed, or how many workers
        the job wants (a worker turning ready changes neither: 256 arrivals are not 256
        wake-ups of every node of the job)."""
        c = self._count
        return (
            self.state,
            self.open,
            self.epoch,
            self.target,
            self.change_pending(),
            self.suspending,
            self.failures,
            c[WorkerState.LEAVING],
            c[WorkerState.DEAD],
            c[WorkerState.LEFT],
            c[WorkerState.DONE],
            self._spares[WorkerState.DEAD],
        )

    def assignment_key(self) -> tuple[Any, ...]:
        """Changes whenever a waiting worker's :meth:`assignment` may have changed."""
        c = self._count
        return (
            self.state,
            self.open,
            self.epoch,
            c[WorkerState.LEAVING],
            c[WorkerState.DEAD],
            self._spares[WorkerState.DEAD],
        )

    def ready(self, wid: str, now: float) -> None:
        """The worker finished its start-up and wants to join the next epoch."""
        w = self._worker(wid)
        if w.state == WorkerState.STARTING:
            self._set_state(w, WorkerState.READY)
            w.ready_at = now
            w.last_heartbeat = now
            if w.spare:
                self._log(now, "spare_ready", worker=wid, seconds=round(now - w.started_at, 3))
        w.seen(now)

    def progress(
        self,
        wid: str,
        seen_at: float,
        step: int,
        stalled: bool,
        trained_s: float = 0.0,
        gap_mean_s: float = 0.0,
        gap_std_s: float = 0.0,
        vouched_until: float = 0.0,
    ) -> None:
        """What the worker's agent reports of it: it last heard from the worker at ``seen_at``
        (which is never older than what was known), at its step, stalled or not, with the
        rhythm of its heartbeats (mean and deviation of their gaps) as the agent measured it,
        and until when the agent vouches for it (a report of silence withdraws the promise)."""
        w = self._worker(wid)
        if seen_at > w.last_heartbeat:
            w.last_heartbeat = seen_at
        w.vouched_until = vouched_until
        w.gap_mean, w.gap_var = gap_mean_s, gap_std_s * gap_std_s
        w.trained_s = max(w.trained_s, trained_s)
        if w.state in (WorkerState.ACTIVE, WorkerState.LEAVING):
            w.reached(step, seen_at)
            if stalled != w.stalled:
                self._stalled = max(0, self._stalled + (1 if stalled else -1))
            w.stalled = stalled

    def joined(self, wid: str, at: float, now: float) -> None:
        """A restart-mode worker's processes reached their store at ``at`` (this loop's workers
        say more: :meth:`arrive`)."""

    def view(self, wid: str, now: float) -> p.WorkerView:
        """What the worker must know between two steps."""
        w = self._worker(wid)
        closed = w.state not in (WorkerState.ACTIVE, WorkerState.LEAVING) or w.epoch != self.epoch or not self.open
        return p.WorkerView(
            job_state=self.state,
            epoch=self.epoch,
            member_epoch=w.epoch,
            closed=closed,
            change=self.change_pending(),
            leave=w.state == WorkerState.LEAVING,
            stop=w.state == WorkerState.DEAD or self.over,
            suspend=self.suspending is not None,
            failures=self.failures,
            age_s=round(now - self.created_at, 3),
        )

    def change_pending(self) -> bool:
        """Members should stop at the next step boundary and rendezvous."""
        if not self.open or self.suspending:
            return False
        if self._leaving_members:
            return True
        return self._count[WorkerState.READY] > 0 and len(self.members) < self.target

    def exited(
        self,
        wid: str,
        code: int,
        error: str | None,
        now: float,
        *,
        joined: bool | None = None,
        marked: bool | None = None,
        stderr: list[str] | None = None,
        noticed: bool = False,
    ) -> None:
        """The agent saw the worker process exit (what else it saw of an unmodified script,
        ``joined``, ``marked``, ``stderr`` and ``noticed``, matters to
        :mod:`maitre.control.restarts` only: this loop's workers say how they ended)."""
        w = self._worker(wid)
        w.exit_code = code
        if w.ended_at is None:
            w.ended_at = now  # its slots are free only now
        if w.state in (WorkerState.DONE, WorkerState.LEFT, WorkerState.DEAD):
            return
        if code == 0 and w.state == WorkerState.LEAVING:  # left without saying so
            self.left(wid, now)
            return
        if self.over:  # stopped with its run
            self._set_state(w, WorkerState.LEFT if code == 0 else WorkerState.DEAD)
            return
        if error:
            w.error = error
        elif code == 0:
            w.error = "exited (code 0) without finishing its training loop"
        else:
            w.error = f"exited with code {code}" if code > 0 else f"killed by signal {-code}"
        self._mark_dead(w, f"worker {wid}: {w.error}", now)
        if self.over:  # (the loss ended the run: a suspension or the job completed, or failed)
            return
        if w.error.startswith(p.DATA_ERROR):  # (the data's fault: no peer or replacement reads it)
            self._fail(f"the data cannot be read: {w.error.removeprefix(p.DATA_ERROR)} (worker {wid})", now)
            return
        self._check_user_error(now)

    def evict(self, wid: str, reason: str, now: float) -> None:
        self._mark_dead(self._worker(wid), reason, now)

    def _mark_dead(self, w: Worker, reason: str, now: float) -> None:
        was_member = self._is_member(w)
        was_leaving = w.state == WorkerState.LEAVING
        self._set_state(w, WorkerState.DEAD)
        self._set_arrived(w, None)
        self._promoted.pop(w.id, None)
        if w.spare:  # it held no state and trained nothing: no failure of the job
            if w.exit_code is not None and w.exit_code > 0:  # its script failed (not a kill)
                self.spare_failures += 1
            self._log(now, "worker_dead", worker=w.id, reason=reason, spare=True)
            return
        if was_leaving and not was_member:
            # Told to leave, and in no epoch the job counts on: a joiner a scale turned away
            # (issue 41: eight of them, silent once answered "leave", failed a job that trained
            # on), or a member of an epoch the others have since left behind. It holds nothing
            # the job needs and nothing replaces it: its loss is no failure. (A leaving member
            # of the current epoch still is: its peers may wait on it, it may hold the state.)
            self._log(now, "worker_dead", worker=w.id, reason=reason, leaving=True)
            self._check_suspended(now)
            return
        if was_member and self._check_completed(now):
            return  # a member finished the last step: the others' exits are no failure
        # One failure event per lost epoch (a node's workers often die together, and survivors
        # may have closed the epoch before the agent's report came); a worker lost outside an
        # epoch (while starting or joining) is an event of its own.
        if not was_member or self._failed_epoch != self.epoch:
            self.failures += 1
        if was_member:
            self._failed_epoch = self.epoch
            if self.open:
                self._close(reason, now)
        self._log(now, "worker_dead", worker=w.id, reason=reason)
        self._check_suspended(now)
        if self.failures > self.spec.max_restarts and not self.over:
            self._fail(
                f"{self.failures} failures exceeded --max-restarts={self.spec.max_restarts}; last: {reason}", now
            )
        if not self.over:  # a warm spare takes its place in the next epoch
            self._refill(w.id, now)

    def _check_user_error(self, now: float) -> None:
        """The same exception on every member (or every worker, before the first epoch) is a bug
        in the script: fail the job with it instead of restarting forever."""
        pool = [self.workers[m] for m in self.members] if self.members else list(self.workers.values())
        if not pool or any(w.state != WorkerState.DEAD for w in pool):
            return
        if any(w.exit_code is None or w.exit_code <= 0 for w in pool):
            return  # killed by a signal (node loss, OOM killer, preemption): not the script's bug
        errors = {w.error for w in pool}
        if len(errors) == 1 and None not in errors:
            self._fail(f"every worker failed with: {errors.pop()}", now)
        elif not self.members:
            self._fail(
                f"every worker failed before joining; first error: {next(w.error for w in pool if w.error)}", now
            )

    def left(self, wid: str, now: float) -> None:
        """The worker left gracefully. Normally the epoch is already closed (leavers go at a
        step boundary); a member that leaves an epoch that still runs (it was asked to leave
        before it picked up its assignment) ends it, or its peers would wait for it forever."""
        w = self._worker(wid)
        was_member = self._is_member(w)
        self._set_state(w, WorkerState.LEFT)
        self._set_arrived(w, None)
        self._log(now, "worker_left", worker=wid)
        if self._check_completed(now):  # (a listener that left as the job finished)
            return
        if was_member and self.open:
            self._close(f"worker {wid} left", now)

    def done(self, wid: str, step: int, now: float, suspended: bool = False) -> None:
        """The worker finished its training loop, or (``suspended``) checkpointed and stopped."""
        w = self._worker(wid)
        self._set_state(w, WorkerState.DONE if not suspended else WorkerState.LEFT)
        w.step = max(w.step, step)
        if suspended:
            self._check_suspended(now)
        else:
            self._check_completed(now)

    def suspend(self, reason: str, now: float) -> None:
        """Ask the members to checkpoint after their current step and stop."""
        if self.over:
            raise ValueError(f"job {self.spec.job_id} is {self.state.value}")
        if self.suspending is None:
            self.suspending = reason
            self.job.move(JobState.SUSPENDING)
            self._log(now, "suspending", reason=reason)
        self._check_suspended(now)

    def cancel(self, reason: str, now: float) -> None:
        """End the job now: its workers are told to stop (or killed by their agents)."""
        if self.over:
            raise ValueError(f"job {self.spec.job_id} is {self.state.value}")
        self._finish(JobState.CANCELLED)
        self.failure = reason
        self._log(now, "cancelled", reason=reason)

    def _check_suspended(self, now: float) -> None:
        if self.suspending is None or self.over:
            return
        members = [self.workers[m] for m in self.members]
        training = [m for m in members if m.state in (WorkerState.ACTIVE, WorkerState.LEAVING)]
        # Members still training checkpoint first, unless a failure left too few of them to
        # open another epoch: then the newest complete checkpoint is where the job resumes.
        if training and not (not self.open and len(training) < self.spec.min_workers):
            return
        self._finish(JobState.SUSPENDED)
        self._log(now, "suspended", step=max((m.step for m in members), default=0), reason=self.suspending)

    def _check_completed(self, now: float) -> bool:
        """The job is complete once a member finished its loop and no member is still in it (the
        last step committed everywhere: a member that died after it changes nothing). A member
        back at the rendezvous from its epoch is out of the loop: a joiner whose peers finished
        the last steps while it joined, its collectives cut off as they exited, would otherwise
        wait for an epoch that never opens, and the job for it, forever."""
        members = [self.workers[m] for m in self.members]
        if (
            self.over
            or not any(m.state == WorkerState.DONE for m in members)
            or any(
                m.state in (WorkerState.ACTIVE, WorkerState.LEAVING)
                and (m.arrived_from is None or m.arrived_from < m.epoch)
                for m in members
            )
        ):
            return self.state == JobState.COMPLETED
        self._finish(JobState.COMPLETED)
        self._log(now, "completed", step=max(m.step for m in members))
        return True

    def scale(self, target: int, now: float, leave: list[str] | None = None) -> list[str]:
        """Set the job's size; members beyond it are asked to leave: those in ``leave`` (the
        scheduler frees slots on chosen nodes), else the highest ranks first."""
        if not self.spec.min_workers <= target <= self.spec.max_workers:
            raise ValueError(
                f"target {target} outside [{self.spec.min_workers}, "
                f"{self.spec.max_workers}] workers of job {self.spec.job_id}"
            )
        self.target = target
        turned_away: list[str] = []
        for wid in leave or []:  # chosen ones that never joined go at once
            w = self.workers.get(wid)
            if w is not None and w.state in (WorkerState.STARTING, WorkerState.READY):
                self._set_state(w, WorkerState.LEAVING)
                turned_away.append(wid)
        staying = [m for m in self.members if self.workers[m].state == WorkerState.ACTIVE]
        chosen = [m for m in staying if m in (leave or [])]
        order = chosen + [m for m in reversed(staying) if m not in chosen]
        excess = max(0, len(staying) - target)
        leaving = [m for m in staying if m in order[:excess]]
        for wid in leaving:
            self._set_state(self.workers[wid], WorkerState.LEAVING)
        for w in self.workers.values():  # joiners that are no longer wanted (spares stay)
            if (
                w.state in (WorkerState.STARTING, WorkerState.READY)
                and not w.spare
                and len(staying) - len(leaving) >= target
            ):
                self._set_state(w, WorkerState.LEAVING)
                turned_away.append(w.id)
        self._refill(None, now)  # a larger size is filled by spares first
        self._log(now, "scale", target=target, leaving=leaving, **({"turned_away": turned_away} if turned_away else {}))
        return leaving

    def release(self, wid: str, now: float) -> bool:
        """Ask one member to leave at the next step boundary while the job keeps its size: a
        replacement is wanted at once (an eviction is a repair, not a shrink). False when it is
        not an active member (it left, or is leaving, already)."""
        w = self.workers.get(wid)
        if self.over or w is None or w.state != WorkerState.ACTIVE:
            return False
        self._set_state(w, WorkerState.LEAVING)
        self._log(now, "scale", target=self.target, leaving=[wid])
        return True

    # -- rendezvous ------------------------------------------------------------------------------
    def arrive(
        self,
        wid: str,
        from_epoch: int,
        step: int,
        reason: str,
        now: float,
        *,
        group_failed: bool = False,
        unreachable: list[str] | None = None,
    ) -> None:
        """A worker asks for the epoch after ``from_epoch`` (0 for a joiner). With
        ``group_failed`` its epoch's process group could not be built: one failure of the epoch
        (however many members say so), and past ``max_restarts`` the job fails saying which
        addresses could not be reached and what to set, instead of opening epochs forever."""
        w = self._worker(wid)
        w.seen(now)
        if w.state == WorkerState.STARTING:
            self.ready(wid, now)
        self._set_arrived(w, from_epoch)
        w.reached(step, now)
        if (
            group_failed
            and from_epoch == self.epoch
            and self._is_member(w)
            and self._failed_epoch != self.epoch
            and not self.over
        ):
            self.failures += 1
            self._failed_epoch = self.epoch
            where = ", ".join(unreachable or []) or "not named by the backend"
            self._log(now, "group_failed", epoch=self.epoch, worker=wid, unreachable=where)
            if self.failures > self.spec.max_restarts:
                self._fail(
                    f"the process group of epoch {self.epoch} could not be built "
                    f"({reason}; unreachable: {where}), {self.failures} failures exceeded "
                    f"--max-restarts={self.spec.max_restarts}. Workers advertise the "
                    "address their host name resolves to unless GLOO_SOCKET_IFNAME "
                    "(NCCL_SOCKET_IFNAME on GPUs) or `maitre agent --iface` names an "
                    "interface their peers can reach",
                    now,
                )
                return
        if self.open and from_epoch == self.epoch and self._is_member(w):
            self._close(f"{reason} (reported by {wid})", now)
        self._check_completed(now)

    def assignment(self, wid: str, from_epoch: int) -> dict[str, Any] | None:
        """What a worker waiting in :meth:`arrive` gets, or None while it must keep waiting."""
        w = self._worker(wid)
        if self.state == JobState.FAILED:
            return {"action": "stop", "reason": self.failure}
        if self.state == JobState.COMPLETED:
            return {"action": "stop", "reason": "job completed"}
        if self.state == JobState.SUSPENDED:
            return {"action": "stop", "reason": "job suspended"}
        if self.state == JobState.CANCELLED:
            return {"action": "stop", "reason": "job cancelled"}
        if w.state == WorkerState.LEAVING:
            return {"action": "leave"}
        if w.state == WorkerState.DEAD:
            return {"action": "stop", "reason": "this worker was removed from the job"}
        if w.state == WorkerState.ACTIVE and w.epoch > from_epoch and self.open:
            return Assignment(
                self.epoch,
                w.rank,
                len(self.members),
                self.store_prefix(),
                list(self.members),
                self._state_lost_epoch == self.epoch,
            ).to_json()
        return None

    def restart_cost_s(self) -> float:
        """Seconds of no training that a resize costs this job (none: members join and leave
        at a step boundary while the others train)."""
        return 0.0

    def store_key(self, w: Worker) -> str:
        """The key of the c10d store ``w``'s processes meet on (the door's run key)."""
        return self.spec.run_key

    def store_keys(self) -> set[str]:
        """The keys of the stores this run still uses."""
        return {self.spec.run_key}

    def store_prefix(self, epoch: int | None = None) -> str:
        scope = f"{self.spec.store_scope}/" if self.spec.store_scope else ""
        return f"job/{self.spec.job_id}/{scope}e{self.epoch if epoch is None else epoch}/"

    def try_open_epoch(self, now: float) -> bool:
        """Open the next epoch if everyone expected has arrived. Returns True when it opened."""
        if self.open or self.over:
            return False
        # Every member that stays must have arrived, and at least the minimum in all.
        needed = max(self.spec.min_workers, self._count[WorkerState.ACTIVE])
        if self._arrivals < needed:
            return False
        stay = [self.workers[m] for m in self.members if self.workers[m].state == WorkerState.ACTIVE]
        joiners = sorted(
            (w for w in self.workers.values() if w.state == WorkerState.READY and not w.spare), key=lambda w: w.ready_at
        )
        joiners = joiners[: max(0, self.target - len(stay))]
        # A member may still be asking to leave an older epoch: it missed one that opened and
        # closed while its long-poll was away. It is here all the same.
        if any(w.arrived_from is None or w.arrived_from > self.epoch for w in stay):
            return False
        arrived = [w for w in joiners if w.arrived_from is not None]
        if self.epoch == 0:  # the first round
            if len(arrived) < self.spec.min_workers:
                return False
            starting = self._count[WorkerState.STARTING] > 0
            waited = now - sorted(w.ready_at for w in arrived)[self.spec.min_workers - 1]
            if len(arrived) < self.target and starting and waited < self.cfg.first_round_grace_s:
                return False
        expected = stay + arrived
        if len(expected) < self.spec.min_workers:
            return False
        expected.sort(key=lambda w: (self._node_order[w.node], w.slot, w.id))
        reached = max((self.workers[m].step for m in self.members), default=0)
        if reached and not any(w.step for w in expected):
            # Every worker that held the job's state is gone: the new group starts from the
            # newest checkpoint, or from scratch without one. Say so.
            self._log(
                now,
                "state_lost",
                step=reached,
                reason="every worker holding the job's state was lost; it resumes from "
                "its newest checkpoint, or from step 0 without one",
            )
            self._state_lost_epoch = self.epoch + 1
        self.epoch += 1
        self.members = [w.id for w in expected]
        for rank, w in enumerate(expected):
            self._set_state(w, WorkerState.ACTIVE)
            self._set_arrived(w, None)
            w.epoch, w.rank, w.stalled = self.epoch, rank, False
            w.last_heartbeat = max(w.last_heartbeat, now)
        self._leaving_members = self._stalled = 0
        self.open = True
        if not self.suspending:  # a suspending job stays so while its members checkpoint
            self.job.move(JobState.RUNNING)
        self._log(
            now,
            "epoch",
            epoch=self.epoch,
            members=list(self.members),
            reason=self.close_reason or "start",
            closed_for_s=None if self.closed_at is None else round(now - self.closed_at, 4),
        )
        for w in expected:
            if w.id in self._promoted:
                replacing, since = self._promoted.pop(w.id)
                self._log(
                    now,
                    "spare_promoted",
                    worker=w.id,
                    replacing=replacing,
                    node=w.node,
                    epoch=self.epoch,
                    seconds=round(now - since, 4),
                )
        self.closed_at = None
        self.close_reason = ""
        return True

    def _close(self, reason: str, now: float) -> None:
        self.open = False
        if not self.suspending:
            self.job.move(JobState.RENDEZVOUS)
        self.closed_at = now
        self.close_reason = reason
        self._log(now, "epoch_closed", epoch=self.epoch, reason=reason)

    # -- failure detection -----------------------------------------------------------------------
    def detect_failures(self, now: float, lost: bool = True) -> list[str]:
        """Declare hung or lost workers dead; returns their ids (the agents kill them). With
        ``lost=False`` only hangs are looked for (the coordinator looks for workers silent past
        ``dead_after_s`` twice a second, for hangs at every tick)."""
        dead: list[str] = []
        if lost:  # (the starting are importing; their agent watches them)
            for w, reason in detectors.lost([w for w in self.workers.values() if w.state in _WATCHED], now, self.cfg):
                dead.append(w.id)
                self._mark_dead(w, reason, now)
        # A hang needs every other member stalled, so none stalled means no hang: the usual
        # case costs nothing.
        if self.open and self._stalled > 0:
            training = [
                self.workers[m]
                for m in self.members
                if self.workers[m].state in (WorkerState.ACTIVE, WorkerState.LEAVING)
            ]
            found = detectors.hung(training, now, self.cfg)
            if found is not None:
                w, reason = found
                dead.append(w.id)
                self._mark_dead(w, reason, now)
        if not self.open and self.epoch > 0 and not self.over:
            self._check_min(now)
        return dead

    def _check_min(self, now: float) -> None:
        live = [w for w in self.live_workers() if w.state != WorkerState.LEAVING]
        if self.suspending:  # nobody is started any more: members that died are gone
            self._check_suspended(now)
            return
        if len(live) < self.spec.min_workers and self.failures >= self.spec.max_restarts:
            self._fail(
                f"only {len(live)} live workers, below the minimum of {self.spec.min_workers}, and no restarts left",
                now,
            )

    def _fail(self, reason: str, now: float) -> None:
        self._finish(JobState.FAILED)
        self.failure = reason
        self._log(now, "failed", reason=reason)

    # -- helpers ---------------------------------------------------------------------------------
    def _worker(self, wid: str) -> Worker:
        try:
            return self.workers[wid]
        except KeyError:
            raise KeyError(f"unknown worker {wid!r}") from None

    def _log(self, now: float, kind: str, **fields: Any) -> None:
        self.events.append({"t": round(now, 4), "kind": kind, **fields})

    # -- persistence -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Everything needed to carry on after the coordinator restarts (see :meth:`from_json`)."""
        return {
            "spec": asdict(self.spec),
            "state": self.state.value,
            "open": self.open,
            "epoch": self.epoch,
            "members": list(self.members),
            "target": self.target,
            "failures": self.failures,
            "failure": self.failure,
            "closed_at": self.closed_at,
            "close_reason": self.close_reason,
            "created_at": self.created_at,
            "suspending": self.suspending,
            "failed_epoch": self._failed_epoch,
            "node_order": dict(self._node_order),
            "state_lost_epoch": self._state_lost_epoch,
            "next_worker": self._next_worker,
            "spare_failures": self.spare_failures,
            "promoted": {k: list(v) for k, v in self._promoted.items()},
            "workers": [
                {**{f: getattr(w, f) for f in _WORKER_FIELDS}, "state": w.state.value} for w in self.workers.values()
            ],
        }

    @classmethod
    def from_json(
        cls, data: dict[str, Any], cfg: DetectorConfig | None, now: float, job: Job | None = None
    ) -> "Membership":
        """A membership as :meth:`to_json` saved it, its live workers' heartbeat clocks restarted
        at ``now`` (the coordinator was away, not they). Events are not carried over. ``job`` is
        the job of the run that goes on (its state was saved with it); an earlier run gets a
        copy of the job as that run ended."""
        spec = JobSpec(**data["spec"])
        m = cls(
            spec,
            cfg,
            data["created_at"],
            data["next_worker"],
            job if job is not None else _job_of(spec, JobState(data["state"])),
        )
        m.open, m.epoch, m.members = data["open"], data["epoch"], list(data["members"])
        m.target, m.failures, m.failure = data["target"], data["failures"], data["failure"]
        m.closed_at, m.close_reason = data["closed_at"], data["close_reason"]
        m.suspending, m._failed_epoch = data["suspending"], data["failed_epoch"]
        m._state_lost_epoch = data.get("state_lost_epoch", -1)
        m.spare_failures = data.get("spare_failures", 0)
        m._promoted = {k: (v[0], v[1]) for k, v in data.get("promoted", {}).items()}
        m._node_order = dict(data["node_order"])
        names = {f.name for f in fields(Worker)}
        for raw in data["workers"]:
            w = Worker(**{k: v for k, v in raw.items() if k in names})
            w.state = WorkerState(raw["state"])
            if w.state in LIVE:
                w.last_heartbeat, w.vouched_until = now, 0.0
                w.gap_mean = w.gap_var = 0.0
            m.workers[w.id] = w
        m._recount()
        return m

    def summary(self) -> dict[str, Any]:
        return {
            "job_id": self.spec.job_id,
            "state": self.state.value,
            "epoch": self.epoch,
            "epoch_open": self.open,
            "members": list(self.members),
            "target": self.target,
            "min_workers": self.spec.min_workers,
            "max_workers": self.spec.max_workers,
            "step": max((self.workers[m].step for m in self.members), default=0),
            "failures": self.failures,
            "failure": self.failure,
            "spares": [w.id for w in self.live_spares()],
            "spares_wanted": self.spec.spares,
            "workers": [
                {
                    "id": w.id,
                    "node": w.node,
                    "slot": w.slot,
                    "state": w.state.value,
                    "spare": w.spare,
                    "rank": w.rank,
                    "epoch": w.epoch,
                    "step": w.step,
                    "exit_code": w.exit_code,
                    "error": w.error,
                    "trained_s": round(w.trained_s, 3),
                }
                for w in self.workers.values()
            ],
        }
