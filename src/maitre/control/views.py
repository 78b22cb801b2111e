"""The read models: what ``maitre status``, the API's job, node and queue routes and the demo
read of the coordinator, built from its state (the caller holds its lock).

Each is the dict of one reply model of :mod:`maitre.protocol` (:class:`~maitre.protocol.JobStatus`,
:class:`~maitre.protocol.JobSummary`, :class:`~maitre.protocol.NodeSummary`,
:class:`~maitre.protocol.QueueSummary`); the API validates it against that model on its way out.
Reading changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maitre.control.membership import LIVE
from maitre.scheduling.lifecycle import JobState

if TYPE_CHECKING:
    from maitre.control.cluster import ClusterState, NodeState
    from maitre.control.coordinator import Coordinator

_NOT_STARTED = {
    # a job the scheduler has not admitted yet: no run, no workers
    "epoch": 0,
    "epoch_open": False,
    "members": [],
    "step": 0,
    "failures": 0,
    "failure": None,
    "workers": [],
    "target": 0,
    "min_workers": 0,
    "max_workers": 0,
    "spares": [],
}


def job_status(co: Coordinator, job_id: str) -> dict[str, Any]:
    """One job, with its run's events and its workers' reports (``maitre status JOB``)."""
    if job_id in co.cluster.managed and job_id not in co.jobs:  # never admitted yet
        return {**_NOT_STARTED, **_managed(co.cluster, job_id), "events": [], "reports": []}
    run = co.job(job_id)
    return {
        **run.summary(),
        **_managed(co.cluster, job_id),
        "events": list(run.events),
        "reports": list(co.reports[job_id]),
        "progress": co.progress.get(job_id),
    }


def job_list(co: Coordinator) -> list[dict[str, Any]]:
    """Every job: the running ones first, then the ones never admitted."""
    ids = list(co.jobs) + [j for j in co.cluster.managed if j not in co.jobs]
    return [{**(co.jobs[j].summary() if j in co.jobs else _NOT_STARTED), **_managed(co.cluster, j)} for j in ids]


def _managed(cluster: ClusterState, job_id: str) -> dict[str, Any]:
    """The scheduler's side of a job."""
    m = cluster.managed.get(job_id)
    if m is None:
        return {}
    return {
        "job_id": m.id,
        "state": m.job.state.value,
        "queue": m.job.queue,
        "spares_wanted": m.manifest.spares,
        "priority": m.job.priority,
        "min_workers": m.job.min_replicas,
        "max_workers": m.job.max_replicas,
        "placement": dict(m.job.placement),
        "incarnation": m.incarnation,
        "held": m.held,
        "waiting_for": m.last_waiting if m.job.state == JobState.PENDING else "",
        "throughput": {str(k): round(v, 3) for k, v in sorted(m.job.throughput.items())},
        "origin": m.manifest.origin,
    }


def nodes(co: Coordinator) -> list[dict[str, Any]]:
    """Every node that beat: its slots, labels, life, price, workers and health."""
    now = co.clock()
    out = []
    for name, entry in sorted(co.nodes.items()):
        held = [wid for wid in sorted(co.on_node(name)) if co.worker_job(wid).workers[wid].state in LIVE]
        state = co.cluster.nodes.get(name)
        out.append(
            {
                "node": name,
                "slots": entry.slots,
                "labels": entry.labels,
                "alive": True if state is None else state.alive,
                "price": co.cluster.node_price(name),
                "draining": state is not None and state.draining,
                "reclaimed": state is not None and state.reclaim is not None and state.reclaim.reclaimed_at is not None,
                "phi": None if state is None else round(min(state.detector.phi(now), 1e6), 2),
                "used": sum(co.worker_job(w).workers[w].slots for w in held),
                "workers": held,
                "last_heartbeat_s": round(now - entry.last_heartbeat, 2),
                **_health(state, now),
            }
        )
    return out


def _health(state: NodeState | None, now: float) -> dict[str, Any]:
    """A node's health: its latest probe, and a suspicion."""
    if state is None:
        return {}
    h = state.health
    probe = (
        None
        if h.probe is None
        else {
            "ok": h.probe.ok,
            "detail": h.probe.detail,
            "seconds": h.probe.seconds,
            "probe": h.probe.probe,
            "age_s": round(max(0.0, now - h.probe.heard_at), 2),
        }
    )
    suspect = None if h.suspect is None else {"reason": h.suspect.reason, "until": round(h.suspect.until, 4)}
    return {"health": probe, "unhealthy": h.unhealthy, "suspect": suspect}


def queues(cluster: ClusterState) -> list[dict[str, Any]]:
    """Every queue: its quota and what its jobs hold now."""
    usage: dict[str, int] = {}
    jobs: dict[str, int] = {}
    for m in cluster.managed.values():
        if not m.job.state.ended:
            usage[m.job.queue] = usage.get(m.job.queue, 0) + m.job.slots
            jobs[m.job.queue] = jobs.get(m.job.queue, 0) + 1
    return [
        {
            "queue": q.name,
            "guaranteed": q.guaranteed,
            "borrowing_limit": q.borrowing_limit,
            "weight": q.weight,
            "allocated": usage.get(q.name, 0),
            "jobs": jobs.get(q.name, 0),
        }
        for q in cluster.queues.values()
    ]
