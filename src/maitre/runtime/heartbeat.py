"""The worker's heartbeat thread: liveness for the coordinator, news for the training loop.

Every ``interval_s`` the thread tells its agent (on the agent's unix socket, never the
coordinator: the agent carries all its node's workers in one beat) the worker's committed step,
the seconds it spent in steps that committed (the cluster's utilization accounting), and whether
it is stalled (waiting in a collective for longer than the loop's stall threshold, which is
derived from observed step times). The reply is the worker's view as the coordinator last sent
it: whether the worker's epoch was closed (a peer died, hung or the job is resizing), whether a
change is pending (a joiner is ready, a member must leave), and whether this worker must stop.
The training loop reads these flags between wait slices and at step boundaries; the thread
itself never touches the process group.

If the agent or the coordinator cannot be reached the flags keep their last values: the current
epoch goes on training, and only the next membership change waits for the coordinator. The view
says as of when it is the coordinator's word (:attr:`CoordinatorView.heard_at`), for the loop's
one step that must not commit on old news (see ``ElasticLoop._confirm_epoch``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError

from maitre.protocol import AgentView, LocalBeat
from maitre.wire import ApiError, CoordinatorUnreachable

log = logging.getLogger("maitre.runtime.heartbeat")


@dataclass(slots=True)
class CoordinatorView:
    """The latest heartbeat reply, as the loop sees it."""

    member_epoch: int = 0
    closed: bool = False
    change: bool = False
    leave: bool = False
    stop: bool = False
    suspend: bool = False
    """Checkpoint after the current step and exit: the job is being suspended."""
    job_state: str = ""
    failures: int = 0
    """The job's failures so far, and its age: the checkpoint interval's failure rate."""
    age_s: float = 0.0
    heard_at: float = -math.inf
    """This process's ``time.monotonic()`` as of which the view is the coordinator's word (its
    agent sent, no later than this, a request the coordinator answered); -inf: not yet."""


class Heartbeat:
    def __init__(
        self,
        send: Callable[[LocalBeat, float], AgentView],
        worker_id: str,
        interval_s: float,
        progress: Callable[[], tuple[int, bool, float]],
        proc: int = 0,
    ) -> None:
        self.send = send
        """Sends a beat to the agent, with a timeout, and returns its answer (the link's
        :meth:`~maitre.runtime.link.CoordinatorLink.beat`)."""
        self.worker_id = worker_id
        self.proc = proc
        """Its index in its replica (the agent tells a replica's processes apart by it)."""
        self.interval_s = interval_s
        self.progress = progress
        self.view = CoordinatorView()
        self._unreadable = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maitre-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            step, stalled, trained_s = self.progress()
            asked = time.monotonic()
            beat = LocalBeat(step=step, stalled=stalled, proc=self.proc, trained_s=round(trained_s, 4))
            try:
                reply = self.send(beat, 2.0)
            except (CoordinatorUnreachable, ApiError):
                pass  # keep the last view: the current epoch trains on
            except ValidationError as exc:  # an agent of another version: the same, said once
                if not self._unreadable:
                    log.warning("worker %s: its agent's answers cannot be read: %s", self.worker_id, exc)
                self._unreadable = True
            else:
                self.view = CoordinatorView(
                    member_epoch=reply.member_epoch,
                    closed=reply.closed,
                    change=reply.change,
                    leave=reply.leave,
                    stop=reply.stop,
                    suspend=reply.suspend,
                    job_state="" if reply.job_state is None else reply.job_state.value,
                    failures=reply.failures,
                    age_s=reply.age_s,
                    heard_at=-math.inf if reply.heard_s is None else asked - reply.heard_s,
                )
            self._stop.wait(self.interval_s)
