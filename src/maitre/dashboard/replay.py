"""``maitre dashboard DIR``: the dashboard's views over a recorded event log, with a time slider.

``DIR`` (or a file in it) is one of:

- a simulation's output (``maitre simulate --out DIR``): ``events-<policy>.jsonl``, one per
  policy (``--policy`` picks one; ``maitre`` is the default when there are several);
- a coordinator's state directory (``maitre up --state-dir DIR``): its ``state.db``, read-only,
  so a run can be watched again, or while it runs, by another process;
- any ``.jsonl`` file of events, one JSON object a line (``{"seq", "t", "job", "kind", ...}``).

The log is read again whenever its file changes, so a replay of a state directory whose
coordinator is still running follows it. A file that is malformed or cut short is refused with
the line and what is wrong: at start, as an error and a non-zero exit; later (it changed under
the replay), as an error page and a 422 from the events route, never a blank page.
"""

from __future__ import annotations

import bisect
import json
import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

from maitre.errors import RequestError

MAX_LINE = 1 << 20


class ReplayError(ValueError):
    """A log that cannot be replayed: the message says which file, which line and why."""


class Unreplayable(RequestError):
    """The events route's answer when the log went bad under a running replay."""

    status = 422


def find(path: Path, policy: str | None = None) -> Path:
    """The event log that ``path`` names (see the module docstring)."""
    if not path.exists():
        raise ReplayError(f"{path}: no such file or directory")
    if path.is_file():
        return path
    logs = sorted(path.glob("events-*.jsonl"))
    if policy is not None:
        chosen = path / f"events-{policy}.jsonl"
        if chosen.is_file():
            return chosen
        names = ", ".join(p.name[7:-6] for p in logs) or "none"
        raise ReplayError(f"{path}: no events of policy {policy!r} (the policies there: {names})")
    if logs:
        by_name = {p.name[7:-6]: p for p in logs}
        return by_name.get("maitre", logs[0])
    for name in ("events.jsonl", "state.db"):
        if (path / name).is_file():
            return path / name
    raise ReplayError(
        f"{path}: no event log in it: expected a simulation's events-<policy>.jsonl "
        f"(maitre simulate --out), a coordinator's state.db (maitre up "
        f"--state-dir) or an events.jsonl"
    )


def _check(event: Any, where: str, last: int) -> dict[str, Any]:
    if not isinstance(event, dict):
        raise ReplayError(f"{where}: an event is a JSON object, got {type(event).__name__}")
    seq, t, kind, job = event.get("seq"), event.get("t"), event.get("kind"), event.get("job")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= last:
        raise ReplayError(f"{where}: 'seq' must be an integer above the previous one ({last}), got {seq!r}")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise ReplayError(f"{where}: 't' must be a finite number of seconds, got {t!r}")
    if not isinstance(kind, str) or not kind or len(kind) > 64:
        raise ReplayError(f"{where}: 'kind' must be a short string, got {kind!r}")
    if job is not None and not isinstance(job, str):
        raise ReplayError(f"{where}: 'job' must be a string or null, got {job!r}")
    return event


def _jsonl(path: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    last = 0
    try:
        with path.open("rb") as f:
            data = f.read()
    except OSError as exc:
        raise ReplayError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if data and not data.endswith(b"\n"):
        lines = data.count(b"\n") + 1
        raise ReplayError(
            f"{path}: line {lines} is cut short (the file does not end with a newline): the log is truncated"
        )
    for number, line in enumerate(data.splitlines(), 1):
        where = f"{path}: line {number}"
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            raise ReplayError(f"{where}: over {MAX_LINE} bytes")
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReplayError(f"{where}: not JSON ({exc})") from None
        events.append(_check(event, where, last))
        last = event["seq"]
    if not events:
        raise ReplayError(f"{path}: no events in it")
    return events


def _sqlite(path: Path) -> list[dict[str, Any]]:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT seq, t, job, kind, body FROM events ORDER BY seq").fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise ReplayError(f"{path}: not a coordinator's state database ({exc})") from None
    events, last = [], 0
    for seq, t, job, kind, body in rows:
        where = f"{path}: event {seq}"
        try:
            fields = json.loads(body)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ReplayError(f"{where}: its body is not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ReplayError(f"{where}: its body is not a JSON object")
        events.append(_check({"seq": seq, "t": t, "job": job, "kind": kind, **fields}, where, last))
        last = seq
    if not events:
        raise ReplayError(f"{path}: no events in it")
    return events


def load(path: Path) -> list[dict[str, Any]]:
    """Every event of the log at ``path`` (a file :func:`find` returned), checked."""
    with path.open("rb") as f:
        sqlite = f.read(16) == b"SQLite format 3\x00"
    return _sqlite(path) if sqlite else _jsonl(path)


def _seq(event: dict[str, Any]) -> int:
    return event["seq"]


class ReplayLog:
    """A recorded log as the dashboard's routes read it (like the live
    :class:`~maitre.control.eventlog.EventLog`), read again when its file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[float, int] | None = None
        self._events: list[dict[str, Any]] = []
        self.error: str | None = None
        self._refresh()
        if self.error:
            raise ReplayError(self.error)

    def _file_stamp(self) -> tuple[float, int]:
        try:
            stat = self.path.stat()
        except OSError:
            return (0.0, -1)
        wal = self.path.with_name(self.path.name + "-wal")
        extra = wal.stat().st_mtime if wal.exists() else 0.0
        return (max(stat.st_mtime, extra), stat.st_size)

    def _refresh(self) -> None:
        with self._lock:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            try:
                self._events = load(self.path)
                self.error = None
            except (ReplayError, OSError) as exc:
                self.error = str(exc)
            self._stamp = stamp

    @property
    def last(self) -> int:
        self._refresh()
        return self._events[-1]["seq"] if self._events else 0

    def since(self, seq: int = 0, limit: int | None = None, job: str | None = None) -> list[dict[str, Any]]:
        self._refresh()
        if self.error:
            raise Unreplayable(f"the event log cannot be replayed: {self.error}", "path")
        first = bisect.bisect_right(self._events, seq, key=_seq)  # (seq is increasing)
        out = []
        for event in self._events[first:]:
            if job is None or event["job"] == job:
                out.append(event)
                if limit is not None and len(out) >= limit:
                    break
        return out
