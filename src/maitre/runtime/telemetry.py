"""What a worker tells the coordinator besides its membership: progress and checkpoints.

The coordinator turns each report into an event (``progress``, ``checkpoint``, ``restore``,
``straggler``) for its event log, the dashboard and ``/metrics``. Four kinds, each from the one
process that knows (:mod:`maitre.protocol` has their shapes):

- **progress**, from the job's rank 0 (the first process of its replica), at most once every
  :data:`PROGRESS_EVERY_S`: the committed step, the last step's loss, steps and samples per
  second over the wall time since the previous report (pauses included: what the job got);
- **checkpoint**, from the committing rank, once the manifest is in place or the save failed;
- **restore**, from rank 0, when the job's state came from disk;
- **straggler**, from rank 0, when its detector found a rank slower than its peers
  (:mod:`maitre.runtime.stragglers`).

The step never waits on the network: :class:`Reporter` posts on a thread of its own. A progress
report is dropped when a post is in flight or waiting (the next one, a second later, says more);
a checkpoint, restore or straggler report waits its turn in a short queue. Nothing here raises into the
training loop: a coordinator that is away loses these reports, not the job's time.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Callable

from maitre.checkpoint.loader import Loaded
from maitre.checkpoint.writer import SaveResult
from maitre.wire import ApiError, CoordinatorUnreachable

PROGRESS_EVERY_S = 1.0
"""Rank 0's progress reports are at least this far apart."""
_QUEUED = 16
"""Checkpoint and restore reports waiting at most (older ones are dropped past it: a
coordinator away that long has missed more than these)."""
_POST_TIMEOUT_S = 2.0


class ProgressMeter:
    """Rank 0's committed steps and samples since its last report; every
    :data:`PROGRESS_EVERY_S` a progress report of them (pure: time passed in)."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self._since: float | None = None
        self._steps = 0
        self._samples = 0

    def reset(self) -> None:
        """Count again from the next step (this process is no longer rank 0, or is again)."""
        self._since = None

    def committed(
        self, now: float, step: int, samples: int, loss: float | None, world_size: int, skipped: int = 0
    ) -> dict[str, Any] | None:
        """A step committed at ``now``; returns a progress report when one is due."""
        if self._since is None:  # the window opens at a commit: no start-up in the rate
            self._since, self._steps, self._samples = now, 0, 0
            return None
        self._steps += 1
        self._samples += samples
        elapsed = now - self._since
        if elapsed < self.every_s:
            return None
        report = {
            "kind": "progress",
            "step": step,
            "loss": loss if loss is not None and math.isfinite(loss) else None,
            "world_size": world_size,
            "steps_per_s": self._steps / elapsed,
            "samples_per_s": self._samples / elapsed,
            "skipped_samples": skipped,
        }
        self._since, self._steps, self._samples = now, 0, 0
        return report


def checkpoint_report(result: SaveResult) -> dict[str, Any]:
    """The committer's result of a save, as the coordinator takes it."""
    return {
        "kind": "checkpoint",
        "step": result.step,
        "world_size": result.world_size,
        "snapshot_s": result.block_s,
        "persist_s": result.persist_s,
        "bytes": result.total_bytes,
        "interval_steps": result.interval_steps,
        "interval_s": result.interval_s,
        "ok": result.error is None and result.path is not None,
        "error": None if result.error is None else result.error[:2000],
    }


def restore_report(loaded: Loaded, seconds: float) -> dict[str, Any]:
    return {"kind": "restore", "step": loaded.step, "source": "disk", "seconds": seconds, "bytes": loaded.nbytes}


class Reporter:
    """Posts reports to the coordinator on a background thread (see the module docstring)."""

    def __init__(
        self, send: Callable[[dict[str, Any], float], None], on_error: Callable[[str], None] | None = None
    ) -> None:
        self._send = send
        """Posts one report, with a timeout (the link's :meth:`~maitre.runtime.link.CoordinatorLink.report`)."""
        self._on_error = on_error
        """Told of a checkpoint or restore report that could not be sent."""
        self._cv = threading.Condition()
        self._queue: deque[dict[str, Any]] = deque(maxlen=_QUEUED)
        self._progress: dict[str, Any] | None = None
        self._posting = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Progress reports dropped because a post was in flight."""
        self.sent = 0

    def offer(self, report: dict[str, Any]) -> bool:
        """A progress report: posted if nothing is in flight or waiting, else dropped (False).
        Never blocks."""
        with self._cv:
            if self._closed or self._posting or self._progress is not None or self._queue:
                self.dropped += 1
                return False
            self._progress = report
            self._wake()
        return True

    def send(self, report: dict[str, Any]) -> None:
        """A checkpoint or restore report: queued, posted in order. Never blocks."""
        with self._cv:
            if self._closed:
                return
            self._queue.append(report)
            self._wake()

    def flush(self, timeout_s: float = _POST_TIMEOUT_S) -> bool:
        """Wait (at most ``timeout_s``) until every queued report went out; False if not."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._queue or self._progress or self._posting), timeout_s)

    def close(self, timeout_s: float = _POST_TIMEOUT_S) -> None:
        """Send what is queued (within ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._progress = None
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="maitre-reporter", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._queue or self._progress)
                if self._closed:
                    return
                if self._queue:
                    report = self._queue.popleft()
                else:
                    report, self._progress = self._progress, None
                self._posting = True
            error = None
            try:
                self._send(report, _POST_TIMEOUT_S)
                self.sent += 1
            except (CoordinatorUnreachable, ApiError) as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 -- never into the training loop
                error = f"{type(exc).__name__}: {exc}"
            finally:
                with self._cv:
                    self._posting = False
                    self._cv.notify_all()
            # (a lost progress report says nothing the next one will not)
            if error is not None and self._on_error is not None and report["kind"] != "progress":
                self._on_error(f"maitre: a {report['kind']} report was lost: {error}")
