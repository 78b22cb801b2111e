"""The job state machine: one enum, one table of the moves it may make, one place that moves it.

Every job, from submission to its end, is in exactly one of these states::

    PENDING --admit--> ADMITTED --first epoch opens--> RUNNING <--epoch closes/opens--> RENDEZVOUS
       ^                  |                              |                                |
       |                  +---------------+--------------+---------------+----------------+
       |                                  | suspend (preemption, `maitre suspend`)
       |                                  v
    SUSPENDED <--members checkpointed-- SUSPENDING

    any state before the end --> COMPLETED | FAILED | CANCELLED   (ADMITTED, RENDEZVOUS,
    RUNNING and SUSPENDING complete or fail; anything not ended may be cancelled)

A SUSPENDED job waits like a PENDING one and is admitted again (a new run resumes it from its
checkpoint). The scheduler moves a job in and out of its slots (admit, suspend, cancel); the
job's membership moves it while it runs (epochs opening and closing, the last step done, too many
failures, the members' checkpoints durable). Both go through
:meth:`maitre.scheduling.model.Job.move`, so a move the table does not allow is a bug that shows,
never a job in two states at once.
"""

from __future__ import annotations

from enum import Enum

from maitre.errors import IllegalMove


class JobState(str, Enum):
    PENDING = "PENDING"
    """Queued: waits for its minimum to fit (and for its queue's quota)."""
    ADMITTED = "ADMITTED"
    """Given its slots: its workers are starting and its first epoch is forming."""
    RENDEZVOUS = "RENDEZVOUS"
    """Between two epochs: a worker joined, left or was lost; the next member list is agreed."""
    RUNNING = "RUNNING"
    """Training in an open epoch."""
    SUSPENDING = "SUSPENDING"
    """Asked to checkpoint and stop (preempted, or by a user); its slots are still held."""
    SUSPENDED = "SUSPENDED"
    """Stopped with a checkpoint; waits to be admitted again, like a pending job."""
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def ended(self) -> bool:
        """Over for good: it holds nothing and never runs again."""
        return self in _ENDED

    @property
    def placed(self) -> bool:
        """Holds slots and trains (or is about to): the states the policy may grow or shrink."""
        return self in _PLACED

    @property
    def waiting(self) -> bool:
        """Holds no slots and waits to be admitted."""
        return self in (JobState.PENDING, JobState.SUSPENDED)

    @property
    def run_over(self) -> bool:
        """Its current run has stopped: the job ended, or was suspended (a new run resumes it)."""
        return self in _ENDED or self == JobState.SUSPENDED


_ENDED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
_PLACED = frozenset({JobState.ADMITTED, JobState.RENDEZVOUS, JobState.RUNNING})

MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.ADMITTED, JobState.CANCELLED}),
    JobState.ADMITTED: frozenset({JobState.RUNNING, JobState.SUSPENDING, *_ENDED}),
    JobState.RUNNING: frozenset({JobState.RENDEZVOUS, JobState.SUSPENDING, *_ENDED}),
    JobState.RENDEZVOUS: frozenset({JobState.RUNNING, JobState.SUSPENDING, *_ENDED}),
    JobState.SUSPENDING: frozenset({JobState.SUSPENDED, *_ENDED}),
    JobState.SUSPENDED: frozenset({JobState.ADMITTED, JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
"""Where each state may go (staying where it is is always allowed)."""


def check_move(job_id: str, current: JobState, to: JobState) -> None:
    """Raise :class:`~maitre.errors.IllegalMove` unless :data:`MOVES` allows ``current`` to
    ``to``."""
    if to != current and to not in MOVES[current]:
        raise IllegalMove(f"job {job_id}: no move from {current.value} to {to.value}")
