"""One run of a restart-mode job (``elastic: restart``): unmodified scripts, restarted whole.

A script that calls ``init_process_group("env://")`` and nothing of maitre's cannot change its
world in place: like ``torchrun --nnodes MIN:MAX``, maitre starts it as a *gang* of a fixed size,
each process with torchrun's environment (its rank and the gang's size come in its start order),
and on any change stops the whole gang and starts the next one at the new size, from which the
script resumes from its own checkpoint::

    ADMITTED --(every replica of gang 1 started)--> RUNNING(1) --(resize, notice, failure)-->
        RENDEZVOUS: gang 1 stopped (SIGTERM, grace, SIGKILL) --> RUNNING(2) ... --> COMPLETED

A gang is this class's epoch: its number is the epoch (``TORCHELASTIC_RESTART_COUNT`` is one
less), its members are ranked in the order they were started, and it opens (the job RUNNING)
once all of them were. What stops it:

- a resize (:meth:`scale`: the scheduler grew or shrank the job, a spot notice drained a node),
  a member asked to go (:meth:`release`), a suspension: no failure;
- a member that failed (a non-zero exit, its node lost), or that exited 0 while the job cannot
  be done: it never reached its process group's store (it never called ``init_process_group``),
  or the job names a success marker that it never printed. One failure per gang; past the
  job's restart budget (``max_restarts``) the job is FAILED with that worker's last lines of
  stderr, instead of restarting forever.

The job is COMPLETED when every member of a gang exited 0 (as torchrun's group succeeds).

Pure logic on :class:`~maitre.control.membership.Membership`'s bookkeeping (workers, counts,
events, persistence): what differs is when workers start, what their order carries, and what
ends a gang. The agents carry the stops out (:class:`maitre.protocol.NodeOrders`' ``terminate``).
"""

from __future__ import annotations

from typing import Any

from maitre import protocol as p
from maitre.control.detectors import DetectorConfig
from maitre.control.membership import LIVE, JobSpec, Membership, Worker, WorkerState
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Job

RESTART = "restart"
INPLACE = "inplace"
UNMEASURED_RESTART_S = 60.0
"""A restart's cost until one was measured: a torchrun script's imports, process group and
checkpoint read take tens of seconds (the scheduler's guess, replaced by the job's own)."""

_RUNNING = (WorkerState.STARTING, WorkerState.READY, WorkerState.ACTIVE)


class RestartRun(Membership):
    """Gangs of unmodified workers, each stopped whole and started again at the new size (see
    the module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        cfg: DetectorConfig | None = None,
        now: float = 0.0,
        first_worker: int = 0,
        job: Job | None = None,
    ) -> None:
        if spec.elastic != RESTART:
            raise ValueError(f"job {spec.job_id} is elastic: {spec.elastic}, not restart")
        super().__init__(spec, cfg, now, first_worker, job)
        self.gang_size = 0
        """The size of the gang that forms or runs (0 between two gangs)."""
        self.stopping: str | None = None
        """Why the gang is being stopped (its members have their SIGTERM), or None."""
        self.stop_at: float | None = None
        self.restarts: list[dict[str, Any]] = []
        """One record per gang started after another: why, and how long the change took."""
        self.last_stderr: list[str] = []
        """The last lines of stderr of the worker whose failure counted last."""
        self.marked: set[str] = set()
        """Workers that printed the job's success marker."""
        self.joined_at: dict[str, float] = {}
        """When each member of the gang reached its store (its ``init_process_group``)."""
        self.started_at: float | None = None
        """When the gang's first worker was started."""

    # -- gangs form ------------------------------------------------------------------------------
    def wants_workers(self) -> int:
        if self.over or self.suspending or self.stopping:
            return 0
        if self.gang_size == 0:  # a new gang forms once the last one's processes are gone
            if any(w.state in LIVE for w in self.workers.values()):
                return 0
            return self.target
        return self.gang_size - len(self.members)

    def spares_wanted(self) -> int:
        return 0

    def add_worker(self, node: str, slot: int, now: float, slots: int = 1) -> Worker:
        if self.gang_size == 0:
            self.epoch += 1
            self.gang_size, self.members, self.open = self.target, [], False
            self.joined_at, self.started_at = {}, now
        w = super().add_worker(node, slot, now, slots)
        w.epoch, w.rank = self.epoch, len(self.members)
        self.members.append(w.id)
        if len(self.members) == self.gang_size:
            self._open(now)
        return w

    def _open(self, now: float) -> None:
        for w in self._gang():
            if w.state in (WorkerState.STARTING, WorkerState.READY):
                self._set_state(w, WorkerState.ACTIVE)
        self.open = True
        self.job.move(JobState.RUNNING)
        took = None if self.closed_at is None else round(now - self.closed_at, 4)
        if self.epoch > 1:
            self.restarts.append(
                {
                    "epoch": self.epoch,
                    "cause": self.close_reason,
                    "size": self.gang_size,
                    "restart_s": took,
                    "t": round(now, 4),
                }
            )
        self._log(
            now,
            "epoch",
            epoch=self.epoch,
            members=list(self.members),
            reason=self.close_reason or "start",
            closed_for_s=took,
            restart=self.epoch - 1,
        )
        self.closed_at, self.close_reason = None, ""

    def joined(self, wid: str, at: float, now: float) -> None:
        """Once every member reached its store, the gang trains: the restart (from the decision
        to stop the last gang) or the start is timed to there."""
        if wid not in self.members or wid in self.joined_at or not self.open:
            return
        self.joined_at[wid] = at
        if len(self.joined_at) < self.gang_size:
            return
        last = max(self.joined_at.values())
        record = self.restarts[-1] if self.restarts and self.restarts[-1]["epoch"] == self.epoch else None
        since = None
        if record is not None:  # (opened at ``t``, ``restart_s`` after the last gang's stop began)
            since = last - (record["t"] - (record["restart_s"] or 0.0))
            record["joined_s"] = round(since, 4)
        self._log(
            now,
            "gang_joined",
            epoch=self.epoch,
            seconds=round(last - (self.started_at or last), 4),
            since_stop_s=None if since is None else round(since, 4),
        )

    def restart_order(self, w: Worker) -> dict[str, Any]:
        """What the agent needs to give ``w`` torchrun's environment."""
        return {
            "group_rank": w.rank,
            "group_world_size": self.gang_size,
            "restart_count": max(0, w.epoch - 1),
            "max_restarts": self.spec.max_restarts,
            "grace_s": self.spec.grace_s,
            "success_marker": self.spec.success_marker,
        }

    def store_key(self, w: Worker) -> str:
        """A store of its own for each gang: torch's agent-store rendezvous prefixes no key by
        the attempt (it expects a new store per restart), and a gang must never meet its
        predecessor's peer addresses."""
        return f"{self.spec.run_key}/g{w.epoch}"

    def store_keys(self) -> set[str]:
        return {f"{self.spec.run_key}/g{self.epoch}"}

    def restart_cost_s(self) -> float:
        """The mean of this run's measured restarts (from the decision to stop one gang to
        every process of the next in its process group: the script's checkpoint read comes
        on top), else :data:`UNMEASURED_RESTART_S`."""
        took = [r["joined_s"] for r in self.restarts[-10:] if r.get("joined_s") is not None]
        return sum(took) / len(took) if took else UNMEASURED_RESTART_S

    def _gang(self) -> list[Worker]:
        return [self.workers[m] for m in self.members]

    # -- gangs stop ------------------------------------------------------------------------------
    def _stop_gang(self, cause: str, now: float) -> None:
        """Every member still running gets its SIGTERM (then SIGKILL after the grace period)."""
        if self.stopping is not None or self.gang_size == 0:
            return
        self.stopping, self.stop_at = cause, now
        self.open = False
        if not self.suspending and not self.over:
            self.job.move(JobState.RENDEZVOUS)
        self.closed_at, self.close_reason = now, cause
        for w in self._gang():
            if w.state in _RUNNING:
                self._set_state(w, WorkerState.LEAVING)
        self._log(now, "epoch_closed", epoch=self.epoch, reason=cause)
        self._check_stopped(now)

    def _check_stopped(self, now: float) -> None:
        """The gang being stopped is gone once none of its processes runs; a suspending job is
        then SUSPENDED."""
        if self.stopping is not None and not any(w.state in LIVE for w in self._gang()):
            stopped_s = round(now - (self.stop_at or now), 4)
            self._log(now, "gang_stopped", epoch=self.epoch, reason=self.stopping, seconds=stopped_s)
            self.stopping, self.stop_at = None, None
            self.gang_size, self.members = 0, []
        self._check_suspended(now)

    def scale(self, target: int, now: float, leave: list[str] | None = None) -> list[str]:
        if not self.spec.min_workers <= target <= self.spec.max_workers:
            raise ValueError(
                f"target {target} outside [{self.spec.min_workers}, "
                f"{self.spec.max_workers}] workers of job {self.spec.job_id}"
            )
        self.target = target
        self._log(now, "scale", target=target, leaving=list(leave or []))
        moved = any(wid in self.members for wid in leave or [])
        if self.gang_size and (target != self.gang_size or moved) and not self.over:
            self._stop_gang(f"resize to {target}", now)
            return [w.id for w in self._gang() if w.state == WorkerState.LEAVING]
        return []

    def release(self, wid: str, now: float) -> bool:
        w = self.workers.get(wid)
        if self.over or w is None or wid not in self.members or w.state not in _RUNNING:
            return False
        self._stop_gang(f"{wid} leaves its node", now)
        return True

    def suspend(self, reason: str, now: float) -> None:
        if self.over:
            raise ValueError(f"job {self.spec.job_id} is {self.state.value}")
        if self.suspending is None:
            self.suspending = reason
            self.job.move(JobState.SUSPENDING)
            self._log(now, "suspending", reason=reason)
        if self.gang_size and self.stopping is None:
            self._stop_gang(f"suspended: {reason}", now)
        self._check_stopped(now)

    def _check_suspended(self, now: float) -> None:
        """A suspending job is SUSPENDED once no gang is being stopped and no process runs."""
        if self.suspending is None or self.over or self.stopping is not None:
            return
        if not any(w.state in LIVE for w in self.workers.values()):
            self._finish(JobState.SUSPENDED)
            self._log(now, "suspended", step=0, reason=self.suspending)

    # -- exits -----------------------------------------------------------------------------------
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
        """The agent saw the worker's processes exit: ``joined`` whether they reached their
        process group's store, ``marked`` whether they printed the job's success marker,
        ``stderr`` their last lines, and ``noticed`` whether its node had a notice then (Slurm
        signals every process of a preempted job: the script's end is the notice's, and the
        drain that follows resizes the job; no failure)."""
        w = self._worker(wid)
        w.exit_code = code
        if w.ended_at is None:
            w.ended_at = now
        if w.state in (WorkerState.DONE, WorkerState.LEFT, WorkerState.DEAD):
            return
        if noticed and w.state in _RUNNING and not self.over:
            self._stop_gang(f"{wid} ended under its node's notice", now)
        if w.state == WorkerState.LEAVING or self.over:  # stopped by us: no failure
            self._set_state(w, WorkerState.LEFT if w.state == WorkerState.LEAVING or code == 0 else WorkerState.DEAD)
            self._check_stopped(now)
            return
        if code == 0 and joined is False:
            w.error = "exited 0 without joining its process group: it never called init_process_group"
        elif code == 0:
            if marked:
                self.marked.add(wid)
            self._set_state(w, WorkerState.DONE)
            self._log(now, "worker_done", worker=wid)
            self._check_completed(now)
            return
        elif error:
            w.error = error
        else:
            w.error = f"exited with code {code}" if code > 0 else f"killed by signal {-code}"
        self.last_stderr = list(stderr or [])[-20:]
        self._mark_dead(w, f"worker {wid}: {w.error}", now)
        if not self.over and w.error.startswith(p.DATA_ERROR):  # a new gang would read it again
            self._fail(f"the data cannot be read: {w.error.removeprefix(p.DATA_ERROR)} (worker {wid})", now)

    def evict(self, wid: str, reason: str, now: float) -> None:
        w = self._worker(wid)
        if w.state in LIVE:
            self._mark_dead(w, reason, now)

    def _mark_dead(self, w: Worker, reason: str, now: float) -> None:
        self._set_state(w, WorkerState.DEAD)
        if self.over:
            return
        if w.id in self.members and self.stopping is None:
            if self._failed_epoch != self.epoch:
                self.failures += 1
                self._failed_epoch = self.epoch
            self._log(now, "worker_dead", worker=w.id, reason=reason)
            if self.failures > self.spec.max_restarts:
                tail = "".join(f"\n  {line}" for line in self.last_stderr)
                said = f"; its last lines of stderr:{tail}" if tail else ""
                self._fail(
                    f"{self.failures} failures exceeded the restart budget (--max-restarts="
                    f"{self.spec.max_restarts}); last: {reason}{said}",
                    now,
                )
                return
            self._stop_gang(reason, now)
        else:
            self._log(now, "worker_dead", worker=w.id, reason=reason)
            self._check_stopped(now)

    def _check_completed(self, now: float) -> bool:
        """Every member of the gang exited 0: the job is done, unless it names a success
        marker that none of them printed (the script ended early: a failure of the gang)."""
        gang = self._gang()
        if self.over or not gang or len(gang) < self.gang_size or any(w.state != WorkerState.DONE for w in gang):
            return self.state == JobState.COMPLETED
        marker = self.spec.success_marker
        if marker and not self.marked.intersection(self.members):
            last = gang[-1]
            last.error = f"every worker exited 0 and none printed the job's success marker {marker!r}"
            self._mark_dead(last, f"gang {self.epoch}: {last.error}", now)
            return False
        self._finish(JobState.COMPLETED)
        self._log(now, "completed", epoch=self.epoch)
        return True

    def done(self, wid: str, step: int, now: float, suspended: bool = False) -> None:
        """(An unmodified script never says so: its exit does.)"""

    # -- what the coordinator's detectors and rendezvous ask ---------------------------------------
    def detect_failures(self, now: float, lost: bool = True) -> list[str]:
        """Nothing to find: these workers never beat (their agent reports their exits, and a
        node lost takes them with it)."""
        return []

    def try_open_epoch(self, now: float) -> bool:
        return False

    def change_pending(self) -> bool:
        return self.stopping is not None

    # -- views and persistence -------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(elastic=RESTART, restarts=list(self.restarts[-50:]), stopping=self.stopping)
        return out

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["restart"] = {
            "gang_size": self.gang_size,
            "stopping": self.stopping,
            "stop_at": self.stop_at,
            "restarts": self.restarts,
            "last_stderr": self.last_stderr,
            "marked": sorted(self.marked),
            "joined_at": self.joined_at,
            "started_at": self.started_at,
        }
        return out

    @classmethod
    def from_json(
        cls, data: dict[str, Any], cfg: DetectorConfig | None, now: float, job: Job | None = None
    ) -> "RestartRun":
        run = super().from_json(data, cfg, now, job)
        assert isinstance(run, RestartRun)
        saved = data.get("restart", {})
        run.gang_size = saved.get("gang_size", 0)
        run.stopping, run.stop_at = saved.get("stopping"), saved.get("stop_at")
        run.restarts = list(saved.get("restarts", []))
        run.last_stderr = list(saved.get("last_stderr", []))
        run.marked = set(saved.get("marked", []))
        run.joined_at = dict(saved.get("joined_at", {}))
        run.started_at = saved.get("started_at")
        return run


def run_class(spec: JobSpec) -> type[Membership]:
    """The kind of run a job's spec asks for."""
    return RestartRun if spec.elastic == RESTART else Membership


def run_from_json(data: dict[str, Any], cfg: DetectorConfig | None, now: float, job: Job | None = None) -> Membership:
    """A run as it was saved (:meth:`Membership.to_json`), of its own kind."""
    kind = RestartRun if data["spec"].get("elastic", INPLACE) == RESTART else Membership
    return kind.from_json(data, cfg, now, job)
