"""The scheduling policy: a pure function from the cluster and its jobs to target placements.

``schedule(cluster, jobs, now)`` returns a :class:`Plan`: where every job should run after this
pass and the actions that get it there (admit, grow, shrink, suspend). No I/O, no clock but
``now``, no randomness: the live coordinator and the simulator call it alike.

One pass, in order:

1. **Admission.** Pending (and suspended) jobs in order of priority, then fair share of their
   queue (slots held over weight), then submission time. A job is admitted only if its *minimum*
   fits in slots that are free now, within its queue's ceiling (guarantee plus borrowing limit),
   all at once (gang admission: two gangs that cannot both fit never both hold part).
2. **Preemption**, for a job that does not fit: first shrink elastic jobs toward their minimum,
   lowest priority first, then suspend whole preemptible jobs (each gets its grace period to
   checkpoint); victims are jobs of lower priority, or jobs of other queues that borrow beyond
   their guarantee when the preemptor's queue reclaims its own guarantee (never below the
   victim queue's guarantee). A job of the same queue and priority may take back another's
   *elastic surplus* (replicas above its minimum, which elastic fill lent it while they were
   idle), but never suspends it (``reclaim_surplus``). The largest victim is shrunk first, one
   replica at a time. Nothing is touched unless the preemptor fits once the victims let
   go; the preemptor itself starts in a later pass, when the slots are really free (so the
   cluster is never over-allocated, even for a moment).
3. **Elastic fill.** Free slots go to the running elastic job with the highest priority and
   then the largest gain per replica (from its speedup curve: the throughput it measured at each
   size, see :class:`~maitre.scheduling.model.Speedup`), weighted toward the jobs that have had
   the least service (``las_weight``); a job may take several replicas at once when that pays
   more per replica than one (``lookahead``: crossing a node often costs before it gains), while
   the gain is worth it (``min_gain``) and the job was not resized within
   ``resize_cooldown_s`` (damping: no back-and-forth).
4. **Rebalance**, when no slot is left free: a replica moves from the running elastic job that
   loses least by giving it up to the one of the same queue and priority that gains most (both
   weighted by service as in the fill), while the gain exceeds the loss by ``rebalance_gain``
   (hysteresis: a move is never undone by the next pass) and neither job is in its cooldown.
   Only the donors' shrinks are in this plan; the slots they free go to the gainers by the next
   pass's elastic fill, once really free.

Placement is topology-aware: a job's replicas go to one domain (node, rack or block, from
``topology.level``; rack by default) when one can hold them, choosing the tightest domain that
fits and, inside it, one node if one fits all, else the fewest nodes; ``required`` never spreads.
Growth prefers the nodes and domains the job already uses, then the node with the most room.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from maitre.scheduling.model import Cluster, Job, Node, Speedup, Topology

_DEFAULT_TOPOLOGY = Topology(level="rack", mode="preferred")


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    resize_cooldown_s: float = 180.0
    """A running job is not resized again within this many seconds of its last resize."""
    reclaim_surplus: bool = True
    """A pending job may shrink running elastic jobs of its own queue and priority toward their
    minimum (never suspend them): elastic growth is lent, not owned."""
    min_gain: float = 0.1
    """Grow a job only if one more replica adds at least this fraction of one replica's
    throughput (by its speedup model)."""
    rebalance_gain: float = 0.25
    """Move a replica between peers only if the taker gains this much more (in units of one
    replica's throughput) than the giver loses; 0 turns rebalancing off."""
    lookahead: int = 64
    """Elastic fill weighs growing a job by up to this many replicas at once, by gain per
    replica: speedup is not concave (a job crossing from one node to two may slow down and gain
    again at four), and one-at-a-time growth would stop at the dip."""
    las_weight: float = 0.5
    """Among jobs of one priority, gains are weighted by ``(1 + attained / las_scale_s) **
    -las_weight`` (attained: slot-seconds of service so far), so the least-served grow first:
    least-attained-service ordering (Tiresias), which shortens mean completion time when job
    lengths are unknown and heavy-tailed. 0 turns it off."""
    las_scale_s: float = 4 * 3600.0
    restart_horizon_s: float = 1800.0
    """A job that restarts to resize (``restart_s`` > 0) grows only if the growth pays for the
    restart within this many seconds: ``(s(n+k) - s(n)) * (H - r) > s(n) * r`` (s: its speedup,
    r: its restart). Such jobs are never moved by the rebalance (each move would cost two
    restarts for a small gain)."""


@dataclass(slots=True)
class Action:
    kind: str
    """``admit``, ``grow``, ``shrink``, ``suspend`` or ``preempting`` (a pending job waits for
    its victims to let go; its placement is where it will fit then)."""
    job: str
    placement: dict[str, int]
    reason: str = ""


@dataclass(slots=True)
class Plan:
    placements: dict[str, dict[str, int]]
    """Target replicas per node of every job (empty: not running)."""
    actions: list[Action] = field(default_factory=list)

    def actions_of(self, kind: str) -> list[Action]:
        return [a for a in self.actions if a.kind == kind]


class FreeSlots:
    """Free slots per node, with per-domain sums so placement need not scan the cluster."""

    def __init__(self, cluster: Cluster, used: dict[str, int]) -> None:
        self.nodes = cluster.nodes
        self.avail = {n: node.slots - used.get(n, 0) for n, node in cluster.nodes.items()}
        self.total = sum(self.avail.values())
        self.reserved = {n: node.reserved_for for n, node in cluster.nodes.items() if node.reserved_for}
        """Nodes that take one job's workers only (see ``Node.reserved_for``)."""
        self.members: dict[str, dict[str, list[str]]] = {lvl: {} for lvl in ("rack", "block")}
        self.sums: dict[str, dict[str, int]] = {lvl: {} for lvl in ("rack", "block")}
        for name, node in cluster.nodes.items():
            for lvl in ("rack", "block"):
                d = _domain(node, lvl)
                self.members[lvl].setdefault(d, []).append(name)
                self.sums[lvl][d] = self.sums[lvl].get(d, 0) + self.avail[name]

    def take(self, placement: dict[str, int], per_replica: int, sign: int = 1) -> None:
        for name, replicas in placement.items():
            self.take_slots(name, sign * replicas * per_replica)

    def take_slots(self, name: str, slots: int) -> None:
        self.avail[name] -= slots
        self.total -= slots
        node = self.nodes[name]
        for lvl in ("rack", "block"):
            self.sums[lvl][_domain(node, lvl)] -= slots

    def give(self, placement: dict[str, int], per_replica: int) -> None:
        self.take(placement, per_replica, sign=-1)

    def copy(self) -> "FreeSlots":
        clone = object.__new__(FreeSlots)
        clone.nodes, clone.members, clone.reserved = self.nodes, self.members, self.reserved
        clone.avail, clone.total = dict(self.avail), self.total
        clone.sums = {lvl: dict(s) for lvl, s in self.sums.items()}
        return clone


def _domain(node: Node, level: str) -> str:
    if level == "node":
        return node.name
    if level == "block":
        return node.block or node.rack or node.name
    return node.rack or node.name


def place(job: Job, replicas: int, free: FreeSlots, prefer: dict[str, int] | None = None) -> dict[str, int] | None:
    """Where ``replicas`` more replicas of ``job`` go in ``free`` (None: they do not fit)."""
    if replicas <= 0:
        return {}
    g = job.slots_per_replica
    if free.total < replicas * g:  # the common case in a full cluster: no scan at all
        return None
    topo = job.topology or _DEFAULT_TOPOLOGY
    prefer = prefer or {}

    reserved = free.reserved

    def fits(name: str) -> int:
        if reserved and reserved.get(name, job.id) != job.id:
            return 0  # another job's node
        return free.avail[name] // g

    if topo.level == "node":  # all replicas on one node
        best = min(
            (n for n in free.avail if fits(n) >= replicas), key=lambda n: (n not in prefer, fits(n), n), default=None
        )
        if best is not None:
            return {best: replicas}
        if topo.mode == "required":
            return None
        return _spread(sorted(free.avail, key=lambda n: (n not in prefer, -fits(n), n)), replicas, fits)
    level = topo.level
    sums = free.sums[level]
    current = {_domain(free.nodes[n], level) for n in prefer}
    # Domains whose free slots could hold the replicas (an upper bound: per-node remainders
    # smaller than a replica do not count), tightest first; the job's own domains first.
    candidates = sorted((d for d, s in sums.items() if s >= replicas * g), key=lambda d: (d not in current, sums[d], d))
    for d in candidates:
        names = free.members[level][d]
        if sum(fits(n) for n in names) < replicas:
            continue
        # A new job takes the tightest node that fits (keeps room whole for gangs); a growing
        # job its own nodes, else the roomiest, where its next replicas can join it.
        one = min(
            (n for n in names if fits(n) >= replicas),
            key=lambda n: (n not in prefer, -fits(n) if prefer else fits(n), n),
            default=None,
        )
        if one is not None:
            return {one: replicas}
        return _spread(sorted(names, key=lambda n: (n not in prefer, -fits(n), n)), replicas, fits)
    if topo.mode == "required":
        return None
    # Only nodes with room can take a replica: in a full cluster that is a few of thousands.
    domains = sorted((d for d, s in sums.items() if s >= g), key=lambda d: (d not in current, -sums[d], d))
    order = [
        n
        for d in domains
        for n in sorted((n for n in free.members[level][d] if fits(n)), key=lambda n: (n not in prefer, -fits(n), n))
    ]
    return _spread(order, replicas, fits)


def _spread(order: list[str], replicas: int, fits: Callable[[str], int]) -> dict[str, int] | None:
    out: dict[str, int] = {}
    left = replicas
    for n in order:
        k = min(fits(n), left)
        if k > 0:
            out[n] = k
            left -= k
            if left == 0:
                return out
    return None


def schedule(cluster: Cluster, jobs: list[Job], now: float, cfg: PolicyConfig | None = None) -> Plan:
    """One scheduling pass (see the module docstring)."""
    cfg = cfg or PolicyConfig()
    by_id = {j.id: j for j in jobs}
    used: dict[str, int] = {}
    usage: dict[str, int] = {q: 0 for q in cluster.queues}
    for j in jobs:
        if j.queue not in cluster.queues:
            raise ValueError(f"job {j.id}: no queue {j.queue!r}")
        for n, r in j.placement.items():
            if n not in cluster.nodes:
                raise ValueError(f"job {j.id}: placed on unknown node {n!r}")
            used[n] = used.get(n, 0) + r * j.slots_per_replica
        usage[j.queue] += j.slots
    for n, u in used.items():
        if u > cluster.nodes[n].slots:
            raise ValueError(f"node {n}: {u} slots in use, it has {cluster.nodes[n].slots}")
    free = FreeSlots(cluster, used)
    target = {j.id: dict(j.placement) for j in jobs}
    plan = Plan(target)
    touched: set[str] = set()  # jobs resized, admitted or preempted in this pass
    admitted: dict[str, Action] = {}

    def share(j: Job) -> float:
        return usage[j.queue] / cluster.queues[j.queue].weight

    # 1-2. admission, with preemption for jobs that do not fit
    running = sorted((j for j in jobs if j.state.placed), key=lambda v: (v.priority, -v.submitted_at, v.id))
    pending = sorted((j for j in jobs if j.state.waiting), key=lambda j: (-j.priority, share(j), j.submitted_at, j.id))
    for j in pending:
        need = j.min_replicas * j.slots_per_replica
        if usage[j.queue] + need > cluster.queues[j.queue].ceiling:
            continue
        where = place(j, j.min_replicas, free)
        if where is not None:
            free.take(where, j.slots_per_replica)
            usage[j.queue] += need
            target[j.id] = where
            touched.add(j.id)
            admitted[j.id] = Action("admit", j.id, where)
            plan.actions.append(admitted[j.id])
            continue
        found = _preemption(j, running, by_id, cluster, free, usage, target, touched, cfg.reclaim_surplus)
        if found is None:
            continue
        victims, where = found
        for n, r in where.items():  # pledge what is free now, so no later job takes it
            free.take_slots(n, min(r * j.slots_per_replica, max(0, free.avail[n])))
        for v, new in victims:
            kind = "suspend" if not new else "shrink"
            usage[v.queue] -= (sum(target[v.id].values()) - sum(new.values())) * v.slots_per_replica
            target[v.id] = new
            touched.add(v.id)
            plan.actions.append(Action(kind, v.id, new, reason=f"preempted by {j.id}"))
        plan.actions.append(
            Action("preempting", j.id, where, reason="waits for " + ", ".join(v.id for v, _ in victims))
        )

    # 3. elastic fill by marginal gain
    curves: dict[str, Speedup] = {}

    def speedup(j: Job, n: int) -> float:
        if j.id not in curves:
            curves[j.id] = Speedup(j.throughput)
        return curves[j.id](n)

    def step(j: Job, n: int, most: int) -> tuple[float, int]:
        """The best growth of ``j`` from ``n`` by at most ``most`` replicas: (gain per replica,
        replicas). A look-ahead, since speedup is not concave (crossing a node costs)."""
        base = speedup(j, n)
        best = (-math.inf, 0)
        for k in range(1, min(most, j.max_replicas - n, cfg.lookahead) + 1):
            g = (speedup(j, n + k) - base) / k
            if g > best[0] + 1e-12:
                best = (g, k)
        return best

    heap: list[tuple[int, float, float, str, int]] = []

    def pays(j: Job, size: int, k: int) -> bool:
        """A restart-mode job's growth by ``k`` earns back its restart within the horizon."""
        r, horizon = j.restart_s, cfg.restart_horizon_s
        if r <= 0 or not k:
            return True
        return r < horizon and (speedup(j, size + k) - speedup(j, size)) * (horizon - r) > speedup(j, size) * r

    def push(j: Job, size: int, most: int) -> None:
        g, k = step(j, size, most)
        if k and g >= cfg.min_gain and pays(j, size, k):
            heapq.heappush(heap, (-j.priority, -g * _las_weight(j, cfg), j.submitted_at, j.id, k))

    for j in jobs:
        size = sum(target[j.id].values())
        growing = j.state.placed or (j.id in touched and size > 0)
        if not (growing and j.elastic and size and size < j.max_replicas):
            continue
        if j.id in touched and j.state.placed:
            continue  # shrunk for a preemptor this pass
        if j.state.placed and now - j.last_resize_at < cfg.resize_cooldown_s:
            continue
        push(j, size, free.total // j.slots_per_replica)
    grown: set[str] = set()
    while heap:
        _, _, _, jid, k = heapq.heappop(heap)
        j = by_id[jid]
        size = sum(target[jid].values())
        headroom = cluster.queues[j.queue].ceiling - usage[j.queue]  # inf: no borrowing limit
        if headroom < k * j.slots_per_replica:
            k = int(headroom // j.slots_per_replica)
            if k <= 0:
                continue
        where = place(j, k, free, prefer=target[jid])
        if where is None:
            if k > 1:
                push(j, size, k - 1)
            continue
        free.take(where, j.slots_per_replica)
        usage[j.queue] += k * j.slots_per_replica
        for n, r in where.items():
            target[jid][n] = target[jid].get(n, 0) + r
        grown.add(jid)
        push(j, size + k, free.total // j.slots_per_replica)
    if free.total == 0 and cfg.rebalance_gain > 0:
        _rebalance(jobs, target, touched | grown, now, cfg, plan, speedup)
    for jid in sorted(grown):
        if by_id[jid].state.placed:
            plan.actions.append(Action("grow", jid, dict(target[jid])))
        else:  # admitted this pass: its admission carries the larger size
            admitted[jid].placement = dict(target[jid])
    return plan


def _preemption(
    j: Job,
    running: list[Job],
    by_id: dict[str, Job],
    cluster: Cluster,
    free: FreeSlots,
    usage: dict[str, int],
    target: dict[str, dict[str, int]],
    touched: set[str],
    reclaim_surplus: bool = True,
) -> tuple[list[tuple[Job, dict[str, int]]], dict[str, int]] | None:
    """Victims (with their new placements; empty = suspend) that let ``j``'s minimum fit, and
    where it will go then; None if no admissible set of victims would make it fit. ``running``
    is in the order victims are chosen: lowest priority first, then the youngest."""
    queue = cluster.queues[j.queue]
    need = j.min_replicas * j.slots_per_replica
    reclaiming = usage[j.queue] + need <= queue.guaranteed

    jq, jp = j.queue, j.priority

    def peer(v: Job) -> bool:
        """A job of the preemptor's own rank: only its elastic surplus may be taken."""
        return reclaim_surplus and v.queue == jq and v.priority == jp and v.elastic

    def room(v: Job) -> float:
        """Slots that may be taken from ``v``'s queue without breaking its guarantee (called
        for every running job by every pending job that does not fit: kept cheap)."""
        if v.queue == jq:
            return math.inf if v.priority < jp or peer(v) else 0
        if v.priority < jp or reclaiming:
            return usage[v.queue] - cluster.queues[v.queue].guaranteed
        return 0

    candidates = [v for v in running if v.id not in touched and v.id != j.id and room(v) > 0]
    # Could all of them together make room? If not, no simulation is needed.
    takeable = {q: 0.0 for q in cluster.queues}
    for v in candidates:
        if v.preemptible or v.elastic:
            keep = 0 if v.preemptible and not peer(v) else v.min_replicas * v.slots_per_replica
            takeable[v.queue] += sum(target[v.id].values()) * v.slots_per_replica - keep
    if (
        free.total
        + sum(min(t, max((room(v) for v in candidates if v.queue == q), default=0)) for q, t in takeable.items())
        < need
    ):
        return None
    trial = free.copy()
    taken = {q: 0 for q in cluster.queues}
    plan: dict[str, dict[str, int]] = {}
    # Phase A: shrink elastic victims toward their minimum, one replica at a time, the lowest
    # priority first and, among equals, the largest.
    current = {v.id: dict(target[v.id]) for v in candidates if v.elastic}
    rank = {v.id: i for i, v in enumerate(candidates)}

    def shrinkable(v: Job) -> bool:
        return sum(current[v.id].values()) > v.min_replicas and taken[v.queue] + v.slots_per_replica <= room(v)

    while True:
        left = [v for v in candidates if v.id in current and shrinkable(v)]
        if not left:
            break
        v = min(left, key=lambda v: (v.priority, -sum(current[v.id].values()), rank[v.id]))
        trial.give({_drop_one(current[v.id]): 1}, v.slots_per_replica)
        taken[v.queue] += v.slots_per_replica
        plan[v.id] = dict(current[v.id])
        where = place(j, j.min_replicas, trial)
        if where is not None:
            return [(by_id[vid], p) for vid, p in plan.items()], where
    # Phase B: suspend whole preemptible victims.
    for v in candidates:
        if not v.preemptible or peer(v):
            continue
        remaining = plan.get(v.id, target[v.id])
        slots = sum(remaining.values()) * v.slots_per_replica
        if taken[v.queue] + slots > room(v):
            continue
        trial.give(remaining, v.slots_per_replica)
        taken[v.queue] += slots
        plan[v.id] = {}
        where = place(j, j.min_replicas, trial)
        if where is not None:
            # Shrinks that turned out not to be needed once a whole job is suspended are kept:
            # they count toward the fit, and a minimal set is not worth a second search.
            return [(by_id[vid], p) for vid, p in plan.items()], where
    return None


def _las_weight(j: Job, cfg: PolicyConfig) -> float:
    """How much a job's gains count by the service it has had (see ``las_weight``)."""
    if not cfg.las_weight:
        return 1.0
    return float((1 + j.attained_slot_s / cfg.las_scale_s) ** -cfg.las_weight)


def _drop_one(placement: dict[str, int]) -> str:
    """Take one replica off ``placement`` (in place), from its thinnest node: unpacking the
    thinnest first keeps the rest packed. Returns that node."""
    node = min(placement, key=lambda n: (placement[n], n))
    placement[node] -= 1
    if not placement[node]:
        del placement[node]
    return node


def _rebalance(
    jobs: list[Job],
    target: dict[str, dict[str, int]],
    touched: set[str],
    now: float,
    cfg: PolicyConfig,
    plan: Plan,
    speedup: Callable[[Job, int], float],
) -> None:
    """Shrink the peers that lose least so that the peers that gain most can grow (step 4)."""

    def settled(j: Job) -> bool:
        return (
            j.state.placed
            and j.elastic
            and j.restart_s <= 0
            and j.id not in touched
            and now - j.last_resize_at >= cfg.resize_cooldown_s
        )

    groups: dict[tuple[str, int], list[Job]] = {}
    for j in jobs:
        if settled(j):
            groups.setdefault((j.queue, j.priority), []).append(j)
    for peers in groups.values():
        _rebalance_peers(peers, target, cfg, plan, speedup)


def _rebalance_peers(
    peers: list[Job],
    target: dict[str, dict[str, int]],
    cfg: PolicyConfig,
    plan: Plan,
    speedup: Callable[[Job, int], float],
) -> None:
    size = {j.id: sum(target[j.id].values()) for j in peers}
    weight = {j.id: _las_weight(j, cfg) for j in peers}

    def gain(j: Job) -> float:  # of one more replica, weighted by service
        return (speedup(j, size[j.id] + 1) - speedup(j, size[j.id])) * weight[j.id]

    def loss(j: Job) -> float:  # of one fewer
        return (speedup(j, size[j.id]) - speedup(j, size[j.id] - 1)) * weight[j.id]

    given: dict[str, int] = {}
    taken: set[str] = set()
    while True:
        takers = [j for j in peers if size[j.id] < j.max_replicas and j.id not in given]
        givers = [j for j in peers if size[j.id] > j.min_replicas and j.id not in taken]
        if not takers or not givers:
            break
        t = max(takers, key=lambda j: (gain(j), -j.submitted_at))
        g = min((j for j in givers if j.id != t.id), key=lambda j: (loss(j), -j.submitted_at), default=None)
        if g is None:
            break
        if gain(t) - loss(g) < cfg.rebalance_gain or g.slots_per_replica != t.slots_per_replica:
            break
        size[t.id] += 1
        size[g.id] -= 1
        taken.add(t.id)
        given[g.id] = given.get(g.id, 0) + 1
        _drop_one(target[g.id])
    for gid, k in sorted(given.items()):
        plan.actions.append(
            Action("shrink", gid, dict(target[gid]), reason=f"rebalance: {k} replica(s) to peers that gain more")
        )
