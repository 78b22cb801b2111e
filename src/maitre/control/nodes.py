"""The coordinator's node registry: every node whose agent beat, and its orders' versions.

An agent's beat tells its node's slots and labels, its own process id (a new one is a
restarted agent, whose workers went with the one before) and the workers it runs. The
registry keeps that per node (:class:`NodeEntry`) and counts the node's *orders version*: it
moves (:meth:`NodeRegistry.bump`) whenever something the node's agent must hear changed (a
worker to start or kill, a view of one of its workers), and a watch answers as soon as it
does. Versions count from 0 in each coordinator process (``boot`` names it in every answer).

The cluster's own view of a node (alive, draining, its health and detector) is
:class:`maitre.control.cluster.NodeState`; this is what the beats carried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from maitre.protocol import StartOrder


@dataclass(slots=True)
class NodeEntry:
    """A node as its agent's beats told it."""

    slots: int
    registered_at: float
    last_heartbeat: float
    labels: dict[str, str] = field(default_factory=dict)
    agent: str | None = None
    """The agent process's id (None: not heard since this coordinator started)."""
    running: set[str] = field(default_factory=set)
    """The workers its last beat listed."""
    beat_at: float = 0.0
    """When that beat came (0: none since this coordinator started)."""


class NodeRegistry:
    """Nodes by name, with their orders' versions (called under the coordinator's lock)."""

    def __init__(self) -> None:
        self._entries: dict[str, NodeEntry] = {}
        self._version = 0
        self._versions: dict[str, int] = {}
        self._woken: set[str] = set()
        self._kills: dict[str, set[str]] = {}
        self._unacked: dict[str, dict[str, tuple[StartOrder, float]]] = {}

    def beat(self, node: str, slots: int, labels: dict[str, str], now: float) -> NodeEntry:
        """A beat of ``node``'s agent came (the first one registers it)."""
        entry = self._entries.get(node)
        if entry is None:
            entry = self._entries[node] = NodeEntry(slots, registered_at=now, last_heartbeat=now)
        entry.slots, entry.last_heartbeat, entry.labels = slots, now, labels
        return entry

    def restored(self, node: str, slots: int, now: float) -> None:
        """A node the store knew, as if it beat now (its agent's next beat says the rest)."""
        self._entries[node] = NodeEntry(slots, registered_at=now, last_heartbeat=now)

    def agent_restarted(self, entry: NodeEntry, agent: str) -> bool:
        """Whether a beat from ``agent`` comes from another agent process than the node's last
        one (not after a coordinator's restart, which knows none yet)."""
        before, entry.agent = entry.agent, agent
        return bool(agent) and bool(before) and before != agent

    def listed(self, entry: NodeEntry, running: set[str], now: float) -> None:
        """The workers its beat listed."""
        entry.running, entry.beat_at = running, now

    # -- orders' versions --------------------------------------------------------------------------
    def bump(self, node: str) -> None:
        """The node's orders changed: its watch answers."""
        self._version += 1
        self._versions[node] = self._version
        self._woken.add(node)

    def version(self, node: str) -> int:
        return self._versions.get(node, 0)

    def woken(self) -> bool:
        return bool(self._woken)

    def take_woken(self) -> set[str]:
        """The nodes bumped since the last call."""
        woken, self._woken = self._woken, set()
        return woken

    # -- what its agent must still hear -------------------------------------------------------------
    def kill(self, node: str, worker: str) -> None:
        """The node's agent must kill ``worker`` (its next orders say so)."""
        self._kills.setdefault(node, set()).add(worker)

    def take_kills(self, node: str) -> set[str]:
        return self._kills.pop(node, set())

    def sent(self, node: str, order: StartOrder, now: float) -> None:
        """A start order went to the node's agent at ``now``: it is sent again until a beat
        lists the worker (an answer can be lost: its agent died with a watch pending, a link
        dropped it)."""
        self._unacked.setdefault(node, {})[order.worker_id] = (order, now)

    def unacked(self, node: str) -> list[tuple[StartOrder, float]]:
        """The node's start orders no beat listed the worker of yet, with when each was last
        sent (a copy: :meth:`acked` drops one)."""
        return list(self._unacked.get(node, {}).values())

    def acked(self, node: str, wid: str) -> None:
        """``wid``'s start order needs no resending (its agent runs it, or it is past starting)."""
        self._unacked.get(node, {}).pop(wid, None)

    def forget_starts(self, node: str) -> None:
        """Orders for an agent that is gone (a restarted one's workers went with it)."""
        self._unacked.pop(node, None)

    # -- reading -----------------------------------------------------------------------------------
    def __contains__(self, node: object) -> bool:
        return node in self._entries

    def __getitem__(self, node: str) -> NodeEntry:
        return self._entries[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, NodeEntry]]:
        return list(self._entries.items())
