"""The coordinator's cluster: nodes, queues and submitted jobs, and the scheduling pass that
carries the policy's decisions out through each job's membership.

A job submitted as a manifest is *managed*: :func:`maitre.scheduling.policy.schedule` decides
when it starts, how many replicas it gets and on which nodes. Every pass (``pass_s``) turns the
coordinator's live state into the policy's view (:class:`~maitre.scheduling.model.Job`: state,
placement, measured throughput), calls the policy, and applies its actions:

=========  ====================================================================================
admit      a new run (an *incarnation*) of the job: a fresh :class:`Membership` whose target is
           the placement; agents start its workers on exactly those nodes. A job that was
           suspended resumes from its newest checkpoint (the loop loads it at step 0).
grow       the target rises; agents start workers on the new nodes; they join at a step boundary.
shrink     the workers on the nodes given up (joiners first, then the highest ranks) are asked
           to leave at the next step boundary. Nobody is killed.
suspend    every member checkpoints after its current step and exits; the slots stay held until
           it did, or until the job's grace period ran out (then its workers are killed).
=========  ====================================================================================

The placement the policy sees is the *allocation*: replicas per node the coordinator granted.
Agents start a job's worker on a node only within its allocation there and only on a slot that
is really free (a leaving worker holds its slot until its process exits), so a node is never
over-committed, not even for the moment between a shrink and its preemptor's start.

A job's warm spares (``spares: N``) are started on slots no allocation holds, so the policy
counts them free: they are no training capacity, and a job placed there takes their slots (the
spares stop first: they hold no state). When a spare takes a lost worker's place, the job's
allocation moves to the spare's slot (:meth:`ClusterState.take_spares`).

A node with a spot notice is drained, then reclaimed (:mod:`maitre.control.drain`): the pass
stops seeing it, its workers leave at a step boundary (or their job checkpoints first), and
its going is a reclaim, not a failure. A node whose health probe failed is drained the same way
and not seen until a probe passes; a node a straggler was evicted from is *suspect*: nothing new
is placed there for a while (:mod:`maitre.control.health`). Each node has a price per slot-hour by its capacity type
(``prices``), which the accounting charges its slot-seconds at.

Nodes are watched by a phi-accrual detector (:mod:`maitre.control.detector`) on their agents'
heartbeats; a node declared dead has its workers evicted (the jobs recover as from any crash) and
its allocations withdrawn, and the next pass places the lost replicas elsewhere.

Throughput is measured, not reported (:mod:`maitre.control.accounting`), and fits the job's
speedup model, which the policy uses to hand out idle slots by marginal gain.

Pure logic over injected time, like :class:`Membership`; the coordinator calls it under its lock
and persists what changed (:mod:`maitre.control.store`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from maitre import protocol
from maitre.control.accounting import Usage, account, measure
from maitre.control.detectors import DetectorConfig, PhiAccrual, PhiConfig
from maitre.control.drain import Reclaim, decide
from maitre.control.health import NodeHealth, Probe
from maitre.control.job import ManagedJob
from maitre.control.membership import JobSpec, Membership, Worker, WorkerState
from maitre.control.restarts import run_class
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Cluster, Job, Node, Queue
from maitre.scheduling.assign import Replica, leavers, repair
from maitre.scheduling.policy import FreeSlots, Plan, PolicyConfig, place, schedule
from maitre.scheduling.spec import JobManifest


@dataclass(slots=True)
class NodeState:
    node: Node
    detector: PhiAccrual
    alive: bool = True
    registered_at: float = 0.0
    reclaim: Reclaim | None = None
    """The node's spot notice, from the first beat that carried one."""
    health: NodeHealth = field(default_factory=NodeHealth)
    """Its latest probe, and a suspicion (:mod:`maitre.control.health`)."""

    @property
    def draining(self) -> bool:
        return self.reclaim is not None

    @property
    def takes_work(self) -> bool:
        """New workers may start here (alive, no notice, its latest probe did not fail)."""
        return self.alive and not self.draining and not self.health.unhealthy


DEFAULT_PRICES = {"on-demand": 2.5, "spot": 0.75}
"""Per slot (GPU) hour, by capacity type: ``maitre up``'s defaults (``--price``), the same as
the simulator's (``maitre simulate --price/--spot-price``): spot at 30% of on-demand."""


class ClusterState:
    """Nodes, queues and managed jobs (see the module docstring)."""

    def __init__(
        self,
        queues: list[Queue],
        *,
        run_dir: Path,
        policy: PolicyConfig | None = None,
        phi: PhiConfig | None = None,
        detector: DetectorConfig | None = None,
        max_restarts: int = 3,
        log: Callable[..., None] | None = None,
        prices: dict[str, float] | None = None,
    ) -> None:
        self.prices = dict(DEFAULT_PRICES if prices is None else prices)
        """Per slot-hour by capacity type; a type without one has no price (its cost is None)."""
        for kind, price in self.prices.items():
            if not 0 <= price < math.inf:
                raise ValueError(f"the {kind} price must be a number >= 0, got {price}")
        self.reclaims = 0
        """Spot nodes reclaimed after a notice."""
        self.queues = {q.name: q for q in queues}
        self.nodes: dict[str, NodeState] = {}
        self.managed: dict[str, ManagedJob] = {}
        self.run_dir = Path(run_dir)
        self.policy = policy or PolicyConfig()
        self.phi = phi or PhiConfig()
        self.detector = detector or DetectorConfig()
        self.max_restarts = max_restarts
        self.log = log or (lambda *a, **k: None)
        """``log(now, kind, job=None, **fields)``: the coordinator's event sink."""
        self.usage = Usage()
        self._withdraw: set[str] = set()
        self._by_node: dict[str, list[str]] = {}
        """Nodes whose allocations the next sync withdraws (they lost slots)."""

    # -- nodes -----------------------------------------------------------------------------------
    def node_beat(self, node: Node, now: float, noticed: bool = False) -> str | None:
        """An agent's heartbeat (``noticed``: it carries a spot notice). Returns what changed:
        ``node_registered``, ``node_changed`` (labels, or more slots), ``node_shrunk`` (fewer
        slots: its allocations are withdrawn, the coordinator evicts its workers) or
        ``node_recovered``; None when nothing did. A reclaimed node that beats without a notice
        is a new machine of the same name: registered afresh."""
        state = self.nodes.get(node.name)
        if state is not None and state.reclaim is not None and state.reclaim.reclaimed_at is not None:
            if noticed:  # the node that went, still beating its notice: it stays out
                return None
            state = None  # a new machine of the same name
        if state is None or state.node != node:
            self.nodes[node.name] = NodeState(
                node,
                PhiAccrual(self.phi, now),
                True,
                state.registered_at if state else now,
                state.reclaim if state else None,
                state.health if state else NodeHealth(),
            )
            kind = (
                "node_registered"
                if state is None
                else "node_shrunk"
                if node.slots < state.node.slots
                else "node_changed"
            )
            if kind == "node_shrunk":
                self._withdraw.add(node.name)
            self.log(
                now,
                kind,
                node=node.name,
                slots=node.slots,
                labels=node_labels(node),
                price=self.price(node.capacity_type),
            )
            return kind
        state.detector.heartbeat(now)
        if not state.alive:
            state.alive = True
            state.detector = PhiAccrual(self.phi, now)
            self.log(now, "node_recovered", node=node.name)
            return "node_recovered"
        return None

    def detect_dead_nodes(self, now: float) -> list[str]:
        """Nodes found dead (silent agents), and noticed nodes that went (silent, or past their
        deadline): those are reclaimed, not dead."""
        dead = []
        for name, state in self.nodes.items():
            if not state.alive:
                continue
            reclaim = state.reclaim
            if reclaim is not None and (now >= reclaim.deadline or state.detector.dead(now)):
                state.alive, reclaim.reclaimed_at = False, now
                self.reclaims += 1
                dead.append(name)
                self.log(now, "node_reclaimed", node=name)
            elif state.detector.dead(now):
                state.alive = False
                dead.append(name)
                self.log(
                    now,
                    "node_dead",
                    node=name,
                    silent_s=round(state.detector.silent_for(now), 2),
                    phi=round(min(state.detector.phi(now), 1e6), 1),
                )
        return dead

    def cluster(self) -> Cluster:
        """The policy's view: live nodes that are not draining and whose latest probe did not
        fail; a suspect node only with the slots its jobs hold there now (none new)."""
        nodes = []
        for s in self.nodes.values():
            if not s.takes_work:
                continue
            if s.health.suspect is not None:
                held = sum(
                    m.job.placement.get(s.node.name, 0) * m.job.slots_per_replica
                    for m in self.managed.values()
                    if not m.job.state.ended
                )
                if not held:
                    continue
                nodes.append(dataclasses.replace(s.node, slots=min(held, s.node.slots)))
            else:
                nodes.append(s.node)
        return Cluster.of(nodes, list(self.queues.values()))

    def price(self, capacity_type: str) -> float | None:
        return self.prices.get(capacity_type)

    def node_price(self, node: str) -> float | None:
        """The node's price per slot-hour (a node never seen: on-demand's)."""
        state = self.nodes.get(node)
        return self.price(state.node.capacity_type if state is not None else "on-demand")

    # -- spot notices ----------------------------------------------------------------------------
    def notice(
        self,
        node: str,
        notice_s: float,
        action: str,
        source: str,
        here: list[tuple[str, Worker]],
        memberships: dict[str, Membership],
        now: float,
    ) -> set[str]:
        """A beat of ``node`` carried a spot notice. The first one drains the node (see
        :mod:`maitre.control.drain`); ``here``: its live workers, with their jobs. Returns the
        jobs it changed (none for a repeat)."""
        state = self.nodes.get(node)
        if state is None or state.reclaim is not None or not state.alive:
            return set()
        state.reclaim = Reclaim(now, now + notice_s, source, action, [w for _, w in here])
        self.log(
            now,
            "spot_notice",
            node=node,
            notice_s=round(notice_s, 3),
            deadline=round(now + notice_s, 4),
            source=source,
            action=action,
        )
        return self._vacate(node, f"spot notice on {node}", {j for j, _ in here}, memberships, now, within_s=notice_s)

    def _vacate(
        self,
        node: str,
        reason: str,
        jobs_here: set[str],
        memberships: dict[str, Membership],
        now: float,
        within_s: float = math.inf,
    ) -> set[str]:
        """Every job gives up its allocation on ``node``: its workers there leave at a step
        boundary, or it checkpoints first (within ``within_s``) where that would leave it with
        no live state or below its minimum (:func:`maitre.control.drain.decide`)."""
        changed = set()
        for m in self.managed.values():
            if m.ended_at is not None or (node not in m.job.placement and m.id not in jobs_here):
                continue
            ms = memberships.get(m.id) if m.incarnation else None
            d = decide(m, ms, node, reason)
            m.place(d.placement)
            changed.add(m.id)
            if d.kind == "leave":
                assert ms is not None
                try:
                    ms.scale(max(ms.spec.min_workers, sum(d.placement.values())), now, leave=d.leave)
                except ValueError as exc:  # (the run ended meanwhile)
                    self.log(now, "resize_skipped", job=m.id, reason=str(exc))
                    continue
                self.log(now, "shrink", job=m.id, placement=dict(d.placement), reason=d.reason)
            elif d.kind == "suspend":
                assert ms is not None
                ms.suspend(d.reason, now)
                m.suspending(min(now + m.job.grace_period_s, now + within_s))
                self.log(now, "suspend", job=m.id, reason=d.reason)
            elif d.kind == "blocked":
                self.log(now, "drain_blocked", job=m.id, node=node, reason=d.reason)
        return changed

    def check_drained(self, node: str, now: float) -> bool:
        """Log ``node_drained`` once every worker that was on the noticed node is gone."""
        state = self.nodes.get(node)
        reclaim = state.reclaim if state is not None else None
        if reclaim is None or reclaim.drained_at is not None or not reclaim.drained():
            return False
        reclaim.drained_at = now
        self.log(
            now,
            "node_drained",
            node=node,
            workers=reclaim.left_gracefully(),
            seconds=round(now - reclaim.noticed_at, 3),
        )
        return True

    # -- health and suspicion (maitre.control.health) ----------------------------------------------
    def node_health(
        self, node: str, probe: Probe, here: set[str], memberships: dict[str, Membership], now: float
    ) -> set[str]:
        """A beat of ``node`` carried a probe result (``here``: the jobs of its live workers).
        A new failing one drains the node; a passing one after a suspicion clears it. Returns
        the jobs it changed."""
        state = self.nodes.get(node)
        if state is None:
            return set()
        was_unhealthy = state.health.unhealthy
        news, cleared = state.health.heard(probe)
        if not news:
            return set()
        self.log(
            now, "node_health", node=node, ok=probe.ok, detail=probe.detail, seconds=probe.seconds, probe=probe.probe
        )
        if cleared:
            self.log(now, "node_cleared", node=node, reason="health probe passed")
        if probe.ok or was_unhealthy or not state.alive:
            return set()
        why = f"health probe failed on {node} ({probe.probe})"
        return self._vacate(node, why, here, memberships, now)

    def wants_probe(self, node: str) -> bool:
        state = self.nodes.get(node)
        return state is not None and state.alive and state.health.wants_probe

    def cool_suspects(self, now: float) -> list[str]:
        """Suspect nodes whose cool-down ended: seen again by the next pass."""
        cooled = [n for n, s in self.nodes.items() if s.health.cooled(now)]
        for node in cooled:
            self.log(now, "node_cleared", node=node, reason="cool-down ended")
        return cooled

    def evict(self, job_id: str, ms: Membership, worker: str, reason: str, now: float) -> dict[str, int] | None:
        """A straggler of a job with ``stragglers: {policy: evict}``: its node is suspect for
        ``cooldownSeconds`` (or until a later probe passes), its replica leaves at the next step
        boundary, and the job is repaired at once (:meth:`replace`). A job that has no free slot
        for the replacement and would be left below its minimum keeps the worker
        (``evict_skipped``: a gang that waits is worse than one that is slow). Returns where the
        replacement goes (None: no eviction, or no slot free now)."""
        m = self.managed.get(job_id)
        spec = m.manifest.stragglers if m is not None else None
        w = ms.workers.get(worker)
        if m is None or spec is None or spec.policy != "evict" or w is None or ms.over or w.state != WorkerState.ACTIVE:
            return None  # (a repeated verdict about one already leaving, too)
        node = w.node
        state = self.nodes.get(node)
        if state is not None:
            sus = state.health.suspected(reason, now, spec.cooldown_s, job_id, worker)
            self.log(
                now,
                "node_suspect",
                node=node,
                reason=reason,
                until=round(sus.until, 4),
                job=job_id,
                worker=worker,
                probe=sus.after,
            )
        where = self._free_for(m)  # (the node is suspect now: none of its slots is free)
        # A spare on the suspect node would be as slow: the others may take the place.
        spares = [s for s in ms.live_spares() if s.node != node]
        if where is None and not spares and sum(m.job.placement.values()) - 1 < ms.spec.min_workers:
            self.log(
                now,
                "evict_skipped",
                job=job_id,
                worker=worker,
                node=node,
                reason=f"{reason}: no free slot for its replacement, and the job would be "
                f"below its minimum of {ms.spec.min_workers}",
            )
            return None
        ms.release(worker, now)
        m.give_up(node)
        self.log(now, "evict", job=job_id, worker=worker, node=node, reason=reason)
        promoted = ms.promote_spare(worker, now, avoid_node=node)
        if promoted is not None:  # a warm spare comes in at the step boundary the worker leaves at
            self.take_spares(m, ms, now)
            self.index_allocations()
            return {promoted.node: 1}
        return self.replace(m, ms, now, f"replaces {worker} (evicted from {node})", where)

    def replace(
        self, m: ManagedJob, ms: Membership, now: float, reason: str, where: dict[str, int] | None = None
    ) -> dict[str, int] | None:
        """Grow the job by one replica at once, outside the scheduling pass (a repair: no resize
        cooldown): on a free slot of a node that takes work, its own nodes first (``where``:
        found already; :meth:`evict` hands the place to a warm spare first). With no free slot the
        job runs one smaller (never below its minimum: :meth:`evict` does not evict then)."""
        where = where if where is not None else self._free_for(m)
        if where is None:
            size = sum(m.job.placement.values())
            if ms.spec.min_workers <= size < ms.target:
                ms.scale(size, now)
            self.log(now, "replace_waiting", job=m.id, reason=f"{reason}: no free slot")
            return None
        m.grow(where)
        self.log(now, "repair", job=m.id, placement=dict(m.job.placement), reason=reason)
        self.index_allocations()
        return dict(where)

    def _free_for(self, m: ManagedJob) -> dict[str, int] | None:
        """Where one more replica of ``m`` fits now, on slots no job holds (None: nowhere)."""
        used: dict[str, int] = {}
        for other in self.managed.values():
            if not other.job.state.ended:
                for n, r in other.job.placement.items():
                    used[n] = used.get(n, 0) + r * other.job.slots_per_replica
        return place(m.job, 1, FreeSlots(self.cluster(), used), prefer=m.job.placement)

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, manifest: JobManifest, now: float, env: dict[str, str] | None = None) -> ManagedJob:
        if manifest.queue not in self.queues:
            raise ValueError(f"no queue {manifest.queue!r} (queues: {', '.join(sorted(self.queues))})")
        largest = max((s.node.slots for s in self.nodes.values() if s.alive), default=None)
        if largest is not None and manifest.gpus_per_replica > largest:
            raise ValueError(
                f"a replica of job {manifest.name!r} needs {manifest.gpus_per_replica}"
                f" slots on one node (gpusPerReplica); the largest node has "
                f"{largest}"
            )
        old = self.managed.get(manifest.name)
        if old is not None and not old.job.state.ended:
            raise ValueError(f"job {manifest.name!r} exists and is not over; cancel it first")
        job = manifest.job(now)
        if manifest.checkpoint_dir is None:  # nothing to resume from: never suspend it
            job.preemptible = False
        managed = ManagedJob(  # a name reused: worker ids go on, history is dropped
            manifest,
            job,
            env=dict(env or {}),
            workers_started=0 if old is None else old.workers_started,
            generation=0 if old is None else old.generation + 1,
        )
        self.managed[manifest.name] = managed
        self.log(
            now,
            "submitted",
            job=manifest.name,
            queue=manifest.queue,
            priority=manifest.priority,
            replicas=[manifest.min_replicas, manifest.max_replicas],
        )
        return managed

    def incarnation_spec(self, m: ManagedJob) -> JobSpec:
        man = m.manifest
        scope = f"g{m.generation}i{m.incarnation}"
        env = {protocol.RUN_ID: f"{m.id}-{scope}", protocol.LEDGER_DIR: str(self.ledger_dir(m))}
        if man.checkpoint_dir:
            env[protocol.CHECKPOINT_DIR] = man.checkpoint_dir
        if man.stragglers is not None:
            env.update(protocol.straggler_environ(man.stragglers))
        env.update(m.env)
        return JobSpec(
            job_id=m.id,
            command=list(man.command),
            min_workers=man.min_replicas,
            max_workers=man.max_replicas,
            max_restarts=self.max_restarts,
            env=env,
            spares=man.spares,
            nproc_per_replica=man.nproc_per_replica,
            mesh=man.mesh_text if man.nproc_per_replica > 1 else "",
            store_scope=scope,
            elastic=man.elastic,
            grace_s=man.grace_period_s,
            success_marker=man.success_marker,
        )

    def _run(self, m: ManagedJob, now: float) -> Membership:
        """A new run of ``m``, of the kind its manifest asks for (in place, or restarted whole)."""
        spec = self.incarnation_spec(m)
        return run_class(spec)(spec, self.detector, now, m.workers_started, m.job)

    def ledger_dir(self, m: ManagedJob) -> Path:
        """Where the job's workers record the samples they commit (``<name>``, then
        ``<name>.1``... for later jobs of the same name)."""
        name = m.id if not m.generation else f"{m.id}.{m.generation}"
        return self.run_dir / "ledger" / name

    def allowed_on(self, job_id: str, node: str, staying_here: int) -> int:
        """Workers of a managed job that may still start on ``node``: its allocation there minus
        its workers there that are not leaving (``staying_here``)."""
        m = self.managed.get(job_id)
        if m is None or m.job.state.ended:
            return 0
        return max(0, m.job.placement.get(node, 0) - staying_here)

    def allocated_on(self, node: str) -> list[str]:
        """The jobs with an allocation on ``node``, as of the last :meth:`index_allocations`
        (allocations grow only in a scheduling pass, which ends with one)."""
        return self._by_node.get(node, [])

    def index_allocations(self) -> None:
        by_node: dict[str, list[str]] = {}
        for m in self.managed.values():
            if not m.job.state.ended:
                for node in m.job.placement:
                    by_node.setdefault(node, []).append(m.id)
        self._by_node = by_node

    def take_spares(self, m: ManagedJob, ms: Membership, now: float) -> bool:
        """The spares the run promoted hold slots of the job now: its allocation grows on each
        one's node and gives up a slot it no longer fills (the lost worker's, preferably).
        Returns whether the allocation changed."""
        changed = False
        place = m.job.placement
        for wid, replacing in ms.take_promotions():
            spare = ms.workers[wid]
            if spare.spare or spare.state not in (WorkerState.STARTING, WorkerState.READY, WorkerState.ACTIVE):
                continue  # lost meanwhile (it may be in its epoch already: that is no loss)
            m.grow({spare.node: 1})
            held = Counter(w.node for w in ms.live_workers() if w.state != WorkerState.LEAVING)
            gone = ms.workers[replacing].node if replacing in ms.workers else None
            unfilled = [n for n in place if place[n] > held[n]]
            if unfilled:
                m.give_up(gone if gone in unfilled else max(unfilled, key=lambda n: (place[n] - held[n], n)))
            changed = True
            self.log(
                now, "spare_assigned", job=m.id, worker=wid, replacing=replacing, node=spare.node, placement=dict(place)
            )
        return changed

    def slots_per_worker(self, job_id: str) -> int:
        m = self.managed.get(job_id)
        return 1 if m is None else m.job.slots_per_replica

    # -- the scheduling pass ---------------------------------------------------------------------
    def sync(self, memberships: dict[str, Membership], now: float) -> None:
        """Bring the policy's view of each job up to date with its membership."""
        for m in self.managed.values():
            if m.ended_at is not None:
                continue
            ms = memberships.get(m.id) if m.incarnation else None
            job = m.job
            # Lost (or shrunk) nodes take their allocation with them.
            lost = [n for n in job.placement if not self._alive(n) or n in self._withdraw]
            m.lose_nodes(lost)
            if ms is None:
                continue
            self.take_spares(m, ms, now)  # (before the lost nodes' replicas are counted)
            if lost:
                m.retarget(ms)
            account(m, ms)
            # The run moved the job (to an end, or suspended): free its slots, once.
            if job.state.ended:
                m.ended(now)
                self.log(now, "job_" + job.state.value.lower(), job=m.id, reason=ms.failure or "", step=self._step(ms))
                continue
            if job.state == JobState.SUSPENDED:
                if m.suspended():
                    self.log(now, "job_suspended", job=m.id, step=self._step(ms))
                continue
            if m.grace_expired(now):
                for w in ms.live_workers():
                    ms.evict(w.id, f"grace period of {job.grace_period_s:.0f}s ran out", now)
                self.log(now, "grace_expired", job=m.id)
            measure(m, ms, now)

    def plan(self, now: float) -> Plan:
        view, jobs = self.prepare(now)
        return schedule(view, jobs, now, self.policy)

    def prepare(self, now: float) -> tuple[Cluster, list[Job]]:
        """What the policy is called with (after the repair of gangs below their minimum): a
        view of the live nodes and copies of the jobs, so that the pass can run while the
        coordinator serves on (:meth:`fingerprint` tells whether its plan still applies)."""
        self._withdraw.clear()  # sync() has withdrawn their allocations
        jobs = [m.job for m in self.managed.values() if not m.job.state.ended and not (m.held and m.job.state.waiting)]
        cluster = self.cluster()
        copies = [dataclasses.replace(j, placement=dict(j.placement), throughput=dict(j.throughput)) for j in jobs]
        for c in repair(cluster, copies):  # before anything else is scheduled
            self.managed[c.id].place(c.placement)
            self.log(now, "repair", job=c.id, placement=dict(c.placement))
        return cluster, copies

    def fingerprint(self) -> tuple[Any, ...]:
        """What a plan was made from: jobs' states (as the policy tells them apart: an epoch
        opening or closing is none of its business), bounds and placement, nodes' life and size.
        A plan made on one fingerprint is applied only on the same one."""
        return (
            tuple(
                (
                    m.id,
                    m.held,
                    "placed" if m.job.state.placed else m.job.state,
                    m.job.min_replicas,
                    m.job.max_replicas,
                    tuple(sorted(m.job.placement.items())),
                )
                for m in self.managed.values()
            ),
            tuple(
                (n, s.alive, s.draining, s.node, s.health.unhealthy, s.health.suspect is not None)
                for n, s in self.nodes.items()
            ),
        )

    def apply(self, plan: Plan, memberships: dict[str, Membership], now: float) -> list[tuple[str, str, Any]]:
        """Carry the plan out; returns what the coordinator must do beyond the memberships:
        ``("start", job_id, membership)`` for a new incarnation."""
        out: list[tuple[str, str, Any]] = []
        for action in plan.actions:
            m = self.managed[action.job]
            job = m.job
            new = dict(action.placement)
            if action.kind == "admit":
                ms = m.admit(
                    new,
                    now,
                    lambda m=m: self._run(m, now),
                    memberships.get(m.id),
                )
                out.append(("start", m.id, ms))
                self.log(
                    now,
                    "admit",
                    job=m.id,
                    placement=new,
                    incarnation=m.incarnation,
                    resumes=job.submitted_at < now and m.incarnation > 1,
                )
            elif action.kind in ("grow", "shrink"):
                ms = memberships[m.id]
                leave = self._leavers(ms, job.placement, new) if action.kind == "shrink" else None
                m.resize(new, now)
                try:
                    ms.scale(sum(new.values()), now, leave=leave)
                except ValueError as exc:  # the membership ended meanwhile
                    self.log(now, "resize_skipped", job=m.id, reason=str(exc))
                    continue
                self.log(now, action.kind, job=m.id, placement=new, reason=action.reason)
            elif action.kind == "suspend":
                ms = memberships[m.id]
                try:
                    ms.suspend(action.reason, now)  # the job is SUSPENDING
                except ValueError:  # its run stopped meanwhile: the next sync sees how
                    continue
                m.suspending(now + job.grace_period_s)
                self.log(now, "suspend", job=m.id, reason=action.reason)
            elif action.kind == "preempting" and action.reason != m.last_waiting:
                m.last_waiting = action.reason
                self.log(now, "preempting", job=m.id, reason=action.reason, placement=new)
        return out

    @staticmethod
    def _leavers(ms: Membership, old: dict[str, int], new: dict[str, int]) -> list[str]:
        return leavers(
            [
                Replica(w.id, w.node, w.state == WorkerState.ACTIVE, w.rank)
                for w in ms.live_workers()
                if w.state != WorkerState.LEAVING
            ],
            old,
            new,
        )

    # -- user requests ---------------------------------------------------------------------------
    def cancel(self, job_id: str, ms: Membership | None, now: float) -> None:
        self._get(job_id).cancel(ms, now)
        self.log(now, "job_cancelled", job=job_id)

    def set_max(self, job_id: str, replicas: int, ms: Membership | None, now: float) -> None:
        """``maitre scale`` on a managed job: a new ceiling (the policy shrinks it now if above,
        and grows it up to the ceiling when slots are idle); ``ms``: its run."""
        self._get(job_id).set_max(replicas, ms)
        self.log(now, "max_replicas", job=job_id, replicas=replicas)

    def shrink_to_max(self, job_id: str, ms: Membership | None, now: float) -> list[str]:
        """After :meth:`set_max` below the current size: give up the excess at once, spot nodes
        first (Slurm's scavenger replicas, Kubernetes' surplus pods: the capacity asked for
        last), then the nodes it has least on. Returns the members asked to leave."""
        m = self._get(job_id)
        excess = m.job.replicas - m.job.max_replicas
        if excess <= 0 or ms is None or ms.over:
            return []
        new = dict(m.job.placement)

        def spot_first(n: str) -> tuple[bool, int, str]:  # (capacity that may go anyway, a surplus)
            state = self.nodes.get(n)
            return (state is None or state.node.capacity_type != "spot", new[n], n)

        for node in sorted(new, key=spot_first):
            take = min(excess, new[node])
            new[node] -= take
            excess -= take
        new = {n: r for n, r in new.items() if r}
        leave = self._leavers(ms, m.job.placement, new)
        m.shrink_to_max(new, ms)
        return ms.scale(sum(new.values()), now, leave=leave)

    def _get(self, job_id: str) -> ManagedJob:
        try:
            return self.managed[job_id]
        except KeyError:
            raise KeyError(f"no job {job_id!r}") from None

    def _alive(self, node: str) -> bool:
        state = self.nodes.get(node)
        return state is not None and state.alive

    @staticmethod
    def _step(ms: Membership) -> int:
        return max((w.step for w in ms.workers.values()), default=0)

    # -- persistence -----------------------------------------------------------------------------


def node_labels(node: Node) -> dict[str, str]:
    """The node's labels as its agent gave them (the capacity type always)."""
    return {k: v for k in protocol.LABELS if (v := getattr(node, k))}
