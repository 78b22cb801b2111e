"""The coordinator: an HTTP API over the membership state machine, and the c10d store host.

One coordinator per cluster. It hosts the ``TCPStore`` that every epoch's process group
rendezvous on (under the epoch's own prefix), keeps each job's :class:`Membership`, answers
workers (heartbeat, rendezvous long-poll, done, left) and agents (node heartbeat with start/kill
directives, process exits), and runs the failure detector every ``tick_s``.

All state changes happen under one lock; a condition variable wakes the rendezvous long-polls
when an epoch opens. Routes (JSON, under ``/v1``)::

    GET  /health       GET /jobs     GET /jobs/<job>     GET /nodes     GET /queues     GET /report
    POST /jobs            (JobSpec; with a cluster: {"manifest": YAML text or mapping})
    POST /jobs/<job>/scale {"workers": n}     (with a cluster: the job's new maxReplicas)
    POST /jobs/<job>/suspend {"reason": "..."}   (members checkpoint, then stop)
    POST /jobs/<job>/resume    POST /jobs/<job>/cancel          (cluster jobs)
    POST /nodes/<node>/heartbeat {"slots": n, "labels": {...}, "running": [worker ids]}
                                 -> {"start": [...], "kill": [...]}
    POST /workers/<w>/exit {"code": c, "error": "..."}
    POST /workers/<w>/heartbeat {"step": s, "stalled": b}
    POST /workers/<w>/rendezvous {"from_epoch": e, "step": s, "reason": "...", "wait_s": t}
    POST /workers/<w>/done {"step": s, "suspended": b}   POST /workers/<w>/left   POST /workers/<w>/report {...}

With a ``token`` every route but ``/health`` (left open for liveness probes) needs the header
``Authorization: Bearer <token>``; a call without it gets 401. ``maitre run`` always sets one and
writes it to a file only its owner can read; agents pass it to their workers as ``MAITRE_TOKEN``.
The c10d store port is not covered: it must stay on a trusted network, as torchrun's does.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import sys
import threading
import time
import traceback
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch.distributed as dist

from maitre.control.cluster import ClusterState, ManagedJob
from maitre.control.membership import (ENDED, LIVE, DetectorConfig, JobSpec, Membership,
                                       WorkerState)
from maitre.control.store import Store
from maitre.scheduling.model import Node, Phase
from maitre.scheduling.spec import ManifestError, parse_manifest
from maitre.wire import API


class BadRequest(ValueError):
    pass


class NotFound(KeyError):
    pass


class Coordinator:
    """Thread-safe owner of all jobs and nodes. Time comes from ``clock`` (wall seconds).

    With a :class:`ClusterState` (``maitre up``) jobs are submitted as manifests and the
    scheduling policy sizes and places them; with a :class:`Store` every change is persisted and
    a restarted coordinator carries on from it. Without either (``maitre run``) there is one
    job, sized by hand, on whichever nodes join.
    """

    def __init__(self, store_address: str, cfg: DetectorConfig | None = None,
                 clock: Callable[[], float] = time.time,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 cluster: ClusterState | None = None, store: Store | None = None,
                 pass_s: float = 0.5) -> None:
        self.store_address = store_address
        self.store_id = secrets.token_hex(8)
        """Names this coordinator's c10d store: workers reconnect when it changes (a restart)."""
        self.cfg = cfg or DetectorConfig()
        self.clock = clock
        self.on_event = on_event
        self.cond = threading.Condition()
        self.jobs: dict[str, Membership] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, list[dict[str, Any]]] = {}
        self.cluster = cluster
        self.db = store
        self.pass_s = pass_s
        self._next_pass = 0.0
        self._next_save = 0.0
        self._persisted: dict[str, str] = {}
        self._worker_job: dict[str, Membership] = {}
        self._pending_kills: dict[str, set[str]] = {}
        self._emitted: dict[str, int] = {}
        if cluster is not None:
            cluster.log = self._cluster_event
            if store is not None:
                self._restore()

    # -- jobs ------------------------------------------------------------------------------------
    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.cluster is not None:
            return self.submit(body.get("manifest"))
        try:
            spec = JobSpec(**body)
        except TypeError as exc:
            raise BadRequest(f"invalid job spec: {exc}") from None
        with self.cond:
            if spec.job_id in self.jobs:
                raise BadRequest(f"job {spec.job_id!r} already exists")
            self._install(Membership(spec, self.cfg, self.clock()))
            return {"job_id": spec.job_id}

    def submit(self, manifest: Any) -> dict[str, Any]:
        """A job manifest (YAML text or a mapping): checked whole, stored, then scheduled."""
        assert self.cluster is not None
        if not isinstance(manifest, (str, dict)):
            raise BadRequest("the request needs 'manifest': the job's YAML text or mapping")
        with self.cond:
            try:
                parsed = parse_manifest(manifest, queues=set(self.cluster.queues))
                managed = self.cluster.submit(parsed, self.clock())
            except (ManifestError, ValueError) as exc:
                raise BadRequest(str(exc)) from None
            self._persist()
            self._next_pass = 0.0  # schedule it in the next tick
            return {"job_id": managed.id, "queue": parsed.queue, "priority": parsed.priority}

    def _install(self, membership: Membership) -> None:
        job_id = membership.spec.job_id
        self.jobs[job_id] = membership
        self.reports.setdefault(job_id, [])
        self._emitted[job_id] = 0
        for wid in membership.workers:
            self._worker_job[wid] = membership

    def job(self, job_id: str) -> Membership:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    def job_status(self, job_id: str) -> dict[str, Any]:
        with self.cond:
            if self.cluster is not None and job_id in self.cluster.managed and \
                    job_id not in self.jobs:  # submitted, never admitted yet
                return {**_NOT_STARTED, **self._managed_summary(job_id), "events": [],
                        "reports": []}
            job = self.job(job_id)
            return {**job.summary(), **self._managed_summary(job_id), "events": list(job.events),
                    "reports": list(self.reports[job_id])}

    def job_list(self) -> list[dict[str, Any]]:
        with self.cond:
            ids = list(self.jobs) + [j for j in (self.cluster.managed if self.cluster else {})
                                     if j not in self.jobs]
            out = []
            for jid in ids:
                base = self.jobs[jid].summary() if jid in self.jobs else _NOT_STARTED
                out.append({**base, **self._managed_summary(jid)})
            return out

    def _managed_summary(self, job_id: str) -> dict[str, Any]:
        """The scheduler's side of a managed job (nothing for a ``maitre run`` job)."""
        m = self.cluster.managed.get(job_id) if self.cluster is not None else None
        if m is None:
            return {}
        state = m.ended or m.job.phase.value
        if m.ended is None and m.job.phase == Phase.RUNNING and m.id in self.jobs:
            state = self.jobs[m.id].state.value  # PENDING (gang forming), RENDEZVOUS, RUNNING
        return {"job_id": m.id, "state": state, "phase": m.job.phase.value, "queue": m.job.queue,
                "priority": m.job.priority, "min_workers": m.job.min_replicas,
                "max_workers": m.job.max_replicas, "placement": dict(m.job.placement),
                "incarnation": m.incarnation, "held": m.held,
                "waiting_for": m.last_waiting if m.job.phase == Phase.PENDING else ""}

    def scale(self, job_id: str, workers: Any) -> dict[str, Any]:
        if not isinstance(workers, int) or isinstance(workers, bool):
            raise BadRequest(f"'workers' must be an integer, got {workers!r}")
        with self.cond:
            now = self.clock()
            if self.cluster is not None:
                try:
                    self.cluster.set_max(job_id, workers, now)
                    self.cluster.shrink_to_max(job_id, self.jobs.get(job_id), now)
                except KeyError as exc:
                    raise NotFound(exc.args[0]) from None
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None
                self._next_pass = 0.0
                self._changed()
                return {"target": workers, "leaving": [], "max_replicas": workers}
            job = self.job(job_id)
            if job.state in ENDED:
                raise BadRequest(f"job {job_id} is {job.state.value}")
            try:
                leaving = job.scale(workers, now)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            self._changed()
            return {"target": workers, "leaving": leaving}

    def suspend(self, job_id: str, reason: Any = "suspended by request") -> dict[str, Any]:
        with self.cond:
            managed = self.cluster.managed.get(job_id) if self.cluster is not None else None
            if managed is not None:
                if managed.ended is not None:
                    raise BadRequest(f"job {job_id} is {managed.ended}")
                if not managed.manifest.checkpoint_dir:
                    raise BadRequest(f"job {job_id} has no checkpointDir: suspending it would "
                                     "lose its progress (cancel it instead)")
                managed.held = True  # a user's suspension lasts until `maitre resume`
                if managed.job.phase != Phase.RUNNING:
                    self._changed()
                    return {"state": managed.job.phase.value}
                managed.job.phase = Phase.SUSPENDING
                managed.suspend_deadline = self.clock() + managed.job.grace_period_s
            job = self.job(job_id)
            try:
                job.suspend(str(reason), self.clock())
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            self._changed()
            return {"state": job.state.value}

    def resume(self, job_id: str) -> dict[str, Any]:
        with self.cond:
            managed = self.cluster.managed.get(job_id) if self.cluster is not None else None
            if managed is None:
                raise NotFound(f"no managed job {job_id!r}")
            if not managed.held:
                raise BadRequest(f"job {job_id} was not suspended by a user")
            managed.held = False
            self._next_pass = 0.0
            self._changed()
            return {"state": managed.job.phase.value}

    def cancel(self, job_id: str) -> dict[str, Any]:
        with self.cond:
            if self.cluster is None:
                raise BadRequest("cancel is for submitted jobs (maitre up); stop a maitre run "
                                 "with Ctrl-C")
            try:
                self.cluster.cancel(job_id, self.jobs.get(job_id), self.clock())
            except KeyError as exc:
                raise NotFound(exc.args[0]) from None
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            self._next_pass = 0.0
            self._changed()
            return {"state": "CANCELLED"}

    # -- agents ----------------------------------------------------------------------------------
    def node_heartbeat(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        slots = body.get("slots")
        running = body.get("running", [])
        labels = body.get("labels") or {}
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise BadRequest(f"'slots' must be a positive integer, got {slots!r}")
        if not isinstance(running, list) or not all(isinstance(w, str) for w in running):
            raise BadRequest("'running' must be a list of worker ids")
        if not isinstance(labels, dict) or set(labels) - _LABELS or \
                not all(isinstance(v, str) for v in labels.values()):
            raise BadRequest(f"'labels' must map some of {sorted(_LABELS)} to strings, "
                             f"got {labels!r}")
        now = self.clock()
        with self.cond:
            info = self.nodes.setdefault(node, {"slots": slots, "registered_at": now})
            info.update(slots=slots, last_heartbeat=now, labels=labels)
            if self.cluster is not None:
                try:
                    described = Node(node, slots, **labels)
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None
                change = self.cluster.node_beat(described, now)
                if change and self.db is not None:
                    self.db.put_node(described, now)
                if change == "node_shrunk":
                    self._evict_node(node, f"node {node} now has {slots} slots", now)
            start: list[dict[str, Any]] = []
            kill = sorted(self._pending_kills.pop(node, set()))
            # Slots in use: processes the agent runs, and workers it was asked to start that
            # it does not list yet (it starts them off its heartbeat thread).
            used: set[int] = set()
            for wid, ms in self._worker_job.items():
                w = ms.workers[wid]
                if w.node == node and (wid in running or (w.state in LIVE and w.ended_at is None
                                                          and w.exit_code is None)):
                    used.update(range(w.slot, w.slot + w.slots))
            for wid in running:
                ms = self._worker_job.get(wid)
                if ms is not None:
                    w = ms.workers[wid]
                    # Processes the coordinator gave up on, or leftovers of an ended run.
                    if wid not in kill and (w.state == WorkerState.DEAD or (
                            ms.state in ENDED and w.state not in (WorkerState.DONE,
                                                                  WorkerState.LEFT))):
                        kill.append(wid)
            alive = self.cluster is None or self.cluster.nodes[node].alive
            for job in self.jobs.values():
                want = job.wants_workers() if alive else 0
                per = 1
                if self.cluster is not None:
                    want = min(want, self.cluster.allowed_on(job.spec.job_id, job, node))
                    per = self.cluster.slots_per_worker(job.spec.job_id)
                for _ in range(want):
                    slot = next((s for s in range(0, slots - per + 1)
                                 if not used.intersection(range(s, s + per))), None)
                    if slot is None:
                        break
                    worker = job.add_worker(node, slot, now, slots=per)
                    used.update(range(slot, slot + per))
                    self._worker_job[worker.id] = job
                    start.append({"worker_id": worker.id, "job_id": job.spec.job_id,
                                  "command": job.spec.command, "env": dict(job.spec.env),
                                  "local_rank": slot, "slots": per, "store": self.store_address})
            if start:
                self._changed()
            return {"start": start, "kill": kill}

    def worker_exit(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        code = body.get("code")
        if not isinstance(code, int):
            raise BadRequest(f"'code' must be an integer, got {code!r}")
        with self.cond:
            self._job_of(wid).exited(wid, code, body.get("error"), self.clock())
            self._changed()
        return {}

    # -- workers ---------------------------------------------------------------------------------
    def worker_heartbeat(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            return self._job_of(wid).heartbeat(wid, self.clock(), int(body.get("step", 0)),
                                               bool(body.get("stalled", False)),
                                               float(body.get("trained_s", 0.0)))

    def rendezvous(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        from_epoch = body.get("from_epoch")
        if not isinstance(from_epoch, int) or from_epoch < 0:
            raise BadRequest(f"'from_epoch' must be a non-negative integer, got {from_epoch!r}")
        wait_s = min(float(body.get("wait_s", 5.0)), 30.0)
        deadline = time.monotonic() + wait_s
        with self.cond:
            job = self._job_of(wid)
            job.arrive(wid, from_epoch, int(body.get("step", 0)), str(body.get("reason", "")),
                       self.clock())
            self._changed()
            while True:
                if job.try_open_epoch(self.clock()):
                    self._changed()
                answer = job.assignment(wid, from_epoch)
                if answer is not None:
                    answer["store"] = self.store_address
                    answer["store_id"] = self.store_id
                    return answer
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"action": "wait"}
                self.cond.wait(min(remaining, 0.25))

    def worker_done(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            self._job_of(wid).done(wid, int(body.get("step", 0)), self.clock(),
                                   suspended=bool(body.get("suspended", False)))
            self._changed()
        return {}

    def worker_left(self, wid: str) -> dict[str, Any]:
        with self.cond:
            self._job_of(wid).left(wid, self.clock())
            self._changed()
        return {}

    def worker_report(self, wid: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            job_id = self._job_of(wid).spec.job_id
            managed = self.cluster.managed.get(job_id) if self.cluster is not None else None
            report = {"worker": wid, **body,  # epochs count again in each incarnation
                      "incarnation": managed.incarnation if managed is not None else 1}
            self.reports[job_id].append(report)
            self._emit(job_id, "report", report)
        return {}

    # -- failure detector and scheduler ----------------------------------------------------------
    def tick(self) -> None:
        with self.cond:
            now = self.clock()
            changed = False
            for job in self.jobs.values():
                for wid in job.detect_failures(now):
                    self._pending_kills.setdefault(job.workers[wid].node, set()).add(wid)
                    changed = True
                changed |= job.try_open_epoch(now)
            if self.cluster is not None and now >= self._next_pass:
                self._next_pass = now + self.pass_s
                changed |= self._schedule(now)
                if self.db is not None and now >= self._next_save:  # progress, accounting
                    self._next_save = now + 5.0
                    self._persist()
                    self.db.put_meta("usage", self.cluster.usage.snapshot())
            if changed:
                self._changed()

    def _schedule(self, now: float) -> bool:
        """One pass: dead nodes, the policy, its actions, the accounting."""
        cluster = self.cluster
        assert cluster is not None
        for node in cluster.detect_dead_nodes(now):
            self._evict_node(node, f"node {node} is dead (no agent heartbeat)", now)
        cluster.sync(self.jobs, now)
        plan = cluster.plan(now)
        for kind, _, membership in cluster.apply(plan, self.jobs, now):
            if kind == "start":
                self._install(membership)
        for m in cluster.managed.values():
            m.workers_started = max(m.workers_started, self.jobs[m.id].workers_added
                                    if m.id in self.jobs and m.incarnation else 0)
        cluster.tick_usage(self.jobs, now)
        return bool(plan.actions)

    def _evict_node(self, node: str, reason: str, now: float) -> None:
        """Its workers are gone for the coordinator (their jobs recover as from a crash); its
        agent is told to kill any that still run."""
        for job in self.jobs.values():
            for w in job.live_workers():
                if w.node == node:
                    job.evict(w.id, reason, now)
                    self._pending_kills.setdefault(node, set()).add(w.id)

    def report(self) -> dict[str, Any]:
        with self.cond:
            if self.cluster is None:
                raise BadRequest("no cluster report: this coordinator runs one job (maitre run)")
            return self.cluster.report(self.jobs, self.clock())

    def nodes_view(self) -> list[dict[str, Any]]:
        with self.cond:
            now = self.clock()
            out = []
            for name, info in sorted(self.nodes.items()):
                held = [(wid, ms) for wid, ms in self._worker_job.items()
                        if ms.workers[wid].node == name and ms.workers[wid].state in LIVE]
                state = self.cluster.nodes.get(name) if self.cluster is not None else None
                out.append({"node": name, "slots": info["slots"], "labels": info.get("labels", {}),
                            "alive": True if state is None else state.alive,
                            "phi": None if state is None else round(min(state.detector.phi(now), 1e6), 2),
                            "used": sum(ms.workers[w].slots for w, ms in held),
                            "workers": [w for w, _ in held],
                            "last_heartbeat_s": round(now - info.get("last_heartbeat", now), 2)})
            return out

    def queues_view(self) -> list[dict[str, Any]]:
        with self.cond:
            if self.cluster is None:
                return []
            usage: dict[str, int] = {}
            for m in self.cluster.managed.values():
                if m.ended is None:
                    usage[m.job.queue] = usage.get(m.job.queue, 0) + m.job.slots
            return [{"queue": q.name, "guaranteed": q.guaranteed,
                     "borrowing_limit": q.borrowing_limit, "weight": q.weight,
                     "allocated": usage.get(q.name, 0),
                     "jobs": sum(1 for m in self.cluster.managed.values()
                                 if m.job.queue == q.name and m.ended is None)}
                    for q in self.cluster.queues.values()]

    # -- persistence -----------------------------------------------------------------------------
    def _persist(self) -> None:
        """Write every managed job whose state changed (one transaction each)."""
        if self.db is None or self.cluster is None:
            return
        for m in self.cluster.managed.values():
            ms = self.jobs.get(m.id) if m.incarnation else None
            extra = self.cluster.job_extra(m, ms)
            text = json.dumps([extra, m.job.phase.value, m.job.placement, m.job.max_replicas,
                               m.job.throughput, m.job.last_resize_at], sort_keys=True, default=str)
            if self._persisted.get(m.id) != text:
                self.db.put_job(m.job, extra)
                self._persisted[m.id] = text

    def _restore(self) -> None:
        """Carry on from the store: nodes, queues, jobs and their memberships."""
        assert self.cluster is not None and self.db is not None
        now = self.clock()
        cluster = self.cluster
        stored = self.db.cluster()
        for q in stored.queues.values():
            cluster.queues.setdefault(q.name, q)
        for q in cluster.queues.values():
            self.db.put_queue(q)
        for node in stored.nodes.values():
            cluster.node_beat(node, now)
            self.nodes[node.name] = {"slots": node.slots, "registered_at": now,
                                     "last_heartbeat": now}
        for job, extra in self.db.jobs():
            manifest = parse_manifest({k: v for k, v in extra["manifest"].items()
                                       if v is not None})
            job.attained_slot_s = extra.get("attained_slot_s", 0.0)
            managed = ManagedJob(manifest, job, incarnation=extra["incarnation"],
                                 workers_started=extra["workers_started"], ended=extra["ended"],
                                 held=extra["held"], admitted_at=extra["admitted_at"],
                                 ended_at=extra["ended_at"], productive_s=extra["productive_s"],
                                 suspend_deadline=extra["suspend_deadline"],
                                 generation=extra.get("generation", 0))
            managed.history = [Membership.from_json(h, self.cfg, now) for h in extra["history"]]
            for h in managed.history:
                for wid in h.workers:
                    self._worker_job[wid] = h
            cluster.managed[job.id] = managed
            if extra["membership"] is not None:
                ms = Membership.from_json(extra["membership"], self.cfg, now)
                managed.seen_trained = {w.id: w.trained_s for w in ms.workers.values()}
                self._install(ms)
        usage = self.db.meta("usage")
        if usage:
            cluster.usage.restore(usage)
        if cluster.managed or cluster.nodes:
            cluster.log(now, "coordinator_restarted", jobs=len(cluster.managed),
                        nodes=len(cluster.nodes))

    # -- helpers ---------------------------------------------------------------------------------
    def _job_of(self, wid: str) -> Membership:
        try:
            return self._worker_job[wid]
        except KeyError:
            raise NotFound(f"unknown worker {wid!r}") from None

    def _changed(self) -> None:
        self.cond.notify_all()
        for job_id, job in self.jobs.items():
            for event in job.events[self._emitted[job_id]:]:
                self._emit(job_id, event["kind"], event)
            self._emitted[job_id] = len(job.events)
        self._persist()

    def _cluster_event(self, now: float, kind: str, job: str | None = None, **fields: Any) -> None:
        self._emit(job, kind, {"t": round(now, 4), **fields})

    def _emit(self, job_id: str | None, kind: str, event: dict[str, Any]) -> None:
        if self.db is not None:
            body = {k: v for k, v in event.items() if k not in ("kind", "t")}
            self.db.add_event(event.get("t", self.clock()), kind, job_id, **body)
        if self.on_event is not None:
            self.on_event(job_id or "", {**event, "kind": kind})


_LABELS = {"rack", "block", "capacity_type", "accelerator"}
_MAX_BODY = 1 << 20
_NOT_STARTED = {"epoch": 0, "members": [], "step": 0, "failures": 0, "failure": None,
                "workers": [], "target": 0}


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/health"), "health"),
    ("GET", re.compile(r"/jobs"), "jobs"),
    ("POST", re.compile(r"/jobs"), "create_job"),
    ("GET", re.compile(r"/jobs/(?P<job>[\w.-]+)"), "job_status"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/scale"), "scale"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/suspend"), "suspend"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/resume"), "resume"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/cancel"), "cancel"),
    ("GET", re.compile(r"/nodes"), "nodes"),
    ("GET", re.compile(r"/queues"), "queues"),
    ("GET", re.compile(r"/report"), "report"),
    ("POST", re.compile(r"/nodes/(?P<node>[\w.-]+)/heartbeat"), "node_heartbeat"),
    ("POST", re.compile(r"/workers/(?P<w>[\w.-]+)/(?P<verb>exit|heartbeat|rendezvous|done|left|report)"),
     "worker"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    coordinator: Coordinator
    token: str | None = None

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: heartbeats are many
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _authorized(self, path: str) -> bool:
        """Every call but the health probe carries the coordinator's token."""
        if self.token is None or path == API + "/health":
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        status, body = HTTPStatus.NOT_FOUND, {"error": f"no route {method} {path}"}
        try:
            payload = self._body() if method == "POST" else {}
            if not self._authorized(path):
                status, body = HTTPStatus.UNAUTHORIZED, {
                    "error": "missing or wrong token: pass the coordinator's token file with "
                             "--token-file, or set MAITRE_TOKEN"}
            elif path.startswith(API):
                for m, pattern, name in _ROUTES:
                    match = pattern.fullmatch(path[len(API):])
                    if m == method and match:
                        status, body = HTTPStatus.OK, self._call(name, match.groupdict(), payload)
                        break
        except BadRequest as exc:
            status, body = HTTPStatus.BAD_REQUEST, {"error": str(exc)}
        except NotFound as exc:
            status, body = HTTPStatus.NOT_FOUND, {"error": exc.args[0]}
        except KeyError as exc:
            status, body = HTTPStatus.NOT_FOUND, {"error": str(exc.args[0])}
        except Exception as exc:  # a bug in the coordinator: say so, keep serving
            status, body = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
        if length > _MAX_BODY:  # a manifest is a few hundred bytes
            self.close_connection = True
            raise BadRequest(f"request body of {length} bytes is over the limit of {_MAX_BODY}")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _call(self, name: str, args: dict[str, str], body: dict[str, Any]) -> Any:
        c = self.coordinator
        if name == "health":
            return {"ok": True}
        if name == "jobs":
            return {"jobs": c.job_list()}
        if name == "nodes":
            return {"nodes": c.nodes_view()}
        if name == "queues":
            return {"queues": c.queues_view()}
        if name == "report":
            return c.report()
        if name in ("resume", "cancel"):
            return getattr(c, name)(args["job"])
        if name == "create_job":
            return c.create_job(body)
        if name == "job_status":
            return c.job_status(args["job"])
        if name == "scale":
            return c.scale(args["job"], body.get("workers"))
        if name == "suspend":
            return c.suspend(args["job"], body.get("reason", "suspended by request"))
        if name == "node_heartbeat":
            return c.node_heartbeat(args["node"], body)
        verb, wid = args["verb"], args["w"]
        if verb == "exit":
            return c.worker_exit(wid, body)
        if verb == "heartbeat":
            return c.worker_heartbeat(wid, body)
        if verb == "rendezvous":
            return c.rendezvous(wid, body)
        if verb == "done":
            return c.worker_done(wid, body)
        if verb == "left":
            return c.worker_left(wid)
        return c.worker_report(wid, body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A worker killed mid-request resets its connection; that is news for the failure
        detector (via the agent), not a traceback on the console."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class CoordinatorServer:
    """The coordinator's HTTP server, its c10d store and its detector thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, store_port: int = 0,
                 cfg: DetectorConfig | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 tick_s: float = 0.05, token: str | None = None,
                 cluster: ClusterState | None = None, db: Store | None = None) -> None:
        self.store = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.coordinator = Coordinator(f"{host}:{self.store.port}", cfg, on_event=on_event,
                                       cluster=cluster, store=db)
        self.token = token
        handler = type("Handler", (_Handler,), {"coordinator": self.coordinator, "token": token})
        self.httpd = _Server((host, port), handler)
        self.address = f"{host}:{self.httpd.server_address[1]}"
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.httpd.serve_forever, name="maitre-http",
                                          daemon=True),
                         threading.Thread(target=self._detector, name="maitre-detector",
                                          daemon=True)]

    def start(self) -> "CoordinatorServer":
        for t in self._threads:
            t.start()
        return self

    def _detector(self) -> None:
        last = ""
        while not self._stop.wait(self._tick_s):
            try:
                self.coordinator.tick()
            except Exception:  # a bug: say so (once), but never stop detecting and scheduling
                text = traceback.format_exc()
                if text != last:
                    print(f"maitre: coordinator tick failed:\n{text}", file=sys.stderr, flush=True)
                    last = text

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "CoordinatorServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
