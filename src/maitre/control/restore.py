"""A coordinator carries on from its store: nodes, queues, jobs and their memberships, the
suspect nodes (called once, by the :class:`~maitre.control.coordinator.Coordinator` that opens
the store)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maitre.control.health import Suspect
from maitre.control.job import ManagedJob
from maitre.control.membership import WorkerState
from maitre.control.restarts import run_from_json
from maitre.scheduling.spec import manifest_from_record

if TYPE_CHECKING:
    from maitre.control.coordinator import Coordinator


def restore(co: "Coordinator") -> None:
    """Carry on from the store: nodes, queues, jobs and their memberships."""
    assert co.db is not None
    now = co.clock()
    cluster = co.cluster
    stored = co.db.cluster()
    for q in stored.queues.values():
        cluster.queues.setdefault(q.name, q)
    for q in cluster.queues.values():
        co.db.put_queue(q)
    for node in stored.nodes.values():
        cluster.node_beat(node, now)
        co.nodes.restored(node.name, node.slots, now)
    for job, extra in co.db.jobs():
        managed = ManagedJob.from_record(manifest_from_record(extra["manifest"]), job, extra)
        managed.history = [run_from_json(h, co.cfg, now) for h in extra["history"]]
        for h in managed.history:
            co.tokens[h.spec.token] = h  # its workers may still report their exits
            co.workers.remember(h)
        cluster.managed[job.id] = managed
        if extra["membership"] is not None:
            ms = run_from_json(extra["membership"], co.cfg, now, job)
            managed.seen_trained = {w.id: w.trained_s for w in ms.workers.values()}
            co.install(ms)
            for w in ms.workers.values():  # their orders may never have reached an agent
                if w.state == WorkerState.STARTING:
                    co.nodes.sent(w.node, co.orders.order(ms, w), now)
    restore_suspects(co, now)
    usage = co.db.meta("usage")
    if usage:
        cluster.usage.restore(usage)
    if cluster.managed or cluster.nodes:
        cluster.log(now, "coordinator_restarted", jobs=len(cluster.managed), nodes=len(cluster.nodes))


def restore_suspects(co: "Coordinator", now: float) -> None:
    """Suspect nodes stay suspect across a restart: the event log's last ``node_suspect``
    of each node that no ``node_cleared`` followed, while its cool-down lasts (a node's
    probes ride its beats, so its health comes back with its next one)."""
    assert co.db is not None
    standing: dict[str, dict[str, Any]] = {}
    for e in co.db.events(kinds=("node_suspect", "node_cleared")):
        if e["kind"] == "node_suspect":
            standing[e["node"]] = e
        else:
            standing.pop(e["node"], None)
    for node, e in standing.items():
        state = co.cluster.nodes.get(node)
        if state is not None and e["until"] > now:
            state.health.suspect = Suspect(
                e["reason"], e["t"], e["until"], int(e.get("probe", 0)), e.get("job", ""), e.get("worker", "")
            )
