"""The scheduling policy: hand-checked scenarios, then random clusters under invariants."""

from __future__ import annotations

import random

import pytest

from maitre.scheduling import Cluster, Job, JobState, Node, Plan, PolicyConfig, Queue, Topology
from maitre.scheduling import place, schedule
from maitre.scheduling.policy import FreeSlots
from maitre.scheduling.model import Speedup

pytestmark = pytest.mark.timeout(60)


def make_cluster(racks: int = 2, nodes: int = 2, slots: int = 4, queues: list[Queue] | None = None) -> Cluster:
    return Cluster.of(
        [Node(f"r{r}n{n}", slots, rack=f"r{r}") for r in range(racks) for n in range(nodes)], queues or [Queue("q")]
    )


def job(
    id: str,
    min_r: int = 1,
    max_r: int | None = None,
    *,
    queue: str = "q",
    priority: int = 0,
    per: int = 1,
    at: float = 0.0,
    preemptible: bool = True,
    **kw,
) -> Job:
    return Job(
        id=id,
        queue=queue,
        priority=priority,
        min_replicas=min_r,
        max_replicas=max_r or min_r,
        slots_per_replica=per,
        submitted_at=at,
        preemptible=preemptible,
        **kw,
    )


def apply(plan: Plan, jobs: list[Job], now: float) -> None:
    """The runtime carries the plan out at once (victims let go before the next pass)."""
    by_id = {j.id: j for j in jobs}
    for a in plan.actions:
        j = by_id[a.job]
        if a.kind in ("admit", "grow", "shrink"):
            j.placement, j.state, j.last_resize_at = dict(a.placement), JobState.RUNNING, now
        elif a.kind == "suspend":
            j.placement, j.state = {}, JobState.SUSPENDED


def check(cluster: Cluster, jobs: list[Job]) -> None:
    used: dict[str, int] = {}
    for j in jobs:
        for n, r in j.placement.items():
            used[n] = used.get(n, 0) + r * j.slots_per_replica
        if j.placement:
            assert j.min_replicas <= j.replicas <= j.max_replicas, j
    for n, u in used.items():
        assert u <= cluster.nodes[n].slots, (n, u)
    for j in jobs:  # a node reserved for one job holds no other job's replicas
        for n in j.placement:
            assert cluster.nodes[n].reserved_for in ("", j.id), (j.id, cluster.nodes[n])


def kinds(plan: Plan) -> list[tuple[str, str]]:
    return [(a.kind, a.job) for a in plan.actions]


# -- admission -----------------------------------------------------------------------------------
def test_gangs_that_cannot_both_fit_never_both_hold_part() -> None:
    cluster = make_cluster()  # 16 slots
    jobs = [job("a", 10, at=0), job("b", 10, at=1)]
    plan = schedule(cluster, jobs, 0)
    assert kinds(plan) == [("admit", "a")]
    assert plan.placements["b"] == {}
    apply(plan, jobs, 0)
    check(cluster, jobs)
    assert schedule(cluster, jobs, 1).actions == []  # b waits whole, holding nothing


def test_priority_then_fair_share_then_age() -> None:
    cluster = make_cluster(racks=1, nodes=1, slots=4, queues=[Queue("x"), Queue("y")])
    running = job("x0", 2, queue="x", at=0, state=JobState.RUNNING, placement={"r0n0": 2})
    jobs = [
        running,
        job("x1", 2, queue="x", at=1),
        job("y1", 2, queue="y", at=2),
        job("lo", 2, queue="x", at=0, priority=-1),
    ]
    plan = schedule(cluster, jobs, 5)
    assert kinds(plan) == [("admit", "y1")]  # y holds less than x: its job goes first


def test_queue_ceiling_blocks_admission() -> None:
    cluster = make_cluster(queues=[Queue("q", guaranteed=2, borrowing_limit=0)])
    assert schedule(cluster, [job("a", 3)], 0).actions == []


# -- preemption ----------------------------------------------------------------------------------
def test_high_priority_job_shrinks_an_elastic_job_before_suspending_anything() -> None:
    cluster = make_cluster()
    low = job("low", 2, 16, priority=0, state=JobState.RUNNING, placement={"r0n0": 4, "r0n1": 4, "r1n0": 4, "r1n1": 4})
    high = job("high", 6, priority=10, at=5)
    jobs = [low, high]
    plan = schedule(cluster, jobs, 100)
    assert [k for k, _ in kinds(plan)] == ["shrink", "preempting"]
    assert sum(plan.placements["low"].values()) == 10
    apply(plan, jobs, 100)
    plan = schedule(cluster, jobs, 101)
    assert kinds(plan) == [("admit", "high")]
    apply(plan, jobs, 101)
    check(cluster, jobs)


def test_suspends_a_whole_job_only_when_shrinking_is_not_enough() -> None:
    cluster = make_cluster()
    fixed = job("fixed", 16, priority=0, state=JobState.RUNNING, placement={"r0n0": 4, "r0n1": 4, "r1n0": 4, "r1n1": 4})
    jobs = [fixed, job("high", 4, priority=5)]
    plan = schedule(cluster, jobs, 0)
    assert kinds(plan) == [("suspend", "fixed"), ("preempting", "high")]
    fixed.preemptible = False
    assert schedule(cluster, jobs, 0).actions == []


def test_no_preemption_when_the_preemptor_would_not_fit_anyway() -> None:
    cluster = make_cluster()
    low = job("low", 1, 16, state=JobState.RUNNING, placement={"r0n0": 4, "r0n1": 4, "r1n0": 4, "r1n1": 4})
    plan = schedule(cluster, [low, job("huge", 17, priority=9)], 0)
    assert plan.actions == [] and plan.placements["low"] == low.placement


def test_equal_priority_takes_back_elastic_surplus_but_never_suspends() -> None:
    cluster = make_cluster()
    full = {"r0n0": 4, "r0n1": 4, "r1n0": 4, "r1n1": 4}
    a = job("a", 1, 16, state=JobState.RUNNING, placement=dict(full))
    plan = schedule(cluster, [a, job("b", 4)], 0)
    assert kinds(plan) == [("shrink", "a"), ("preempting", "b")]
    assert sum(plan.placements["a"].values()) == 12  # one node's worth, no more
    # a peer at its minimum, or a fixed gang, is never touched; nor with the option off
    at_min = job("m", 16, 16, state=JobState.RUNNING, placement=dict(full))
    assert schedule(cluster, [at_min, job("b", 4)], 0).actions == []
    lent = job("a", 1, 16, state=JobState.RUNNING, placement=dict(full))
    off = PolicyConfig(reclaim_surplus=False)
    assert schedule(cluster, [lent, job("b", 4)], 0, off).actions == []


def test_surplus_is_taken_from_the_largest_peer_first() -> None:
    cluster = make_cluster()
    big = job("big", 1, 16, state=JobState.RUNNING, placement={"r0n0": 4, "r0n1": 4, "r1n0": 4})
    small = job("small", 1, 16, state=JobState.RUNNING, placement={"r1n1": 4}, at=1)
    plan = schedule(cluster, [big, small, job("new", 2, at=2)], 0)
    assert kinds(plan) == [("shrink", "big"), ("preempting", "new")]
    assert plan.placements["small"] == {"r1n1": 4}


def test_a_queue_reclaims_its_guarantee_from_a_borrower_but_no_further() -> None:
    queues = [Queue("a", guaranteed=8), Queue("b", guaranteed=8)]
    cluster = make_cluster(queues=queues)
    borrower = job(
        "a1", 2, 16, queue="a", state=JobState.RUNNING, placement={"r0n0": 4, "r0n1": 4, "r1n0": 4, "r1n1": 4}
    )
    jobs = [borrower, job("b1", 8, queue="b", at=3)]
    plan = schedule(cluster, jobs, 100)
    assert kinds(plan) == [("shrink", "a1"), ("preempting", "b1")]
    assert sum(plan.placements["a1"].values()) == 8  # exactly its guarantee left
    apply(plan, jobs, 100)
    plan = schedule(cluster, jobs, 101)
    assert kinds(plan) == [("admit", "b1")]
    apply(plan, jobs, 101)
    # b asks for more than its guarantee: a is at its guarantee and is not touched
    jobs.append(job("b2", 2, queue="b", at=4))
    assert schedule(cluster, jobs, 200).actions == []


def test_borrowing_limit_caps_elastic_growth() -> None:
    cluster = make_cluster(queues=[Queue("a", guaranteed=4, borrowing_limit=2)])
    plan = schedule(cluster, [job("a1", 2, 16, queue="a")], 0)
    assert sum(plan.placements["a1"].values()) == 6


# -- elastic fill and damping --------------------------------------------------------------------
def test_fill_goes_to_the_largest_marginal_gain() -> None:
    cluster = make_cluster(racks=1, nodes=1, slots=4)
    scales = job("scales", 1, 4, state=JobState.RUNNING, placement={"r0n0": 1}, throughput={1: 100.0, 2: 198.0})
    flat = job("flat", 1, 4, state=JobState.RUNNING, placement={"r0n0": 1}, throughput={1: 100.0, 2: 110.0})
    plan = schedule(cluster, [scales, flat], 1000)
    assert plan.placements["scales"] == {"r0n0": 3} and plan.placements["flat"] == {"r0n0": 1}
    assert flat.comm_cost() > 0.5 > scales.comm_cost()


def test_damping_waits_out_the_cooldown() -> None:
    cluster = make_cluster(racks=1, nodes=1, slots=4)
    j = job("j", 1, 4, state=JobState.RUNNING, placement={"r0n0": 1}, last_resize_at=100.0)
    cfg = PolicyConfig(resize_cooldown_s=60)
    assert schedule(cluster, [j], 130, cfg).actions == []
    assert kinds(schedule(cluster, [j], 161, cfg)) == [("grow", "j")]


def test_newly_admitted_jobs_start_at_the_size_that_fits() -> None:
    cluster = make_cluster()
    plan = schedule(cluster, [job("a", 2, 6), job("b", 2, 6, at=1)], 0)
    sizes = {a.job: sum(a.placement.values()) for a in plan.actions}
    assert sizes == {"a": 6, "b": 6}


# -- placement -----------------------------------------------------------------------------------
def test_packs_into_one_node_then_one_rack() -> None:
    cluster = make_cluster(racks=2, nodes=2, slots=4)
    free = FreeSlots(cluster, {"r0n0": 3})
    assert place(job("x", 2, per=2), 2, free) in ({"r0n1": 2}, {"r1n0": 2}, {"r1n1": 2})
    assert set(place(job("y", 4, per=2), 4, free)) in ({"r1n0", "r1n1"},)


def test_best_fit_keeps_empty_nodes_for_big_jobs() -> None:
    cluster = make_cluster(racks=1, nodes=3, slots=4)
    free = FreeSlots(cluster, {"r0n0": 3, "r0n1": 1})
    assert place(job("one", 1), 1, free) == {"r0n0": 1}


def test_required_topology_never_spreads() -> None:
    cluster = make_cluster(racks=2, nodes=2, slots=4)
    required = job("r", 12, topology=Topology(level="rack", mode="required"))
    preferred = job("p", 12, topology=Topology(level="rack", mode="preferred"))
    free = FreeSlots(cluster, {})
    assert place(required, 12, free) is None
    assert sum(place(preferred, 12, free).values()) == 12


def test_growth_prefers_the_jobs_own_nodes() -> None:
    cluster = make_cluster(racks=2, nodes=2, slots=4)
    free = FreeSlots(cluster, {"r1n1": 1})
    assert place(job("g", 1, 4), 1, free, prefer={"r1n1": 1}) == {"r1n1": 1}


def test_a_node_reserved_for_a_job_takes_its_replicas_only() -> None:
    """A Slurm replica job's node (``reserved_for``) is that job's: no other job is placed, grown
    or preempted onto it, even when it stands idle; the job itself may also use open nodes."""
    cluster = Cluster.of(
        [
            Node("a0", 2, reserved_for="a"),
            Node("a1", 2, reserved_for="a"),
            Node("open", 2),
            Node("b0", 2, reserved_for="b"),
        ],
        [Queue("q")],
    )
    a, c = job("a", 1, 6), job("c", 1, 6, at=1.0)
    urgent = job("urgent", 4, 4, priority=9, at=2.0)
    jobs = [a, c]
    apply(schedule(cluster, jobs, 0.0), jobs, 0.0)
    check(cluster, jobs)
    assert set(a.placement) <= {"a0", "a1", "open"} and a.replicas >= 4, a.placement
    assert set(c.placement) == {"open"}, c.placement
    assert "b0" not in a.placement and "b0" not in c.placement  # idle, and b's
    jobs.append(urgent)  # the b0 node and a's nodes are no room for it: it waits
    plan = schedule(cluster, jobs, 100.0)
    apply(plan, jobs, 100.0)
    check(cluster, jobs)
    assert urgent.state == JobState.PENDING and not urgent.placement, kinds(plan)
    assert FreeSlots(cluster, {}).reserved == {"a0": "a", "a1": "a", "b0": "b"}
    assert place(job("b"), 2, FreeSlots(cluster, {"open": 2})) == {"b0": 2}


def test_bad_input_is_rejected() -> None:
    cluster = make_cluster()
    with pytest.raises(ValueError, match="no queue"):
        schedule(cluster, [job("a", queue="nope")], 0)
    with pytest.raises(ValueError, match="unknown node"):
        schedule(cluster, [job("a", state=JobState.RUNNING, placement={"zz": 1})], 0)
    with pytest.raises(ValueError, match="slots in use"):
        schedule(cluster, [job("a", 5, state=JobState.RUNNING, placement={"r0n0": 5})], 0)
    with pytest.raises(ValueError, match="minReplicas"):
        job("a", 3, 2)


# -- random clusters under invariants ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(300))
def test_invariants_hold_on_random_clusters(seed: int) -> None:
    rng = random.Random(seed)
    queues = [
        Queue(f"q{i}", guaranteed=rng.choice([0, 4, 8]), borrowing_limit=rng.choice([None, 0, 8])) for i in range(3)
    ]
    cluster = Cluster.of(
        [
            Node(f"r{r}n{n}", rng.choice([4, 8]), rack=f"r{r}", reserved_for=rng.choice(["", "", "", "j0", "j1"]))
            for r in range(rng.randint(1, 3))
            for n in range(rng.randint(1, 4))
        ],
        queues,
    )
    jobs: list[Job] = []
    cfg = PolicyConfig(resize_cooldown_s=rng.choice([0, 30]))
    for t in range(30):
        now = t * 10.0
        if rng.random() < 0.6:
            lo = rng.randint(1, 4)
            jobs.append(
                job(
                    f"j{len(jobs)}",
                    lo,
                    lo + rng.choice([0, 0, 2, 6]),
                    queue=rng.choice(queues).name,
                    priority=rng.choice([0, 0, 5, 9]),
                    per=rng.choice([1, 1, 2, 4]),
                    at=now,
                    preemptible=rng.random() < 0.8,
                )
            )
        for j in jobs:  # some finish
            if j.state == JobState.RUNNING and rng.random() < 0.05:
                j.placement, j.state = {}, JobState.SUSPENDED
                j.min_replicas = j.max_replicas = 10**6  # gone: never fits again
        usage_before = {q.name: sum(j.slots for j in jobs if j.queue == q.name) for q in queues}
        plan = schedule(cluster, jobs, now, cfg)
        by_id = {j.id: j for j in jobs}
        reclaimed = set()
        for a in plan.actions:
            if a.kind == "shrink" and a.reason.startswith("rebalance"):
                victim = by_id[a.job]  # a peer gives up lent replicas, never below its minimum
                assert victim.elastic and sum(a.placement.values()) >= victim.min_replicas
                continue
            if a.kind in ("shrink", "suspend"):
                victim = by_id[a.job]
                preemptor = by_id[a.reason.removeprefix("preempted by ")]
                if victim.queue == preemptor.queue and victim.priority == preemptor.priority:
                    # a peer's elastic surplus: shrunk, never below its minimum
                    assert a.kind == "shrink"
                    assert sum(a.placement.values()) >= victim.min_replicas
                elif victim.priority >= preemptor.priority:  # a reclaim across queues
                    assert victim.queue != preemptor.queue
                    reclaimed.add(victim.queue)
        apply(plan, jobs, now)
        check(cluster, jobs)
        pledged = {q.name: 0 for q in queues}
        for a in plan.actions_of("preempting"):
            pledged[by_id[a.job].queue] += sum(a.placement.values()) * by_id[a.job].slots_per_replica
        for q in reclaimed:  # a reclaim never takes a queue below its guarantee (counting the
            held = sum(j.slots for j in jobs if j.queue == q) + pledged[q]  # slots pledged to it)
            assert held >= min(cluster.queues[q].guaranteed, usage_before[q]), q
        for q in queues:
            assert sum(j.slots for j in jobs if j.queue == q.name) <= max(q.ceiling, usage_before[q.name])
        used: dict[str, int] = {}
        for j in jobs:
            for n, r in j.placement.items():
                used[n] = used.get(n, 0) + r * j.slots_per_replica
        for a in plan.actions_of("preempting"):  # once the victims let go, every preemptor
            preemptor = by_id[a.job]  # fits where the plan says, all at once
            assert sum(a.placement.values()) == preemptor.min_replicas
            for n, r in a.placement.items():
                used[n] = used.get(n, 0) + r * preemptor.slots_per_replica
        for n, u in used.items():
            assert u <= cluster.nodes[n].slots, (n, kinds(plan))


def test_rebalance_moves_a_replica_to_the_peer_that_gains_more_and_not_back() -> None:
    cluster = make_cluster()  # 16 slots
    # "flat" stopped scaling (its throughput is the same at 2 and 12); "steep" scales well
    flat = job(
        "flat",
        1,
        16,
        state=JobState.RUNNING,
        throughput={2: 100.0, 12: 100.0},
        placement={"r0n0": 4, "r0n1": 4, "r1n0": 4},
    )
    steep = job("steep", 1, 16, state=JobState.RUNNING, throughput={1: 100.0, 4: 390.0}, placement={"r1n1": 4}, at=1)
    plan = schedule(cluster, [flat, steep], 1000)
    assert kinds(plan) == [("shrink", "flat")] and "rebalance" in plan.actions[0].reason
    assert sum(plan.placements["flat"].values()) < 12
    apply(plan, [flat, steep], 1000)
    plan = schedule(cluster, [flat, steep], 1001)  # the freed slots go to the gainer
    assert kinds(plan) == [("grow", "steep")]
    apply(plan, [flat, steep], 1001)
    later = schedule(cluster, [flat, steep], 5000)  # cooldowns over: no move back
    assert not any(a.job == "steep" and a.kind == "shrink" for a in later.actions)
    off = PolicyConfig(rebalance_gain=0)
    flat.placement = {"r0n0": 4, "r0n1": 4, "r1n0": 4}
    steep.placement, steep.last_resize_at = {"r1n1": 4}, -1e9
    assert schedule(cluster, [flat, steep], 5000, off).actions == []


# -- the speedup curve, look-ahead and least-attained service ------------------------------------
def test_speedup_keeps_measurements_interpolates_and_extrapolates_through_the_nearest() -> None:
    curve = Speedup({1: 100.0, 4: 300.0, 8: 280.0})  # slower on two nodes than on one
    assert curve(1) == 1.0 and curve(4) == 3.0 and curve(8) == 2.8  # what was measured
    assert curve(6) == pytest.approx(2.9)  # the straight line between 4 and 8
    c = curve.comm_cost
    assert 0 < c < 1
    # beyond 8: the fitted curve n / (1 + c (n - 1)), scaled through the point at 8
    assert curve(16) == pytest.approx(2.8 * (16 / (1 + 15 * c)) / (8 / (1 + 7 * c)))
    assert curve(0) == 0.0
    assert Speedup({})(4) == pytest.approx(4 / (1 + 3 * 0.05))  # nothing measured: the prior
    # never measured at one replica: the curve through the smallest measurement sets the base
    only = Speedup({4: 400.0})
    assert only(4) == pytest.approx(4 / (1 + 3 * 0.05)) and only(1) == pytest.approx(1.0)
    assert job("j", 1, 8, throughput={1: 100.0, 4: 300.0}).speedup(4) == 3.0


def test_fill_looks_past_a_dip_when_crossing_a_node() -> None:
    cluster = make_cluster(racks=1, nodes=3, slots=4)
    # 4 replicas fit one node; 5 to 7 cross to a second and lose; 8 gain again
    tp = {1: 100.0, 2: 195.0, 4: 380.0, 5: 330.0, 8: 700.0}
    big = job("big", 1, 8, state=JobState.RUNNING, placement={"r0n0": 4}, throughput=dict(tp))
    plan = schedule(cluster, [big], 1000)
    assert sum(plan.placements["big"].values()) == 8
    one_step = schedule(
        cluster,
        [job("big", 1, 8, state=JobState.RUNNING, placement={"r0n0": 4}, throughput=dict(tp))],
        1000,
        PolicyConfig(lookahead=1),
    )
    assert one_step.placements["big"] == {"r0n0": 4}  # one at a time stops at the dip


def test_the_least_served_peer_grows_first() -> None:
    cluster = make_cluster(racks=1, nodes=1, slots=4)
    tp = {1: 100.0, 2: 190.0}

    def pair() -> list[Job]:
        return [
            job(
                "old",
                1,
                4,
                state=JobState.RUNNING,
                placement={"r0n0": 1},
                throughput=dict(tp),
                attained_slot_s=50 * 3600.0,
            ),
            job(
                "new",
                1,
                4,
                state=JobState.RUNNING,
                placement={"r0n0": 1},
                throughput=dict(tp),
                attained_slot_s=60.0,
                at=5,
            ),
        ]

    plan = schedule(cluster, pair(), 1000, PolicyConfig(min_gain=0.5))
    # both gain 0.9 from a second replica, but "old" has had 50 slot-hours: "new" gets both
    # free slots' first pick (and its third replica still gains enough to beat "old"'s second)
    assert sum(plan.placements["new"].values()) > sum(plan.placements["old"].values())
    even = schedule(cluster, pair(), 1000, PolicyConfig(min_gain=0.5, las_weight=0))
    assert sum(even.placements["old"].values()) >= sum(even.placements["new"].values())
