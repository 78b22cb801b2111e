"""The recovery path's own parts (:mod:`maitre.runtime.recovery`), without a process group: how the
coordinator's answers to a rendezvous end in an epoch, a wait, a leave or a stop, and how a
worker reads from its view whether its epoch still counts. The whole path, with ranks as threads
and as processes, is exercised by tests/test_inprocess.py, test_elastic_processes.py and the
chaos run."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from maitre import protocol
from maitre.errors import ApiError, CoordinatorUnreachable, WorkerStopped
from maitre.runtime import recovery
from maitre.runtime.group import EpochLost
from maitre.runtime.heartbeat import CoordinatorView

pytestmark = pytest.mark.timeout(30)

TRAIN = {"action": "train", "epoch": 3, "rank": 1, "world_size": 2, "store_prefix": "e3/"}


class _Link:
    """A coordinator link that answers rendezvous from a script: an answer (a dict), or an
    exception to raise."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: list[protocol.RendezvousRequest] = []
        self.lefts = 0
        self.left_raises: Exception | None = None

    def rendezvous(self, request: protocol.RendezvousRequest, timeout_s: float) -> protocol.Assignment:
        self.asked.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return protocol.Assignment.model_validate(answer)

    def left(self) -> None:
        self.lefts += 1
        if self.left_raises is not None:
            raise self.left_raises


def _enter(link: _Link, *, lost: EpochLost | None = None, timeout_s: float = 5.0, speaks: bool = True) -> Any:
    return recovery.rendezvous(
        link, from_epoch=2, step=40, reason="x" * 600, lost=lost, timeout_s=timeout_s, speaks=speaks
    )


def test_a_worker_asks_again_through_waits_and_a_restarting_coordinator_until_it_may_train(monkeypatch) -> None:
    monkeypatch.setattr(recovery, "RETRY_S", 0.0)
    link = _Link({"action": "wait"}, CoordinatorUnreachable("restarting"), {"action": "wait"}, TRAIN)
    answer = _enter(link)
    assert (answer.epoch, answer.rank, answer.world_size) == (3, 1, 2)
    assert len(link.asked) == 4
    first = link.asked[0]
    assert (first.from_epoch, first.step, len(first.reason)) == (2, 40, 500)  # (the protocol's cap)
    assert not first.group_failed and first.unreachable == []


def test_a_group_that_could_not_be_built_is_told_with_the_peers_it_could_not_reach() -> None:
    link = _Link(TRAIN)
    lost = EpochLost("connect failed", 0.0, unbuilt=True, unreachable=[f"10.0.0.{i}:29500" for i in range(80)])
    _enter(link, lost=lost)
    assert link.asked[0].group_failed and len(link.asked[0].unreachable) == 64
    link = _Link(TRAIN)
    _enter(link, lost=EpochLost("a peer crashed", 0.0))  # lost in training: not the group's failure
    assert not link.asked[0].group_failed and link.asked[0].unreachable == []


def test_a_coordinator_out_of_reach_past_the_timeout_stops_the_worker(monkeypatch) -> None:
    monkeypatch.setattr(recovery, "RETRY_S", 0.01)
    link = _Link(*[CoordinatorUnreachable("no route to host")] * 1000)
    began = time.monotonic()
    with pytest.raises(WorkerStopped, match="no route to host; giving up after 0s"):
        _enter(link, timeout_s=0.05)
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("speaks", [True, False])
def test_leave_ends_the_workers_part_and_its_first_process_says_so(speaks: bool, capsys) -> None:
    link = _Link({"action": "leave"})
    link.left_raises = CoordinatorUnreachable("gone")  # (its exit tells it too: not an error)
    with pytest.raises(recovery.Ended) as ended:
        _enter(link, speaks=speaks)
    assert ended.value.why == "left" and link.lefts == int(speaks)
    assert ("could not report leaving" in capsys.readouterr().err) == speaks


def test_leaving_tells_the_coordinator_once_through_the_process_that_speaks() -> None:
    """The loop's own leave (a listener whose job finished while its state streamed in) goes
    the same way as a rendezvous's ``leave``: told through the link, its message kept."""
    link = _Link()
    with pytest.raises(recovery.Ended) as ended:
        recovery.leave(link, "maitre: w1: the job finished at step 40 while this worker's state streamed in")
    assert (ended.value.why, link.lefts) == ("left", 1) and "step 40" in (ended.value.message or "")
    with pytest.raises(recovery.Ended):
        recovery.leave(None)  # (not the replica's first process: it says nothing)


@pytest.mark.parametrize(
    ("reason", "why"),
    [("job suspended", "suspended"), ("job completed", "stopped"), ("job cancelled", "stopped")],
)
def test_stop_with_the_job_ends_the_workers_part(reason: str, why: str) -> None:
    with pytest.raises(recovery.Ended) as ended:
        _enter(_Link({"action": "stop", "reason": reason}))
    assert ended.value.why == why and reason in (ended.value.message or "")


def test_a_failed_job_a_refusal_or_an_unreadable_answer_stops_the_worker_with_the_cause() -> None:
    with pytest.raises(WorkerStopped, match="worker stopped: job failed: 3 restarts"):
        _enter(_Link({"action": "stop", "reason": "job failed: 3 restarts"}))
    with pytest.raises(WorkerStopped, match="rendezvous refused: unknown worker"):
        _enter(_Link(ApiError(404, "unknown worker")))
    with pytest.raises(ValidationError) as bad:  # a train answer with no epoch, as a link parses it
        protocol.Assignment.model_validate({"action": "train"})
    with pytest.raises(WorkerStopped, match="answer cannot be read"):
        _enter(_Link(bad.value))


def test_the_view_says_whether_the_epoch_still_counts() -> None:
    view = CoordinatorView
    assert recovery.given_up(None, 3) is None  # no coordinator (torchrun, alone)
    assert recovery.given_up(view(member_epoch=3), 3) is None
    assert recovery.given_up(view(member_epoch=3, closed=True), 3) == "the coordinator closed the epoch"
    assert recovery.given_up(view(member_epoch=2, closed=True), 3) is None  # an older epoch's news
    assert recovery.given_up(view(member_epoch=4), 3) == "the coordinator moved this worker to a newer epoch"
    assert recovery.given_up(view(member_epoch=3, stop=True), 3) == "the coordinator removed this worker"
    for state in recovery.JOB_ENDED:  # closed with the job: the last step stands
        assert recovery.given_up(view(member_epoch=3, closed=True, job_state=state), 3) is None
    assert recovery.epoch_closed(view(member_epoch=3, closed=True, job_state="COMPLETED"), 3) is not None


def test_a_long_step_waits_for_the_coordinators_word_before_it_commits() -> None:
    """Its collectives completed at ``since``: the step stands once the coordinator has spoken
    after that and still counts on the epoch; it is dropped if the word is that the epoch was
    given up; and the worker stops if no word comes."""
    current = [CoordinatorView(member_epoch=3, heard_at=time.monotonic() - 10)]
    since = time.monotonic()

    def speak(later: CoordinatorView) -> None:
        time.sleep(0.1)
        current[0] = later

    threading.Thread(target=speak, args=(CoordinatorView(member_epoch=3, heard_at=since + 0.05),)).start()
    recovery.await_word(lambda: current[0], 3, since, 5.0, 40)  # returns: the step stands
    current[0] = CoordinatorView(member_epoch=3, heard_at=since - 1)
    threading.Thread(target=speak, args=(CoordinatorView(member_epoch=3, closed=True, heard_at=since + 0.05),)).start()
    with pytest.raises(EpochLost, match="closed the epoch"):
        recovery.await_word(lambda: current[0], 3, since, 5.0, 40)
    current[0] = CoordinatorView(member_epoch=3, heard_at=since - 1)
    with pytest.raises(WorkerStopped, match="after step 41; giving up"):
        recovery.await_word(lambda: current[0], 3, since, 0.05, 40)


def test_a_recovery_reports_each_phase() -> None:
    rec = recovery.Recovery("a peer crashed", detected_at=100.0, assigned_at=100.5, group_at=101.0)
    rec.synced_at, rec.state_bytes, rec.state_source = 103.0, 4096, "peer"
    report = rec.report(epoch=4, rank=0, world_size=3, step=41, now=103.5)
    assert report["rendezvous_s"] == 0.5 and report["group_s"] == 0.5 and report["state_s"] == 2.0
    assert report["to_next_step_s"] == 3.5 and report["state_source"] == "peer"
    protocol.RecoveryReport.model_validate(report)  # what the coordinator accepts
