"""Spot reclaims in the live cluster: a node with a notice is drained, then reclaimed.

A node's agent hears a spot notice (:mod:`maitre.agent.notices`) and sends it with its beats
(:class:`maitre.protocol.SpotNotice`). From the first one the node is *draining*: the scheduling
pass no longer sees it (nothing new is placed there), every job is given its allocation there
back, and the job's workers on the node leave gracefully at their next step boundary, the way a
shrink's leavers do. Where that would leave a job below its minimum, or with no live member
holding its state (every member that trained is on the node), the job is suspended instead: its
members checkpoint after the current step and stop, within the notice, and the scheduler admits
it again elsewhere (it resumes from that checkpoint). When the node goes (its agent falls silent,
or the deadline passes) it is *reclaimed*: counted as such, never as a node failure or a job
failure (a worker still there is lost like any other, which a drain in time avoids). A notice
may bring the deadline forward, never back: an agent that stops while its notice stands sends
a last one with no time left, and the node is reclaimed at the next pass.

Events (the coordinator's log): ``spot_notice`` {node, notice_s, deadline, source},
``node_drained`` {node, workers (those that left gracefully), seconds (from the notice to the
last one gone)}, ``node_reclaimed`` {node}; each job's part is a ``shrink`` or ``suspend`` with
the notice as its reason (``drain_blocked`` when neither is possible: a job below its minimum
without a checkpoint directory).

Pure logic, like :class:`maitre.control.cluster.ClusterState`, which calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

from maitre.control.membership import LIVE, Membership, Worker, WorkerState

if TYPE_CHECKING:
    from maitre.control.job import ManagedJob


@dataclass(slots=True)
class Reclaim:
    """A node's notice and what became of it."""

    noticed_at: float
    deadline: float
    """Coordinator time when the node goes."""
    source: str
    action: str = "terminate"
    workers: list[Worker] = field(default_factory=list)
    """The live workers on the node when the notice came."""
    drained_at: float | None = None
    reclaimed_at: float | None = None

    def drained(self) -> bool:
        """Every worker that was on the node has stopped (its exit is in)."""
        return all(w.ended_at is not None or (w.state not in LIVE and w.exit_code is not None) for w in self.workers)

    def left_gracefully(self) -> list[str]:
        return [w.id for w in self.workers if w.state in (WorkerState.LEFT, WorkerState.DONE)]


class Decision(NamedTuple):
    kind: Literal["leave", "suspend", "blocked", "none"]
    placement: dict[str, int]
    """The job's allocation without the node."""
    leave: list[str]
    """Its workers on the node (they leave at the next step boundary)."""
    reason: str


def decide(m: "ManagedJob", ms: Membership | None, node: str, reason: str | None = None) -> Decision:
    """What one job does about a notice on ``node`` (see the module docstring), or about
    another reason to vacate it (a failed health probe: :mod:`maitre.control.health`)."""
    placement = {n: r for n, r in m.job.placement.items() if n != node}
    reason = reason or f"spot notice on {node}"
    if ms is None or ms.over:
        return Decision("none", placement, [], reason)
    here = [w for w in ms.live_workers() if w.node == node]
    if not here and node not in m.job.placement:
        return Decision("none", placement, [], reason)
    leave = [w.id for w in here if w.state != WorkerState.LEAVING]
    if ms.suspending:  # checkpointing already: its members stop anyway
        return Decision("none", placement, leave, reason)
    target = sum(placement.values())
    trained = max((ms.workers[w].step for w in ms.members), default=0) > 0
    holders = [w for w in ms.live_workers() if w.node != node and w.state == WorkerState.ACTIVE]
    if target >= ms.spec.min_workers and (holders or not trained):
        return Decision("leave", placement, leave, reason)
    if m.manifest.checkpoint_dir:
        why = (
            "its only live state is there"
            if target >= ms.spec.min_workers
            else f"it would be left below its minimum of {ms.spec.min_workers}"
        )
        return Decision("suspend", placement, leave, f"{reason}: {why}; it checkpoints first")
    if target >= ms.spec.min_workers:  # no checkpoint to keep its state: it starts again
        return Decision("leave", placement, leave, reason + " (no checkpointDir: its state is lost)")
    return Decision(
        "blocked",
        placement,
        [],
        f"{reason}: below its minimum of {ms.spec.min_workers} and no checkpointDir to suspend to",
    )
