"""The failure detectors: of workers (hung or lost), from what their agents report, and of
nodes (phi accrual on their agents' beats). Each decides; the membership and the cluster act.

**Workers.** A worker beats its agent 10 times a second; the agent reports each worker's silence
and the rhythm of its beats in the node beat. A member is *hung* when it has been silent longer
than its own rhythm allows (``gap mean + suspect_sigmas`` deviations, at least
``suspect_floor_s``) while every other member of its epoch waits in a collective (a stopped
process, a wedged kernel: its peers stall on it); it is *lost* when it has been silent past
``dead_after_s`` whatever the others do. How long a worker has been silent is what the coordinator
knows of it: a node beats every 2 s in steady state, but its agent beats at once when one of its
workers falls silent past :data:`maitre.protocol.SILENT_S`, so a beat that said a worker was
heard *vouches* for it until the agent's next beat is due (:func:`silence`). Without that, a
healthy member on a quiet node looked 2 s silent at the worst moment (its peers stalled on its
longer step) and was declared hung.

**Nodes**: phi accrual (Hayashibara et al., 2004, as in Akka and Cassandra).

Instead of a fixed timeout, each node's detector learns the distribution of the gaps between
its agent's heartbeats and answers with a suspicion level::

    phi(t) = -log10(1 - F(t - last))       F: the normal CDF of the observed gaps

``phi = 1`` means the chance that a heartbeat is merely late is 10%, ``phi = 8`` one in 10^8. A
node on a loaded machine, whose heartbeats come irregularly, gets a longer timeout on its own;
a node that beats like a metronome is declared dead soon after it stops. ``acceptable_pause_s``
is added to the mean gap so that a pause the cluster expects (a garbage collection, a busy
host) is not a death, and ``min_std_s`` keeps a very regular node from being declared dead by
one slightly late beat.

Pure logic over injected time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Protocol, TypeVar


# -- workers -------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """The worker detector's settings."""

    heartbeat_interval_s: float = 0.1
    """How often workers send heartbeats."""
    suspect_floor_s: float = 1.5
    """Least heartbeat silence that can mark a member hung (when its peers are stalled)."""
    suspect_sigmas: float = 8.0
    """Adaptive part: mean gap + this many standard deviations of the member's heartbeat gaps."""
    dead_after_s: float = 15.0
    """Heartbeat silence that marks a worker dead whatever its peers do."""
    first_round_grace_s: float = 2.0
    """How long the first round waits for more ready workers once the minimum is there."""


class Heard(Protocol):
    """What the worker detector reads of a worker (:class:`maitre.control.membership.Worker`)."""

    id: str
    last_heartbeat: float
    """When it was last heard (its agent's report of its last beat)."""
    vouched_until: float
    """Until when its agent's last beat vouches for it (0: no promise)."""
    gap_mean: float
    gap_var: float
    stalled: bool


W = TypeVar("W", bound=Heard)


def silence(w: Heard, now: float) -> float:
    """How long ``w`` has been silent as far as the coordinator knows: nothing while its agent's
    last beat vouches for it; then from when the promise ran out, or from its last beat if
    that is later."""
    return now - max(w.last_heartbeat, min(now, w.vouched_until))


def suspect_after(w: Heard, cfg: DetectorConfig) -> float:
    """The silence past which ``w`` may be hung: its own rhythm, bounded by the config."""
    adaptive = w.gap_mean + cfg.suspect_sigmas * math.sqrt(w.gap_var)
    return min(max(cfg.suspect_floor_s, adaptive), cfg.dead_after_s)


def lost(workers: Iterable[W], now: float, cfg: DetectorConfig) -> list[tuple[W, str]]:
    """The workers silent past ``dead_after_s``, with why."""
    limit = now - cfg.dead_after_s
    return [
        (w, f"worker {w.id} sent no heartbeat for {silence(w, now):.1f}s")
        for w in workers
        if w.last_heartbeat < limit and silence(w, now) > cfg.dead_after_s
    ]


def hung(members: list[W], now: float, cfg: DetectorConfig) -> tuple[W, str] | None:
    """The first of an epoch's training ``members`` silent past its suspect time while every
    other one waits in a collective, with why; None when there is none."""
    floor = now - cfg.suspect_floor_s
    for w in members:
        if w.last_heartbeat >= floor:  # the common case, decided without arithmetic
            continue
        silent = silence(w, now)
        if silent <= suspect_after(w, cfg):
            continue
        others = [o for o in members if o is not w]
        if others and all(o.stalled for o in others):
            return w, (f"worker {w.id} hung: no heartbeat for {silent:.1f}s while its peers waited in a collective")
    return None


# -- nodes ---------------------------------------------------------------------------------------


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
