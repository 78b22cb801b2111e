"""The coordinator's journal: what a call changed is in the store before the call answers.

A call marks the jobs it changed (:meth:`Journal.mark`, under the coordinator's lock) and,
once it let go of the lock, waits until they are saved and committed (:meth:`Journal.durable`;
the API's event loop awaits :meth:`Journal.when_durable` instead, holding no thread). Saving is
grouped in *rounds*: one saver thread serializes every job changed so far, under the lock,
once a round, while the calls that changed them wait; so the 256 exits of a cancelled gang save
their job a few times, not 256 (each save is O(the job's workers): 256 exits took 1.3 s when
each saved it), and 256 exits no longer fill the API's thread pool ahead of the arrivals of the
gang that takes their slots (that queue made such a gang open 3 s late at 64 nodes).

A job's record (:meth:`maitre.control.job.ManagedJob.record`) is written only when it changed
since the last write. Progress and accounting (steps, trained seconds, throughput, usage) are
saved every :data:`SAVE_EVERY_S`, a few jobs a tick (:meth:`Journal.save_progress`): saving
8,192 workers at once held the lock for a third of a second, and every beat behind it waited.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Iterable

from maitre.control.store import Store
from maitre.scheduling.model import Job

SAVE_EVERY_S = 5.0
"""Progress and accounting are saved this often; every state change is saved when it happens."""
SAVES_PER_TICK = 2
"""... a few jobs a tick, so that no tick holds the lock for long."""

Then = Callable[[BaseException | None], None]


class Journal:
    """Saves the jobs that calls changed, in rounds, on a thread of its own."""

    def __init__(
        self,
        store: Store,
        lock: threading.RLock,
        records: Callable[[str], tuple[Job, dict[str, Any]] | None],
    ) -> None:
        """``lock``: the coordinator's (a round serializes jobs under it); ``records``: a job's
        scheduler view and record by its id (None: no such job any more)."""
        self.store = store
        self._lock = lock
        self._records = records
        self._mine = threading.local()
        self._dirty: set[str] = set()
        """Jobs changed and not yet saved."""
        self._dirty_round = 1
        self._saved_round = 0
        self._cv = threading.Condition()
        self._waits: list[tuple[int, int, Then]] = []
        self._saver: threading.Thread | None = None
        self._written: dict[str, str] = {}
        """Each job's record as last written (a record that did not change is not written)."""
        self._next_progress = 0.0
        self._progress_due: list[str] = []

    def mark(self, job_ids: Iterable[str]) -> None:
        """Jobs to save (under the lock): this thread's call waits for the round that saves them."""
        job_ids = set(job_ids)
        if job_ids:
            self._dirty |= job_ids
            self._mine.need = self._dirty_round

    def take_pending(self) -> tuple[int, int]:
        """What this thread's last calls left to make durable: (save round, store commit);
        zeros for nothing. :meth:`durable` waits for them, on any thread."""
        need = getattr(self._mine, "need", 0)
        self._mine.need = 0
        return need, self.store.take_staged()

    def durable(self, need: int, staged: int) -> None:
        """Wait until save round ``need`` is saved and store commit ``staged`` is in (raises
        the store's error if it failed)."""
        if not (need or staged):
            return
        done = threading.Event()
        failed: list[BaseException | None] = []
        self.when_durable(need, staged, lambda exc: (failed.append(exc), done.set()))
        done.wait()
        if failed[0] is not None:
            raise failed[0]

    def when_durable(self, need: int, staged: int, then: Then) -> None:
        """Call ``then(None)`` once save round ``need`` is saved and store commit ``staged`` is
        in (``then(error)`` if the store failed), from the saver thread, or at once for nothing
        to wait for."""
        if not (need or staged):
            then(None)
            return
        with self._cv:
            self._waits.append((need, staged, then))
            if self._saver is None:
                self._saver = threading.Thread(target=self._save_rounds, name="maitre-saver", daemon=True)
                self._saver.start()
            self._cv.notify()

    def save_progress(self, now: float, job_ids: Callable[[], list[str]], usage: Callable[[], Any]) -> None:
        """Every :data:`SAVE_EVERY_S`, every job's progress, :data:`SAVES_PER_TICK` jobs a
        tick (under the lock), and the cluster's usage."""
        if now >= self._next_progress:
            self._next_progress = now + SAVE_EVERY_S
            self._progress_due = sorted(job_ids())
            self.store.put_meta("usage", usage())
        some, self._progress_due = self._progress_due[:SAVES_PER_TICK], self._progress_due[SAVES_PER_TICK:]
        self.mark(some)

    def _save_rounds(self) -> None:
        while True:
            with self._cv:
                while not self._waits:
                    self._cv.wait()
                waits, self._waits = self._waits, []
            error: BaseException | None = None
            try:
                seq = max(staged for _, staged, _ in waits)
                if max(need for need, _, _ in waits) > self._saved_round:
                    with self._lock:
                        jobs, self._dirty = self._dirty, set()
                        done = self._dirty_round
                        self._dirty_round += 1
                        self._write(jobs)
                    seq = max(seq, self.store.take_staged())
                    self._saved_round = done
                if seq:
                    self.store.wait(seq)
            except Exception as exc:  # the store failed: every waiter hears it
                error = exc
            for _, _, then in waits:
                then(error)

    def _write(self, job_ids: set[str]) -> None:
        """Stage the records among ``job_ids`` that changed since their last write (under the
        lock)."""
        for job_id in sorted(job_ids):
            found = self._records(job_id)
            if found is None:
                continue
            job, record = found
            text = json.dumps(
                [record, job.state.value, job.placement, job.max_replicas, job.throughput, job.last_resize_at],
                sort_keys=True,
                default=str,
            )
            if self._written.get(job_id) != text:
                self.store.put_job(job, record)
                self._written[job_id] = text
