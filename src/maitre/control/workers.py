"""The coordinator's index of workers: which run each belongs to, and which hold each node's slots.

A node beat reads and writes only its own workers, and a worker's call only its own run: both are
found here in O(1), so the work per call is proportional to what the call touches, not to the
cluster. A worker stays in its node's set from its start order until its slots are known free
(its exit is in, or it was never started); its run is remembered for good (a run in a job's
history may still hear from its workers: their exits).
"""

from __future__ import annotations

from typing import Iterator

from maitre.control.membership import LIVE, Membership, Worker
from maitre.errors import NotFound


class WorkerIndex:
    """Worker id -> its run; node -> the workers that hold (or may still hold) its slots."""

    def __init__(self) -> None:
        self._runs: dict[str, Membership] = {}
        self._on: dict[str, set[str]] = {}

    def add(self, run: Membership, worker: Worker) -> None:
        """A worker of ``run`` (started, or restored from the store)."""
        self._runs[worker.id] = run
        if worker.ended_at is None:
            self._on.setdefault(worker.node, set()).add(worker.id)

    def remember(self, run: Membership) -> None:
        """The workers of a run in a job's history: their exits may still come."""
        for wid in run.workers:
            self._runs[wid] = run

    def __contains__(self, wid: str) -> bool:
        return wid in self._runs

    def run(self, wid: str) -> Membership:
        """The run ``wid`` belongs to (KeyError: none of this coordinator's)."""
        return self._runs[wid]

    def get(self, wid: str) -> Membership | None:
        return self._runs.get(wid)

    def job_of(self, wid: str) -> Membership:
        """:meth:`run`, for a worker's call: an unknown worker is a 404."""
        try:
            return self._runs[wid]
        except KeyError:
            raise NotFound(f"unknown worker {wid!r}", "path.worker") from None

    def on(self, node: str) -> set[str]:
        """The workers that hold (or may still hold) slots of ``node`` (a copy)."""
        return set(self._on.get(node, ()))

    def freed(self, node: str, wid: str) -> None:
        """``wid`` holds no slot of ``node`` any more."""
        self._on.get(node, set()).discard(wid)

    def live_on(self, node: str) -> Iterator[tuple[Membership, Worker]]:
        """Each live worker on ``node`` and its run, in worker id order."""
        for wid in sorted(self._on.get(node, ())):
            run = self._runs[wid]
            w = run.workers[wid]
            if w.state in LIVE:
                yield run, w
