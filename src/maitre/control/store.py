"""The coordinator's durable state: nodes, queues, jobs, placements and events in SQLite (WAL).

The coordinator keeps its working state in memory; every change is *staged* here (a statement
queued in memory, in order) and a writer thread commits what is staged in one transaction at a
time (group commit): a burst of changes, such as the 256 arrivals and reports of one epoch,
costs one ``fsync`` instead of hundreds, and none of it is paid under the coordinator's lock.
Durability is unchanged for what is acknowledged: a call that staged a change waits
(:meth:`Store.acknowledge`, after it let go of the lock) until the transaction holding it is
committed, before its answer goes out. After a crash or a restart the store holds a prefix of
the staged changes that includes every acknowledged one (running jobs then re-attach: their
workers keep training meanwhile). WAL mode lets readers (``maitre status``, the dashboard) read
while the coordinator writes; ``synchronous = FULL`` makes each commit durable. This process's
own reads see everything staged (they commit it first).

Values that are structures (labels, manifests, placements, throughput) are JSON columns.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Cluster, Job, Node, Queue, Topology

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, slots INTEGER NOT NULL, labels TEXT NOT NULL,
    registered_at REAL NOT NULL, last_heartbeat REAL NOT NULL);
CREATE TABLE IF NOT EXISTS queues (
    name TEXT PRIMARY KEY, guaranteed INTEGER NOT NULL, borrowing_limit INTEGER,
    weight REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, queue TEXT NOT NULL, priority INTEGER NOT NULL,
    min_replicas INTEGER NOT NULL, max_replicas INTEGER NOT NULL,
    slots_per_replica INTEGER NOT NULL, preemptible INTEGER NOT NULL,
    grace_period_s REAL NOT NULL, topology TEXT, submitted_at REAL NOT NULL,
    state TEXT NOT NULL, placement TEXT NOT NULL, last_resize_at REAL,
    throughput TEXT NOT NULL, extra TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, job TEXT, kind TEXT NOT NULL,
    body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
SCHEMA_VERSION = "2"
"""2: one job state (``jobs.state``, :mod:`maitre.scheduling.lifecycle`) for 1's ``phase``."""
_MAX_STAGED = 50_000
"""Statements staged but not committed past which staging waits for the writer (a bound on
memory when the disk is slower than the coordinator)."""
log = logging.getLogger("maitre.store")


class StoreError(Exception):
    """The database is not a maitre coordinator store, or is of another version."""


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        _owner_only(self.path)  # it holds every run's token
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a maitre coordinator store: {exc}") from None
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema version {row[0]}, this maitre reads {SCHEMA_VERSION}")
        self._next_event = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
        self._cv = threading.Condition()
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._staged = self._committed = 0
        self._failed: str | None = None
        self._closing = False
        self._mine = threading.local()
        self._writer = threading.Thread(target=self._write, name="maitre-store", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Commit what is staged, then close."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout=30)
        with self._lock:
            self._db.close()

    # -- staging and group commit ----------------------------------------------------------------
    def _stage(self, *statements: tuple[str, tuple[Any, ...]]) -> int:
        with self._cv:
            while len(self._pending) > _MAX_STAGED and self._failed is None:
                self._cv.wait(1.0)
            self._pending.extend(statements)
            self._staged += 1
            seq = self._staged
            self._cv.notify_all()
        self._mine.seq = seq
        return seq

    def _write(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, []
                upto = self._staged
                self._cv.notify_all()
            try:
                with self._tx() as db:
                    for sql, args in batch:
                        db.execute(sql, args)
            except sqlite3.Error as exc:  # disk full, I/O error: the batch is not in
                log.error("the coordinator's store %s failed to commit: %s", self.path, exc)
                with self._cv:
                    self._failed = f"{self.path}: {exc}"
                    self._cv.notify_all()
                return
            with self._cv:
                self._committed = upto
                self._cv.notify_all()

    def wait(self, seq: int, timeout_s: float = 60.0) -> None:
        """Until the change staged as ``seq`` is committed (raises StoreError if it never is)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._committed >= seq or self._failed is not None, timeout_s):
                raise StoreError(f"{self.path}: no commit within {timeout_s:.0f}s")
            if self._committed < seq:
                raise StoreError(f"the coordinator's store failed: {self._failed}")

    def acknowledge(self) -> None:
        """Wait until everything this thread staged is committed (before answering a call)."""
        seq = self.take_staged()
        if seq:
            self.wait(seq)

    def take_staged(self) -> int:
        """What this thread staged since it last asked (0: nothing), for a caller that waits
        for it elsewhere (:meth:`wait`)."""
        seq = getattr(self._mine, "seq", 0)
        self._mine.seq = 0
        return seq

    def flush(self) -> None:
        """Commit everything staged so far (reads of this process see their own writes)."""
        with self._cv:
            seq = self._staged
        self.wait(seq)

    def _tx(self) -> "_Transaction":
        return _Transaction(self)

    # -- writes ----------------------------------------------------------------------------------
    def put_node(self, node: Node, now: float) -> None:
        labels = {
            "rack": node.rack,
            "block": node.block,
            "capacity_type": node.capacity_type,
            "accelerator": node.accelerator,
        }
        self._stage(
            (
                "INSERT INTO nodes VALUES (?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "slots=excluded.slots, labels=excluded.labels, "
                "last_heartbeat=excluded.last_heartbeat",
                (node.name, node.slots, json.dumps(labels), now, now),
            )
        )

    def node_heartbeat(self, name: str, now: float) -> None:
        self._stage(("UPDATE nodes SET last_heartbeat=? WHERE name=?", (now, name)))

    def remove_node(self, name: str) -> None:
        self._stage(("DELETE FROM nodes WHERE name=?", (name,)))

    def put_queue(self, queue: Queue) -> None:
        self._stage(
            (
                "INSERT OR REPLACE INTO queues VALUES (?, ?, ?, ?)",
                (queue.name, queue.guaranteed, queue.borrowing_limit, queue.weight),
            )
        )

    def put_job(self, job: Job, extra: dict[str, Any] | None = None) -> None:
        """Insert or update a job (``extra``: what the coordinator keeps beside the scheduler's
        view, e.g. the command and checkpoint directory of its manifest)."""
        topology = (
            None if job.topology is None else json.dumps({"level": job.topology.level, "mode": job.topology.mode})
        )
        if extra is None:
            self.flush()
            with self._lock:
                row = self._db.execute("SELECT extra FROM jobs WHERE id=?", (job.id,)).fetchone()
            extra = json.loads(row[0]) if row else {}
        self._stage(
            (
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.id,
                    job.queue,
                    job.priority,
                    job.min_replicas,
                    job.max_replicas,
                    job.slots_per_replica,
                    int(job.preemptible),
                    job.grace_period_s,
                    topology,
                    job.submitted_at,
                    job.state.value,
                    json.dumps(job.placement),
                    None if job.last_resize_at == float("-inf") else job.last_resize_at,
                    json.dumps({str(k): v for k, v in job.throughput.items()}),
                    json.dumps(extra),
                ),
            )
        )

    def remove_job(self, job_id: str) -> None:
        self._stage(("DELETE FROM jobs WHERE id=?", (job_id,)))

    def add_event(self, t: float, kind: str, job: str | None = None, **body: Any) -> int:
        """Stage an event; returns its sequence number (``events(since=...)`` counts by it)."""
        with self._cv:  # numbered and staged at once (the lock is reentrant): in commit order
            self._next_event += 1
            seq = self._next_event
            self._stage(
                (
                    "INSERT INTO events (seq, t, job, kind, body) VALUES (?, ?, ?, ?, ?)",
                    (seq, t, job, kind, json.dumps(body)),
                )
            )
        return seq

    def put_meta(self, key: str, value: Any) -> None:
        self._stage(("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value))))

    # -- reads -----------------------------------------------------------------------------------
    def meta(self, key: str) -> Any:
        self.flush()
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def cluster(self) -> Cluster:
        self.flush()
        with self._lock:
            nodes = [
                Node(name, slots, **json.loads(labels))
                for name, slots, labels, *_ in self._db.execute("SELECT * FROM nodes ORDER BY name")
            ]
            queues = [Queue(name, g, b, w) for name, g, b, w in self._db.execute("SELECT * FROM queues ORDER BY name")]
        return Cluster.of(nodes, queues)

    def node_heartbeats(self) -> dict[str, float]:
        self.flush()
        with self._lock:
            return dict(self._db.execute("SELECT name, last_heartbeat FROM nodes"))

    def jobs(self) -> list[tuple[Job, dict[str, Any]]]:
        self.flush()
        with self._lock:
            rows = list(self._db.execute("SELECT * FROM jobs ORDER BY submitted_at, id"))
        out = []
        for (
            jid,
            queue,
            priority,
            lo,
            hi,
            per,
            preemptible,
            grace,
            topology,
            submitted,
            state,
            placement,
            last_resize,
            throughput,
            extra,
        ) in rows:
            topo = None if topology is None else Topology(**json.loads(topology))
            job = Job(
                id=jid,
                queue=queue,
                priority=priority,
                min_replicas=lo,
                max_replicas=hi,
                slots_per_replica=per,
                preemptible=bool(preemptible),
                grace_period_s=grace,
                topology=topo,
                submitted_at=submitted,
                state=JobState(state),
                placement=json.loads(placement),
                last_resize_at=float("-inf") if last_resize is None else last_resize,
                throughput={int(k): v for k, v in json.loads(throughput).items()},
            )
            out.append((job, json.loads(extra)))
        return out

    def events(
        self, since: int = 0, job: str | None = None, kinds: tuple[str, ...] | None = None
    ) -> Iterator[dict[str, Any]]:
        """The events after ``since``, oldest first (only ``job``'s, only of ``kinds``)."""
        query = "SELECT seq, t, job, kind, body FROM events WHERE seq > ?"
        args: tuple[Any, ...] = (since,)
        if job is not None:
            query += " AND job = ?"
            args += (job,)
        if kinds is not None:
            query += f" AND kind IN ({', '.join('?' * len(kinds))})"
            args += tuple(kinds)
        self.flush()
        with self._lock:
            rows = list(self._db.execute(query + " ORDER BY seq", args))
        for seq, t, jid, kind, body in rows:
            yield {"seq": seq, "t": t, "job": jid, "kind": kind, **json.loads(body)}


class _Transaction:
    """``with store._tx() as db:`` runs the body in one IMMEDIATE transaction under the lock."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.store._db.execute("BEGIN IMMEDIATE")
        return self.store._db

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            self.store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.store._lock.release()


def _owner_only(path: Path) -> None:
    """Create the database file readable and writable by its owner only, or make an older one
    so (SQLite gives its -wal and -shm files the database file's mode)."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc}") from None
