"""The coordinator's HTTP API as seen by its clients (workers, agents, the CLI).

JSON over HTTP/1.1 with keep-alive: a worker's heartbeat is one small request on a connection that
stays open. This module is the only place that knows URLs and status codes, so the runtime and the
agent can talk to the coordinator without importing it.

Errors:
    CoordinatorUnreachable  the connection failed or timed out (the caller decides whether to retry)
    ApiError                the coordinator answered 4xx/5xx; ``status`` and ``message`` say why
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any

API = "/v1"


class CoordinatorUnreachable(ConnectionError):
    pass


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"coordinator answered {status}: {message}")
        self.status = status
        self.message = message


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be HOST:PORT, got {address!r}")
    return host, int(port)


class Client:
    """A thread-safe JSON client; each thread keeps its own keep-alive connection."""

    def __init__(self, address: str, timeout_s: float = 10.0, token: str | None = None) -> None:
        self.address = address
        self.token = token
        self.host, self.port = parse_address(address)
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            self._local.conn = conn
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def request(self, method: str, path: str, body: Any = None,
                timeout_s: float | None = None) -> Any:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        timeout = timeout_s or self.timeout_s
        for attempt in range(2):  # one silent retry: the server may have closed an idle connection
            conn = self._connection(timeout)
            try:
                conn.request(method, API + path, payload, headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (ConnectionError, http.client.HTTPException, socket.timeout, OSError) as exc:
                self._drop()
                if attempt == 1 or isinstance(exc, (socket.timeout, ConnectionRefusedError)):
                    raise CoordinatorUnreachable(
                        f"cannot reach the coordinator at {self.address}: {exc}") from exc
        try:
            parsed = json.loads(data) if data else None
        except json.JSONDecodeError:
            parsed = {"error": data.decode(errors="replace")[:200]}
        if resp.status >= 400:
            message = parsed.get("error", "") if isinstance(parsed, dict) else str(parsed)
            raise ApiError(resp.status, message)
        return parsed

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self.request("GET", path, None, timeout_s)

    def post(self, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, body or {}, timeout_s)

    def close(self) -> None:
        self._drop()
