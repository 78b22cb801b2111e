"""The job state machine's table (:mod:`maitre.scheduling.lifecycle`); how the coordinator moves a
job through it is in ``test_control_plane.py`` and ``test_membership.py``."""

from __future__ import annotations

import pytest

from maitre.errors import IllegalMove
from maitre.scheduling.lifecycle import MOVES, JobState
from maitre.scheduling.model import Job

pytestmark = pytest.mark.timeout(10)
S = JobState


def test_every_state_has_its_moves_and_an_ended_job_has_none() -> None:
    assert set(MOVES) == set(JobState)
    for state, targets in MOVES.items():
        assert state not in targets
        assert (not targets) == state.ended, state
        if not state.ended:
            assert S.CANCELLED in targets, f"{state.value} cannot be cancelled"


def test_the_groups_tell_every_state_apart() -> None:
    for state in JobState:
        groups = [state.placed, state.waiting, state == S.SUSPENDING, state.ended]
        assert groups.count(True) == 1, state
        assert state.run_over == (state.ended or state == S.SUSPENDED)


def test_every_state_is_reachable_from_pending() -> None:
    seen, todo = {S.PENDING}, [S.PENDING]
    while todo:
        for to in MOVES[todo.pop()] - seen:
            seen.add(to)
            todo.append(to)
    assert seen == set(JobState)


@pytest.mark.parametrize(
    "start,to",
    [
        (S.PENDING, S.RUNNING),
        (S.COMPLETED, S.RUNNING),
        (S.SUSPENDED, S.RUNNING),
        (S.RUNNING, S.PENDING),
        (S.SUSPENDING, S.RUNNING),
        (S.CANCELLED, S.ADMITTED),
    ],
)
def test_a_move_the_table_does_not_allow_raises_and_changes_nothing(start, to) -> None:
    job = Job(id="j", queue="q", state=start)
    with pytest.raises(IllegalMove, match=f"job j: no move from {start.value} to {to.value}"):
        job.move(to)
    assert job.state == start


def test_staying_is_always_allowed() -> None:
    for state in JobState:
        job = Job(id="j", queue="q", state=state)
        job.move(state)
        assert job.state == state
