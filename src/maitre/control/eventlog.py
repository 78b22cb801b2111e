"""The coordinator's event log: every state change as a numbered event, in memory and on disk.

Each event is ``{"seq", "t", "job", "kind", ...body}``: ``seq`` counts from 1 in the order the
events happened, ``t`` is the coordinator's clock (seconds), ``job`` the job it is about (None for
the cluster's own: nodes, notices). The :class:`~maitre.control.store.Store` keeps them for good;
this log keeps the newest :data:`KEEP` in memory too, so that the dashboard's reads and its live
stream never wait on SQLite, and it tells whoever listens (the API's stream) that there are new
ones. A coordinator restarted on the same state carries on the same numbering.

``maitre status``, the dashboard, ``/metrics`` and a replay all read this one log, so a replay of
a live run looks like the live run (:mod:`maitre.dashboard`).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from maitre.control.store import Store

KEEP = 200_000
"""Events kept in memory (older ones are read back from the store)."""


class EventLog:
    def __init__(self, store: "Store | None" = None, keep: int = KEEP) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._tail: deque[dict[str, Any]] = deque(maxlen=keep)
        self.listeners: list[Callable[[int], None]] = []
        """Called with the newest ``seq`` after each append (from the appending thread)."""
        if store is not None:
            for event in store.events():
                self._tail.append(event)
        self.last = self._tail[-1]["seq"] if self._tail else 0

    def append(self, t: float, kind: str, job: str | None, body: dict[str, Any]) -> int:
        """Record one event; returns its ``seq``."""
        with self._lock:
            if self._store is not None:
                seq = self._store.add_event(t, kind, job, **body)
            else:
                seq = self.last + 1
            self.last = seq
            self._tail.append({"seq": seq, "t": t, "job": job, "kind": kind, **body})
        for listen in self.listeners:
            listen(seq)
        return seq

    def newest(self, kind: str) -> dict[str, Any] | None:
        """The newest event of ``kind`` still in memory."""
        with self._lock:
            for event in reversed(self._tail):
                if event["kind"] == kind:
                    return event
        return None

    def since(self, seq: int = 0, limit: int | None = None, job: str | None = None) -> list[dict[str, Any]]:
        """The events after ``seq`` (at most ``limit``), oldest first; only ``job``'s if given."""
        with self._lock:
            first = self._tail[0]["seq"] if self._tail else self.last + 1
            if seq + 1 >= first or self._store is None:
                out = []
                start = max(0, seq + 1 - first)
                for i in range(start, len(self._tail)):
                    event = self._tail[i]
                    if job is None or event["job"] == job:
                        out.append(event)
                        if limit is not None and len(out) >= limit:
                            break
                return out
        older = self._store.events(since=seq, job=job)  # older than memory: from disk
        out = []
        for event in older:
            out.append(event)
            if limit is not None and len(out) >= limit:
                break
        return out
