"""The coordinator: an HTTP API over the membership state machine, and the c10d store host.

One coordinator per cluster. It hosts the ``TCPStore`` that every epoch's process group
rendezvous on (under the epoch's own prefix), keeps each job's :class:`Membership`, answers
workers (heartbeat, rendezvous long-poll, done, left) and agents (node heartbeat with start/kill
directives, process exits), and runs the failure detector every ``tick_s``.

All state changes happen under one lock; a condition variable wakes the rendezvous long-polls
when an epoch opens. Routes (JSON, under ``/v1``)::

    GET  /health                       GET  /jobs            GET /jobs/<job>
    POST /jobs            (JobSpec)    POST /jobs/<job>/scale {"workers": n}
    POST /jobs/<job>/suspend {"reason": "..."}   (members checkpoint, then stop)
    POST /nodes/<node>/heartbeat {"slots": n, "running": [worker ids]} -> {"start": [...], "kill": [...]}
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
import sys
import threading
import time
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch.distributed as dist

from maitre.control.membership import (ENDED, DetectorConfig, JobSpec, Membership,
                                       WorkerState)
from maitre.wire import API


class BadRequest(ValueError):
    pass


class NotFound(KeyError):
    pass


class Coordinator:
    """Thread-safe owner of all jobs and nodes. Time comes from ``clock`` (wall seconds)."""

    def __init__(self, store_address: str, cfg: DetectorConfig | None = None,
                 clock: Callable[[], float] = time.time,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.store_address = store_address
        self.cfg = cfg or DetectorConfig()
        self.clock = clock
        self.on_event = on_event
        self.cond = threading.Condition()
        self.jobs: dict[str, Membership] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, list[dict[str, Any]]] = {}
        self._worker_job: dict[str, str] = {}
        self._pending_kills: dict[str, set[str]] = {}
        self._emitted: dict[str, int] = {}

    # -- jobs ------------------------------------------------------------------------------------
    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            spec = JobSpec(**body)
        except TypeError as exc:
            raise BadRequest(f"invalid job spec: {exc}") from None
        with self.cond:
            if spec.job_id in self.jobs:
                raise BadRequest(f"job {spec.job_id!r} already exists")
            self.jobs[spec.job_id] = Membership(spec, self.cfg, self.clock())
            self.reports[spec.job_id] = []
            self._emitted[spec.job_id] = 0
            return {"job_id": spec.job_id}

    def job(self, job_id: str) -> Membership:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    def job_status(self, job_id: str) -> dict[str, Any]:
        with self.cond:
            job = self.job(job_id)
            return {**job.summary(), "events": list(job.events), "reports": list(self.reports[job_id])}

    def scale(self, job_id: str, workers: Any) -> dict[str, Any]:
        if not isinstance(workers, int) or isinstance(workers, bool):
            raise BadRequest(f"'workers' must be an integer, got {workers!r}")
        with self.cond:
            job = self.job(job_id)
            if job.state in ENDED:
                raise BadRequest(f"job {job_id} is {job.state.value}")
            try:
                leaving = job.scale(workers, self.clock())
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            self._changed()
            return {"target": workers, "leaving": leaving}

    def suspend(self, job_id: str, reason: Any = "suspended by request") -> dict[str, Any]:
        with self.cond:
            job = self.job(job_id)
            try:
                job.suspend(str(reason), self.clock())
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            self._changed()
            return {"state": job.state.value}

    # -- agents ----------------------------------------------------------------------------------
    def node_heartbeat(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        slots = body.get("slots")
        running = body.get("running", [])
        if not isinstance(slots, int) or slots < 1:
            raise BadRequest(f"'slots' must be a positive integer, got {slots!r}")
        now = self.clock()
        with self.cond:
            info = self.nodes.setdefault(node, {"slots": slots, "registered_at": now})
            info.update(slots=slots, last_heartbeat=now)
            start: list[dict[str, Any]] = []
            kill = sorted(self._pending_kills.pop(node, set()))
            used = {self.jobs[self._worker_job[w]].workers[w].slot
                    for w in running if w in self._worker_job}
            for job in self.jobs.values():
                if job.state in ENDED:
                    kill += [w for w in running if self._worker_job.get(w) == job.spec.job_id
                             and job.workers[w].state not in (WorkerState.DONE, WorkerState.LEFT)]
                    continue
                for w in running:  # processes the coordinator already gave up on
                    if self._worker_job.get(w) == job.spec.job_id and \
                            job.workers[w].state == WorkerState.DEAD and w not in kill:
                        kill.append(w)
                free = [s for s in range(slots) if s not in used]
                for slot in free[:job.wants_workers()]:
                    worker = job.add_worker(node, slot, now)
                    used.add(slot)
                    self._worker_job[worker.id] = job.spec.job_id
                    start.append({"worker_id": worker.id, "job_id": job.spec.job_id,
                                  "command": job.spec.command, "env": dict(job.spec.env),
                                  "local_rank": slot, "store": self.store_address})
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
                                               bool(body.get("stalled", False)))

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
            self.reports[job_id].append({"worker": wid, **body})
            self._emit(job_id, "report", {"worker": wid, **body})
        return {}

    # -- failure detector ------------------------------------------------------------------------
    def tick(self) -> None:
        with self.cond:
            now = self.clock()
            changed = False
            for job in self.jobs.values():
                for wid in job.detect_failures(now):
                    self._pending_kills.setdefault(job.workers[wid].node, set()).add(wid)
                    changed = True
                changed |= job.try_open_epoch(now)
            if changed:
                self._changed()

    # -- helpers ---------------------------------------------------------------------------------
    def _job_of(self, wid: str) -> Membership:
        try:
            return self.jobs[self._worker_job[wid]]
        except KeyError:
            raise NotFound(f"unknown worker {wid!r}") from None

    def _changed(self) -> None:
        self.cond.notify_all()
        for job_id, job in self.jobs.items():
            for event in job.events[self._emitted[job_id]:]:
                self._emit(job_id, event["kind"], event)
            self._emitted[job_id] = len(job.events)

    def _emit(self, job_id: str, kind: str, event: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(job_id, {**event, "kind": kind})


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/health"), "health"),
    ("GET", re.compile(r"/jobs"), "jobs"),
    ("POST", re.compile(r"/jobs"), "create_job"),
    ("GET", re.compile(r"/jobs/(?P<job>[\w.-]+)"), "job_status"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/scale"), "scale"),
    ("POST", re.compile(r"/jobs/(?P<job>[\w.-]+)/suspend"), "suspend"),
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
        length = int(self.headers.get("Content-Length") or 0)
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
            with c.cond:
                return {"jobs": [j.summary() for j in c.jobs.values()]}
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
                 tick_s: float = 0.05, token: str | None = None) -> None:
        self.store = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.coordinator = Coordinator(f"{host}:{self.store.port}", cfg, on_event=on_event)
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
        while not self._stop.wait(self._tick_s):
            self.coordinator.tick()

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
