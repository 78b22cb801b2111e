"""The dashboard's routes, on the coordinator's API (live) or on a replay's own server.

- ``GET /dashboard/``: the page (one HTML file, its scripts and styles under
  ``/dashboard/assets/``, all in the package: nothing is fetched from elsewhere). The scripts:
  ``draw.js`` (DOM and SVG helpers, charts), ``model.js`` (the events folded into a model),
  ``views.js`` (each view drawn from the model), ``app.js`` (loading, the stream, the slider).
- ``GET /dashboard/meta.json``: live or replay, the source, the price table.
- ``GET /v1/events?since=N``: the event log after ``seq`` N, a page at a time
  (:class:`~maitre.protocol.EventPage`).
- ``GET /v1/events/stream?since=N``: the same events as they happen, as server-sent events
  (``id:`` the seq, ``data:`` the event as JSON), with a comment every 15 s to keep proxies
  from closing an idle stream. A replay's stream ends after its last event.

The page builds every view from these events alone (``assets/app.js``), so what a replay shows
of a run is what the live page showed.
"""

from __future__ import annotations

import asyncio
import json
import math
from importlib import resources
from typing import Any, Callable, Protocol

from fastapi import FastAPI, Query, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from maitre import protocol as p
from maitre.dashboard import auth

_JS = "text/javascript; charset=utf-8"
ASSETS = {
    "draw.js": _JS,
    "model.js": _JS,
    "views.js": _JS,
    "app.js": _JS,
    "app.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
"""Every file the page loads, and its type: anything else under ``/dashboard/`` is a 404."""
PAGE_LIMIT = 10_000
KEEPALIVE_S = 15.0


class Events(Protocol):
    """A log the dashboard reads: :class:`maitre.control.eventlog.EventLog`, or a replay's."""

    last: int

    def since(self, seq: int = 0, limit: int | None = None, job: str | None = None) -> list[dict[str, Any]]: ...


def _static(name: str) -> bytes:
    return (resources.files("maitre.dashboard") / "static" / name).read_bytes()


def clean(value: Any) -> Any:
    """JSON for a browser: ``NaN`` and infinities (which ``JSON.parse`` refuses) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def dumps(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(clean(value), separators=(",", ":"))


class _Wakeup:
    """Wakes the streams on the server's event loop when the log grows (from any thread)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self._pending = False

    def bind(self) -> asyncio.Event:
        if self.event is None:
            self.loop, self.event = asyncio.get_running_loop(), asyncio.Event()
        return self.event

    def __call__(self, seq: int) -> None:
        loop = self.loop
        if loop is None or self._pending or loop.is_closed():
            return
        self._pending = True
        try:
            loop.call_soon_threadsafe(self._fire)
        except RuntimeError:  # the loop is shutting down
            pass

    def _fire(self) -> None:
        self._pending = False
        if self.event is not None:
            self.event.set()
            self.event = asyncio.Event()


def mount(
    app: FastAPI,
    events: Events,
    meta: Callable[[], dict[str, Any]],
    *,
    live: bool,
    closing: Callable[[], bool] = lambda: False,
    listeners: list[Callable[[int], None]] | None = None,
    responses: dict[int | str, Any] | None = None,
) -> None:
    """Add the dashboard's routes to ``app`` (``listeners``: the live log's, so that the
    streams wake when it grows; a replay's log never grows)."""
    wakeup = _Wakeup()
    if listeners is not None:
        listeners.append(wakeup)
    page = _static("index.html")

    errors = responses or {}

    @app.get(p.API + p.EVENTS, response_model=p.EventPage, responses=errors)
    def events_page(
        since: int = Query(0, ge=0),
        limit: int = Query(PAGE_LIMIT, ge=1, le=PAGE_LIMIT),
        job: str | None = Query(None, pattern=p.NAME_PATTERN, max_length=128),
    ) -> Response:
        last = events.last  # before the read: a later event is in the next page, not lost
        body = dumps({"events": events.since(since, limit, job), "last": last})
        return Response(body, media_type="application/json")

    @app.get(
        p.API + p.EVENTS_STREAM,
        response_class=StreamingResponse,
        responses={
            **errors,
            200: {"content": {"text/event-stream": {}}, "description": "server-sent events, one per event of the log"},
        },
    )
    async def events_stream(request: Request, since: int = Query(0, ge=0)) -> Response:
        async def stream():  # type: ignore[no-untyped-def]
            seq = since
            yield "retry: 1000\n\n"
            while not closing():
                woken = wakeup.bind() if live else None
                batch = events.since(seq, 1000)
                if batch:
                    seq = batch[-1]["seq"]
                    yield "".join(f"id: {e['seq']}\ndata: {dumps(e)}\n\n" for e in batch)
                    continue
                if not live:
                    yield "event: end\ndata: {}\n\n"
                    return
                try:
                    await asyncio.wait_for(woken.wait(), KEEPALIVE_S)  # type: ignore[union-attr]
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )

    @app.get("/", include_in_schema=False)
    def root() -> Response:
        return RedirectResponse(auth.PREFIX + "/", 307)

    @app.get(auth.PREFIX, include_in_schema=False)
    def bare() -> Response:
        return RedirectResponse(auth.PREFIX + "/", 307)

    @app.get(auth.PREFIX + "/", include_in_schema=False)
    def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    @app.get(auth.PREFIX + "/meta.json", include_in_schema=False)
    def meta_json() -> Response:
        return Response(
            dumps({"live": live, **meta()}), media_type="application/json", headers={"Cache-Control": "no-store"}
        )

    @app.get(auth.ASSETS + "/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in ASSETS:
            return not_found(f"/dashboard/assets/{name}")
        return Response(_static(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get(auth.LOGIN, include_in_schema=False)
    def login_form(next: str = auth.PREFIX + "/") -> Response:  # noqa: A002 (the form's name)
        return auth.login_page(nxt=next if next.startswith(auth.PREFIX + "/") else auth.PREFIX + "/")

    @app.post(auth.LOGIN, include_in_schema=False)
    async def login(request: Request) -> Response:
        token = getattr(request.app.state, "dashboard_token", None)
        given, nxt = auth.parse_login(await request.body())
        if token is None:
            return RedirectResponse(nxt, 303)
        if not auth.same_token(given, token):
            return auth.login_page("That token is not this coordinator's.", 401, nxt)
        response = RedirectResponse(nxt, 303)
        auth.set_cookie(response, token, request.scope)
        return response

    @app.get(auth.LOGOUT, include_in_schema=False)
    def logout() -> Response:
        response = RedirectResponse(auth.LOGIN, 303)
        response.delete_cookie(auth.COOKIE, path="/")
        return response

    @app.get(auth.PREFIX + "/{rest:path}", include_in_schema=False)
    def missing(rest: str) -> Response:
        return not_found(f"/dashboard/{rest}")


def not_found(path: str) -> HTMLResponse:
    from html import escape

    return HTMLResponse(
        f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>maitre: not found
</title><link rel="stylesheet" href="{auth.ASSETS}/app.css">
<link rel="icon" href="{auth.ICON}" type="image/svg+xml"></head><body class="login"><main>
<h1>404</h1><p>There is no page <code>{escape(path)}</code>. The dashboard is at
<a href="{auth.PREFIX}/">{auth.PREFIX}/</a>.</p></main></body></html>""",
        status_code=404,
    )
