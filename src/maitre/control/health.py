"""Sick nodes in the live cluster: what the coordinator knows of each node's health, and which
nodes the scheduler avoids.

Two ways a node falls out of favour:

- **Unhealthy**: its agent's health probe failed (:mod:`maitre.agent.health`; the result rides
  every beat as :class:`maitre.protocol.NodeHealth`). The node is drained the way a spot notice
  drains it (:func:`maitre.control.drain.decide`: its workers leave at a step boundary, or their
  job checkpoints first when its only live state is there), the scheduling pass no longer sees
  it, and it gets no work until a probe passes.
- **Suspect**: a job whose manifest says ``stragglers: {policy: evict}`` had a straggler there;
  its replica left and took a free slot elsewhere. The scheduler places nothing new on the node
  (what other jobs hold there stays) until a probe *run after the suspicion* passes (the
  coordinator asks the agent for one: ``NodeOrders.probe``) or the job's ``cooldownSeconds`` end.

Events (the coordinator's log): ``node_health`` {node, ok, detail, seconds, probe} for each new
probe result; ``node_suspect`` {node, reason, until, job, worker}; ``node_cleared`` {node,
reason} when a suspicion ends. Each job's part of a drain is a ``shrink`` or ``suspend`` with
the failed probe as its reason; an eviction is an ``evict`` {job, worker, node, reason} and its
replacement a ``repair`` {job, placement, reason} (``replace_waiting`` with no free slot;
``evict_skipped`` where the job would be left below its minimum: the node is suspect all the
same).

Neither state is persisted: a restarted coordinator hears each node's latest probe with its
next beat, and forgets suspicions (the cool-down is a preference, not a safety property).

Pure logic, like :class:`maitre.control.cluster.ClusterState`, which holds one per node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Probe:
    """A node's latest health probe, as its agent said."""

    id: int
    ok: bool
    detail: str
    seconds: float
    probe: str
    heard_at: float


@dataclass(frozen=True, slots=True)
class Suspect:
    """Why and until when a node is avoided."""

    reason: str
    since: float
    until: float
    """Coordinator time when the cool-down ends."""
    after: int
    """The id of the node's latest probe when it became suspect: only a later one clears it."""
    job: str
    worker: str


@dataclass(slots=True)
class NodeHealth:
    """One node's health as the coordinator knows it."""

    probe: Probe | None = None
    suspect: Suspect | None = None

    @property
    def unhealthy(self) -> bool:
        return self.probe is not None and not self.probe.ok

    @property
    def wants_probe(self) -> bool:
        """Suspect, and no probe has come since: its agent is asked for one."""
        return self.suspect is not None and (self.probe is None or self.probe.id <= self.suspect.after)

    def heard(self, probe: Probe) -> tuple[bool, bool]:
        """A probe result. Returns (is it news, did it clear a suspicion)."""
        if self.probe is not None and probe.id == self.probe.id:
            return False, False
        self.probe = probe
        cleared = probe.ok and self.suspect is not None and probe.id > self.suspect.after
        if cleared:
            self.suspect = None
        return True, cleared

    def suspected(self, reason: str, now: float, cooldown_s: float, job: str, worker: str) -> Suspect:
        """Suspect from now (a suspicion already standing is extended, never shortened)."""
        until = now + cooldown_s
        if self.suspect is not None:
            until = max(until, self.suspect.until)
        self.suspect = Suspect(reason, now, until, self.probe.id if self.probe else 0, job, worker)
        return self.suspect

    def cooled(self, now: float) -> bool:
        """The suspicion's cool-down is over: it ends (True once)."""
        if self.suspect is not None and now >= self.suspect.until:
            self.suspect = None
            return True
        return False
