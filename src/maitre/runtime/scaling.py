"""Scaling rules: what the global batch and the learning rate are at a given world size.

``ConstantBatch`` (the default) keeps the global batch fixed whatever the world size: each rank
takes ``global_batch / world`` samples (micro-batched when that exceeds the micro-batch size), the
update is the mean over the same global batch, and the run follows the trajectory of a fixed-size
run up to floating-point summation order.

``LinearScaling`` and ``SqrtScaling`` are for throughput-first jobs: each rank keeps its own batch,
so the global batch grows with the world, and the learning rate is scaled by ``world / base_world``
(Goyal et al., 2017) or its square root (Krizhevsky, 2014). After every resize the factor moves
from its old to its new value linearly over ``warmup_steps`` steps, which avoids the loss spike of
an abrupt jump. A global batch larger than the data set is refused before the first step; one
that grows past it later (the world grew) takes the rest of the data epoch as its step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class ConstantBatch:
    """Same global batch and learning rate at every world size (the default)."""

    def global_batch_size(self, base: int, world_size: int) -> int:
        return base

    def on_resize(self, world_size: int, step: int) -> None:
        pass

    def lr_factor(self, step: int) -> float:
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"rule": "constant"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rule") != "constant":
            raise ValueError(f"scaling state is for rule {state.get('rule')!r}, not 'constant'")


@dataclass(kw_only=True, slots=True)
class _PerRankBatch:
    per_rank_batch_size: int
    """Samples per rank per step; the global batch is this times the world size."""
    base_world_size: int
    """The world size at which the optimizer's learning rate is the intended one."""
    warmup_steps: int = 100
    """Steps over which the factor moves to its new value after a resize."""
    _from: float = 1.0
    _to: float = 1.0
    _since: int = 0
    rule = "per-rank"

    def __post_init__(self) -> None:
        if self.per_rank_batch_size < 1 or self.base_world_size < 1 or self.warmup_steps < 0:
            raise ValueError("per_rank_batch_size and base_world_size must be >= 1, warmup_steps >= 0")

    def scale(self, ratio: float) -> float:
        raise NotImplementedError

    def global_batch_size(self, base: int, world_size: int) -> int:
        return self.per_rank_batch_size * world_size

    def on_resize(self, world_size: int, step: int) -> None:
        target = self.scale(world_size / self.base_world_size)
        if target != self._to:
            self._from, self._to, self._since = self.lr_factor(step), target, step

    def lr_factor(self, step: int) -> float:
        if self.warmup_steps == 0 or step - self._since >= self.warmup_steps:
            return self._to
        frac = (step - self._since) / self.warmup_steps
        return self._from + (self._to - self._from) * frac

    def state_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "from": self._from, "to": self._to, "since": self._since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rule") != self.rule:
            raise ValueError(f"scaling state is for rule {state.get('rule')!r}, not {self.rule!r}")
        self._from, self._to, self._since = float(state["from"]), float(state["to"]), int(state["since"])


class LinearScaling(_PerRankBatch):
    """Learning rate proportional to the world size, with warm-up after each resize."""

    rule = "linear"

    def scale(self, ratio: float) -> float:
        return ratio


class SqrtScaling(_PerRankBatch):
    """Learning rate proportional to the square root of the world size, with warm-up."""

    rule = "sqrt"

    def scale(self, ratio: float) -> float:
        return math.sqrt(ratio)
