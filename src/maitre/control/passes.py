"""A scheduling pass, in two halves under the coordinator's lock: :func:`begin` (dead nodes
evicted, the jobs brought up to date, what the policy will see) and :func:`end` (the plan carried
out, the accounting). The policy itself (:func:`maitre.scheduling.policy.schedule`) runs between
them with the lock free (:meth:`Coordinator.tick`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maitre.control import accounting, nodenews

if TYPE_CHECKING:
    from maitre.control.coordinator import Coordinator


def begin(co: "Coordinator", now: float) -> tuple[Any, list[Any], dict[str, tuple[Any, ...]], tuple[Any, ...]]:
    """A pass, under the lock: dead nodes, the jobs brought up to date, what the policy
    will see (and the fingerprint it is made on)."""
    cluster = co.cluster
    for node in cluster.detect_dead_nodes(now):
        nodenews.evict_node(
            co,
            node,
            f"node {node} was reclaimed (spot notice)"
            if cluster.nodes[node].draining
            else f"node {node} is dead (no agent heartbeat)",
            now,
        )
    for node in cluster.cool_suspects(now):
        co.bump(node)
    synced = {m.id: m.record_key() for m in cluster.managed.values()}
    cluster.sync(co.jobs, now)
    placed = {m.id: dict(m.job.placement) for m in cluster.managed.values()}
    view, jobs = cluster.prepare(now)
    for m in cluster.managed.values():
        if m.job.placement != placed.get(m.id):  # repaired: its agents start workers
            for node in m.job.placement:
                co.bump(node)
        if m.record_key() != synced.get(m.id):  # (a suspension or an end acted on, a repair)
            co.touch(m.id, persist=True)
    cluster.index_allocations()
    before = {m.id: m.record_key() for m in cluster.managed.values()}
    return view, jobs, before, cluster.fingerprint()


def end(co: "Coordinator", plan: Any, before: dict[str, tuple[Any, ...]], now: float) -> None:
    """The plan carried out, under the lock, and the accounting (``before``: each job's
    :meth:`ManagedJob.record_key` as the plan was made)."""
    cluster = co.cluster
    placed = {m.id: dict(m.job.placement) for m in cluster.managed.values()}
    for kind, _, membership in cluster.apply(plan, co.jobs, now):
        if kind == "start":
            co.install(membership)
    for m in cluster.managed.values():
        if m.id in co.jobs and m.incarnation:
            m.started(co.jobs[m.id])
        if m.job.placement != placed.get(m.id):
            for node in set(m.job.placement) | set(placed.get(m.id, {})):
                co.bump(node)  # start orders (or a shrink) for its agent
        if m.record_key() != before.get(m.id):
            co.touch(m.id, persist=True)
        else:
            co.touch(m.id)  # sync and the plan may have moved its membership
    for action in plan.actions:
        co.touch(action.job, persist=True)
    cluster.index_allocations()
    accounting.tick_usage(cluster, co.jobs, now)
