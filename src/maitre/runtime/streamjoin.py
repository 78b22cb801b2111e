"""A streamed join (``MAITRE_JOIN=stream``), as one member of an epoch sees it.

An epoch that opens with members behind (joiners, or members that lost their state) does not
wait for them. The members at the highest step train on at once, ranked among themselves; the
others *listen*: listener ``i`` gets the committed state from the ``i``-th member ahead (round
robin, so the sources spread over the members), streamed in the background on a pair group of
its own (:mod:`maitre.runtime.transfer`). Meanwhile a listener takes part in every step's
reduction with no samples, and keeps each step's reduced gradients and control slots; once its
snapshot has landed it replays them, then applies each step as it comes. When every listener is
caught up (the control slots' READY count says so, on every member alike), all are promoted
together: from the next step every member trains, on the epoch's group as it is (no rebuild),
ranked in :attr:`StreamJoin.order` (the training members first, as they were, so the checkpoint's
writer stays the same).

This module keeps who listens, who sends, what was heard and when all are caught up; the loop
(:class:`~maitre.runtime.loop.ElasticLoop`) applies the state and the steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from maitre.runtime.group import EpochLost
from maitre.runtime.transfer import Receiver, Sender


@dataclass(slots=True)
class Listening:
    """This member is behind in its epoch: it hears every step while its snapshot streams in."""

    receiver: Receiver
    snapshot_step: int
    """The committed step of the snapshot (the training members' step as the epoch opened)."""
    queue: deque[tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=deque)
    """The reduced gradients and control slots of each step heard and not yet replayed."""
    loaded: bool = False
    state_bytes: int = 0
    replayed: int = 0
    started: float = field(default_factory=time.monotonic)
    """When it began to listen (``time.monotonic()``)."""
    interval: float = 0.0
    """Seconds between its last two steps heard (the training members' step time)."""

    @property
    def caught_up(self) -> bool:
        return self.loaded and not self.queue

    def hear(self, grads: list[torch.Tensor], control: torch.Tensor) -> None:
        """Keep a step's reduced gradients and control slots, to replay once the state lands
        (copies: the buffers are the next step's)."""
        self.queue.append(([g.clone() for g in grads], control.clone()))

    def landed(self) -> bool:
        """Whether the snapshot is here (raises :class:`EpochLost` when its transfer failed)."""
        rec = self.receiver
        if rec.done.is_set() and rec.result is None:
            raise EpochLost(f"the state transfer failed: {rec.error}", time.monotonic())
        return rec.done.is_set()

    def take(self) -> tuple[Any, list[torch.Tensor]]:
        """The landed snapshot (its tree's description and flat buffers), once."""
        assert self.receiver.result is not None
        meta, flats, self.state_bytes = self.receiver.result
        self.receiver.result = None
        return meta, flats

    def heard_upto(self, step: int) -> int:
        """The step this listener would be at with everything heard applied (``step``: its
        committed one, once loaded)."""
        return (step if self.loaded else self.snapshot_step) + len(self.queue)

    def caught_up_report(self, epoch: int, rank: int, world_size: int, step: int) -> dict[str, Any]:
        return {
            "kind": "caught_up",
            "epoch": epoch,
            "rank": rank,
            "world_size": world_size,
            "step": step,
            "listened_s": time.monotonic() - self.started,
            "state_bytes": self.state_bytes,
            "replayed": self.replayed,
            "transfer_s": self.receiver.seconds,
        }


class StreamJoin:
    """This epoch's streamed join, as this member sees it (see the module docstring)."""

    def __init__(self) -> None:
        self.listeners: tuple[int, ...] = ()
        """This epoch's members that are catching up (group ranks), while they do."""
        self.order: list[int] = []
        """Group ranks in the order of their data ranks once every listener trains."""
        self.listening: Listening | None = None
        """This member is one of them."""
        self.senders: list[Sender] = []
        """Snapshots streamed from this member (they outlive the epoch that began them)."""

    def reset(self) -> None:
        """A new epoch decides again."""
        self.listeners, self.listening = (), None

    def plan(self, steps: list[int], ahead: int) -> list[int]:
        """Each member's committed step (by group rank) -> the training members (group ranks);
        the others listen."""
        training = [r for r, s in enumerate(steps) if s == ahead]
        self.listeners = tuple(r for r, s in enumerate(steps) if s != ahead)
        self.order = training + list(self.listeners)
        return training

    def source_of(self, me: int, training: list[int]) -> int | None:
        """The member that streams this one its state (None: it trains)."""
        if me not in self.listeners:
            return None
        return training[self.listeners.index(me) % len(training)]

    def listeners_of(self, me: int, training: list[int]) -> list[int]:
        """The listeners this training member streams to."""
        return [listener for i, listener in enumerate(self.listeners) if training[i % len(training)] == me]

    def ready_quorum(self, nproc: int) -> float:
        """The READY total at which every listener is caught up (none: never)."""
        if not self.listeners:
            return float("inf")
        return float(len(self.listeners) * nproc)

    def promote(self, group_rank: int) -> tuple[int, Listening | None]:
        """Every listener is caught up: this member's data rank from the next step, and its
        listening (None: it was training)."""
        listening, self.listeners, self.listening = self.listening, (), None
        return self.order.index(group_rank), listening

    def await_snapshots(self) -> None:
        """Wait until every snapshot being streamed from here no longer reads the live state."""
        for sender in self.senders:
            sender.copied.wait()
        self.senders = [s for s in self.senders if not s.done.is_set()]
