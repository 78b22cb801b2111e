"""A simulation's event log, in the live coordinator's shapes (:mod:`maitre.control.eventlog`).

``maitre simulate`` writes it as ``events-<policy>.jsonl``; ``maitre dashboard DIR`` replays it
with the same views as a live cluster's log, because the kinds and fields are the same: nodes
registered with their slots, labels and price; jobs submitted, admitted, grown and shrunk with
their placement (slots per node); each allocation a membership epoch; spot notices, reclaims and
failures. Time is the simulation's clock (seconds from its start).
"""

from __future__ import annotations

from typing import Any


def node_name(index: int) -> str:
    return f"n{index}"


class SimEvents:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._epochs: dict[str, int] = {}

    def add(self, t: float, kind: str, job: str | None = None, **body: Any) -> None:
        self.events.append({"seq": len(self.events) + 1, "t": round(t, 3), "job": job, "kind": kind, **body})

    def nodes(self, nodes: list[Any], prices: dict[str, float]) -> None:
        self.add(0.0, "prices", prices=prices)
        for n in nodes:
            self.node(0.0, n, "node_registered")

    def node(self, t: float, n: Any, kind: str) -> None:
        self.add(
            t,
            kind,
            node=node_name(n.index),
            slots=n.gpus,
            price=n.price,
            labels={"capacity_type": "spot" if n.spot else "on-demand"},
        )

    def placed(self, t: float, job: Any, old: list[int], new: list[int]) -> None:
        """A job's allocation changed from ``old`` to ``new`` (GPU -> node index lists)."""
        name = job.name
        placement: dict[str, int] = {}
        for i in new:
            placement[node_name(i)] = placement.get(node_name(i), 0) + 1
        if job.completed is not None and not new:
            self.add(t, "job_completed", name, placement={}, step=None, reason="")
            return
        if not new:
            self.add(t, "job_suspended", name, placement={})
            return
        kind = "admit" if not old else "grow" if len(new) > len(old) else "shrink" if len(new) < len(old) else "repair"
        self.add(t, kind, name, placement=placement, reason="policy")
        epoch = self._epochs.get(name, 0) + 1
        self._epochs[name] = epoch
        if old:
            self.add(t, "epoch_closed", name, epoch=epoch - 1, reason=kind)
        self.add(
            t,
            "epoch",
            name,
            epoch=epoch,
            members=[f"{name}-r{k}" for k in range(len(new))],
            reason=kind if old else "start",
        )
