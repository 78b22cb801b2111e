"""A small stdlib JSON client for maitre's HTTP APIs: the coordinator's (workers, agents, the
CLI) and an agent's unix socket (its workers' heartbeats).

JSON over HTTP/1.1 with keep-alive: each thread keeps one connection open. Routes and message
shapes are :mod:`maitre.protocol`'s; this module only moves them, so the training process talks to
its agent and the coordinator without an HTTP library.

Errors (:mod:`maitre.errors`):
    CoordinatorUnreachable  the connection failed or timed out (the caller decides whether to retry)
    ApiError                the server answered 4xx/5xx; ``status`` and ``message`` say why
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from typing import Any

from maitre.errors import ApiError, CoordinatorUnreachable

__all__ = ["ApiError", "Client", "CoordinatorUnreachable", "UnixClient", "parse_address"]
API = "/v1"  # maitre.protocol.API (not imported: it needs pydantic, the training process not)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be HOST:PORT, got {address!r}")
    return host, int(port)


class Client:
    """A thread-safe JSON client; each thread keeps its own keep-alive connection."""

    def __init__(
        self, address: str, timeout_s: float = 10.0, token: str | None = None, tls_ca: str | None = None
    ) -> None:
        """``tls_ca``: a PEM file of the certificates that sign the coordinator's; given, the
        client speaks HTTPS and checks the coordinator's certificate and name (raises
        ``OSError`` or ``ssl.SSLError`` for a file that is not such a bundle)."""
        self.address = address
        self.token = token
        self.tls_ca = tls_ca
        self.host, self.port = parse_address(address)
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._tls = ssl.create_default_context(cafile=tls_ca) if tls_ca else None

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self._tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect(timeout_s)
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

    def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
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
                    raise CoordinatorUnreachable(f"cannot reach the coordinator at {self.address}: {exc}") from exc
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


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixClient(Client):
    """The same client over a unix socket (a worker to its agent)."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.address = path
        self.token = self.tls_ca = None
        self.host, self.port = "localhost", 0
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._path = path

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        return _UnixConnection(self._path, timeout_s)
