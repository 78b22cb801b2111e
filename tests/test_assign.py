"""The worker-level choices of maitre.scheduling.assign, shared by the coordinator and the
simulator: repair of a gang below its minimum, who leaves on a shrink, which slot a worker takes."""

from __future__ import annotations

import pytest

from maitre.scheduling import Cluster, Job, JobState, Node, Queue
from maitre.scheduling.assign import Replica, free_slot, leavers, repair

pytestmark = pytest.mark.timeout(30)


def cluster(nodes: int = 3, slots: int = 4) -> Cluster:
    return Cluster.of([Node(f"n{i}", slots, rack=f"r{i // 2}") for i in range(nodes)], [Queue("q")])


def running(id: str, lo: int, hi: int, placement: dict[str, int], priority: int = 0, submitted_at: float = 0.0) -> Job:
    return Job(
        id=id,
        queue="q",
        priority=priority,
        min_replicas=lo,
        max_replicas=hi,
        submitted_at=submitted_at,
        state=JobState.RUNNING,
        placement=dict(placement),
    )


def test_a_gang_below_its_minimum_gets_its_replicas_back_near_its_survivors() -> None:
    c = cluster()
    gang = running("gang", 4, 4, {"n0": 2})  # it lost n1's two replicas with n1
    other = running("other", 1, 4, {"n1": 4})
    assert repair(c, [gang, other]) == [gang]
    assert gang.replicas == 4 and gang.placement["n0"] == 4  # its own node first
    assert other.placement == {"n1": 4}  # a repair never takes from another job


def test_a_repair_that_does_not_fit_waits_and_the_first_in_line_goes_first() -> None:
    c = cluster(nodes=2)  # 8 slots
    full = running("full", 1, 4, {"n0": 4})
    late = running("late", 3, 3, {"n1": 1}, submitted_at=2.0)
    early = running("early", 3, 3, {"n1": 1}, submitted_at=1.0)
    assert repair(c, [full, late, early]) == [early]  # 2 slots were free: one repair
    assert early.replicas == 3 and late.replicas == 1 and full.replicas == 4
    early.placement = {"n1": 1}
    high = running("high", 3, 3, {"n1": 1}, priority=10, submitted_at=3.0)
    assert repair(c, [full, early, high]) == [high]  # priority before age
    assert repair(c, [running("fine", 1, 2, {"n0": 1})]) == []


def test_leavers_are_joiners_first_then_the_highest_ranks_on_the_nodes_given_up() -> None:
    replicas = [
        Replica("a", "n0", True, 0),
        Replica("b", "n0", True, 3),
        Replica("c", "n0", False, None),
        Replica("d", "n1", True, 1),
        Replica("e", "n1", True, 2),
    ]
    assert leavers(replicas, {"n0": 3, "n1": 2}, {"n0": 1, "n1": 2}) == ["c", "b"]
    assert leavers(replicas, {"n0": 3, "n1": 2}, {"n0": 3}) == ["e", "d"]
    assert leavers(replicas, {"n0": 3}, {"n0": 3}) == []


def test_a_worker_takes_the_first_contiguous_free_slots() -> None:
    assert free_slot(set(), 8, 1) == 0
    assert free_slot({0, 1, 3}, 8, 1) == 2
    assert free_slot({0, 1, 3}, 8, 2) == 4  # 2..3 is not free, 4..5 is
    assert free_slot({0, 1, 2, 3}, 4, 1) is None
    assert free_slot({1}, 4, 4) is None
