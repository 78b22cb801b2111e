"""The recovery path: how a worker learns that its epoch is over, and how it gets into the next.

:class:`~maitre.runtime.loop.ElasticLoop` owns the step boundary; when a step cannot commit
(a collective failed, or the coordinator gave up the epoch under it) or a worker joins, it comes
here:

- **Is the epoch still counted on?** The coordinator's word arrives in the heartbeat's view
  (:mod:`maitre.runtime.heartbeat`): :func:`epoch_closed` and :func:`given_up` read it for one
  epoch. A group waiting in a collective asks the first (:class:`~maitre.runtime.group.EpochGroup`);
  a step whose collectives waited past the stall threshold asks the second before it commits,
  once the coordinator has spoken since (:func:`await_word`).
- **The way in:** :func:`rendezvous` asks the coordinator for the next epoch until it answers
  ``train`` (an :class:`~maitre.protocol.Assignment`), riding out a coordinator that restarts;
  ``leave`` and ``stop`` end the worker's part (:class:`Ended`, or
  :class:`~maitre.errors.WorkerStopped` when the job failed or the worker was refused).
- **What it cost:** a :class:`Recovery` times each phase (rendezvous, group, state) and becomes
  the report the coordinator turns into the job's recovery history.

The loop then builds the epoch's group and brings the state up to the members ahead
(:mod:`maitre.runtime.transfer`, or streamed: :mod:`maitre.runtime.streamjoin`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from maitre import protocol
from maitre.errors import ApiError, CoordinatorUnreachable, WorkerStopped
from maitre.runtime.group import EpochLost
from maitre.runtime.heartbeat import CoordinatorView
from maitre.runtime.link import CoordinatorLink

JOB_ENDED = ("COMPLETED", "FAILED", "SUSPENDED", "CANCELLED")
"""Job states (a view's ``job_state``) in which the epoch closed with the job, not without a
member: the step every member finished still stands."""

RETRY_S = 0.5
"""The pause before asking an unreachable coordinator again."""


class Ended(Exception):
    """This worker's part in the job ended before its last step; :meth:`ElasticLoop.run` catches
    it and returns (``why``: :attr:`ElasticLoop.ended`)."""

    def __init__(self, why: str, message: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.message = message


@dataclass(slots=True)
class Recovery:
    """Timings of the last membership change, as this worker saw it (wall clock, seconds)."""

    reason: str
    detected_at: float
    assigned_at: float = 0.0
    group_at: float = 0.0
    synced_at: float = 0.0
    state_bytes: int = 0
    state_from: int = -1
    state_source: str = "none"
    """Where the state this member starts the epoch with came from: ``peer`` (live in the
    group: its own, or received from a member ahead), ``disk`` or ``none`` (step 0)."""

    def report(self, *, epoch: int, rank: int, world_size: int, step: int, now: float) -> dict[str, Any]:
        """What the coordinator records of it (:class:`~maitre.protocol.RecoveryReport`), sent
        at the first step of the epoch (``now``)."""
        return {
            "kind": "recovery",
            "epoch": epoch,
            "rank": rank,
            "reason": self.reason,
            "world_size": world_size,
            "detected_at": self.detected_at,
            "rendezvous_s": self.assigned_at - self.detected_at,
            "group_s": self.group_at - self.assigned_at,
            "state_s": self.synced_at - self.group_at,
            "state_bytes": self.state_bytes,
            "to_next_step_s": now - self.detected_at,
            "step": step,
            "state_source": self.state_source,
        }


def epoch_closed(view: CoordinatorView | None, epoch: int) -> str | None:
    """Why ``epoch`` is over for this worker, as ``view`` says (else None): the coordinator
    closed it, or already moved the worker to a newer one (another process of its replica went
    on while this one still waited in the old epoch)."""
    if view is None:
        return None
    if view.closed and view.member_epoch == epoch:
        return "the coordinator closed the epoch"
    if view.member_epoch > epoch > 0:
        return "the coordinator moved this worker to a newer epoch"
    return None


def given_up(view: CoordinatorView | None, epoch: int) -> str | None:
    """Why the coordinator no longer counts on this worker in ``epoch`` (else None): the epoch
    is over without the job ending, or the worker was removed. An epoch closed because the job
    ended leaves its last step standing."""
    if view is None or view.job_state in JOB_ENDED:
        return None
    if view.stop:
        return "the coordinator removed this worker"
    return epoch_closed(view, epoch)


def await_word(view: Callable[[], CoordinatorView], epoch: int, since: float, timeout_s: float, step: int) -> None:
    """Wait until the coordinator has spoken after ``since`` (monotonic: the view's
    ``heard_at``), then raise :class:`EpochLost` if it gave ``epoch`` up. For a step whose
    collectives kept this worker waiting past its stall threshold: they complete once every
    member contributed, even members that abandoned the epoch since, so only the coordinator
    can tell whether the step stands (see ``ElasticLoop._confirm_epoch``)."""
    deadline = time.monotonic() + timeout_s
    while view().heard_at < since and given_up(view(), epoch) is None:
        if time.monotonic() > deadline:
            raise WorkerStopped(f"no word from the coordinator for {timeout_s:.0f}s after step {step + 1}; giving up")
        time.sleep(0.01)
    reason = given_up(view(), epoch)
    if reason is not None:
        raise EpochLost(reason, time.monotonic())


def rendezvous(
    link: CoordinatorLink,
    *,
    from_epoch: int,
    step: int,
    reason: str,
    lost: EpochLost | None,
    timeout_s: float,
    speaks: bool,
) -> protocol.Assignment:
    """Leave ``from_epoch`` (0: join) at committed ``step`` for ``reason``, and ask the
    coordinator for the next epoch until it says ``train``; return that answer. ``lost``: how
    the last epoch was lost, when it was (a group that could not be built is a failure the
    coordinator counts, with the peers that could not be reached).

    ``wait``: ask again (the coordinator holds each ask up to ``wait_s``). Unreachable
    (restarting): ask again for up to ``timeout_s``, then :class:`WorkerStopped`. ``leave``: the
    job goes on without this worker; it says so (when it ``speaks`` for its replica: its first
    process) and ends with :class:`Ended` ``("left")``. ``stop``: the job was suspended,
    completed or cancelled (:class:`Ended`), or failed (:class:`WorkerStopped`). A refusal, or
    an answer that is not an Assignment: :class:`WorkerStopped`."""
    unbuilt = lost is not None and lost.unbuilt
    request = protocol.RendezvousRequest(
        from_epoch=from_epoch,
        step=step,
        reason=reason[:500],
        wait_s=5.0,
        group_failed=unbuilt,
        unreachable=lost.unreachable[:64] if lost is not None and unbuilt else [],
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = link.rendezvous(request, timeout_s=15.0)
        except CoordinatorUnreachable as exc:
            if time.monotonic() > deadline:
                raise WorkerStopped(f"{exc}; giving up after {timeout_s:.0f}s") from None
            time.sleep(RETRY_S)
            continue
        except ApiError as exc:
            raise WorkerStopped(f"rendezvous refused: {exc.message}") from None
        except ValidationError as exc:  # a coordinator of another version
            raise WorkerStopped(f"the coordinator's rendezvous answer cannot be read: {exc}") from None
        if answer.action == "train":
            return answer
        if answer.action == "leave":
            leave(link if speaks else None)
        if answer.action == "stop":
            said = f"maitre: worker stopped: {answer.reason}"
            if answer.reason == "job suspended":
                raise Ended("suspended", said)
            if answer.reason in ("job completed", "job cancelled"):
                raise Ended("stopped", said)
            raise WorkerStopped(f"worker stopped: {answer.reason}")


def leave(link: CoordinatorLink | None, message: str | None = None) -> None:
    """The job goes on without this worker: tell the coordinator through ``link`` (None: the
    worker does not speak for its replica, or has no coordinator), then end its part
    (:class:`Ended` ``("left")``, with ``message`` for stderr). An unreachable coordinator
    learns it from the worker's exit as well."""
    if link is not None:
        try:
            link.left()
        except (CoordinatorUnreachable, ApiError) as exc:
            print(f"maitre: could not report leaving: {exc}", file=sys.stderr)
    raise Ended("left", message)
