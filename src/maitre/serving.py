"""An ASGI app served by uvicorn on a thread of its own: the coordinator's API
(:class:`maitre.control.api.CoordinatorServer`) and a replay's dashboard
(:class:`maitre.dashboard.server.ReplayServer`). The socket is bound first (:func:`bound`), so
a bad or busy address fails at once, with the caller's words, and connections queue from then
on, before the server runs."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def bound(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one); raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Serving:
    """``app`` on ``sock`` (uvicorn's options as keywords) from :meth:`start` to :meth:`stop`."""

    def __init__(self, app: Any, sock: socket.socket, name: str, **options: Any) -> None:
        import uvicorn  # (here: the modules that name this one start fast without it)

        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1, **options
            )
        )
        self._thread = threading.Thread(target=lambda: self.server.run(sockets=[sock]), name=name, daemon=True)

    def start(self, what: str, timeout_s: float = 30.0) -> None:
        """Serve; RuntimeError naming ``what`` if it has not started within ``timeout_s``."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.server.started:
            raise RuntimeError(f"{what} did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sock.close()
