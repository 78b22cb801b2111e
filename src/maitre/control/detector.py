"""The node failure detector: phi accrual (Hayashibara et al., 2004, as in Akka and Cassandra).

Instead of a fixed timeout, each node's detector learns the distribution of the gaps between
its agent's heartbeats and answers with a suspicion level::

    phi(t) = -log10(1 - F(t - last))       F: the normal CDF of the observed gaps

``phi = 1`` means the chance that a heartbeat is merely late is 10%, ``phi = 8`` one in 10^8. A
node on a loaded machine, whose heartbeats come irregularly, gets a longer timeout on its own;
a node that beats like a metronome is declared dead soon after it stops. ``acceptable_pause_s``
is added to the mean gap so that a pause the cluster expects (a garbage collection, a busy
host) is not a death, and ``min_std_s`` keeps a very regular node from being declared dead by
one slightly late beat.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class PhiConfig:
    threshold: float = 8.0
    """Suspicion at which a node is declared dead."""
    min_std_s: float = 0.5
    acceptable_pause_s: float = 3.0
    window: int = 200
    """Gaps remembered per node."""
    first_gap_s: float = 1.0
    """Assumed gap until ``min_samples`` were observed (with a standard deviation as large)."""
    min_samples: int = 5


class PhiAccrual:
    def __init__(self, cfg: PhiConfig, now: float) -> None:
        self.cfg = cfg
        self.last = now
        self.gaps: deque[float] = deque(maxlen=cfg.window)
        self._sum = self._sq = 0.0

    def heartbeat(self, now: float) -> None:
        gap = now - self.last
        self.last = now
        if gap <= 0:
            return
        if len(self.gaps) == self.gaps.maxlen:
            old = self.gaps[0]
            self._sum -= old
            self._sq -= old * old
        self.gaps.append(gap)
        self._sum += gap
        self._sq += gap * gap

    def phi(self, now: float) -> float:
        n = len(self.gaps)
        if n < self.cfg.min_samples:  # too few gaps to know the node's rhythm: be patient
            mean = var = self.cfg.first_gap_s
        else:
            mean = self._sum / n
            var = max(0.0, self._sq / n - mean * mean)
        std = max(math.sqrt(var), self.cfg.min_std_s)
        mean += self.cfg.acceptable_pause_s
        y = (now - self.last - mean) / std
        # Logistic approximation of the normal tail (as Akka does), written so that neither
        # branch overflows: phi = -log10(P(gap > elapsed)).
        z = y * (1.5976 + 0.070566 * y * y)
        if z > 0:  # P = e^-z / (1 + e^-z)
            return (z + math.log1p(math.exp(-z))) / math.log(10)
        return math.log1p(math.exp(z)) / math.log(10)

    def dead(self, now: float) -> bool:
        return self.phi(now) >= self.cfg.threshold

    def silent_for(self, now: float) -> float:
        return now - self.last
