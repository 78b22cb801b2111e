"""The coordinator's HTTP API: FastAPI on uvicorn, the routes and messages of :mod:`maitre.protocol`.

Every request body is a pydantic model (a misspelt field is refused); every refusal is a JSON
:class:`~maitre.protocol.ErrorReply` that names the field, with 400 for a bad request (pydantic's
422 included), 401 without a token, 403 for a job's token outside its own workers' routes, 404
for an unknown job, node, worker or route, 413 for a
body over :data:`~maitre.protocol.MAX_BODY`. Handlers that only read or change state are plain
functions (FastAPI runs them on its thread pool, since they take the coordinator's lock); the two
long-polls, a node's watch and a worker's rendezvous, are coroutines that hold no thread while
they wait: the coordinator tells :class:`Waiters` which nodes and jobs changed, and only their
waiters wake.

:class:`CoordinatorServer` puts it together: the door to the runs' c10d stores that every
epoch's process group rendezvous on (:mod:`maitre.control.storedoor`), the coordinator, uvicorn on
a thread of its own and the detector thread that ticks the coordinator every ``tick_s``.

With a ``token`` every route but ``/health`` (left open for liveness probes) needs the header
``Authorization: Bearer <token>``: the coordinator's token (the CLI, agents), or a run's token
(its workers, given in their start orders), which opens that run's own workers' routes only.
With ``tls_cert`` and ``tls_key`` the API is served over HTTPS.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import inspect
import re
import json
import logging
import pathlib
import tempfile
import threading
from typing import Annotated, Any, Callable

from fastapi import Body, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from maitre import serving
from maitre import protocol as p
from maitre.control.cluster import ClusterState
from maitre.control.coordinator import Coordinator
from maitre.control.detectors import DetectorConfig
from maitre.control.metrics import CONTENT_TYPE as METRICS_TYPE
from maitre.control.store import Store
from maitre.dashboard import auth as dashboard_auth
from maitre.dashboard import routes as dashboard
from maitre.control.storedoor import StoreDoor, Stores
from maitre.errors import NotFound, RequestError

log = logging.getLogger("maitre.api")

Name = Annotated[str, Path(pattern=p.NAME_PATTERN, max_length=128)]
"""A job, node or worker name in a path."""


class Waiters:
    """Long-polls waiting on a node's orders or a job's membership, woken by key.

    ``event(key)`` is taken before the waiter checks its condition, and :meth:`fire` sets the
    events of the keys it is given and replaces them, so a change between the check and the
    wait is never missed."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        """The server is stopping: long-polls answer now instead of waiting."""

    def event(self, key: tuple[str, str]) -> asyncio.Event:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = asyncio.Event()
        return ev

    def fire(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            ev = self._events.pop(key, None)
            if ev is not None:
                ev.set()

    def wake(self, nodes: set[str], jobs: set[str]) -> None:
        """From any thread (the coordinator calls it under its lock)."""
        loop = self.loop
        if loop is None or loop.is_closed() or not (nodes or jobs):
            return
        keys = [("node", n) for n in nodes] + [("job", j) for j in jobs]
        try:
            loop.call_soon_threadsafe(self.fire, keys)
        except RuntimeError:  # the loop is shutting down
            pass

    def close(self) -> None:
        """From any thread: every long-poll answers now (the server is stopping)."""
        self.closing = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.fire, list(self._events))
            except RuntimeError:
                pass

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        if timeout_s > 0 and not self.closing:
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass


def _error(
    status: int, message: str, problems: list[p.Problem] | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = p.ErrorReply(error=message, problems=problems or [])
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _where(error: dict[str, Any]) -> tuple[Any, ...]:
    """Where a validation error is; a body that is not JSON is ``body`` (not ``body.<offset>``)."""
    loc = tuple(error.get("loc", ()))
    return loc[:1] if error.get("type") == "json_invalid" else loc


def build_app(co: Coordinator, token: str | None = None) -> FastAPI:
    """The ASGI app over ``co`` (see the module docstring)."""
    waiters = Waiters()
    co.on_wake = waiters.wake
    extra: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # FastAPI's own OpenTelemetry layer costs a fifth of a node beat; maitre's metrics are
        # its own (the event log, /metrics).
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    app = FastAPI(
        title="maitre coordinator",
        version="1",
        openapi_url=p.API + "/openapi.json",
        docs_url=None,
        redoc_url=None,
        description="Routes and messages of maitre's coordinator (see maitre.protocol).",
        **extra,
    )
    app.state.waiters = waiters
    app.state.dashboard_token = token
    lanes: list[tuple[re.Pattern[str], str, type[Any], Callable[..., Any]]] = []
    app.add_middleware(_Gate, waiters=waiters, token=token, lanes=lanes, credential=co.credential)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message, [p.Problem(field=exc.field, message=exc.message)])

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            p.Problem(field=".".join(str(x) for x in _where(e)) or "body", message=str(e.get("msg", "invalid")))
            for e in exc.errors()
        ]
        text = "; ".join(f"{pr.field}: {pr.message}" for pr in problems)
        return _error(400, f"invalid request: {text}", problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:  # Allow (RFC 9110): every route of the path, not just one
            methods = {
                m
                for r in app.router.routes
                if isinstance(r, Route) and r.methods and r.matches(request.scope)[0] == Match.PARTIAL
                for m in r.methods
            }
            headers = {"Allow": ", ".join(sorted(methods))}
        return _error(exc.status_code, message, [p.Problem(field="path", message=message)], headers=headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:  # say so, keep serving
        log.exception("coordinator bug answering %s %s", request.method, request.url.path)
        return _error(500, f"{type(exc).__name__}: {exc}")

    errors: dict[int | str, dict[str, Any]] = {code: {"model": p.ErrorReply} for code in (400, 401, 403, 404, 413)}
    # Every refusal has this shape; documenting 4XX also keeps FastAPI from documenting a 422
    # this API never sends (a request that does not validate is a 400).
    errors["4XX"] = {"model": p.ErrorReply, "description": "Any other refusal (405)"}
    dashboard.mount(
        app,
        co.events,
        co.dashboard_meta,
        live=True,
        responses=errors,
        closing=lambda: waiters.closing,
        listeners=co.events.listeners,
    )

    def route(method: str, path: str, model: Any, **kw: Any) -> Callable[..., Any]:
        return app.api_route(p.API + path, methods=[method], response_model=model, responses=errors, **kw)

    @app.get(p.API + p.HEALTH, response_model=p.Health)
    def health() -> dict[str, Any]:
        return {"ok": True}

    @route("GET", p.JOBS, p.JobList)
    def jobs() -> dict[str, Any]:
        return {"jobs": co.job_list()}

    @route("POST", p.JOBS, p.Submitted)
    def submit(req: p.SubmitRequest) -> dict[str, Any]:
        return co.submit(req.manifest)

    @route("GET", p.JOB, p.JobStatus)
    def job(job: Name) -> dict[str, Any]:
        return co.job_status(job)

    @route("POST", p.JOB_SCALE, p.Scaled)
    def scale(req: p.ScaleRequest, job: Name) -> dict[str, Any]:
        return co.scale(job, req.workers)

    @route("POST", p.JOB_SUSPEND, p.JobStateReply)
    def suspend(job: Name, req: p.SuspendRequest | None = None) -> dict[str, Any]:
        return co.suspend(job, (req or p.SuspendRequest()).reason)

    @route("POST", p.JOB_RESUME, p.JobStateReply)
    def resume(job: Name) -> dict[str, Any]:
        return co.resume(job)

    @route("POST", p.JOB_CANCEL, p.JobStateReply)
    def cancel(job: Name) -> dict[str, Any]:
        return co.cancel(job)

    @route("GET", p.NODES, p.NodeList)
    def nodes() -> dict[str, Any]:
        return {"nodes": co.nodes_view()}

    @route("GET", p.QUEUES, p.QueueList)
    def queues() -> dict[str, Any]:
        return {"queues": co.queues_view()}

    @route("GET", p.REPORT, p.Report)
    def report() -> dict[str, Any]:
        return co.report()

    @app.get(
        p.METRICS,
        response_class=Response,
        responses={
            **errors,
            200: {
                "description": "Prometheus's text format (maitre.control.metrics)",
                "content": {METRICS_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
            },
        },
    )
    def metrics() -> Response:
        return Response(co.metrics.render(), media_type=METRICS_TYPE)

    async def now(method: Callable[..., Any], *args: Any) -> Any:
        """The hot calls (beats, arrivals, exits): on the loop when the coordinator's lock is
        free (they touch their own node or job only: microseconds), else on the thread pool,
        which then waits for the lock only; a change is durable before it is answered either
        way, awaited without a thread."""
        done = co.try_now(method, *args)
        if done is None:
            done = await run_in_threadpool(co.try_now, method, *args, block=True)
        result, (need, staged) = done
        if need or staged:
            await durable(need, staged)
        return result

    async def durable(need: int, staged: int) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

        co.when_durable(need, staged, lambda error: loop.call_soon_threadsafe(settle, error))
        await future

    async def beat(node: str, beat: p.NodeBeat) -> p.NodeOrders:
        return await now(Coordinator.node_heartbeat, node, beat)

    @route("POST", p.NODE_HEARTBEAT, p.NodeOrders)
    async def node_heartbeat(beat: p.NodeBeat, node: Name) -> Any:  # (served by the lane)
        return Response((await beat(node, beat)).model_dump_json(), media_type="application/json")

    @route("POST", p.NODE_WATCH, p.NodeOrders)
    async def node_watch(req: p.WatchRequest, node: Name) -> p.NodeOrders:
        if node not in co.nodes:
            raise NotFound(f"no node {node!r}: it has not sent a heartbeat", "path.node")
        deadline = asyncio.get_running_loop().time() + req.wait_s
        while True:
            event = waiters.event(("node", node))
            remaining = deadline - asyncio.get_running_loop().time()
            if co.node_version(node) > req.since or remaining <= 0 or waiters.closing:
                break
            await waiters.wait(event, remaining)
        return await now(Coordinator.node_orders, node, req.since)

    @route("POST", p.WORKER_EXIT, p.Empty)
    async def worker_exit(req: p.ExitRequest, worker: Name) -> dict[str, Any]:
        return await now(Coordinator.worker_exit, worker, req)

    @route("POST", p.WORKER_RENDEZVOUS, p.Assignment)
    async def rendezvous(req: p.RendezvousRequest, worker: Name) -> dict[str, Any]:
        return await meet(worker, req)

    async def meet(worker: str, req: p.RendezvousRequest) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.wait_s
        job_id, answer = await now(Coordinator.arrive, worker, req)
        while answer is None:
            event = waiters.event(("job", job_id))
            answer = await now(Coordinator.assignment, worker, req.from_epoch)
            remaining = deadline - loop.time()
            if answer is not None or remaining <= 0 or waiters.closing:
                break
            await waiters.wait(event, min(remaining, 1.0))
        return answer if answer is not None else {"action": "wait"}

    # The two calls a cluster makes by the thousand go through the lane (see _Gate).
    lanes += [
        (_route_pattern(p.NODE_HEARTBEAT), "path.node", p.NodeBeat, beat),
        (_route_pattern(p.WORKER_RENDEZVOUS), "path.worker", p.RendezvousRequest, meet),
    ]

    @route("POST", p.WORKER_DONE, p.Empty)
    async def worker_done(req: p.DoneRequest, worker: Name) -> dict[str, Any]:
        return await now(Coordinator.worker_done, worker, req)

    @route("POST", p.WORKER_LEFT, p.Empty)
    async def worker_left(worker: Name) -> dict[str, Any]:
        return await now(Coordinator.worker_left, worker)

    @route("POST", p.WORKER_REPORT, p.Empty)
    async def worker_report(req: Annotated[p.WorkerReport, Body()], worker: Name) -> dict[str, Any]:
        return await now(Coordinator.worker_report, worker, req.model_dump())

    return app


def openapi_document() -> str:
    """The API's OpenAPI schema as ``docs/openapi.json`` holds it (sorted keys, indented):
    ``print(openapi_document(), end='')`` into that file regenerates it (tests/test_api.py checks
    that it is current)."""
    schema = build_app(
        Coordinator("127.0.0.1:0", cluster=ClusterState([], run_dir=pathlib.Path(tempfile.gettempdir())))
    ).openapi()  # (it writes nothing there)
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


_OPEN = (p.API + p.HEALTH, p.API + "/openapi.json")
"""What answers without the token: liveness probes, and the schema (it holds no secret)."""


def _route_pattern(route: str) -> re.Pattern[str]:
    """``/nodes/{node}/heartbeat`` -> a pattern of the full path with the name as group 1."""
    return re.compile(re.escape(p.API + route).replace(r"\{node\}", "([^/]*)").replace(r"\{worker\}", "([^/]*)") + "$")


_NAME = re.compile(p.NAME_PATTERN)
_WORKER_ROUTE = re.compile(re.escape(p.API) + r"/workers/([^/]+)/[^/]+$")


class _Gate:
    """ASGI middleware, before any routing or parsing: a body over
    :data:`~maitre.protocol.MAX_BODY` is refused unread (413), a call without the token (401);
    the first request tells the waiters which event loop is theirs.

    It is also the *lane* of the two calls that come by the thousand (node beats, and
    rendezvous when a large gang forms): the same pydantic model validates the body, the same
    refusals come back, but FastAPI's routing and dependency machinery is skipped, which is
    half of a beat's cost here (measured: about 450 us of CPU a beat through FastAPI, 110 us for
    uvicorn's bare minimum). FastAPI still declares these routes, for the schema."""

    def __init__(
        self,
        app: Any,
        waiters: Waiters,
        token: str | None,
        lanes: list[tuple[re.Pattern[str], str, type[Any], Callable[..., Any]]],
        credential: Callable[[str, str], int],
    ) -> None:
        self.app = app
        self.waiters = waiters
        self.expected = f"Bearer {token}".encode() if token else None
        self.token = token or ""
        self.lanes = lanes
        self.credential = credential

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self.waiters.loop is None:
                self.waiters.loop = asyncio.get_running_loop()
            headers = dict(scope.get("headers", ()))
            length = headers.get(b"content-length", b"0")
            response = None
            if not length.isdigit() or int(length) > p.MAX_BODY:
                response = _error(
                    413,
                    f"request body of {length.decode(errors='replace')} bytes is over the limit of {p.MAX_BODY}",
                    [p.Problem(field="header.content-length", message="too large")],
                )
            elif self.expected is not None and scope.get("path") not in _OPEN:
                given = headers.get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    let_in, response = dashboard_auth.authorize(scope, self.token)
                    if not let_in and response is None:
                        response = self._as_worker(given, scope.get("path", ""))
            if response is None and scope.get("method") == "POST":
                for pattern, field, model, handler in self.lanes:
                    match = pattern.match(scope.get("path", ""))
                    if match:
                        response = await self._lane(match.group(1), field, model, handler, receive)
                        break
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _as_worker(self, given: bytes, path: str) -> Any:
        """A request without the coordinator's token may still carry a run's token: it acts
        for that run's own workers, on their routes, and for nothing else (None: let it in)."""
        token = given[7:].decode("ascii", "replace") if given.startswith(b"Bearer ") else ""
        match = _WORKER_ROUTE.match(path)
        status = self.credential(token, match.group(1) if match else None) if token else 401
        if status == 200 and match:
            return None
        if status == 404:
            return _error(
                404,
                f"no worker {match.group(1)!r}" if match else "not found",
                [p.Problem(field="path.worker", message="no such worker")],
            )
        if status == 403:
            return _error(
                403,
                "this token is a job's: it acts for that job's own workers, on their routes, and for nothing else",
                [p.Problem(field="header.authorization", message="not this worker's job")],
            )
        return _error(
            401,
            "missing or wrong token: pass the coordinator's token file with --token-file, or set MAITRE_TOKEN",
            [p.Problem(field="header.authorization", message="wrong or missing")],
        )

    async def _lane(self, name: str, field: str, model: type[Any], handler: Callable[..., Any], receive: Any) -> Any:
        if not _NAME.match(name):
            return _error(
                400,
                f"invalid request: {field}: must match {p.NAME_PATTERN}",
                [p.Problem(field=field, message=f"must match {p.NAME_PATTERN}")],
            )
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > p.MAX_BODY:
                return _error(
                    413, f"request body over the limit of {p.MAX_BODY}", [p.Problem(field="body", message="too large")]
                )
        try:
            request = model.model_validate_json(body)
        except ValidationError as exc:
            problems = [
                p.Problem(field=".".join(["body", *(str(x) for x in e["loc"])]), message=e["msg"]) for e in exc.errors()
            ]
            text = "; ".join(f"{pr.field}: {pr.message}" for pr in problems)
            return _error(400, f"invalid request: {text}", problems)
        try:
            reply = await handler(name, request)
        except RequestError as exc:
            return _error(exc.status, exc.message, [p.Problem(field=exc.field, message=exc.message)])
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("coordinator bug answering %s", name)
            return _error(500, f"{type(exc).__name__}: {exc}")
        body = reply.model_dump_json() if isinstance(reply, BaseModel) else json.dumps(reply)
        return Response(body, media_type="application/json")


class CoordinatorServer:
    """The coordinator's HTTP server, its c10d store and its detector thread."""

    def __init__(
        self,
        cluster: ClusterState,
        host: str = "127.0.0.1",
        port: int = 0,
        store_port: int = 0,
        cfg: DetectorConfig | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        tick_s: float = 0.05,
        token: str | None = None,
        db: Store | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        # raises OSError: the caller says where and why; connections queue from now on
        sock = serving.bound(host, port, backlog=4096)
        self.stores = Stores()
        try:
            self.door = StoreDoor(self.stores, host, store_port)  # raises OSError, as above
        except OSError:
            sock.close()
            raise
        self.coordinator = Coordinator(
            f"{host}:{self.door.port}", cfg, on_event=on_event, cluster=cluster, store=db, stores=self.stores
        )
        self.token = token
        self.app = build_app(self.coordinator, token)
        self.http = serving.Serving(
            self.app,
            sock,
            "maitre-http",
            timeout_keep_alive=120,
            proxy_headers=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            backlog=4096,
        )
        self.port = self.http.port
        self.address = f"{host}:{self.port}"
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._detector, name="maitre-detector", daemon=True)

    def start(self) -> "CoordinatorServer":
        # What is alive now (torch, FastAPI, the restored state: some 200,000 objects) lives as
        # long as the process: kept out of the cyclic collector, a full collection no longer
        # stops the event loop for a tenth of a second under a thousand nodes' beats.
        gc.collect()
        gc.freeze()
        # And the young generation collected every 50,000 allocations, not 700: a beat makes a
        # few hundred objects, nearly all freed by reference counting at once.
        gc.set_threshold(50_000, 20, 20)
        self.door.start()
        self._ticker.start()
        self.http.start("the coordinator's HTTP server")
        return self

    def _detector(self) -> None:
        last = ""
        while not self._stop.wait(self._tick_s):
            try:
                self.coordinator.tick()
            except Exception as exc:  # a bug: say so (once), but never stop detecting
                text = repr(exc)
                if text != last:
                    log.exception("coordinator tick failed")
                    last = text

    def stop(self) -> None:
        self._stop.set()
        self.app.state.waiters.close()
        for wake in self.coordinator.events.listeners:  # the dashboard's streams end now
            wake(self.coordinator.events.last)
        self.http.stop()
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)
        self.door.stop()
        self.stores.retain(set())

    def __enter__(self) -> "CoordinatorServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
