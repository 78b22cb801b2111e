"""What a node's beat brings besides its workers' progress, and a node's eviction.

- **A restarted agent** (another agent process than the node's last one): the workers of the one
  before went with it; their jobs recover at once, as from a crash.
- **A spot notice**: the first one drains the node (:mod:`maitre.control.drain`).
- **A health probe**: a new failing one drains the node as a notice does, a passing one lets
  work go there again (:mod:`maitre.control.health`).
- **A straggler** evicted by its job's policy, and **a node evicted** (dead, reclaimed, shrunk).

Called by the :class:`~maitre.control.coordinator.Coordinator` under its lock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from maitre import protocol as p
from maitre.control.health import Probe
from maitre.control.membership import Membership

if TYPE_CHECKING:
    from maitre.control.coordinator import Coordinator

log = logging.getLogger("maitre.coordinator")


def agent_restarted(co: "Coordinator", node: str, now: float) -> None:
    """A beat from another agent process than the node's last one: the agent restarted (it
    was killed, its host rebooted), and the workers of the one before are gone with it
    (any still running are orphans: killed if the new agent finds them). Their jobs
    recover at once, as from a crash, instead of waiting out their heartbeats' silence."""
    co.nodes.forget_starts(node)  # orders for the agent before: its workers go too
    gone = [w.id for _, w in co.workers.live_on(node)]
    if gone:
        log.info("node %s: a new agent, without %s", node, ", ".join(sorted(gone)))
        evict_node(co, node, f"node {node}'s agent restarted: its workers went with the agent before", now)


def noticed(co: "Coordinator", node: str, notice: p.SpotNotice, now: float) -> None:
    """A spot notice in a node's beat: the first one drains the node (its jobs' workers
    there leave, or their jobs checkpoint first: :mod:`maitre.control.drain`)."""
    state = co.cluster.nodes.get(node)
    if state is None:
        return
    if state.reclaim is not None:  # it may come sooner (an agent that stops says "now")
        if state.reclaim.reclaimed_at is None and now + notice.notice_s < state.reclaim.deadline - 1.0:  # (not jitter)
            state.reclaim.deadline = now + notice.notice_s
            co.replan()  # (the pass counts the reclaim)
        return
    co.orders.release_spares(node, f"node {node} has a spot notice", now)  # (no state to save)
    here = [(ms.spec.job_id, w) for ms, w in co.workers.live_on(node) if not ms.over]
    changed = co.cluster.notice(node, notice.notice_s, notice.action, notice.source, here, co.jobs, now)
    for job_id in changed:
        co.touch(job_id, persist=True)
    co.cluster.index_allocations()
    co.cluster.check_drained(node, now)  # (nothing ran there)
    co.bump(node)
    co.replan()  # the jobs that gave it up may grow elsewhere
    co.flush()


def probed(co: "Coordinator", node: str, health: p.NodeHealth, now: float) -> None:
    """A probe result in a node's beat: a new failing one drains the node (as a notice
    does, :mod:`maitre.control.health`); a passing one lets work go there again."""
    state = co.cluster.nodes.get(node)
    if state is None or (state.health.probe is not None and state.health.probe.id == health.id):
        return  # (every beat carries the latest: the same one again is no news)
    here = {ms.spec.job_id for ms, _ in co.workers.live_on(node) if not ms.over}
    before = (state.health.unhealthy, state.health.suspect)
    if not health.ok:  # its spares hold no state: they go at once, the rest drains
        co.orders.release_spares(node, f"node {node} failed its health probe", now)
    probe = Probe(health.id, health.ok, health.detail, health.seconds, health.probe, now)
    changed = co.cluster.node_health(node, probe, here, co.jobs, now)
    for job_id in changed:
        co.touch(job_id, persist=True)
    if changed or (state.health.unhealthy, state.health.suspect) != before:
        co.cluster.index_allocations()
        co.bump(node)
        co.replan()  # jobs that gave it up may grow elsewhere, or back here
        co.flush()


def evict_straggler(co: "Coordinator", ms: Membership, report: dict[str, Any], now: float) -> None:
    """A straggler of a job whose policy is ``evict``: its replica leaves at a step
    boundary and a free slot elsewhere replaces it at once (:meth:`ClusterState.evict`)."""
    wid, node = report["worker"], report.get("node")
    reason = f"straggler: {wid} at {report.get('ratio', 0):.2f}x the median since step {report.get('since_step', 0)}"
    where = co.cluster.evict(ms.spec.job_id, ms, wid, reason, now)
    if node is not None:
        co.bump(node)  # its worker's view says leave; its agent probes
    for n in where or {}:
        co.bump(n)  # start orders for the replacement
    co.touch(ms.spec.job_id, persist=True)


def evict_node(co: "Coordinator", node: str, reason: str, now: float) -> None:
    """Its workers are gone for the coordinator (their jobs recover as from a crash); its
    agent is told to kill any that still run."""
    for ms, w in list(co.workers.live_on(node)):
        ms.evict(w.id, reason, now)
        co.nodes.kill(node, w.id)
        co.touch(ms.spec.job_id)
    co.bump(node)
