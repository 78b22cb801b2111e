"""The coordinator: the one owner of every job's membership and of the cluster's nodes.

It answers agents (a node heartbeat carries the liveness and progress of all the node's workers
at once; a watch long-polls for the node's orders) and workers (rendezvous, done, left,
recovery reports: per membership change, never per step; checkpoint reports; rank 0's progress
about once a second, of which only the latest is kept; rank 0's straggler verdicts, to which it
adds the slow worker's node), runs the failure detectors and the
scheduling pass every ``tick``, and persists what changed. Transport is elsewhere
(:mod:`maitre.control.api`): this class is called with validated messages
(:mod:`maitre.protocol`) under its own lock, with time from ``clock``, so tests drive it
directly on an injected clock.

It is the lock, the calls and the record of what they changed (``touch``, ``bump``, ``flush``);
what it owns lives in modules of their own: the managed jobs' records and lifecycle verbs
(:mod:`~maitre.control.job`, through :class:`ClusterState`), the runs' rendezvous
(:mod:`~maitre.control.membership`), the node registry (:mod:`~maitre.control.nodes`), the index of
workers (:mod:`~maitre.control.workers`), each node's orders (:mod:`~maitre.control.orders`), what a
node's beat brings besides progress (:mod:`~maitre.control.nodenews`), the scheduling pass
(:mod:`~maitre.control.passes`), the journal (:mod:`~maitre.control.journal`), the restart
(:mod:`~maitre.control.restore`) and the read models (:mod:`~maitre.control.views`).

Work per call is proportional to what the call touches, not to the cluster:

- workers are indexed by node and by id (:mod:`maitre.control.workers`); a node beat reads and
  writes only its own workers;
- a job's memberships count their workers by state, so "does it want workers", "is a change
  pending" cost O(1);
- a node's orders carry a version (:mod:`maitre.control.nodes`): views of its workers are sent only when
  something they show changed (:meth:`Membership.view_key` moved), and only the nodes of the
  job that changed are woken (``on_wake``).

Jobs are submitted as manifests to its :class:`ClusterState`, and the scheduling policy sizes
and places them: ``maitre up``'s cluster of queues and jobs, and ``maitre run``'s one job on one
queue are the same path. With a :class:`Store` every change is persisted and a restarted
coordinator carries on from it. Every event it emits is also counted for ``/metrics``
(:mod:`maitre.control.metrics`).
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from maitre import protocol as p
from maitre.control import accounting
from maitre.control.cluster import ClusterState
from maitre.control.detectors import DetectorConfig
from maitre.control.eventlog import EventLog
from maitre.control.metrics import Metrics
from maitre.control.membership import LIVE, Membership
from maitre.control.journal import Journal
from maitre.control.nodes import NodeRegistry
from maitre.control.orders import Orders
from maitre.control.store import Store
from maitre.control import nodenews, passes, views
from maitre.control.restore import restore
from maitre.control.workers import WorkerIndex
from maitre.errors import BadRequest, NotFound
from maitre.scheduling.model import Job, Node
from maitre.scheduling.policy import schedule
from maitre.scheduling.spec import ManifestError, parse_manifest

if TYPE_CHECKING:  # (torch: the controller itself never imports it)
    from maitre.control.storedoor import Stores

log = logging.getLogger("maitre.coordinator")

_VOUCH_SLACK_S = 0.5
"""How late a node beat may come past its ``interval_s`` before its workers' silence counts (a
loaded agent, the network; the agent beats every ``urgent_s`` once a worker falls silent)."""
_LOST_CHECK_S = 0.5
"""Workers silent past ``dead_after_s`` (15 s) are looked for this often; hangs, every tick."""
_REPORTS_KEPT = 4096
"""A job's recovery, checkpoint and restore reports kept in memory (the newest; the event log
keeps them all)."""
_PROGRESS_EVENT_S = 0.5
"""A job's progress reports closer than this become no event (rank 0 sends one a second; two
rank 0s around a resize would send more): the event log grows by at most two a second a job."""
_EVENT_OF_REPORT = {
    "recovery": "report",
    "caught_up": "caught_up",
    "checkpoint": "checkpoint",
    "restore": "restore",
    "progress": "progress",
    "straggler": "straggler",
}


F = TypeVar("F", bound=Callable[..., Any])


def acknowledged(method: F) -> F:
    """A call's changes are durable before it answers: once it let go of the lock (so the
    others go on) it waits until the jobs it changed are saved and committed (:meth:`durable`)."""

    @functools.wraps(method)
    def call(self: "Coordinator", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.durable(*self.take_pending())  # (nothing to wait for without a store)

    return call  # type: ignore[return-value]


class Coordinator:
    """Thread-safe owner of all jobs and nodes (see the module docstring)."""

    def __init__(
        self,
        store_address: str,
        cfg: DetectorConfig | None = None,
        clock: Callable[[], float] = time.time,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        *,
        cluster: ClusterState,
        store: Store | None = None,
        pass_s: float = 0.5,
        stores: "Stores | None" = None,
    ) -> None:
        self.store_address = store_address
        """Where workers reach the door of their run's c10d store (``HOST:PORT``)."""
        self.stores = stores
        """One c10d store per run of a job, behind that door (None: in-process tests)."""
        self.store_id = secrets.token_hex(8)
        """Names this coordinator's stores: workers reconnect when it changes (a restart)."""
        self.tokens: dict[str, Membership] = {}
        """Each run's token -> its membership: what a worker's credential opens."""
        self._runs_ended: dict[str, float] = {}
        self._next_store_check = 0.0
        self.cfg = cfg or DetectorConfig()
        self.clock = clock
        self.on_event = on_event
        self.on_wake: Callable[[set[str], set[str]], None] = lambda nodes, jobs: None
        """Called (under the lock) with the nodes whose orders changed and the jobs whose
        membership changed: the API wakes the watches and rendezvous waiting on them."""
        self.lock = threading.RLock()
        self.jobs: dict[str, Membership] = {}
        self.nodes = NodeRegistry()
        """Every node whose agent beat, and its orders' versions (:mod:`maitre.control.nodes`)."""
        self.reports: dict[str, deque[dict[str, Any]]] = {}
        """Per job, its workers' reports but progress, newest :data:`_REPORTS_KEPT`."""
        self.progress: dict[str, dict[str, Any]] = {}
        """Per job, its latest progress report (``t``: when it came, coordinator clock)."""
        self.metrics = Metrics(self)
        """``/metrics``: counted from the events as they are emitted, the rest read at scrape."""
        self.cluster = cluster
        self.db = store
        self.pass_s = pass_s
        self._next_pass = 0.0
        self.journal = Journal(store, self.lock, self._record) if store is not None else None
        """Saves what calls changed before they answer (:mod:`maitre.control.journal`)."""
        self._next_lost_check = 0.0
        self.workers = WorkerIndex()
        """Each worker's run, each node's workers (:mod:`maitre.control.workers`)."""
        self.orders = Orders(self)
        """What each node's agent is told (:mod:`maitre.control.orders`)."""
        """Per node, the workers that hold (or may still hold) its slots."""
        self.spare_jobs: set[str] = set()
        """Jobs whose runs keep warm spares (the only ones a node's orders look at for them)."""
        self._emitted: dict[str, int] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}
        """Each membership's :meth:`~Membership.view_key` when its nodes were last told."""
        self._assigned: dict[str, tuple[Any, ...]] = {}
        """... and its :meth:`~Membership.assignment_key` when its waiters last asked."""
        self.boot = secrets.token_hex(8)
        """This process's id in every node's orders: its versions count from 0, not on from a
        previous coordinator's."""
        self._wake_jobs: set[str] = set()
        self.events = EventLog(store)
        """Every state change, numbered (:mod:`maitre.control.eventlog`)."""
        cluster.log = self._cluster_event
        if store is not None:
            restore(self)
        prices = dict(getattr(cluster, "prices", {}) or {})
        last = self.events.newest("prices")
        if prices and (last is None or last.get("prices") != prices):  # what cost is counted at
            self._emit(None, "prices", {"t": round(clock(), 4), "prices": prices})

    # -- jobs ------------------------------------------------------------------------------------
    @acknowledged
    def submit(self, manifest: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
        """A job manifest (YAML text or a mapping): checked whole, stored, then scheduled.
        ``env``: its workers' environment beyond the cluster's (in process only: ``maitre
        run``'s checkpoint settings and ledger)."""
        if not isinstance(manifest, (str, dict)):
            raise BadRequest("the request needs 'manifest': the job's YAML text or mapping", "body.manifest")
        with self.lock:
            try:
                parsed = parse_manifest(manifest, queues=set(self.cluster.queues))
                managed = self.cluster.submit(parsed, self.clock(), env)
            except (ManifestError, ValueError) as exc:
                raise BadRequest(str(exc), "body.manifest") from None
            self.persist({managed.id})
            self._next_pass = 0.0  # schedule it in the next tick
            return {"job_id": managed.id, "queue": parsed.queue, "priority": parsed.priority}

    def install(self, membership: Membership) -> None:
        job_id = membership.spec.job_id
        self.jobs[job_id] = membership
        self.tokens[membership.spec.token] = membership
        self.reports.setdefault(job_id, deque(maxlen=_REPORTS_KEPT))
        self._emitted[job_id] = 0
        if membership.spec.spares:
            self.spare_jobs.add(job_id)
        else:
            self.spare_jobs.discard(job_id)
        for w in membership.workers.values():
            self.workers.add(membership, w)

    def job(self, job_id: str) -> Membership:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}", "path.job") from None

    @acknowledged
    def scale(self, job_id: str, workers: int) -> dict[str, Any]:
        with self.lock:
            now = self.clock()
            try:
                ms = self.jobs.get(job_id)
                self.cluster.set_max(job_id, workers, ms, now)
                leaving = self.cluster.shrink_to_max(job_id, ms, now)
            except KeyError as exc:
                raise NotFound(exc.args[0], "path.job") from None
            except ValueError as exc:
                raise BadRequest(str(exc), "body.workers") from None
            self._next_pass = 0.0
            self._changed(job_id, persist=True)
            return {"target": workers, "leaving": leaving, "max_replicas": workers}

    @acknowledged
    def suspend(self, job_id: str, reason: str = "suspended by request") -> dict[str, Any]:
        with self.lock:
            managed = self.cluster.managed.get(job_id)
            if managed is None:
                raise NotFound(f"no job {job_id!r}", "path.job")
            if managed.job.state.ended:
                raise BadRequest(f"job {job_id} is {managed.job.state.value}", "path.job")
            if not managed.manifest.checkpoint_dir:
                raise BadRequest(
                    f"job {job_id} has no checkpointDir: suspending it would lose its progress (cancel it instead)",
                    "path.job",
                )
            deadline = None
            if managed.job.state.placed:
                try:  # refused (the run stopped meanwhile): nothing is changed
                    self.jobs[job_id].suspend(str(reason), self.clock())  # SUSPENDING
                except ValueError as exc:
                    raise BadRequest(str(exc), "path.job") from None
                deadline = self.clock() + managed.job.grace_period_s
            managed.hold(deadline)  # a user's suspension lasts until `maitre resume`
            self._changed(job_id, persist=True)
            return {"state": managed.job.state.value}

    @acknowledged
    def resume(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            managed = self.cluster.managed.get(job_id)
            if managed is None:
                raise NotFound(f"no job {job_id!r}", "path.job")
            if not managed.held:
                raise BadRequest(f"job {job_id} was not suspended by a user", "path.job")
            managed.release()
            self._next_pass = 0.0
            self._changed(job_id, persist=True)
            return {"state": managed.job.state.value}

    @acknowledged
    def cancel(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            try:
                self.cluster.cancel(job_id, self.jobs.get(job_id), self.clock())
            except KeyError as exc:
                raise NotFound(exc.args[0], "path.job") from None
            except ValueError as exc:
                raise BadRequest(str(exc), "path.job") from None
            self._next_pass = 0.0
            self._changed(job_id, persist=True)
            return {"state": "CANCELLED"}

    # -- agents ----------------------------------------------------------------------------------
    @acknowledged
    def node_heartbeat(self, node: str, beat: p.NodeBeat) -> p.NodeOrders:
        """An agent's beat: its node, and what each of its workers is doing. Returns its
        orders: workers to start and to kill, and its workers' views when they changed."""
        labels = beat.labels.given()
        now = self.clock()
        with self.lock:
            entry = self.nodes.beat(node, beat.slots, labels, now)
            try:
                described = Node(node, beat.slots, **labels)
            except ValueError as exc:
                raise BadRequest(str(exc), "body.labels") from None
            if self.nodes.agent_restarted(entry, beat.agent):
                nodenews.agent_restarted(self, node, now)
            change = self.cluster.node_beat(described, now, noticed=beat.notice is not None)
            if change and self.db is not None:
                self.db.put_node(described, now)
            if change == "node_shrunk":
                nodenews.evict_node(self, node, f"node {node} now has {beat.slots} slots", now)
            if change:
                self.bump(node)
            if beat.notice is not None:
                nodenews.noticed(self, node, beat.notice, now)
            if beat.health is not None:
                nodenews.probed(self, node, beat.health, now)
            running = set()
            for wb in beat.workers:
                running.add(wb.id)
                ms = self.workers.get(wb.id)
                if ms is None or ms.workers[wb.id].node != node:
                    continue  # not ours (a leftover of another coordinator's run): killed below
                seen = now - wb.silent_s if wb.silent_s is not None else 0.0
                vouched = (
                    now + beat.interval_s + _VOUCH_SLACK_S
                    if beat.interval_s and wb.silent_s is not None and wb.silent_s < p.SILENT_S
                    else 0.0
                )
                ms.progress(wb.id, seen, wb.step, wb.stalled, wb.trained_s, wb.gap_mean_s, wb.gap_std_s, vouched)
                if wb.joined_s is not None:
                    ms.joined(wb.id, now - wb.joined_s, now)
            self.nodes.listed(entry, running, now)
            return self.orders.of(node, beat.since, now)

    def try_now(
        self, method: Callable[..., Any], *args: Any, block: bool = False
    ) -> tuple[Any, tuple[int, int]] | None:
        """Call ``method`` (one of the :func:`acknowledged` ones) if the lock is free now (or
        once it is, with ``block``), else return None having done nothing. It does not wait for
        the store: it returns the result and what to wait for before the result goes out
        (:meth:`take_pending`, for :meth:`when_durable`). The API answers most beats and
        arrivals this way on its event loop, without a thread hand-off each, and no thread of
        its pool ever waits for a commit."""
        if not self.lock.acquire(blocking=block):
            return None
        try:
            result = method.__wrapped__(self, *args)
        except BaseException:
            self.take_pending()  # a refused call changed nothing: nothing to wait for
            raise
        finally:
            self.lock.release()
        return result, self.take_pending()

    def take_pending(self) -> tuple[int, int]:
        """What this thread's last calls left to make durable (:meth:`Journal.take_pending`)."""
        return self.journal.take_pending() if self.journal is not None else (0, 0)

    def durable(self, need: int, staged: int) -> None:
        """Wait until a call's changes are saved and committed (:meth:`Journal.durable`)."""
        if self.journal is not None:
            self.journal.durable(need, staged)

    def when_durable(self, need: int, staged: int, then: Callable[[BaseException | None], None]) -> None:
        """Call ``then`` once a call's changes are saved and committed (:meth:`Journal.when_durable`)."""
        if self.journal is None:
            then(None)
        else:
            self.journal.when_durable(need, staged, then)

    def node_version(self, node: str) -> int:
        return self.nodes.version(node)

    @acknowledged
    def node_orders(self, node: str, since: int) -> p.NodeOrders:
        """A watch's answer: the node's orders as of now (the node must have beaten once)."""
        with self.lock:
            if node not in self.nodes:
                raise NotFound(f"no node {node!r}: it has not sent a heartbeat", "path.node")
            return self.orders.of(node, since, self.clock())

    # -- warm spares (see maitre.control.membership) ---------------------------------------------
    def promote_spare(self, job_id: str, replacing: str | None) -> str | None:
        """A warm spare of the job joins its next epoch in place of ``replacing`` (a worker the
        health policy evicts; a lost member's spare is promoted without asking). Returns the
        spare's id, or None when the job has none ready or starting."""
        with self.lock:
            ms = self.job(job_id)
            spare = ms.promote_spare(replacing, self.clock())
            self._changed(job_id, persist=True)
            return None if spare is None else spare.id

    @acknowledged
    def worker_exit(self, wid: str, req: p.ExitRequest) -> dict[str, Any]:
        with self.lock:
            ms = self.workers.job_of(wid)
            ms.exited(
                wid,
                req.code,
                req.error,
                self.clock(),
                joined=req.joined,
                marked=req.marked,
                stderr=req.stderr,
                noticed=bool(req.noticed),
            )
            self.bump(ms.workers[wid].node)  # its slots are free: a replacement may start
            self.cluster.check_drained(ms.workers[wid].node, self.clock())
            self._changed(ms.spec.job_id)
        return {}

    # -- workers ---------------------------------------------------------------------------------
    @acknowledged
    def arrive(self, wid: str, req: p.RendezvousRequest) -> tuple[str, dict[str, Any] | None]:
        """A worker enters the rendezvous after ``from_epoch``. Returns its job and its answer,
        or None while it must wait (:meth:`assignment` asks again when the job changes)."""
        with self.lock:
            job = self.workers.job_of(wid)
            job.arrive(
                wid,
                req.from_epoch,
                req.step,
                req.reason,
                self.clock(),
                group_failed=req.group_failed,
                unreachable=req.unreachable,
            )
            job_id = job.spec.job_id
            self.touch(job_id)
            answer = self._answer(job, wid, req.from_epoch)
            self.flush()
            return job_id, answer

    @acknowledged
    def assignment(self, wid: str, from_epoch: int) -> dict[str, Any] | None:
        with self.lock:
            answer = self._answer(self.workers.job_of(wid), wid, from_epoch)
            self.flush()
            return answer

    def _answer(self, job: Membership, wid: str, from_epoch: int) -> dict[str, Any] | None:
        if job.try_open_epoch(self.clock()):
            self.touch(job.spec.job_id)
        answer = job.assignment(wid, from_epoch)
        if answer is not None:
            key = job.spec.run_key
            if self.stores is not None:
                self.stores.open(key, job.spec.token)
            answer.update(store=self.store_address, store_key=key, store_id=f"{self.store_id}/{key}")
        return answer

    def credential(self, token: str, wid: str | None) -> int:
        """May a request presenting ``token`` act for worker ``wid`` (None: on a route that is
        no worker's)? 200: yes (one of that run's workers), 401: it is no run's token, 403: no
        (another job's worker, or not a worker's route), 404: no such worker. Read without the
        lock (a dict lookup or two), for the API's gate."""
        ms = self.tokens.get(token)
        if ms is None:
            return 401
        if wid is None:
            return 403
        owner = self.workers.get(wid)
        if owner is None:
            return 404
        return 200 if owner.spec.token == token else 403

    def rendezvous(self, wid: str, req: p.RendezvousRequest) -> dict[str, Any]:
        """:meth:`arrive` and wait (blocking this thread) up to ``wait_s`` for the answer; the
        API waits without holding a thread, this is for in-process callers and tests."""
        deadline = time.monotonic() + req.wait_s
        _, answer = self.arrive(wid, req)
        while answer is None and time.monotonic() < deadline:
            time.sleep(0.01)
            answer = self.assignment(wid, req.from_epoch)
        return answer if answer is not None else {"action": "wait"}

    @acknowledged
    def worker_done(self, wid: str, req: p.DoneRequest) -> dict[str, Any]:
        with self.lock:
            ms = self.workers.job_of(wid)
            ms.done(wid, req.step, self.clock(), suspended=req.suspended)
            self._changed(ms.spec.job_id)
        return {}

    @acknowledged
    def worker_left(self, wid: str) -> dict[str, Any]:
        with self.lock:
            ms = self.workers.job_of(wid)
            ms.left(wid, self.clock())
            self._changed(ms.spec.job_id)
        return {}

    @acknowledged
    def worker_report(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            ms = self.workers.job_of(wid)
            job_id = ms.spec.job_id
            managed = self.cluster.managed.get(job_id)
            report = {
                "worker": wid,
                **body,  # epochs count again in each incarnation
                "incarnation": managed.incarnation if managed is not None else 1,
            }
            kind = body.get("kind", "recovery")
            if kind == "straggler":  # about the slow worker (rank 0 found it), and its node
                slow = ms.workers.get(report.pop("straggler"))
                report = {
                    **report,
                    "worker": body["straggler"],
                    "reporter": wid,
                    "node": slow.node if slow is not None else None,
                }
            if kind == "progress":  # the latest only: one a second a job, for as long as it runs
                now = self.clock()
                last = self.progress.get(job_id)
                self.progress[job_id] = {**report, "t": round(now, 4)}
                if last is not None and now - last["t"] < _PROGRESS_EVENT_S:
                    return {}
            else:
                self.reports[job_id].append(report)
            self._emit(job_id, _EVENT_OF_REPORT[kind], report)
            if kind == "straggler" and report.get("policy") == "evict":
                nodenews.evict_straggler(self, ms, report, self.clock())
                self.flush()
        return {}

    # -- failure detector and scheduler ----------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            lost = now >= self._next_lost_check
            if lost:
                self._next_lost_check = now + _LOST_CHECK_S
            for job_id, job in self.jobs.items():
                dead = job.detect_failures(now, lost=lost)
                for wid in dead:
                    node = job.workers[wid].node
                    self.nodes.kill(node, wid)
                    self.bump(node)
                if job.try_open_epoch(now) or dead:
                    self.touch(job_id)
            pending = None
            if now >= self._next_pass:
                self._next_pass = now + self.pass_s
                began = time.perf_counter()  # (self.clock may be a test's)
                pending = passes.begin(self, now)
                pass_s = time.perf_counter() - began
            if self.journal is not None:
                self.journal.save_progress(now, lambda: list(self.cluster.managed), self.cluster.usage.snapshot)
            if self.stores is not None and now >= self._next_store_check:
                self._next_store_check = now + 1.0
                self._close_stores(now)
            self.flush()
        self.durable(*self.take_pending())
        if pending is None:
            return
        # The policy runs with the lock free (tens of milliseconds at a thousand nodes: beats
        # go on meanwhile); its plan is applied only to the cluster it was made for.
        view, jobs, before, made_on = pending
        began = time.perf_counter()  # (the store's commit above is not the pass's)
        plan = schedule(view, jobs, now, self.cluster.policy)
        with self.lock:
            if self.cluster.fingerprint() == made_on:
                passes.end(self, plan, before, self.clock())
            else:
                self._next_pass = 0.0  # the cluster changed meanwhile: plan again next tick
            self.flush()
            self.metrics.scheduling_pass(pass_s + time.perf_counter() - began)
        self.durable(*self.take_pending())

    def _close_stores(self, now: float) -> None:
        """Close the c10d stores of runs over for a minute (their workers have long stopped
        using them; a store is only met while a group forms)."""
        assert self.stores is not None
        keep = set()
        for ms in self.jobs.values():
            key = ms.spec.run_key
            if not ms.over:
                self._runs_ended.pop(key, None)
                keep |= ms.store_keys()
            elif now - self._runs_ended.setdefault(key, now) < 60.0:
                keep |= ms.store_keys()
        self.stores.retain(keep)

    # -- read models (maitre.control.views) ------------------------------------------------------
    def on_node(self, node: str) -> set[str]:
        """The workers that hold (or may still hold) slots of ``node``."""
        return self.workers.on(node)

    def worker_job(self, wid: str) -> Membership:
        """The run a worker id belongs to (KeyError: none of this coordinator's)."""
        return self.workers.run(wid)

    def job_status(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            return views.job_status(self, job_id)

    def job_list(self) -> list[dict[str, Any]]:
        with self.lock:
            return views.job_list(self)

    def nodes_view(self) -> list[dict[str, Any]]:
        with self.lock:
            return views.nodes(self)

    def queues_view(self) -> list[dict[str, Any]]:
        with self.lock:
            return views.queues(self.cluster)

    def report(self) -> dict[str, Any]:
        with self.lock:
            return accounting.report(self.cluster, self.jobs, self.clock())

    def dashboard_meta(self) -> dict[str, Any]:
        """What the dashboard's page needs besides the event log."""
        prices = getattr(self.cluster, "prices", None)
        return {"source": "coordinator", "now": self.clock(), "prices": dict(prices) if prices else None}

    def replan(self) -> None:
        """Schedule again in the next tick (something the policy reads changed)."""
        self._next_pass = 0.0

    # -- changes ---------------------------------------------------------------------------------
    def bump(self, node: str) -> None:
        """The node's orders changed: its watch answers."""
        self.nodes.bump(node)

    def touch(self, job_id: str, persist: bool = False) -> None:
        self._wake_jobs.add(job_id)
        if persist:
            self._keys.pop(job_id, None)

    def _changed(self, job_id: str, persist: bool = False) -> None:
        self.touch(job_id, persist)
        self.flush()

    def flush(self) -> None:
        """After a call: every job it touched whose views moved wakes its nodes, is saved, and
        its new events go out."""
        if not self._wake_jobs and not self.nodes.woken():
            return
        jobs, self._wake_jobs = self._wake_jobs, set()
        save, woken = set(), set()
        for job_id in jobs:
            ms = self.jobs.get(job_id)
            if ms is None:
                save.add(job_id)  # a managed job not admitted yet
                continue
            if ms.promotions:
                self.orders.spares_moved(job_id, ms)
            assigned = ms.assignment_key()
            if self._assigned.get(job_id) != assigned:  # its rendezvous waiters ask again
                self._assigned[job_id] = assigned
                woken.add(job_id)
            key = ms.view_key()
            if self._keys.get(job_id) != key:
                self._keys[job_id] = key
                save.add(job_id)
                for w in ms.workers.values():
                    if w.ended_at is None and w.state in LIVE:
                        self.bump(w.node)
            events = ms.events
            for event in events[self._emitted[job_id] :]:
                self._emit(job_id, event["kind"], event)
                if event["kind"] == "gang_stopped":
                    self._wake_placed(job_id)
            self._emitted[job_id] = len(events)
        self.persist(save)
        self.on_wake(self.nodes.take_woken(), woken)

    def _wake_placed(self, job_id: str) -> None:
        """A restart-mode gang is gone and the next one forms: every node the job is placed on
        hears it now (its start order), not at its next beat. A node with a worker of the gang
        was woken by its exit; one that joined had none (a node's beat is 2 s apart: the
        whole new gang waited that long in its process group for a joiner's worker)."""
        managed = self.cluster.managed.get(job_id)
        for node in managed.job.placement if managed is not None else ():
            if node in self.nodes:
                self.bump(node)

    # -- persistence -----------------------------------------------------------------------------
    def persist(self, job_ids: set[str]) -> None:
        """Mark jobs to save (under the lock); the call saves them when it let go of it
        (:meth:`durable`)."""
        if self.journal is not None:
            self.journal.mark(job_ids)

    def _record(self, job_id: str) -> tuple[Job, dict[str, Any]] | None:
        """A managed job's scheduler view and record, for the journal (under the lock)."""
        m = self.cluster.managed.get(job_id)
        if m is None:
            return None
        return m.job, m.record(self.jobs.get(m.id) if m.incarnation else None)

    # -- helpers ---------------------------------------------------------------------------------
    def _cluster_event(self, now: float, kind: str, job: str | None = None, **fields: Any) -> None:
        self._emit(job, kind, {"t": round(now, 4), **fields})

    def _emit(self, job_id: str | None, kind: str, event: dict[str, Any]) -> None:
        self.metrics.observe(job_id, kind, event)
        body = {k: v for k, v in event.items() if k not in ("kind", "t", "job")}
        self.events.append(event.get("t", round(self.clock(), 4)), kind, job_id, body)
        if self.on_event is not None:
            self.on_event(job_id or "", {**event, "kind": kind})
