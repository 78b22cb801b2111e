"""A clock for time limits that a busy machine must not fail: it counts the seconds the machine
left to this test session, not the seconds on the wall.

A smoke run that takes 60 s on CI's two quiet cores takes 120 s beside a process spinning on each
core, and that says nothing about the code. So a limit is checked against :meth:`FairClock.now`:
every sampling period it advances by the period times the share of the cores that processes
*outside* this session's process tree left free (the session's own processes, however many,
are what the limit is about). Beside two spinning processes on two cores it advances at about
half speed; on a quiet machine, at wall speed. It never slows below ``floor`` of the wall (a
machine taken whole for good must still end a run that hangs), and a run that hangs on a quiet
machine is still caught at its limit.

The other processes' CPU comes from ``/proc`` (utime + stime of each, between two samples): one
that starts and ends inside a period is not seen, which makes the clock run faster, so a limit
stays strict, never lax, when what loads the machine is short-lived."""

from __future__ import annotations

import os
import threading
import time

from maitre import procs


def free_share(root: int, before: dict[int, procs.Proc], after: dict[int, procs.Proc], dt: float, cores: int) -> float:
    """The share of ``cores`` that processes outside ``root``'s tree left free between two
    samples of the process table taken ``dt`` seconds apart (0: they took every core)."""
    if dt <= 0:
        return 1.0
    ours = {root, *procs.descendants(root, before), *procs.descendants(root, after)}
    others = sum(
        max(0.0, proc.cpu_s - before[pid].cpu_s) for pid, proc in after.items() if pid not in ours and pid in before
    )
    return 1.0 - min(1.0, others / (dt * cores))


class FairClock:
    """Seconds since start, each counted at the share of the machine that others left free (see
    the module docstring). A sampling thread runs while the clock is open."""

    FLOOR = 0.25
    """The slowest it runs: a quarter of the wall, however busy the machine."""

    def __init__(self, root: int | None = None, period_s: float = 1.0, floor: float = FLOOR) -> None:
        self.root = os.getpid() if root is None else root
        self.period_s = period_s
        self.floor = floor
        self.cores = len(os.sched_getaffinity(0))
        self._fair = 0.0
        self._wall = 0.0
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="fair-clock", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Fair seconds since the clock started (to the last sample, plus the wall since it)."""
        with self._lock:
            return self._fair + (time.monotonic() - self._since)

    def wall(self) -> float:
        with self._lock:
            return self._wall + (time.monotonic() - self._since)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        before, at = procs.table(live_only=False), time.monotonic()
        while not self._stop.wait(self.period_s):
            after, now = procs.table(live_only=False), time.monotonic()
            dt = now - at
            free = free_share(self.root, before, after, dt, self.cores)
            with self._lock:
                self._fair += dt * max(self.floor, free)
                self._wall += dt
                self._since = now
            before, at = after, now
