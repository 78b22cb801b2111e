"""Accounting: what the cluster measures of its jobs, and the report it gives.

* **Throughput** is measured, not reported: the steps a job commits per second at each world
  size, over stretches of uninterrupted training (its global batch is fixed, so steps per second
  are samples per second up to a constant). It fits the job's speedup model, which the policy
  uses to hand out idle slots by marginal gain (:func:`measure`).
* **Effective training time**: what a job's rank-0 member spent in committed steps
  (:func:`account`), and the attained service least-attained-first orders by.
* **Allocation** (:class:`Usage`): slot-seconds held by workers over slot-seconds of capacity,
  counted only while some job waits or could grow.
* **Cost**: the slot-seconds each worker held, at its node's price per slot-hour (by capacity
  type: ``ClusterState.prices``), and the same slot-seconds all at the on-demand price (what they
  would have cost without spot), per job, per queue and for the cluster. Live: a worker still
  running counts up to now.
* :func:`report`: all of it, per job and for the cluster (``/v1/report``, the demo's table).

Pure logic over injected time; the coordinator calls it under its lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maitre.control.membership import LIVE, Membership

if TYPE_CHECKING:
    from maitre.control.cluster import ClusterState
    from maitre.control.job import ManagedJob

THROUGHPUT_WINDOW_S = 4.0
"""Shortest stretch of uninterrupted training a throughput sample is taken over."""


def measure(m: "ManagedJob", ms: Membership, now: float) -> None:
    """Steps per second at the current world size, over stretches of uninterrupted training of
    at least :data:`THROUGHPUT_WINDOW_S` (an exponential average per size).

    A stretch is timed by when its steps were reached (:attr:`Worker.step_at`), not by when a
    pass saw them. Timed by the pass, a sample taken while the members waited on a hung peer
    (their step stands still until the epoch is closed) counted the wait as training, and a node
    beats every 2 s, so the step a pass sees may be that old: a job on three hosts measured
    itself slower at 3 replicas (15.6 steps/s) than at 2 (16.0) while its ledger said 21.2 and
    16.1, and the policy never grew it back onto the node that had hung and returned. A stretch
    starts at the first step reached in its epoch (the steps before are older than the epoch).

    And what a resize costs it (:attr:`Job.restart_s`: 0 in place, a restart-mode job's restart)."""
    m.job.restart_s = ms.restart_cost_s()
    if not ms.open or ms.over or not ms.members:
        m.window = None
        return
    lead = max((ms.workers[w] for w in ms.members), key=lambda w: (w.step, -w.step_at))
    step, at = lead.step, lead.step_at
    key = (m.incarnation, ms.epoch)
    if m.window is None or m.window[:2] != key:
        m.window = (*key, step, math.nan)  # timed from the epoch's first step on
        return
    _, _, step0, t0 = m.window
    if step <= step0:
        return
    if math.isnan(t0):
        m.window = (*key, step, at)
        return
    if at - t0 < THROUGHPUT_WINDOW_S:
        return
    rate = (step - step0) / (at - t0)
    world = len(ms.members)
    old = m.job.throughput.get(world)
    m.job.throughput[world] = rate if old is None else 0.5 * old + 0.5 * rate
    m.window = (*key, step, at)


def account(m: "ManagedJob", ms: Membership) -> None:
    """The job's effective training time: what its rank-0 member spent in committed steps
    (one member's clock, so heartbeats arriving out of step do not add up)."""
    for wid in ms.members:
        w = ms.workers[wid]
        if wid == ms.members[0]:
            m.productive_s += max(0.0, w.trained_s - m.seen_trained.get(wid, 0.0))
        m.seen_trained[wid] = w.trained_s


def _memberships(m: "ManagedJob", memberships: dict[str, Membership]) -> list[Membership]:
    """Every incarnation of a job: the earlier ones and the current one."""
    return m.history + ([memberships[m.id]] if m.id in memberships and m.incarnation else [])


def tick_usage(cluster: "ClusterState", memberships: dict[str, Membership], now: float) -> None:
    usage = cluster.usage
    if usage.last is not None and now > usage.last:
        for m in cluster.managed.values():  # attained service: what least-attained-first orders
            if m.job.state.placed:
                m.job.attained_slot_s += m.job.slots * (now - usage.last)
    # A draining node's slots are no capacity: nothing may be placed there any more.
    capacity = sum(s.node.slots for s in cluster.nodes.values() if s.alive and not s.draining)
    held = sum(
        w.slots
        for m in cluster.managed.values()
        for ms in _memberships(m, memberships)
        for w in ms.workers.values()
        if w.ended_at is None and w.state in LIVE and not w.spare
    )  # a warm spare's slot is free to the scheduler: not allocated
    contended = any(
        (m.job.state.waiting and not m.held)
        or (m.job.state.placed and m.job.elastic and m.job.replicas < m.job.max_replicas)
        for m in cluster.managed.values()
    )
    usage.tick(now, capacity, held, contended)


def report(cluster: "ClusterState", memberships: dict[str, Membership], now: float) -> dict[str, Any]:
    """Allocation, utilization and each job's effective training time (see the demo)."""
    held_s = trained_s = 0.0
    jobs = {}
    on_demand = cluster.price("on-demand")
    total = Cost()
    queues: dict[str, Cost] = {}
    for m in cluster.managed.values():
        j_held = j_trained = j_spare = 0.0
        cost = Cost()
        for ms in _memberships(m, memberships):
            for w in ms.workers.values():
                end = w.ended_at if w.ended_at is not None else now
                slot_s = max(0.0, end - w.started_at) * w.slots
                j_held += slot_s
                if w.spare:  # (a spare promoted later counts as a worker whole)
                    j_spare += slot_s
                j_trained += w.trained_s * w.slots
                state = cluster.nodes.get(w.node)
                cost.add(
                    slot_s,
                    cluster.node_price(w.node),
                    on_demand,
                    spot=state is not None and state.node.capacity_type == "spot",
                )
        held_s += j_held
        trained_s += j_trained
        total.merge(cost)
        queues.setdefault(m.job.queue, Cost()).merge(cost)
        span_end = m.ended_at if m.ended_at is not None else now
        ran = span_end - m.admitted_at if m.admitted_at is not None else 0.0
        jobs[m.id] = {
            "state": m.job.state.value,
            "queue": m.job.queue,
            "priority": m.job.priority,
            "incarnations": m.incarnation,
            "waited_s": round((m.admitted_at or now) - m.job.submitted_at, 2),
            "ran_s": round(ran, 2),
            "productive_s": round(m.productive_s, 2),
            "ettr": round(m.productive_s / ran, 4) if ran > 0 else None,
            "held_slot_s": round(j_held, 2),
            "trained_slot_s": round(j_trained, 2),
            "spare_slot_s": round(j_spare, 2),
            "throughput": {str(k): round(v, 3) for k, v in sorted(m.job.throughput.items())},
            "spot_slot_s": round(cost.spot_slot_s, 2),
            "cost": cost.rounded(cost.cost),
            "on_demand_cost": cost.rounded(cost.on_demand_cost),
        }
    usage = cluster.usage
    return {
        "allocation": usage.allocation(),
        "contended_s": round(usage.contended_s, 2),
        "utilization": round(trained_s / held_s, 4) if held_s else None,
        "held_slot_s": round(held_s, 2),
        "trained_slot_s": round(trained_s, 2),
        "jobs": jobs,
        "spot_slot_s": round(total.spot_slot_s, 2),
        "cost": total.rounded(total.cost),
        "on_demand_cost": total.rounded(total.on_demand_cost),
        "queues": {q: c.to_json() for q, c in sorted(queues.items())},
        "prices": dict(cluster.prices),
        "reclaims": cluster.reclaims,
    }


@dataclass(slots=True)
class Cost:
    """Slot-seconds held and what they cost, at their nodes' prices and all at on-demand's
    (None once a slot-second had no price: a capacity type missing from the table)."""

    held_slot_s: float = 0.0
    spot_slot_s: float = 0.0
    cost: float | None = 0.0
    on_demand_cost: float | None = 0.0

    def add(self, slot_s: float, price: float | None, on_demand: float | None, spot: bool) -> None:
        self.held_slot_s += slot_s
        self.spot_slot_s += slot_s if spot else 0.0
        self.cost = None if self.cost is None or price is None else self.cost + slot_s / 3600.0 * price
        self.on_demand_cost = (
            None
            if self.on_demand_cost is None or on_demand is None
            else self.on_demand_cost + slot_s / 3600.0 * on_demand
        )

    def merge(self, other: "Cost") -> None:
        self.held_slot_s += other.held_slot_s
        self.spot_slot_s += other.spot_slot_s
        self.cost = None if self.cost is None or other.cost is None else self.cost + other.cost
        self.on_demand_cost = (
            None
            if self.on_demand_cost is None or other.on_demand_cost is None
            else self.on_demand_cost + other.on_demand_cost
        )

    @staticmethod
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    def to_json(self) -> dict[str, Any]:
        return {
            "held_slot_s": round(self.held_slot_s, 2),
            "spot_slot_s": round(self.spot_slot_s, 2),
            "cost": self.rounded(self.cost),
            "on_demand_cost": self.rounded(self.on_demand_cost),
        }


@dataclass(slots=True)
class Usage:
    """Allocation: slot-seconds held by workers over slot-seconds of capacity, counted only
    while some job waits or could grow (an idle cluster with nothing to run is not waste)."""

    last: float | None = None
    contended_s: float = 0.0
    capacity_slot_s: float = 0.0
    held_slot_s: float = 0.0
    _prev: tuple[int, int, bool] = (0, 0, False)

    def tick(self, now: float, capacity: int, held: int, contended: bool) -> None:
        if self.last is not None and self._prev[2]:
            dt = now - self.last
            self.contended_s += dt
            self.capacity_slot_s += self._prev[0] * dt
            self.held_slot_s += min(self._prev[1], self._prev[0]) * dt
        self.last = now
        self._prev = (capacity, held, contended)

    def snapshot(self) -> dict[str, float]:
        return {
            "contended_s": self.contended_s,
            "capacity_slot_s": self.capacity_slot_s,
            "held_slot_s": self.held_slot_s,
        }

    def restore(self, data: dict[str, float]) -> None:
        """Carry the integrals over a coordinator restart (the time it was away is not counted)."""
        self.contended_s = data["contended_s"]
        self.capacity_slot_s = data["capacity_slot_s"]
        self.held_slot_s = data["held_slot_s"]

    def allocation(self) -> float | None:
        return round(self.held_slot_s / self.capacity_slot_s, 4) if self.capacity_slot_s else None
