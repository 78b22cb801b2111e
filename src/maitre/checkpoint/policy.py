"""When to checkpoint: the Young/Daly interval from the measured cost and the failure rate.

A checkpoint every ``tau`` seconds costs ``delta / tau`` of the run in saves, and each failure
loses on average ``tau / 2`` of work. Young (1974) minimised the sum to ``tau = sqrt(2 delta M)``
for a mean time between failures ``M``; Daly (2006) gave the higher-order optimum used here::

    tau = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta   (delta < 2M)
    tau = M                                                                         (otherwise)

``delta`` is measured, not assumed: the time a save blocked the step plus the time the steps ran
slower while the background writer used the CPU, smoothed over saves. ``M`` is the user's
``mtbf_s`` when given, otherwise estimated from the job's own history: with a prior of one
failure per ``prior_mtbf_s`` counted as one observation, ``M = (prior + age) / (1 + failures)``,
where the coordinator reports the job's age and failures. The interval is kept within
``[min_interval_s, max_interval_s]``; ``every_steps`` replaces all of this with a fixed count.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimal compute time between checkpoints (seconds)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


@dataclass(kw_only=True, slots=True)
class IntervalConfig:
    every_steps: int | None = None
    """Checkpoint every this many steps, whatever the cost and failure rate."""
    mtbf_s: float | None = None
    """The job's mean time between failures; None estimates it from the job's history."""
    prior_mtbf_s: float = 6 * 3600.0
    """The estimate before any failure is seen, weighted as one observation."""
    min_interval_s: float = 30.0
    max_interval_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.mtbf_s is not None and self.mtbf_s <= 0:
            raise ValueError(f"mtbf_s must be positive, got {self.mtbf_s}")
        if self.prior_mtbf_s <= 0:
            raise ValueError(f"prior_mtbf_s must be positive, got {self.prior_mtbf_s}")
        if not 0 <= self.min_interval_s <= self.max_interval_s:
            raise ValueError(
                f"need 0 <= min_interval_s ({self.min_interval_s}) <= max_interval_s ({self.max_interval_s})"
            )


class IntervalPolicy:
    """Decides, at each step boundary, whether this rank asks for a checkpoint."""

    def __init__(self, cfg: IntervalConfig, now: float) -> None:
        self.cfg = cfg
        self.cost_s: float | None = None
        self.failures = 0
        self.age_s = 0.0
        self._last_save_at = now
        self._last_save_step = 0
        self._steps: deque[float] = deque(maxlen=64)
        self._save_cost = 0.0
        self._saving = False

    # -- inputs ----------------------------------------------------------------------------------
    def observe_history(self, failures: int, age_s: float) -> None:
        self.failures, self.age_s = max(0, failures), max(0.0, age_s)

    def record_step(self, duration_s: float, writer_busy: bool) -> None:
        """A committed step's duration; while the writer runs, its excess counts as save cost."""
        if writer_busy and self._saving:
            if len(self._steps) >= 3:
                self._save_cost += max(0.0, duration_s - statistics.median(self._steps))
        else:
            self._steps.append(duration_s)

    def resumed(self, step: int, now: float) -> None:
        """The job continues from a checkpoint of ``step``: count the interval from here."""
        self._last_save_at, self._last_save_step = now, step

    def started(self, step: int, now: float, block_s: float) -> None:
        self._last_save_at, self._last_save_step = now, step
        self._save_cost, self._saving = block_s, True

    def finished(self) -> None:
        """The save is durable: fold its measured cost into the estimate."""
        if not self._saving:
            return
        self._saving = False
        c = self._save_cost
        self.cost_s = c if self.cost_s is None else 0.7 * self.cost_s + 0.3 * c

    # -- the decision ----------------------------------------------------------------------------
    def mtbf_s(self) -> float:
        if self.cfg.mtbf_s is not None:
            return self.cfg.mtbf_s
        return (self.cfg.prior_mtbf_s + self.age_s) / (1 + self.failures)

    def interval_s(self) -> float:
        if self.cost_s is None:  # nothing measured yet: the first save measures it
            return self.cfg.min_interval_s
        tau = daly_interval_s(self.cost_s, self.mtbf_s())
        return min(self.cfg.max_interval_s, max(self.cfg.min_interval_s, tau))

    def due(self, step: int, now: float) -> bool:
        if step <= self._last_save_step:
            return False
        if self.cfg.every_steps is not None:
            return step - self._last_save_step >= self.cfg.every_steps
        return now - self._last_save_at >= self.interval_s()
