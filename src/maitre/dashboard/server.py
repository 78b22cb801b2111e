"""The replay's own web server (``maitre dashboard DIR``): the dashboard's routes over a
:class:`~maitre.dashboard.replay.ReplayLog`, behind the same token as a live coordinator's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from maitre import serving
from maitre.dashboard import auth, routes
from maitre.dashboard.replay import ReplayLog
from maitre.errors import RequestError


class _Gate:
    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            let_in, response = auth.authorize(scope, self.token)
            if not let_in:
                response = response or JSONResponse(
                    {
                        "error": "missing or wrong token: use the URL `maitre dashboard` printed",
                        "problems": [{"field": "header.authorization", "message": "wrong or missing"}],
                    },
                    401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def replay_app(log: ReplayLog, token: str) -> FastAPI:
    app = FastAPI(title="maitre dashboard (replay)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dashboard_token = token
    app.add_middleware(_Gate, token=token)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(
            {"error": exc.message, "problems": [{"field": exc.field, "message": exc.message}]}, exc.status
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {
                "error": f"no route {request.method} {request.url.path}"
                if exc.status_code in (404, 405)
                else str(exc.detail),
                "problems": [],
            },
            exc.status_code,
        )

    def meta() -> dict[str, Any]:
        return {"source": str(log.path), "error": log.error}

    routes.mount(app, log, meta, live=False)
    return app


class ReplayServer:
    """``with ReplayServer(path, token) as s:`` serves ``s.url`` until the block ends."""

    def __init__(self, path: Path, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.log = ReplayLog(path)  # raises ReplayError: nothing is served
        self.token = token
        sock = serving.bound(host, port)  # raises OSError: the caller says where and why
        self.http = serving.Serving(replay_app(self.log, token), sock, "maitre-dashboard")
        self.port = self.http.port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}{auth.PREFIX}/"

    def start(self) -> "ReplayServer":
        self.http.start("the dashboard's server")
        return self

    def stop(self) -> None:
        self.http.stop()

    def __enter__(self) -> "ReplayServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
