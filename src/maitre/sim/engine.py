"""The simulator's discrete-event engine: one event heap, simulated time, seeded randomness.

Events are kept in one heap keyed by ``(time, seq)``: ``seq`` grows with every event scheduled,
so events at the same time run in the order they were scheduled, whatever their callbacks are.
Time is simulated seconds (never the wall clock). Each entity (a job, a node, the arrival
process) draws from its own :class:`random.Random`, seeded from the run's seed and the entity's
name through a stable hash (not Python's ``hash``, which is salted per process), so adding an
entity or reordering draws of one does not change what another one draws. The same inputs give
the same outputs bit for bit.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(order=True, slots=True)
class Event:
    time: float
    seq: int
    callback: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False, default=())
    cancelled: bool = field(compare=False, default=False)

    def cancel(self) -> None:
        """The event will not run (it stays in the heap until its time comes)."""
        self.cancelled = True


class Engine:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.now = 0.0
        self.processed = 0
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self._rngs: dict[str, random.Random] = {}
        self._stopped = False

    def at(self, time: float, callback: Callable[..., Any], *args: Any) -> Event:
        """Run ``callback(*args)`` at simulated ``time`` (not before now)."""
        if not math.isfinite(time):
            raise ValueError(f"event time must be finite, got {time}")
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        event = Event(time, next(self._seq), callback, args)
        heapq.heappush(self._heap, event)
        return event

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> Event:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        return self.at(self.now + delay, callback, *args)

    def rng(self, entity: str) -> random.Random:
        """The random stream of ``entity``, the same for the same seed in every run."""
        stream = self._rngs.get(entity)
        if stream is None:
            digest = hashlib.sha256(f"{self.seed}:{entity}".encode()).digest()
            stream = self._rngs[entity] = random.Random(int.from_bytes(digest[:8], "big"))
        return stream

    def stop(self) -> None:
        """End :meth:`run` after the event being processed; later events never run."""
        self._stopped = True

    def pending(self) -> int:
        return sum(1 for e in self._heap if not e.cancelled)

    def run(self, until: float | None = None) -> float:
        """Process events in (time, seq) order until none is left or the next is after
        ``until`` (then the clock stops at ``until``). Returns the clock."""
        while self._heap and not self._stopped:
            event = self._heap[0]
            if until is not None and event.time > until:
                self.now = until
                return self.now
            heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.now = event.time
            self.processed += 1
            event.callback(*event.args)
        if until is not None:
            self.now = max(self.now, until)
        return self.now
