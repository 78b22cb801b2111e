"""The scheduler's view of a cluster: nodes with slots, queues with quotas, jobs with sizes.

A *slot* is one accelerator (a GPU; a CPU slot stands in on a laptop). A job runs as replicas
of ``slots_per_replica`` slots each, every replica on one node, between ``min_replicas`` and
``max_replicas``; ``min == max`` is a fixed gang, never resized. A *queue* (a team) has a
guaranteed quota of slots it can always reclaim, a borrowing limit on top of it (None: no limit)
and a weight for fair share. Everything here is plain data: the policy is a pure function of it
(:mod:`maitre.scheduling.policy`), so the live coordinator and the simulator call the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from maitre.scheduling.lifecycle import JobState, check_move


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    slots: int
    rack: str = ""
    block: str = ""
    capacity_type: str = "on-demand"
    """``on-demand`` or ``spot``."""
    accelerator: str = ""
    reserved_for: str = ""
    """The one job whose workers this node takes ('' for any): a node an engine brought up for
    that job (a Slurm replica job's node), so that the site's accounting of it is that job's."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"node {self.name}: slots must be >= 1, got {self.slots}")


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    guaranteed: int = 0
    """Slots this queue can always get back, by preempting other queues' borrowed slots."""
    borrowing_limit: int | None = None
    """Slots it may hold beyond its guarantee while others do not need them (None: any)."""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.guaranteed < 0 or (self.borrowing_limit is not None and self.borrowing_limit < 0):
            raise ValueError(f"queue {self.name}: quotas must be >= 0")
        if not self.weight > 0:
            raise ValueError(f"queue {self.name}: weight must be positive, got {self.weight}")

    @property
    def ceiling(self) -> float:
        return math.inf if self.borrowing_limit is None else self.guaranteed + self.borrowing_limit


@dataclass(frozen=True, slots=True)
class Topology:
    level: str = "rack"
    """``node``, ``rack`` or ``block``: the domain the job should fit in."""
    mode: str = "preferred"
    """``required`` (never place across domains) or ``preferred`` (pack, but may spread)."""

    def __post_init__(self) -> None:
        if self.level not in ("node", "rack", "block"):
            raise ValueError(f"topology level must be node, rack or block, got {self.level!r}")
        if self.mode not in ("required", "preferred"):
            raise ValueError(f"topology mode must be required or preferred, got {self.mode!r}")


@dataclass(kw_only=True, slots=True)
class Job:
    """One job as the scheduler sees it: its request, where it runs, how fast it went."""

    id: str
    queue: str
    priority: int = 0
    min_replicas: int = 1
    max_replicas: int = 1
    slots_per_replica: int = 1
    preemptible: bool = True
    grace_period_s: float = 30.0
    topology: Topology | None = None
    submitted_at: float = 0.0
    state: JobState = JobState.PENDING
    placement: dict[str, int] = field(default_factory=dict)
    """Replicas per node now."""
    last_resize_at: float = -math.inf
    throughput: dict[int, float] = field(default_factory=dict)
    """Measured samples per second by number of replicas (fits the speedup model)."""
    attained_slot_s: float = 0.0
    """Slot-seconds of service the job has had so far (orders peers' growth, least first)."""
    restart_s: float = 0.0
    """What one resize costs the job, in seconds during which none of its replicas trains: 0
    for a job resized in place at a step boundary; a restart-mode job's measured restart (its
    gang stopped, the next one started), which the policy weighs before it grows the job."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"job {self.id}: need 1 <= minReplicas <= maxReplicas, got {self.min_replicas} and {self.max_replicas}"
            )
        if self.slots_per_replica < 1:
            raise ValueError(f"job {self.id}: gpusPerReplica must be >= 1")

    def move(self, to: JobState) -> None:
        """The one way a job changes state (see :mod:`maitre.scheduling.lifecycle`)."""
        check_move(self.id, self.state, to)
        self.state = to

    @property
    def replicas(self) -> int:
        return sum(self.placement.values())

    @property
    def slots(self) -> int:
        return self.replicas * self.slots_per_replica

    @property
    def elastic(self) -> bool:
        return self.min_replicas < self.max_replicas

    def speedup(self, replicas: int) -> float:
        """Throughput at ``replicas`` relative to one replica (see :class:`Speedup`)."""
        return Speedup(self.throughput)(replicas)

    def comm_cost(self) -> float:
        return Speedup(self.throughput).comm_cost


class Speedup:
    """A job's speedup curve from the throughput it measured at each size.

    At a measured size it is the measurement; between two, the straight line; beyond the
    largest (or below the smallest), the curve ``n / (1 + c (n - 1))`` through the nearest
    measured point, with the communication cost ``c`` fitted to all of them (0.05 until two are
    measured). Measurements are kept as they are, not smoothed into the fit: real curves are not
    concave (a job that crosses from one node to two often slows down, then gains again at
    four), and a policy that looks ahead can only see that in the points themselves."""

    __slots__ = ("points", "comm_cost", "base")

    def __init__(self, throughput: dict[int, float]) -> None:
        self.points = sorted((n, t) for n, t in throughput.items() if n > 0 and t > 0)
        self.comm_cost = self._fit()
        if self.points:
            n0, t0 = self.points[0]
            self.base = t0 / self._curve(n0)  # throughput of one replica
        else:
            self.base = 1.0

    def _curve(self, n: float) -> float:
        return n / (1 + self.comm_cost * (n - 1))

    def _fit(self) -> float:
        points = self.points
        if len(points) < 2:
            return 0.05
        # t(n) = t1 * n / (1 + c (n - 1))  =>  n t1 / t(n) - 1 = c (n - 1); least squares in c,
        # with t1 from the smallest size measured.
        n0, t0 = points[0]
        t1 = t0 * (1 + 0.05 * (n0 - 1)) / n0 if n0 > 1 else t0
        num = sum((n * t1 / t - 1) * (n - 1) for n, t in points)
        den = sum((n - 1) ** 2 for n, t in points)
        return min(1.0, max(0.0, num / den)) if den else 0.05

    def __call__(self, replicas: int) -> float:
        if replicas <= 0:
            return 0.0
        points = self.points
        if not points:
            return self._curve(replicas)
        lo: tuple[int, float] | None = None
        hi: tuple[int, float] | None = None
        for n, t in points:
            if n == replicas:
                return t / self.base
            if n < replicas:
                lo = (n, t)
            elif hi is None:
                hi = (n, t)
        if lo is not None and hi is not None:
            (a, ta), (b, tb) = lo, hi
            return (ta + (tb - ta) * (replicas - a) / (b - a)) / self.base
        nearest = lo or hi
        assert nearest is not None  # points is not empty
        n, t = nearest
        return t / self.base * self._curve(replicas) / self._curve(n)


@dataclass(slots=True)
class Cluster:
    nodes: dict[str, Node]
    queues: dict[str, Queue]

    @classmethod
    def of(cls, nodes: list[Node], queues: list[Queue]) -> "Cluster":
        return cls({n.name: n for n in nodes}, {q.name: q for q in queues})

    @property
    def capacity(self) -> int:
        return sum(n.slots for n in self.nodes.values())
