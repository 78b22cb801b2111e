"""A job's replicas as units the cluster's own scheduler places: what to add and what to remove.

Slurm's replica jobs (:mod:`maitre.engines.slurm`) and Kubernetes' replica pods
(:mod:`maitre.engines.kubernetes.pods`) are one idea: each unit asks the cluster's scheduler for
one replica's node (or GPUs), runs one ``maitre agent`` there that takes that job's workers only
(``reserved_for``), and goes when the job no longer needs it. :func:`plan` is the rule both
follow, level-triggered, from what the coordinator and the cluster report:

- a job that has not ended has a unit for each of its first ``minReplicas`` indices (the
  cluster queues them until it has room: the gang waits there, not in maitre), never more
  units than ``maxReplicas`` (a minimum unit removed on a scale-down, its replica training on a
  surplus one, is not asked for again: that would be removed again, and so on);
- its surplus, up to ``maxReplicas``, is asked for as ``surplus`` allows (Slurm: one per idle
  node of the scavenger partition; Kubernetes: one at a time), and never while a surplus unit
  is still waiting: a unit that stays pending is capacity the cluster does not have;
- a job with more units than ``maxReplicas`` (``maitre scale``) loses its pending ones first,
  then those whose node runs none of its workers: the coordinator shrinks first, at a step
  boundary (giving up ``spot``-labelled nodes, the surplus, first), and only then is the unit
  removed; a unit already going (deleted, draining) keeps its index and counts for nothing;
- an ended job's units, and those of a job the coordinator does not know, are removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

ENDED = ("COMPLETED", "FAILED", "CANCELLED")


@dataclass(frozen=True, slots=True)
class Unit:
    """One replica's unit as the cluster reports it."""

    id: str
    """What the cluster removes it by (a Slurm job id, a pod's name)."""
    job: str
    index: int
    pending: bool
    """Waiting for the cluster's scheduler (no node yet)."""
    node: str
    """The maitre node its agent registers ('' while pending)."""
    going: bool = False
    """Being deleted already (its agent drains): it keeps its index until it is gone."""


@dataclass(frozen=True, slots=True)
class Add:
    job: str
    index: int
    surplus: bool
    """Beyond the job's minimum: preemptible capacity (the scavenger partition, a lower
    PriorityClass)."""


@dataclass(slots=True)
class Changes:
    add: list[Add] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


def plan(
    jobs: Iterable[dict[str, Any]],
    nodes: dict[str, list[str]],
    have: Iterable[Unit],
    *,
    surplus: int,
    surplus_per_job: int | None = None,
) -> Changes:
    """What to add and remove. ``jobs``: the coordinator's job summaries (``job_id``, ``state``,
    ``min_workers``, ``max_workers``, ``workers``); ``nodes``: each live maitre node's workers;
    ``have``: the units the cluster has; ``surplus``: how many surplus units may be asked for
    in all; ``surplus_per_job``: and at most this many per job per pass (None: no bound)."""
    out = Changes()
    by_job: dict[str, list[Unit]] = {}
    for u in have:
        by_job.setdefault(u.job, []).append(u)
    live = {j["job_id"]: j for j in jobs if j["state"] not in ENDED}
    for job_id, mine in sorted(by_job.items()):
        if job_id not in live:
            out.remove.extend(u.id for u in mine)
    for job_id, job in sorted(live.items()):
        every = by_job.get(job_id, [])
        indices = {u.index for u in every}
        mine = [u for u in every if not u.going]
        lo, hi = job["min_workers"], job["max_workers"]
        missing = [i for i in range(lo) if i not in indices][: max(0, hi - len(every))]
        out.add.extend(Add(job_id, i, False) for i in missing)
        extra = len(mine) - hi
        if extra > 0:  # scaled down: pending first, then nodes the coordinator already left
            workers = {w["id"] for w in job.get("workers", [])}
            for u in sorted(mine, key=lambda u: (not u.pending, u.index < lo, -u.index)):
                if extra <= 0:
                    break
                if u.pending or not workers & set(nodes.get(u.node, [])):
                    out.remove.append(u.id)
                    extra -= 1
            continue
        if any(u.pending and u.index >= lo for u in mine):
            continue
        asked = 0
        for i in range(lo, hi):
            if surplus <= 0 or (surplus_per_job is not None and asked >= surplus_per_job):
                break
            if i not in indices:
                out.add.append(Add(job_id, i, True))
                surplus -= 1
                asked += 1
    return out
