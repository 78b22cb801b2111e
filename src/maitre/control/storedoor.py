"""The door to the c10d stores: every process group rendezvous on one, and only its job gets in.

torch's ``TCPStore`` serves whoever connects, and answers ``list_keys``: a store on the cluster
network would let any host that reaches it read, block or poison every job's rendezvous keys
(gloo's peer addresses among them). So the coordinator keeps one store per run of a job
(:class:`Stores`), on loopback, and puts this door on the cluster network instead. A client must
first prove that it holds its job's token, by challenge and response::

    door   -> client   MAITRE-STORE/1 <nonce: 32 hex digits>\\n
    client -> door     <run key> <hex HMAC-SHA256(token, nonce)>\\n
    door   -> client   OK\\n        then the two byte streams are joined to that run's store
                       (anything else: the connection is closed, nothing was served)

The run key names a run of a job (``<job>/<scope>``); its token reaches the job's workers in
their start orders, over the coordinator's token-protected API. The nonce makes a recorded
answer useless for another connection. What the door does not do: encrypt (the store's traffic,
like the API's without TLS, can be read on the wire), or keep out local users of the
coordinator's own host (the stores listen on its loopback). The worker's side is
:class:`maitre.runtime.storelink.StoreLink`.

One asyncio loop on a thread of its own; bytes are moved by ``asyncio`` streams, never parsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("maitre.storedoor")

GREETING = b"MAITRE-STORE/1 "
HANDSHAKE_TIMEOUT_S = 10.0
_MAX_LINE = 512


def answer(token: str, nonce: bytes) -> str:
    """The response to a challenge (both sides compute it the same way)."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).hexdigest()


@dataclass(slots=True)
class _Run:
    store: Any
    port: int
    token: str = field(repr=False)


class Stores:
    """One loopback ``TCPStore`` per run of a job, opened with its run, closed when it ends (a
    later run never meets an earlier one's keys, and no run can list another's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}

    def open(self, key: str, token: str) -> None:
        with self._lock:
            if key in self._runs:
                return
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        with self._lock:
            self._runs.setdefault(key, _Run(store, store.port, token))

    def retain(self, keys: set[str]) -> None:
        """Close the stores of every run not in ``keys`` (runs that ended)."""
        with self._lock:
            for key in [k for k in self._runs if k not in keys]:
                del self._runs[key]  # the server stops with its last reference

    def lookup(self, key: str) -> _Run | None:
        with self._lock:
            return self._runs.get(key)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)


class StoreDoor:
    """Listens on ``host:port`` (0: any free port) and lets authenticated clients through to
    their run's store in ``stores``."""

    def __init__(self, stores: Stores, host: str = "127.0.0.1", port: int = 0) -> None:
        self.stores = stores
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # raises OSError: the caller says where and why
        self._sock.listen(4096)
        self.port = self._sock.getsockname()[1]
        self.refused = 0
        """Connections turned away (no handshake, an unknown run, a wrong answer)."""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maitre-store-door", daemon=True)

    def start(self) -> "StoreDoor":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the store door did not start")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._sock.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        run = await self._handshake(reader, writer)
        if run is None:
            self.refused += 1
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", run.port)
        except OSError as exc:
            log.warning("a run's store is gone: %s", exc)
            writer.close()
            return
        writer.write(b"OK\n")
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Run | None:
        nonce = secrets.token_hex(16).encode()
        writer.write(GREETING + nonce + b"\n")
        try:
            line = await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError, ValueError):
            return None
        if len(line) > _MAX_LINE or not line.endswith(b"\n"):
            return None
        try:
            key, given = line.decode("ascii").split()
        except (UnicodeDecodeError, ValueError):
            return None
        run = self.stores.lookup(key)
        if run is None or not hmac.compare_digest(given, answer(run.token, nonce)):
            return None
        return run


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass
