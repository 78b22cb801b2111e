"""The cluster simulation: jobs arrive, a policy allocates GPUs every round, nodes come and go.

Driven by :class:`maitre.sim.engine.Engine`. Events:

- *arrival*: a job is submitted; it is seen at the next scheduling round (as in Pollux's
  simulator, whose published results the baselines are checked against).
- *round*, every ``interval_s``: every job is advanced to now, finished jobs let go of their
  GPUs, the policy allocates, each job whose allocation changed pays its resize pause.
- *node events*: a spot *notice* (the node leaves at its end; jobs on it leave gracefully now, at
  the cost of a resize), *down* (a failure, or a reclaim with no notice: jobs on it lose the work
  since their last checkpoint, or, with peer recovery, only a step if a replica survives), *up*
  (the node is usable again). A notice or a failure triggers a round at once.

Cost is what the provisioned nodes cost while they are up, until the last job finishes:
GPUs x price per GPU-hour (on-demand or spot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from maitre.sim.engine import Engine
from maitre.sim.events import SimEvents, node_name
from maitre.sim.jobs import SimJob, young_daly_interval
from maitre.sim.policies import Allocations, Policy


@dataclass(kw_only=True, slots=True)
class SimNode:
    index: int
    gpus: int
    price: float = 2.5
    """Price per GPU-hour while the node is up."""
    spot: bool = False
    up: bool = True
    leaving: bool = False
    up_since: float = 0.0
    cost: float = 0.0


@dataclass(frozen=True, slots=True)
class NodeEvent:
    time: float
    node: int
    kind: str
    """``notice`` (leaves at time + notice_s), ``down``, or ``up``."""
    notice_s: float = 0.0


@dataclass(kw_only=True, slots=True)
class SimConfig:
    interval_s: float = 60.0
    """Seconds between scheduling rounds (Pollux's simulator: 60)."""
    node_mtbf_s: float = math.inf
    """Mean time between failures of one node (exponential); inf: no failures."""
    repair_s: float = 3600.0
    """A failed node is back after this long."""
    seed: int = 0
    max_time_s: float = 400 * 86400.0
    """A run that has not finished by then is an error (a job that can never be placed)."""


@dataclass(slots=True)
class Timeline:
    time: list[float] = field(default_factory=list)
    available: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    changes: list[tuple[float, str, int]] = field(default_factory=list)
    """(time, job, GPUs) at every allocation change."""


class Simulation:
    def __init__(
        self,
        jobs: list[SimJob],
        nodes: list[SimNode],
        policy: Policy,
        cfg: SimConfig | None = None,
        node_events: list[NodeEvent] = (),
        progress: Callable[[int, int, float], None] | None = None,
        prices: dict[str, float] | None = None,
    ) -> None:
        self.cfg = cfg or SimConfig()
        self.jobs = sorted(jobs, key=lambda j: (j.submitted, j.name))
        self.nodes = {n.index: n for n in nodes}
        self.policy = policy
        self.engine = Engine(self.cfg.seed)
        self.active: list[SimJob] = []
        self.done: list[SimJob] = []
        self.timeline = Timeline()
        self.log = SimEvents()
        """What happened, in the live coordinator's event shapes (``maitre dashboard``)."""
        self.progress = progress
        self.log.nodes(nodes, prices or {})
        biggest = max((n.gpus for n in nodes), default=0) * len(nodes)
        too_big = [j.name for j in jobs if j.min_replicas > biggest]
        if too_big:
            raise ValueError(
                f"{len(too_big)} job(s) need more GPUs than the cluster has ({biggest}): {', '.join(too_big[:5])}"
            )
        for j in self.jobs:
            self.engine.at(j.submitted, self._arrive, j)
        for ev in node_events:
            self.engine.at(ev.time, self._node_event, ev)
        if math.isfinite(self.cfg.node_mtbf_s):
            for n in self.nodes.values():
                self._schedule_failure(n)
        self.engine.at(self.cfg.interval_s, self._round)

    # -- events -------------------------------------------------------------------------------

    def _arrive(self, job: SimJob) -> None:
        self.active.append(job)
        self.log.add(
            self.engine.now,
            "submitted",
            job.name,
            queue=job.queue,
            priority=job.priority,
            replicas=[job.min_replicas, job.max_replicas],
        )

    def _round(self) -> None:
        self.reschedule()
        self._record()
        if self.progress:
            self.progress(len(self.done), len(self.jobs), self.engine.now)
        if len(self.done) == len(self.jobs):
            self.engine.stop()  # capacity events after the last job change nothing it reports
        else:
            if self.engine.now > self.cfg.max_time_s:
                raise RuntimeError(
                    f"simulation not finished after {self.cfg.max_time_s:.0f} s: "
                    f"{len(self.jobs) - len(self.done)} jobs left"
                )
            self.engine.after(self.cfg.interval_s, self._round)

    def _schedule_failure(self, node: SimNode) -> None:
        delay = self.engine.rng(f"node-{node.index}").expovariate(1.0 / self.cfg.node_mtbf_s)
        self.engine.after(delay, self._fail, node)

    def _fail(self, node: SimNode) -> None:
        if node.up:
            self._node_event(NodeEvent(self.engine.now, node.index, "down"))
            self.engine.after(
                self.cfg.repair_s, self._node_event, NodeEvent(self.engine.now + self.cfg.repair_s, node.index, "up")
            )
        self._schedule_failure(node)

    def _node_event(self, ev: NodeEvent) -> None:
        now = self.engine.now
        node = self.nodes[ev.node]
        if ev.kind == "up":
            if not node.up:
                node.up, node.leaving, node.up_since = True, False, now
                self.log.add(now, "node_recovered", node=node_name(node.index))
            return
        if not node.up:
            return
        for j in self.active:
            j.advance(now)
        if ev.kind == "notice" and ev.notice_s > 0:
            self.log.add(
                now,
                "spot_notice",
                node=node_name(node.index),
                notice_s=ev.notice_s,
                deadline=round(now + ev.notice_s, 3),
                source="simulated",
            )
            node.leaving = True
            self.engine.at(now + ev.notice_s, self._node_event, NodeEvent(now + ev.notice_s, ev.node, "down"))
            on_it = [j.name for j in self.active if node.index in j.alloc]
            self._evict(node, failed=False)
            self.log.add(now, "node_drained", node=node_name(node.index), workers=on_it, seconds=0.0)
        else:
            self.log.add(now, "node_reclaimed" if node.leaving else "node_dead", node=node_name(node.index))
            node.cost += (now - node.up_since) * node.gpus * node.price / 3600
            node.up = node.leaving = False
            self._evict(node, failed=True)
        self.reschedule(advance=False)

    def _evict(self, node: SimNode, failed: bool) -> None:
        """Take ``node``'s replicas from the jobs holding it: a fixed gang loses all of them, an
        elastic job keeps its survivors if they are at least its minimum."""
        for j in self.active:
            if node.index not in j.alloc:
                continue
            survivors = [n for n in j.alloc if n != node.index]
            fixed = j.min_replicas == j.max_replicas
            keep = survivors if survivors and not fixed and len(survivors) >= j.min_replicas else []
            if failed:
                rec = j.recovery
                if keep and rec.peer_recovery:
                    j.lose(0.0, rec.failure_pause_s)
                else:
                    since = j.clock - j.started if j.started is not None else 0.0
                    lost = (
                        self.engine.rng(f"job-{j.name}").uniform(0, min(since, j.checkpoint_interval_s))
                        if since > 0
                        else 0.0
                    )
                    j.lose(lost, rec.failure_pause_s)
            self._set(j, keep)

    # -- the round ----------------------------------------------------------------------------

    def reschedule(self, advance: bool = True) -> None:
        now = self.engine.now
        if advance:
            for j in self.active:
                j.advance(now)
        finished = [j for j in self.active if j.completed is not None]
        if finished:
            for j in finished:
                self._set(j, [])
                self.done.append(j)
            self.active = [j for j in self.active if j.completed is None]
        if not self.active:
            return
        usable = {i: n.gpus for i, n in self.nodes.items() if n.up and not n.leaving}
        prev = {j.name: j.alloc for j in self.active if j.alloc}
        allocs = self.policy.allocate(now, list(self.active), usable, prev)
        self._check(allocs, usable)
        for j in self.active:
            new = allocs.get(j.name, [])
            if new != j.alloc:
                self._set(j, new)

    def _check(self, allocs: Allocations, usable: dict[int, int]) -> None:
        used: dict[int, int] = {}
        for alloc in allocs.values():
            for n in alloc:
                used[n] = used.get(n, 0) + 1
        for n, u in used.items():
            if n not in usable or u > usable[n]:
                raise AssertionError(
                    f"policy {self.policy.name} over-allocated node {n}: {u} GPUs of {usable.get(n, 0)}"
                )

    def _set(self, job: SimJob, alloc: list[int]) -> None:
        now = self.engine.now
        old = job.alloc
        job.reallocate(alloc, now)
        self.log.placed(now, job, old, alloc)
        if alloc and job.recovery.checkpoint_s > 0 and math.isfinite(self.cfg.node_mtbf_s):
            job.checkpoint_interval_s = young_daly_interval(
                job.recovery.checkpoint_s, self.cfg.node_mtbf_s / len(set(alloc))
            )
        self.timeline.changes.append((now, job.name, len(alloc)))

    def _record(self) -> None:
        t, tl = self.engine.now, self.timeline
        tl.time.append(t)
        tl.available.append(sum(n.gpus for n in self.nodes.values() if n.up))
        tl.allocated.append(sum(len(j.alloc) for j in self.active))
        tl.running.append(sum(1 for j in self.active if j.alloc))
        tl.queued.append(sum(1 for j in self.active if not j.alloc))
        tl.cost.append(self.cost_until(t))

    # -- results ------------------------------------------------------------------------------

    def cost_until(self, t: float) -> float:
        """What the nodes cost up to ``t`` (between the last completion and the round that
        sees it, a node that came up has not cost anything yet by ``t``)."""
        return sum(
            n.cost + (max(0.0, t - n.up_since) * n.gpus * n.price / 3600 if n.up else 0.0) for n in self.nodes.values()
        )

    def run(self) -> "SimResult":
        self.engine.run()
        return SimResult.of(self)


@dataclass(slots=True)
class SimResult:
    policy: str
    jcts: dict[str, float]
    makespan_s: float
    utilization: float
    """Useful over held GPU-time (eta)."""
    allocation: float
    """Held over available GPU-time, up to the makespan."""
    gpu_hours: float
    """GPU-hours held by jobs."""
    cost: float
    restarts: int
    failures: int
    timeline: Timeline
    events: list[dict] = field(default_factory=list)
    """The run's event log (:mod:`maitre.sim.events`)."""

    @classmethod
    def of(cls, sim: Simulation) -> "SimResult":
        jobs = sim.done
        end = max((j.completed for j in jobs), default=0.0)
        first = min((j.submitted for j in jobs), default=0.0)
        held = sum(j.held_s for j in jobs)
        useful = sum(j.useful_s for j in jobs)
        tl = sim.timeline
        avail = 0.0
        for i in range(len(tl.time)):
            start = tl.time[i - 1] if i else 0.0
            avail += (min(tl.time[i], end) - min(start, end)) * tl.available[i]
        return cls(
            policy=sim.policy.name,
            jcts={j.name: j.completed - j.submitted for j in jobs},
            makespan_s=end - first,
            utilization=useful / held if held else 0.0,
            allocation=held / avail if avail else 0.0,
            gpu_hours=held / 3600,
            cost=sim.cost_until(end),
            restarts=sum(max(0, j.restarts) for j in jobs),
            failures=sum(j.failures for j in jobs),
            timeline=tl,
            events=sim.log.events,
        )

    @property
    def avg_jct_s(self) -> float:
        return sum(self.jcts.values()) / len(self.jcts) if self.jcts else 0.0

    @property
    def p99_jct_s(self) -> float:
        values = sorted(self.jcts.values())
        if not values:
            return 0.0
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def summary(self) -> dict[str, float]:
        return {
            "avg_jct_s": round(self.avg_jct_s, 1),
            "p99_jct_s": round(self.p99_jct_s, 1),
            "makespan_s": round(self.makespan_s, 1),
            "utilization": round(self.utilization, 4),
            "allocation": round(self.allocation, 4),
            "gpu_hours": round(self.gpu_hours, 2),
            "cost": round(self.cost, 2),
            "jobs": len(self.jcts),
            "restarts": self.restarts,
            "failures": self.failures,
        }
