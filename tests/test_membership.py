"""The coordinator's rendezvous state machine, driven with injected time (no server, no processes)."""

from __future__ import annotations

import pytest

from maitre import protocol as p
from maitre.agent.agent import WorkerBeats
from maitre.control.detectors import DetectorConfig, suspect_after
from maitre.control.membership import JobSpec, Membership, WorkerState
from maitre.scheduling.lifecycle import JobState

pytestmark = pytest.mark.timeout(30)


def make(min_w: int = 2, max_w: int = 3, max_restarts: int = 3, **cfg: float) -> Membership:
    spec = JobSpec(
        job_id="j", command=["python", "train.py"], min_workers=min_w, max_workers=max_w, max_restarts=max_restarts
    )
    return Membership(spec, DetectorConfig(**cfg), now=0.0)


def add(m: Membership, placements: list[tuple[str, int]], now: float = 0.0) -> list[str]:
    return [m.add_worker(node, slot, now).id for node, slot in placements]


def start(m: Membership, n: int, now: float = 1.0, node: str = "n0") -> list[str]:
    """n workers on one node, all arrived, first epoch open."""
    wids = add(m, [(node, s) for s in range(n)], now=0.0)
    for w in wids:
        m.arrive(w, 0, 0, "join", now)
    assert m.try_open_epoch(now)
    assert m.state == JobState.RUNNING
    return wids


def heartbeat(m: Membership, wid: str, t: float, step: int, stalled: bool) -> p.WorkerView:
    """A worker's heartbeat as it reaches the coordinator: its agent measures the rhythm and
    reports it with the step in the node's beat; the reply is the view the agent hands back."""
    beats = m.__dict__.setdefault("_agent", {}).setdefault(wid, WorkerBeats())
    beats.beat(t, step, stalled, 0.0)
    r = beats.report(wid, t)
    m.progress(wid, t, step, stalled, 0.0, r.gap_mean_s, r.gap_std_s)
    return m.view(wid, t)


def beat(m: Membership, wids: list[str], t0: float, t1: float, *, stalled: bool = False, dt: float = 0.1) -> float:
    """Regular heartbeats of wids from t0 up to t1; returns the time of the last beat."""
    t = t0
    while t <= t1 + 1e-9:
        for w in wids:
            heartbeat(m, w, t, step=0, stalled=stalled)
        last = t
        t = round(t + dt, 6)
    return last


def state(m: Membership, wid: str) -> WorkerState:
    return m.workers[wid].state


# -- JobSpec -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"command": []}, "no command"),
        ({"min_workers": 0}, "at least 1"),
        ({"min_workers": 3, "max_workers": 2}, "max workers 2 < min workers 3"),
        ({"max_restarts": -1}, "max restarts"),
    ],
)
def test_job_spec_validation(kwargs, match):
    base = {"job_id": "j", "command": ["python", "x.py"], "min_workers": 1, "max_workers": 2}
    with pytest.raises(ValueError, match=match):
        JobSpec(**{**base, **kwargs})


def test_job_spec_valid_defaults():
    spec = JobSpec(job_id="j", command=["x"], min_workers=2, max_workers=2)
    assert (spec.max_restarts, spec.env, spec.store_scope) == (3, {}, "")
    assert len(spec.token) == 64 and spec.token not in repr(spec)  # a run's token is never shown


# -- the first epoch ------------------------------------------------------------------------------


def test_first_epoch_waits_for_min_workers():
    m = make(min_w=2, max_w=2)
    w1, w2 = add(m, [("n0", 0), ("n0", 1)])
    assert m.wants_workers() == 0
    m.arrive(w1, 0, 0, "join", 1.0)
    assert not m.try_open_epoch(1.0)
    assert not m.try_open_epoch(100.0)  # no grace opens an epoch below the minimum
    assert m.state == JobState.ADMITTED and m.epoch == 0
    assert m.assignment(w1, 0) is None
    m.arrive(w2, 0, 0, "join", 101.0)
    assert m.try_open_epoch(101.0)
    assert (m.state, m.epoch, m.members) == (JobState.RUNNING, 1, [w1, w2])
    assert m.assignment(w2, 0) == {
        "action": "train",
        "epoch": 1,
        "rank": 1,
        "world_size": 2,
        "store_prefix": "job/j/e1/",
        "members": [w1, w2],
        "state_lost": False,
    }


@pytest.mark.parametrize(
    "third,t_open,expect_members",
    [
        # third worker still STARTING: wait first_round_grace_s (2.0) from when the minimum (2) was
        # there, the second arrival at t=1.5
        ("starting", [(1.5, False), (3.01, False), (3.49, False), (3.51, True)], 2),
        # third worker arrives inside the grace: opens at once with everyone
        ("arrives", [(1.5, False), (1.6, True)], 3),
        # third worker died while starting: nobody left to wait for
        ("dead", [(1.5, True)], 2),
    ],
)
def test_first_epoch_grace_for_starting_workers(third, t_open, expect_members):
    m = make(min_w=2, max_w=3)
    w1, w2, w3 = add(m, [("n0", 0), ("n0", 1), ("n0", 2)])
    m.arrive(w1, 0, 0, "join", 1.0)
    m.arrive(w2, 0, 0, "join", 1.5)
    if third == "dead":
        m.exited(w3, 1, "ImportError: no module named foo", 1.2)
        assert m.state == JobState.ADMITTED and m.failures == 1
    for t, opens in t_open:
        if third == "arrives" and opens:
            m.arrive(w3, 0, 0, "join", t)
        assert m.try_open_epoch(t) is opens, t
    assert len(m.members) == expect_members
    assert m.epoch == 1
    if expect_members == 2:
        assert m.members == [w1, w2]
        if third == "starting":
            assert state(m, w3) == WorkerState.STARTING
            assert heartbeat(m, w3, 3.1, 0, False).member_epoch == 0


def test_no_grace_when_nobody_is_starting():
    m = make(min_w=1, max_w=4)
    (w1,) = add(m, [("n0", 0)])
    m.arrive(w1, 0, 0, "join", 0.5)
    assert m.try_open_epoch(0.5)
    assert m.members == [w1]
    assert m.wants_workers() == 3


@pytest.mark.parametrize(
    "placements,arrival_order,expected_ranks",
    [
        ([("a", 0), ("b", 0), ("a", 1), ("b", 1)], [3, 2, 1, 0], [0, 2, 1, 3]),
        ([("b", 1), ("a", 0), ("b", 0)], [0, 1, 2], [1, 2, 0]),  # node b was seen first
        ([("x", 2), ("x", 0), ("x", 1)], [2, 0, 1], [2, 0, 1]),  # by slot within a node
    ],
)
def test_ranks_ordered_by_node_then_slot(placements, arrival_order, expected_ranks):
    m = make(min_w=len(placements), max_w=len(placements))
    wids = add(m, placements)
    for i in arrival_order:
        m.arrive(wids[i], 0, 0, "join", 1.0)
    assert m.try_open_epoch(1.0)
    assert [m.workers[w].rank for w in wids] == expected_ranks
    assert m.members == sorted(wids, key=lambda w: m.workers[w].rank)
    for w in wids:
        a = m.assignment(w, 0)
        assert a["rank"] == m.workers[w].rank and a["world_size"] == len(wids)


# -- losing and reopening epochs --------------------------------------------------------------------


def test_member_exit_closes_epoch_and_survivors_open_the_next():
    m = make(min_w=2, max_w=3)
    w1, w2, w3 = start(m, 3)
    assert heartbeat(m, w1, 2.0, 5, False).closed is False
    m.exited(w2, 1, "RuntimeError: CUDA error", 2.5)
    assert (m.state, m.failures, state(m, w2)) == (JobState.RENDEZVOUS, 1, WorkerState.DEAD)
    assert m.workers[w2].error == "RuntimeError: CUDA error"
    assert m.assignment(w2, 1) == {"action": "stop", "reason": "this worker was removed from the job"}
    hb = heartbeat(m, w1, 2.6, 5, True)
    assert (hb.closed, hb.epoch, hb.member_epoch, hb.stop) == (True, 1, 1, False)
    assert heartbeat(m, w2, 2.6, 5, False).stop is True

    m.arrive(w3, 1, 5, "allreduce failed", 3.0)
    assert not m.try_open_epoch(3.0)  # w1 is expected too
    assert m.assignment(w3, 1) is None
    m.arrive(w1, 1, 5, "allreduce failed", 3.1)
    assert m.try_open_epoch(3.1)
    assert (m.state, m.epoch, m.members) == (JobState.RUNNING, 2, [w1, w3])
    assert m.assignment(w3, 1) == {
        "action": "train",
        "epoch": 2,
        "rank": 1,
        "world_size": 2,
        "store_prefix": "job/j/e2/",
        "members": [w1, w3],
        "state_lost": False,
    }
    assert m.assignment(w1, 2) is None  # already in epoch 2: nothing new
    assert m.failures == 1
    assert m.wants_workers() == 1  # a replacement for w2
    hb = heartbeat(m, w1, 3.2, 5, False)
    assert (hb.closed, hb.epoch, hb.member_epoch) == (False, 2, 2)


@pytest.mark.parametrize("order", ["agent_first", "survivors_first", "survivors_then_opened_try"])
def test_failure_counted_once_per_lost_epoch(order):
    m = make(min_w=1, max_w=4, max_restarts=5)
    w1, w2, w3, w4 = start(m, 4)
    # w3 and w4 share a node that dies: both processes exit
    if order == "agent_first":
        m.exited(w3, -9, None, 2.0)
        m.exited(w4, -9, None, 2.0)
        m.arrive(w1, 1, 7, "allreduce failed", 2.1)
        m.arrive(w2, 1, 7, "allreduce failed", 2.1)
    else:
        m.arrive(w1, 1, 7, "allreduce failed", 2.0)
        assert m.state == JobState.RENDEZVOUS and m.failures == 0
        m.arrive(w2, 1, 7, "allreduce failed", 2.0)
        if order == "survivors_then_opened_try":
            assert not m.try_open_epoch(2.05)  # the lost members have not been accounted for
        m.exited(w3, -9, None, 2.1)
        m.exited(w4, -9, None, 2.2)
    assert m.failures == 1
    assert m.workers[w3].error == "killed by signal 9"
    assert m.try_open_epoch(2.3)
    assert (m.epoch, m.members) == (2, [w1, w2])
    # a later epoch's loss is a new event
    m.exited(w2, 1, "boom", 3.0)
    assert m.failures == 2 and m.state == JobState.RENDEZVOUS
    # a worker lost while starting (outside any epoch) is an event of its own
    (w5,) = add(m, [("n1", 0)], now=3.1)
    m.exited(w5, 1, "ImportError", 3.2)
    assert m.failures == 3


def test_hung_member_detected_then_exit_report_counts_once():
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=10.0)
    last = beat(m, [w1, w2, w3], 10.1, 12.0)
    beat(m, [w1, w3], 12.1, 14.0, stalled=True)
    assert m.detect_failures(14.0) == [w2]
    assert m.failures == 1 and state(m, w2) == WorkerState.DEAD
    assert "hung" in m.close_reason and m.state == JobState.RENDEZVOUS
    m.exited(w2, -9, None, 14.5)  # the agent killed it
    assert m.failures == 1 and m.workers[w2].exit_code == -9
    assert last == 12.0


# -- failure detection ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "peers_stalled,checks",
    [
        # silence since 12.0; floor 1.5 s; hard limit 15 s
        (True, [(13.4, []), (13.6, ["w2"])]),
        (False, [(13.6, []), (20.0, []), (26.9, []), (27.1, ["w2"])]),
    ],
)
def test_hang_rule(peers_stalled, checks):
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=10.0)
    beat(m, [w1, w2, w3], 10.1, 12.0)
    assert suspect_after(m.workers[w2], m.cfg) == pytest.approx(1.5)  # regular beats: the floor
    t = 12.1
    for when, expected in checks:
        beat(m, [w1, w3], t, when, stalled=peers_stalled)
        t = round(when + 0.1, 6)
        got = m.detect_failures(when)
        assert got == [f"j-{w}" for w in expected], when
        if expected:
            assert state(m, w2) == WorkerState.DEAD
            assert m.state == JobState.RENDEZVOUS and m.failures == 1
        else:
            assert state(m, w2) == WorkerState.ACTIVE
            assert m.state == JobState.RUNNING and m.failures == 0
    assert state(m, w1) == state(m, w3) == WorkerState.ACTIVE


def vouch(m: Membership, wid: str, t: float, silent_s: float, interval_s: float = 2.0) -> None:
    """A node beat at ``t`` listing ``wid`` as silent for ``silent_s``, as the coordinator takes
    it: heard less than protocol.SILENT_S ago, the agent vouches for it until its next beat is
    due (plus the coordinator's slack of 0.5 s)."""
    fresh = silent_s < p.SILENT_S
    m.progress(wid, t - silent_s, 0, False, 0.0, 0.1, 0.0, t + interval_s + 0.5 if fresh else 0.0)


def test_a_member_its_agent_vouches_for_is_not_hung_while_the_next_beat_is_due():
    """Its peers on a busy node stall on its longer step; its own node beats every 2 s. It was
    heard at that node's last beat (12.0), and its agent would have beaten at once had it fallen
    silent: no silence counts until the promise runs out (14.5), then from there on."""
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=10.0)
    beat(m, [w1, w2, w3], 10.1, 11.9)
    vouch(m, w2, 12.0, silent_s=0.05)
    t = 12.0
    for when, expected in [(13.6, []), (14.4, []), (15.9, []), (16.1, ["w2"])]:
        beat(m, [w1, w3], t, when, stalled=True)
        t = round(when + 0.1, 6)
        assert m.detect_failures(when) == [f"j-{w}" for w in expected], when
    assert "hung: no heartbeat for 1.6s" in m.close_reason


def test_a_beat_that_reports_silence_withdraws_the_promise():
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=10.0)
    beat(m, [w1, w2, w3], 10.1, 11.9)
    vouch(m, w2, 11.95, silent_s=0.05)  # heard at 11.9, vouched for until 14.45...
    vouch(m, w2, 12.3, silent_s=0.4)  # ...until its agent said it fell silent
    beat(m, [w1, w3], 12.0, 13.4, stalled=True)
    assert m.detect_failures(13.4) == []
    beat(m, [w1, w3], 13.5, 13.5, stalled=True)
    assert m.detect_failures(13.5) == ["j-w2"]  # silent since 11.9: 1.6 s, as without a vouch


def test_hang_rule_needs_every_other_member_stalled():
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=10.0)
    beat(m, [w1, w2, w3], 10.1, 12.0)
    t = 12.1
    while t <= 14.0:
        heartbeat(m, w1, t, 0, True)
        heartbeat(m, w3, t, 0, False)  # w3 is still computing: not evidence of a hang
        t = round(t + 0.1, 6)
    assert m.detect_failures(14.0) == []
    heartbeat(m, w3, 14.05, 0, True)
    assert m.detect_failures(14.1) == [w2]


def test_single_member_is_never_declared_hung_before_dead_after():
    m = make(min_w=1, max_w=1)
    (w1,) = start(m, 1, now=0.0)
    beat(m, [w1], 0.1, 1.0)
    assert m.detect_failures(15.9) == []
    assert m.detect_failures(16.1) == [w1]


def test_adaptive_suspect_timeout_for_irregular_heartbeats():
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3, now=0.0)
    t = 0.0
    for i in range(40):  # w2 beats irregularly: gaps of 0.1 and 1.0 s
        t = round(t + (0.1 if i % 2 else 1.0), 6)
        heartbeat(m, w2, t, 0, False)
    last = t
    timeout = suspect_after(m.workers[w2], m.cfg)
    assert 2.5 < timeout < m.cfg.dead_after_s
    beat(m, [w1, w3], 0.1, last + timeout + 0.5, stalled=True)
    assert m.detect_failures(last + timeout - 0.2) == []  # past the floor, inside its own timeout
    assert m.detect_failures(last + timeout + 0.2) == [w2]


def test_ready_joiner_silent_past_dead_after_is_dead_starting_is_not():
    m = make(min_w=1, max_w=3)
    (w1,) = start(m, 1, now=0.0)
    w2, w3 = add(m, [("n1", 0), ("n1", 1)], now=1.0)
    m.arrive(w2, 0, 0, "join", 1.0)  # READY, then silent
    beat(m, [w1], 1.0, 17.0)
    assert m.detect_failures(17.0) == [w2]
    assert state(m, w3) == WorkerState.STARTING  # the agent watches starting processes
    assert m.failures == 1 and m.state == JobState.RUNNING  # not a member: no epoch lost


# -- resizing ---------------------------------------------------------------------------------------


def test_scale_down_marks_highest_ranks_leaving():
    m = make(min_w=1, max_w=4)
    w1, w2, w3, w4 = start(m, 4)
    assert m.scale(2, 2.0) == [w3, w4]
    assert [state(m, w) for w in (w1, w2, w3, w4)] == [
        WorkerState.ACTIVE,
        WorkerState.ACTIVE,
        WorkerState.LEAVING,
        WorkerState.LEAVING,
    ]
    assert m.assignment(w4, 1) == {"action": "leave"}
    hb3, hb1 = heartbeat(m, w3, 2.1, 9, False), heartbeat(m, w1, 2.1, 9, False)
    assert (hb3.leave, hb3.change, hb3.closed) == (True, True, False)
    assert (hb1.leave, hb1.change) == (False, True)
    assert m.wants_workers() == 0

    m.arrive(w4, 1, 9, "leave", 2.2)
    assert m.state == JobState.RENDEZVOUS
    assert m.assignment(w4, 1) == {"action": "leave"}
    m.left(w4, 2.3)
    m.arrive(w3, 1, 9, "leave", 2.2)
    m.exited(w3, 0, None, 2.4)  # leaving with code 0 is not a failure
    m.arrive(w1, 1, 9, "resize", 2.2)
    m.arrive(w2, 1, 9, "resize", 2.2)
    assert m.try_open_epoch(2.5)
    assert (m.epoch, m.members, m.failures) == (2, [w1, w2], 0)
    assert state(m, w3) == WorkerState.LEFT and state(m, w4) == WorkerState.LEFT
    assert m.assignment(w2, 1)["world_size"] == 2
    assert heartbeat(m, w1, 2.6, 9, False).change is False


def test_scale_out_of_range_raises():
    m = make(min_w=2, max_w=4)
    start(m, 4)
    for target in (1, 5):
        with pytest.raises(ValueError, match="outside"):
            m.scale(target, 2.0)
    assert m.target == 4


def test_scale_down_also_turns_away_unneeded_joiners():
    m = make(min_w=1, max_w=3)
    w1, w2 = start(m, 2)
    (w3,) = add(m, [("n0", 2)], now=1.5)
    assert m.scale(2, 2.0) == []
    assert state(m, w3) == WorkerState.LEAVING
    assert m.assignment(w3, 0) == {"action": "leave"}
    m.exited(w3, 0, None, 2.5)
    assert state(m, w3) == WorkerState.LEFT and m.failures == 0


def test_a_joiner_turned_away_then_lost_is_no_failure_a_leaving_member_lost_still_is():
    """Issue 41: a joiner told to leave (it never was in an epoch) that goes silent, or dies,
    is no failure of the job: it holds nothing the job needs. Nor is a leaver the others have
    left behind (the next epoch opened without it). A leaving member of the current epoch lost
    before it left still is one, once for the epoch (its peers may wait on it, it may hold
    the state)."""
    m = make(min_w=1, max_w=4, max_restarts=0)
    w1, w2, w3 = start(m, 3)
    j1, j2 = add(m, [("n1", 0), ("n1", 1)], now=1.5)
    m.arrive(j1, 0, 0, "join", 1.6)  # READY; j2 still STARTING
    assert m.scale(2, 2.0) == [w3]
    assert (state(m, j1), state(m, j2)) == (WorkerState.LEAVING, WorkerState.LEAVING)
    assert m.events[-1]["turned_away"] == [j1, j2]
    m.exited(j2, -9, None, 2.1)  # killed on its way out
    beat(m, [w1, w2, w3], 2.0, 18.0)
    assert m.detect_failures(18.0) == [j1]  # answered "leave", then silent
    assert (state(m, j1), state(m, j2)) == (WorkerState.DEAD, WorkerState.DEAD)
    assert (m.failures, m.state) == (0, JobState.RUNNING), m.failure
    assert [e.get("leaving") for e in m.events if e["kind"] == "worker_dead"] == [True, True]

    # w3, a leaving member of the open epoch 1, then of the closed one, dies: a failure
    m.arrive(w3, 1, 5, "leave", 18.1)
    assert m.state == JobState.RENDEZVOUS
    m.exited(w3, -9, None, 18.2)
    assert m.failures == 1 and m.state == JobState.FAILED  # (max_restarts=0)


def test_a_leaver_left_behind_by_the_next_epoch_is_no_failure_when_lost():
    m = make(min_w=1, max_w=3, max_restarts=0)
    w1, w2, w3 = start(m, 3)
    m.scale(2, 2.0)
    for w in (w1, w2, w3):
        m.arrive(w, 1, 5, "resize", 2.1)
    assert m.try_open_epoch(2.1) and m.members == [w1, w2]
    assert state(m, w3) == WorkerState.LEAVING  # it has not said it left yet
    m.exited(w3, 1, "RuntimeError: teardown", 2.5)
    assert (m.failures, m.state, m.epoch) == (0, JobState.RUNNING, 2), m.failure


def test_a_suspension_completes_when_a_joiner_it_turned_away_is_lost():
    m = make(min_w=1, max_w=3)
    w1, w2 = start(m, 2)
    (j,) = add(m, [("n1", 0)], now=1.5)
    m.scale(2, 2.0)  # j is turned away
    m.suspend("preempted", 2.1)
    m.done(w1, 5, 2.5, suspended=True)
    m.evict(j, "node lost", 2.6)
    assert (m.failures, m.state) == (0, JobState.SUSPENDING)
    m.done(w2, 5, 2.7, suspended=True)
    assert (m.failures, m.state) == (0, JobState.SUSPENDED)


# -- heartbeat replies ------------------------------------------------------------------------------


def test_heartbeat_change_when_a_ready_joiner_exists_and_members_below_target():
    m = make(min_w=2, max_w=3)
    w1, w2 = add(m, [("n0", 0), ("n0", 1)])
    for w in (w1, w2):
        m.arrive(w, 0, 0, "join", 1.0)
    assert m.try_open_epoch(1.0)  # nobody STARTING: no grace
    assert heartbeat(m, w1, 1.1, 1, False).change is False
    (w3,) = add(m, [("n1", 0)], now=1.2)
    assert heartbeat(m, w1, 1.3, 1, False).change is False  # STARTING is not ready
    m.arrive(w3, 0, 0, "join", 1.4)
    assert state(m, w3) == WorkerState.READY
    hb = heartbeat(m, w1, 1.5, 2, False)
    assert (hb.change, hb.closed, hb.epoch, hb.member_epoch) == (True, False, 1, 1)
    hb3 = heartbeat(m, w3, 1.5, 0, False)
    assert (hb3.closed, hb3.member_epoch, hb3.change) == (True, 0, True)

    # members stop at the step boundary and come to the round
    m.arrive(w1, 1, 2, "resize", 1.6)
    hb = heartbeat(m, w2, 1.65, 2, False)  # w2 has not arrived yet: its epoch is closed
    assert (hb.closed, hb.change, hb.epoch, hb.member_epoch) == (True, False, 1, 1)
    m.arrive(w2, 1, 2, "resize", 1.7)
    assert m.try_open_epoch(1.7)
    assert m.members == [w1, w2, w3]
    for w in (w1, w3):
        hb = heartbeat(m, w, 1.8, 2, False)
        assert (hb.closed, hb.change, hb.epoch, hb.member_epoch) == (False, False, 2, 2)


def test_heartbeat_no_change_when_members_at_target():
    m = make(min_w=1, max_w=4)
    m.scale(3, 0.5)
    w1, w2, w3 = start(m, 3)
    (w4,) = add(m, [("n1", 0)], now=1.6)
    m.arrive(w4, 0, 0, "join", 1.7)  # arrive makes a STARTING worker READY
    assert state(m, w4) == WorkerState.READY
    assert m.change_pending() is False
    assert heartbeat(m, w1, 1.8, 0, False).change is False
    m.scale(4, 1.9)
    assert heartbeat(m, w1, 2.0, 0, False).change is True


def test_leaving_member_left_out_of_next_epoch_sees_stale_member_epoch():
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3)
    m.scale(2, 2.0)
    for w in (w1, w2, w3):
        m.arrive(w, 1, 3, "resize", 2.1)
    assert m.try_open_epoch(2.1)
    hb = heartbeat(m, w3, 2.2, 3, False)
    assert (hb.epoch, hb.member_epoch, hb.closed, hb.leave) == (2, 1, True, True)


# -- job outcomes -----------------------------------------------------------------------------------


def test_same_error_on_every_member_fails_the_job_with_it():
    m = make(min_w=1, max_w=2, max_restarts=5)
    w1, w2 = start(m, 2)
    err = "ValueError: bad learning rate"
    m.exited(w1, 1, err, 2.0)
    assert m.state == JobState.RENDEZVOUS
    m.exited(w2, 1, err, 2.1)
    assert m.state == JobState.FAILED
    assert m.failure == f"every worker failed with: {err}"
    assert m.failures == 1  # one lost epoch: far from max_restarts
    assert m.assignment(w1, 1) == {"action": "stop", "reason": m.failure}
    assert heartbeat(m, w1, 2.2, 0, False).stop is True
    assert m.wants_workers() == 0
    assert not m.try_open_epoch(2.3)


def test_a_data_error_fails_the_job_at_once_unless_the_loss_ended_its_run():
    line = p.DATA_ERROR + "/d/shard-001.bin: at byte 200: token id 65000 is not below the vocabulary size 512"
    m = make(min_w=1, max_w=3, max_restarts=5)
    w1, _ = start(m, 2)
    m.exited(w1, 1, line, 2.0)  # the first member that meets it: its peer is not handed the record
    assert m.state == JobState.FAILED and m.failures == 1
    assert m.failure == "the data cannot be read: /d/shard-001.bin: at byte 200: token id 65000 is not below " + (
        f"the vocabulary size 512 (worker {w1})"
    )
    assert [e["kind"] for e in m.events].count("failed") == 1
    # Suspending, the last member's loss ends the suspension: the job stays SUSPENDED.
    m = make(min_w=2, max_w=3)
    a, b = start(m, 2)
    m.suspend("preempted", 2.0)
    m.done(a, 8, 2.5, suspended=True)
    m.exited(b, 1, line, 2.6)
    assert m.state == JobState.SUSPENDED and m.failure is None, m.events[-3:]
    # Past max_restarts already: one failure, the first reason kept.
    m = make(min_w=1, max_w=2, max_restarts=0)
    w1, _ = start(m, 2)
    m.exited(w1, 1, line, 2.0)
    assert m.state == JobState.FAILED and [e["kind"] for e in m.events].count("failed") == 1


def test_different_errors_are_not_a_user_error():
    m = make(min_w=1, max_w=2, max_restarts=5)
    w1, w2 = start(m, 2)
    m.exited(w1, 1, "ValueError: a", 2.0)
    m.exited(w2, 1, "ValueError: b", 2.1)
    assert m.state == JobState.RENDEZVOUS and m.failure is None


def test_same_error_on_every_worker_before_the_first_epoch():
    m = make(min_w=2, max_w=2, max_restarts=5)
    w1, w2 = add(m, [("n0", 0), ("n0", 1)])
    m.exited(w1, 1, "SyntaxError: invalid syntax", 0.5)
    assert m.state == JobState.ADMITTED
    m.exited(w2, 1, "SyntaxError: invalid syntax", 0.6)
    assert m.state == JobState.FAILED
    assert "SyntaxError: invalid syntax" in m.failure


@pytest.mark.parametrize("max_restarts", [0, 1, 2])
def test_failures_beyond_max_restarts_fail_the_job(max_restarts):
    m = make(min_w=1, max_w=4, max_restarts=max_restarts)
    wids = start(m, 4)
    t = 2.0
    for lost in range(1, max_restarts + 2):
        victim = m.members[-1]
        m.exited(victim, 1, f"error {lost}", t)
        assert m.failures == lost
        if lost <= max_restarts:
            assert m.state == JobState.RENDEZVOUS
            for w in m.members:
                if state(m, w) == WorkerState.ACTIVE:
                    m.arrive(w, m.epoch, 0, "lost", t + 0.1)
            assert m.try_open_epoch(t + 0.2)
        t += 1.0
    assert m.state == JobState.FAILED
    assert m.failure.startswith(f"{max_restarts + 1} failures exceeded --max-restarts={max_restarts}")
    assert m.epoch == max_restarts + 1
    assert len(wids) - len(m.members) == max_restarts


def test_below_min_with_no_restarts_left_fails_in_rendezvous():
    m = make(min_w=2, max_w=2, max_restarts=1)
    w1, w2 = start(m, 2)
    m.exited(w2, 1, "oom", 2.0)
    assert m.state == JobState.RENDEZVOUS and m.failures == 1
    m.arrive(w1, 1, 0, "lost", 2.1)
    assert not m.try_open_epoch(2.1)  # 1 < min workers
    heartbeat(m, w1, 2.2, 0, True)
    m.detect_failures(2.3)
    assert m.state == JobState.FAILED and "below the minimum" in m.failure


def test_exits_after_completion_are_not_failures():
    m = make(min_w=1, max_w=3, max_restarts=0)
    w1, w2 = start(m, 2)
    (w3,) = add(m, [("n0", 2)], now=1.5)
    m.arrive(w3, 0, 0, "join", 1.6)  # READY joiner
    m.done(w1, 100, 2.0)
    assert m.state == JobState.RUNNING
    m.done(w2, 100, 2.1)
    assert m.state == JobState.COMPLETED
    m.exited(w1, 0, None, 2.2)
    m.exited(w2, 0, None, 2.2)
    m.exited(w3, -15, None, 2.3)  # killed because its job completed
    assert (m.state, m.failures, m.failure) == (JobState.COMPLETED, 0, None)
    assert [state(m, w) for w in (w1, w2, w3)] == [WorkerState.DONE, WorkerState.DONE, WorkerState.DEAD]
    assert m.assignment(w3, 0) == {"action": "stop", "reason": "job completed"}
    assert m.wants_workers() == 0
    assert m.summary()["step"] == 100


def test_a_member_that_finished_is_not_replaced_while_the_others_finish():
    m = make(min_w=2, max_w=3)
    w1, w2, w3 = start(m, 3)
    m.done(w1, 100, 2.0)
    m.exited(w1, 0, None, 2.01)  # its slot is free before the others report
    assert m.state == JobState.RUNNING and m.wants_workers() == 0
    m.done(w2, 100, 2.1)
    m.done(w3, 100, 2.1)
    assert m.state == JobState.COMPLETED


def test_code_zero_exit_without_done_is_a_failure():
    m = make(min_w=1, max_w=2)
    w1, w2 = start(m, 2)
    m.exited(w2, 0, None, 2.0)
    assert m.failures == 1 and state(m, w2) == WorkerState.DEAD
    assert "without finishing" in m.workers[w2].error
    assert m.state == JobState.RENDEZVOUS


def test_unknown_worker_raises_key_error():
    m = make()
    with pytest.raises(KeyError, match="unknown worker"):
        heartbeat(m, "nope", 0.0, 0, False)


# -- bugs found by these tests, fixed ------------------------------------------------------------


def test_member_that_missed_a_short_lived_epoch_can_still_rendezvous():
    m = make(min_w=1, max_w=3, max_restarts=5)
    w1, w2, w3 = start(m, 3)
    # a resize round: everybody arrives; w3 dies right after arriving (its exit report comes later)
    for w in (w1, w2, w3):
        m.arrive(w, 1, 4, "resize", 2.0)
    assert m.try_open_epoch(2.0) and m.epoch == 2 and m.members == [w1, w2, w3]
    assert m.assignment(w1, 1)["epoch"] == 2  # w1 got its assignment
    m.exited(w3, -9, None, 2.01)  # before w2 looked at the answer
    assert m.state == JobState.RENDEZVOUS and m.failures == 1
    m.arrive(w1, 2, 4, "allreduce failed", 2.5)
    answer = None
    t = 2.0
    for _ in range(20):  # w2 long-polls: re-arrive with the same body, look for an answer
        t += 5.0
        m.arrive(w2, 1, 4, "resize", t)
        heartbeat(m, w1, t, 4, True)
        heartbeat(m, w2, t, 4, True)
        m.try_open_epoch(t)
        m.detect_failures(t)
        answer = m.assignment(w2, 1)
        if answer is not None:
            break
    assert answer is not None, f"w2 waits forever; job {m.state.value} in epoch {m.epoch}"


def test_first_round_grace_counts_from_when_the_minimum_is_there():
    m = make(min_w=2, max_w=3)
    w1, w2, w3 = add(m, [("n0", 0), ("n0", 1), ("n0", 2)])
    m.arrive(w1, 0, 0, "join", 1.0)
    m.arrive(w2, 0, 0, "join", 5.0)  # the minimum is there at t=5; w3 is still STARTING
    assert not m.try_open_epoch(5.0)
    assert not m.try_open_epoch(6.9)
    m.arrive(w3, 0, 0, "join", 6.95)
    assert m.try_open_epoch(6.95) and m.members == [w1, w2, w3]


def test_crash_after_a_member_finished_does_not_restart_training():
    m = make(min_w=1, max_w=2)
    w1, w2 = start(m, 2)
    m.done(w1, 100, 2.0)
    m.exited(w2, 1, "RuntimeError: error during teardown", 2.1)
    assert m.wants_workers() == 0
    w3, w4 = add(m, [("n1", 0), ("n1", 1)], now=2.2)
    for w in (w3, w4):
        m.arrive(w, 0, 0, "join", 3.0)
    assert not m.try_open_epoch(3.0)
    assert m.state in (JobState.COMPLETED, JobState.FAILED)


@pytest.mark.parametrize("reports_first", ["joiner", "finishers"])
def test_a_joiner_whose_peers_finished_the_last_step_does_not_wait_forever(reports_first):
    """Found by running the benchmarks side by side on two cores: a worker joined as the others
    trained the last steps; they finished and exited, its collective failed with "connection
    closed by peer" and it came back to the rendezvous, a member still ACTIVE. The job waited
    for it to finish (it never would: it was out of the loop) and it waited for an epoch that
    could never open (fewer than the minimum left): a hang until someone cancelled the job."""
    m = make(min_w=2, max_w=3)
    w1, w2 = start(m, 2)
    (w3,) = add(m, [("n0", 2)], now=1.5)
    m.arrive(w3, 0, 0, "join", 1.6)
    for w in (w1, w2):
        m.arrive(w, 1, 40, "resize", 1.7)
    assert m.try_open_epoch(1.7) and m.members == [w1, w2, w3]
    if reports_first == "joiner":
        m.arrive(w3, 2, 0, "peer failed: Connection closed by peer", 2.0)
        assert m.state == JobState.RENDEZVOUS
        m.done(w1, 60, 2.1)
        assert m.state == JobState.RENDEZVOUS  # (w2 is still in its last step)
        m.done(w2, 60, 2.1)
    else:
        m.done(w1, 60, 2.0)
        m.done(w2, 60, 2.0)
        assert m.state == JobState.RUNNING  # w3 may be a member still in its last step
        m.arrive(w3, 2, 0, "peer failed: Connection closed by peer", 2.1)
    assert m.state == JobState.COMPLETED
    assert m.assignment(w3, 2) == {"action": "stop", "reason": "job completed"}
    m.exited(w3, 0, None, 2.2)
    assert (m.state, m.failures) == (JobState.COMPLETED, 0)


def test_members_killed_by_the_same_signal_are_not_a_user_error():
    m = make(min_w=1, max_w=2, max_restarts=3)
    w1, w2 = start(m, 2)
    m.exited(w1, -9, None, 2.0)
    m.exited(w2, -9, None, 2.0)
    assert m.failures == 1
    assert m.state == JobState.RENDEZVOUS, m.failure


def test_member_told_to_leave_before_it_joined_its_epoch_ends_that_epoch() -> None:
    """Seen in a chaos run: epoch 2 opened with w3, the job was scaled down before w3 picked up
    its assignment, w3 left instead of joining, and w1, w2 waited for it forever."""
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3)
    assert m.scale(2, 2.0) == [w3]
    assert m.assignment(w3, 0) == {"action": "leave"}
    m.left(w3, 2.1)
    assert m.state == JobState.RENDEZVOUS
    assert heartbeat(m, w1, 2.2, 5, False).closed is True
    for w in (w1, w2):
        m.arrive(w, 1, 5, "the coordinator closed the epoch", 2.3)
    assert m.try_open_epoch(2.3)
    assert (m.epoch, m.members, m.failures) == (2, [w1, w2], 0)


def test_leaver_that_exits_without_saying_so_ends_its_running_epoch() -> None:
    m = make(min_w=1, max_w=3)
    w1, w2, w3 = start(m, 3)
    m.scale(2, 2.0)
    m.exited(w3, 0, None, 2.1)
    assert m.workers[w3].state.value == "LEFT"
    assert m.state == JobState.RENDEZVOUS and m.failures == 0


# -- suspend -----------------------------------------------------------------------------------------


def test_suspend_waits_for_every_member_to_checkpoint():
    m = make(min_w=2, max_w=3)
    a, b = start(m, 2)
    m.suspend("preempted", 2.0)
    assert m.state == JobState.SUSPENDING and m.open and m.wants_workers() == 0
    reply = heartbeat(m, a, 2.1, step=7, stalled=False)
    assert reply.suspend and not reply.stop and not reply.change
    m.done(a, 8, 2.5, suspended=True)
    assert m.state == JobState.SUSPENDING  # b still training
    m.done(b, 8, 2.6, suspended=True)
    assert m.state == JobState.SUSPENDED
    assert m.events[-1]["kind"] == "suspended" and m.events[-1]["step"] == 8
    m.exited(a, 0, None, 3.0)  # the members' exits are no failure
    m.exited(b, 0, None, 3.0)
    assert m.failures == 0 and m.state == JobState.SUSPENDED
    with pytest.raises(ValueError, match="SUSPENDED"):
        m.suspend("again", 4.0)


def test_suspend_before_the_first_epoch_is_immediate():
    m = make()
    (w,) = add(m, [("n0", 0)])
    m.suspend("cancelled", 1.0)
    assert m.state == JobState.SUSPENDED
    m.arrive(w, 0, 0, "join", 1.5)
    assert m.assignment(w, 0) == {"action": "stop", "reason": "job suspended"}


def test_member_lost_while_suspending_does_not_block_it():
    m = make(min_w=1, max_w=2)
    a, b = start(m, 2)
    m.suspend("preempted", 2.0)
    m.done(a, 5, 2.5, suspended=True)
    m.exited(b, -9, None, 2.6)  # b died before it could checkpoint
    assert m.state == JobState.SUSPENDED


def test_too_few_members_left_to_checkpoint_suspends_at_once():
    m = make(min_w=2, max_w=2)
    a, b = start(m, 2)
    m.suspend("preempted", 2.0)
    m.exited(b, -9, None, 2.6)
    assert m.state == JobState.SUSPENDED  # a alone cannot train a step: no new checkpoint


def test_losing_every_worker_that_held_the_state_is_logged():
    """The only member with state dies right after a joiner was admitted: the next epoch has
    nobody with the job's progress, and the coordinator says so (the group restarts from the
    newest checkpoint, or from step 0)."""
    m = make(min_w=1, max_w=2)
    (w1,) = start(m, 1)
    heartbeat(m, w1, 1.5, step=40, stalled=False)
    (w2,) = add(m, [("n1", 0)], now=2.0)
    m.arrive(w2, 0, 0, "join", 2.0)
    m.arrive(w1, m.epoch, 40, "resize", 2.1)
    assert m.try_open_epoch(2.1) and m.members == [w1, w2]
    m.exited(w1, -9, None, 2.2)  # before w2 received the state
    m.arrive(w2, m.epoch, 0, "peer failed", 2.3)
    assert m.try_open_epoch(2.3) and m.members == [w2]
    lost = [e for e in m.events if e["kind"] == "state_lost"]
    assert len(lost) == 1 and lost[0]["step"] == 40
    assert m.assignment(w2, m.epoch - 1)["state_lost"] is True  # w2 records the rollback
    # An ordinary change, with a member that has the state, logs nothing of the kind.
    (w3,) = add(m, [("n0", 1)], now=3.0)
    heartbeat(m, w2, 3.0, step=2, stalled=False)
    m.arrive(w3, 0, 0, "join", 3.1)
    m.arrive(w2, m.epoch, 2, "resize", 3.1)
    assert m.try_open_epoch(3.1)
    assert len([e for e in m.events if e["kind"] == "state_lost"]) == 1
    assert m.assignment(w3, 0)["state_lost"] is False


def test_a_group_that_cannot_be_built_is_a_failure_and_ends_the_job_with_the_setting_to_change():
    m = make(min_w=2, max_w=2, max_restarts=1)
    w1, w2 = start(m, 2, now=1.0)
    for epoch in (1, 2):  # every member says so; it counts once per epoch
        for w in (w1, w2):
            m.arrive(
                w,
                epoch,
                0,
                "group not built: Gloo connectFullMesh failed",
                2.0 * epoch,
                group_failed=True,
                unreachable=["127.0.0.1"],
            )
        if epoch == 1:
            assert m.failures == 1 and m.try_open_epoch(2.5) and m.epoch == 2
    assert m.state == JobState.FAILED and m.failures == 2
    assert "unreachable: 127.0.0.1" in m.failure and "GLOO_SOCKET_IFNAME" in m.failure
    assert "--iface" in m.failure
