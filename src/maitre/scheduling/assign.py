"""Who goes where, below the policy's placements: pure functions that the coordinator and the
simulator both call.

* :func:`repair`: a running gang that lost replicas below its minimum (with a node) gets them
  back on free slots, before the policy runs; the policy never preempts for a repair.
* :func:`leavers`: which replicas leave when a job gives up slots on a node.
* :func:`free_slot`: which slot of its node a starting worker takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from maitre.scheduling.model import Cluster, Job
from maitre.scheduling.policy import FreeSlots, place


def repair(cluster: Cluster, jobs: list[Job]) -> list[Job]:
    """Give each running job below its minimum the replicas it is short of, on slots no job
    holds (its old nodes first), higher priority and then earlier jobs first; a job that does not
    fit waits. Changes the repaired jobs' ``placement`` and returns them."""
    short = [j for j in jobs if j.state.placed and j.replicas < j.min_replicas]
    if not short:
        return []
    used: dict[str, int] = {}
    for j in jobs:
        for n, r in j.placement.items():
            used[n] = used.get(n, 0) + r * j.slots_per_replica
    free = FreeSlots(cluster, used)
    repaired = []
    for j in sorted(short, key=lambda j: (-j.priority, j.submitted_at)):
        where = place(j, j.min_replicas - j.replicas, free, prefer=j.placement)
        if where is None:
            continue
        free.take(where, j.slots_per_replica)
        for n, r in where.items():
            j.placement[n] = j.placement.get(n, 0) + r
        repaired.append(j)
    return repaired


@dataclass(frozen=True, slots=True)
class Replica:
    """What :func:`leavers` needs of a live worker."""

    id: str
    node: str
    member: bool
    """In the current epoch (holding the job's state), not a joiner that has not trained yet."""
    rank: int | None


def leavers(replicas: Iterable[Replica], old: dict[str, int], new: dict[str, int]) -> list[str]:
    """The replicas that leave when a job's placement goes from ``old`` to ``new`` (replicas
    per node): on each node that loses some, joiners first (they hold nothing yet), then the
    highest ranks (rank 0 is the one every peer knows)."""
    by_node: dict[str, list[Replica]] = {}
    for r in replicas:
        by_node.setdefault(r.node, []).append(r)
    out: list[str] = []
    for node, count in old.items():
        drop = count - new.get(node, 0)
        if drop <= 0:
            continue
        here = sorted(by_node.get(node, []), key=lambda r: (r.member, -(-1 if r.rank is None else r.rank)))
        out += [r.id for r in here[:drop]]
    return out


def free_slot(used: set[int], slots: int, per_worker: int) -> int | None:
    """The first slot of a node of ``slots`` from which ``per_worker`` consecutive slots are all
    free (a worker of several GPUs holds a contiguous run of them), or None."""
    return next((s for s in range(0, slots - per_worker + 1) if not used.intersection(range(s, s + per_worker))), None)
