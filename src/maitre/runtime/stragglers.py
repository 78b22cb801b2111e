"""Slow ranks: each rank's compute per unit of work, compared across ranks (pure, no torch).

In synchronous training the slowest rank sets everyone's pace, so a rank that computes slower
than its peers costs the whole job. Each rank times its compute per step (from the start of the
step to its arrival at the step's gradient allreduce: the wait for its peers excluded) divided
by its work (the samples of its share, or the tokens the script logged), in a :class:`Window`.
At a window's last step (every ``window`` steps) every rank puts three numbers into its own
slots of the step's reduction (:mod:`maitre.runtime.loop`): the window's lower quartile, its
*held pace* (the lower quartile over its last ``window * windows`` steps) and its work per step.
No collective of its own: rank 0 reads every rank's numbers from the reduced slots.

Why lower quartiles, not medians or means: on a loaded machine (real runs of 4 workers on 2
oversubscribed cores, their per-step traces: ``MAITRE_STRAGGLER_TRACE``) a step's time is the
rank's pace plus what the OS adds, a wake-up served late, a time slice given to another
process, 2 to 4 times the step now and then, on every rank, independently. That only ever adds
time, so the low end of a rank's steps is its own pace; a window's median moved when three of
its five steps were hit, and two such windows made a straggler (the false positives). The held
pace moves only when 12 of 15 steps are slow, which a slow rank (a throttled device, a
neighbour on its cores) is at every step, and which no transient slowdown shorter than about
12 steps can be; the quartile rather than the fastest step, so that the jitter of the compute
itself does not make one rank's luckiest step its measure.

Rank 0 runs the :class:`Detector` on them, window after window:

- uneven shares: a step's fixed cost (per step, per micro-batch) spread over fewer samples
  makes the ranks of the smaller share look slower per sample, by up to ``(n + 1) / n``
  (shares of ``n`` and ``n + 1``; 8% in the traces with shares of 3 and 4). Each level of work
  that two ranks or more share is corrected by its lower median against that of the level of
  most ranks (:func:`share_factors`; one slow rank does not move it);
- a rank is flagged when its held pace over the median of the ranks' held paces is at least
  ``ratio`` and its robust z score, ``(held - median) / (1.4826 * MAD)`` with the MAD of the
  *other* ranks (a slow rank does not widen the scale it is judged by) floored at
  ``mad_floor * median``, is at least ``z``;
- its onset, the change point: the first step of the run of windows, up to the verdict, whose
  ratio to the window's median reached ``drift`` (and did not fall under half way back to 1).
  A CUSUM of ``log(ratio / drift)`` per rank goes with the evidence.

A verdict (:class:`Verdict`) names the rank and worker, by how much (its held ratio), since
which step, and the windows' numbers as evidence. A rank that is flagged is reported once, and
again only after it recovered (its held ratio back under ``drift``).

The defaults (``window`` 5, ``windows`` 3, ``ratio`` 1.3, ``z`` 3, ``mad_floor`` 0.05, ``drift``
1.15) flag a rank 1.5x slower within 20 steps of its onset (12 to 20: the held span, and where
the onset falls in a window), and nothing in noise whose transients are shorter; measured by
``benchmarks/stragglers.py`` (real runs, and their traces replayed: steps of ~40 ms, of which
~3 ms on the CPU, the rest a device-like wait). Where a step is short and mostly CPU, on cores
shared with other busy processes, the OS keeps some ranks behind the others for longer than
any held span of 20 steps: in traces of 4 ranks with ~12 ms steps on 2 cores loaded by other
test runs, one rank's held pace stayed 15% to 90% above its peer's of the same share for tens
of steps or the whole run, and replayed, they flag a rank in 45% of noise-only trials (12% with
``window`` 10). That is a neighbour taking a rank's CPU, a straggler by the issue's own list,
which timing alone does not tell from load that will pass: there raise ``window`` (and accept
later verdicts) or ``ratio``.

Every threshold comes from the job's environment (:meth:`Thresholds.from_environ`; the
``MAITRE_STRAGGLER_*`` variables of :mod:`maitre.protocol`); a value out of range is an error
that names the variable. A managed job sets them from its manifest's ``stragglers`` (the
limits are :data:`maitre.scheduling.spec.STRAGGLER_LIMITS`, checked at submit). The policy is
``report`` (an event and a metric) or ``evict`` (the coordinator also moves the replica away).
With two ranks there is no majority to compare against: the detector needs ``min_ranks`` (3).

What it cannot see: on a GPU the clock is the host's, so kernels queued but not finished when
the rank reaches the allreduce are not counted (a script that reads its loss, ``float(loss)``,
syncs its forward passes; the last backward stays asynchronous): CUDA events, a step behind, are
to come. A level of work that one rank alone has (three ranks with shares 5, 5, 4; tokens of
every length) is not corrected for its share: keep ``ratio`` above ``(n + 1) / n`` there, or
shares large. And a rank slow at one step of four (a loader that stalls periodically) is not
slow to the lower quartile.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from maitre import protocol
from maitre.scheduling.spec import STRAGGLER_LIMITS, STRAGGLER_POLICIES

_MAD_SCALE = 1.4826
"""The MAD of a normal distribution times this is its standard deviation."""
_EVIDENCE = 8
"""Windows of evidence a verdict carries (the newest; ``windows`` of them if more)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """The detector's settings, all configurable per job (see the module docstring)."""

    window: int = 5
    """Steps per window (``MAITRE_STRAGGLER_WINDOW``, 1..10000)."""
    ratio: float = 1.3
    """A rank's held pace over the median of the ranks' that flags it
    (``MAITRE_STRAGGLER_RATIO``, 1.01..100)."""
    z: float = 3.0
    """The robust z score of its held pace that flags it (``MAITRE_STRAGGLER_Z``, 0..1000)."""
    windows: int = 3
    """Windows the held pace spans, ``window * windows`` steps (``MAITRE_STRAGGLER_WINDOWS``,
    1..64)."""
    mad_floor: float = 0.05
    """The MAD's floor, as a fraction of the median (``MAITRE_STRAGGLER_MAD_FLOOR``, 0.001..1)."""
    drift: float = 1.15
    """A window's ratio from which the rank's onset counts (the CUSUM's drift), and the held
    ratio under which a flagged rank has recovered (``MAITRE_STRAGGLER_DRIFT``, 1..ratio)."""
    policy: str = "report"
    """``report`` (event and metric), ``evict`` (the coordinator also moves the rank's replica
    off its node) or ``off`` (``MAITRE_STRAGGLER_POLICY``)."""
    min_ranks: int = 3

    def __post_init__(self) -> None:
        for name, (var, kind, low, high) in _RANGES.items():
            value = getattr(self, name)
            typed = isinstance(value, (int, float) if kind is float else int)
            if not typed or isinstance(value, bool) or not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{var}={value!r}: out of range [{low}, {high}]")
        if self.policy not in STRAGGLER_POLICIES:
            raise ValueError(
                f"{protocol.STRAGGLER_POLICY}={self.policy!r}: no such policy; "
                f"the policies are {', '.join(STRAGGLER_POLICIES)}"
            )
        if self.drift > self.ratio:
            raise ValueError(
                f"{protocol.STRAGGLER_DRIFT}={self.drift} is above "
                f"{protocol.STRAGGLER_RATIO}={self.ratio}: the onset would come after "
                f"the verdict"
            )
        if self.min_ranks < 3:
            raise ValueError(f"min_ranks={self.min_ranks}: a median needs three ranks or more")

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "Thresholds":
        """The settings from ``MAITRE_STRAGGLER_*`` (defaults for those unset); ValueError
        naming the variable for a value that is no number, out of range, or a policy that does
        not exist."""
        given: dict[str, Any] = {}
        for name, (var, kind, *_) in _RANGES.items():
            text = env.get(var, "").strip()
            if text:
                try:
                    given[name] = kind(text)
                except ValueError:
                    raise ValueError(f"{var}={text!r}: not {'an integer' if kind is int else 'a number'}") from None
        policy = env.get(protocol.STRAGGLER_POLICY, "").strip()
        if policy:
            given["policy"] = policy
        return cls(**given)


@dataclass(frozen=True, kw_only=True, slots=True)
class Injected:
    """Fault injection (tests, drills, benchmarks): ``MAITRE_SLOW_RANK`` (one rank computes
    longer, from a step on), ``MAITRE_SLOW_FACTOR`` (every worker of the node whose agent has it
    in its environment) and ``MAITRE_STEP_JITTER`` (every rank, a random part longer)."""

    slow: tuple[int, float, int] | None = None
    """(data rank, factor, first step): that rank sleeps ``factor`` times its step's compute."""
    node: float = 0.0
    """This worker sleeps ``node`` times its step's compute (its node is slow)."""
    jitter: float = 0.0
    """Every rank sleeps a part of its step's compute, uniform in [0, ``jitter``)."""

    def __bool__(self) -> bool:
        return self.slow is not None or self.node > 0 or self.jitter > 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "Injected":
        """ValueError naming the variable for a value that does not parse or is out of range."""
        return cls(
            slow=_slow_rank(env.get(protocol.SLOW_RANK, "")),
            node=_slow_factor(env.get(protocol.SLOW_FACTOR, "")),
            jitter=_jitter(env.get(protocol.STEP_JITTER, "")),
        )

    def pause(self, rank: int, step: int, took_s: float) -> float:
        """Seconds rank ``rank`` sleeps at step ``step`` whose compute took ``took_s``."""
        pause = random.random() * self.jitter * took_s if self.jitter else 0.0
        pause += self.node * took_s
        if self.slow is not None and self.slow[0] == rank and step >= self.slow[2]:
            pause += self.slow[1] * took_s
        return pause


def _slow_rank(text: str) -> tuple[int, float, int] | None:
    """``MAITRE_SLOW_RANK``: ``RANK:FACTOR[:STEP]`` (None when unset)."""
    if not text.strip():
        return None
    rank, sep, rest = text.partition(":")
    factor, _, step = rest.partition(":")
    try:
        parsed = int(rank), float(factor), int(step) if step else 1
    except ValueError:
        parsed = None
    if not sep or parsed is None or parsed[0] < 0 or not 0 <= parsed[1] <= 1000 or parsed[2] < 1:
        raise ValueError(
            f"{protocol.SLOW_RANK}={text!r}: expected RANK:FACTOR[:STEP] (a rank "
            f">= 0, a factor in [0, 1000], a step >= 1), e.g. 1:0.5 or 1:0.5:40"
        )
    return parsed


def _slow_factor(text: str) -> float:
    """``MAITRE_SLOW_FACTOR``: ``FACTOR`` (0.0 when unset)."""
    return _number(
        protocol.SLOW_FACTOR, text, 1000, "a factor in [0, 1000], e.g. 1.0 (each step's compute takes twice as long)"
    )


def _jitter(text: str) -> float:
    """``MAITRE_STEP_JITTER``: the most of its compute a rank sleeps (0.0 when unset)."""
    return _number(protocol.STEP_JITTER, text, 100, "a fraction in [0, 100], e.g. 0.3")


def _number(var: str, text: str, high: float, expected: str) -> float:
    """``var``'s value ``text``: a number in [0, ``high``] (0.0 when unset), else ValueError."""
    if not text.strip():
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= high:  # (nan fails too)
        raise ValueError(f"{var}={text!r}: expected {expected}")
    return value


_VARIABLES = {
    "window": protocol.STRAGGLER_WINDOW,
    "ratio": protocol.STRAGGLER_RATIO,
    "z": protocol.STRAGGLER_Z,
    "windows": protocol.STRAGGLER_WINDOWS,
    "mad_floor": protocol.STRAGGLER_MAD_FLOOR,
    "drift": protocol.STRAGGLER_DRIFT,
}
_RANGES: dict[str, tuple[str, type, float, float]] = {
    # field: (its variable, type, lowest, highest), the manifest's limits
    name: (_VARIABLES[name], kind, low, high)
    for name, (kind, low, high) in STRAGGLER_LIMITS.items()
}


def lower_quartile(values: list[float]) -> float:
    """The lower quartile (of 5 values the second lowest, of 15 the fourth)."""
    return sorted(values)[(len(values) - 1) // 4]


class Window:
    """One rank's compute per unit of work, step after step: at a window's last step, the
    window's value and the held value over the last ``span`` steps (``window * windows``).

    Both are lower quartiles. The OS descheduling a rank, a wake-up served late, a page-fault
    storm only ever add time, so the low end of a rank's steps is its own pace: its lower
    quartile over 15 steps moves only when 12 of them are slow, which a slow rank (a throttled
    device, a neighbour on its cores) is at every step; the quartile rather than the fastest
    step, so that the jitter of the compute itself does not make one rank's luckiest step the
    measure."""

    def __init__(self, span: int = 1) -> None:
        self.values: list[float] = []
        self.works: list[float] = []
        self.recent: deque[float] = deque(maxlen=max(1, span))

    def add(self, compute_s: float, work: float) -> None:
        if work > 0 and compute_s >= 0 and math.isfinite(compute_s):
            self.values.append(compute_s / work)
            self.works.append(work)
            self.recent.append(compute_s / work)

    def take(self) -> tuple[float, float, float]:
        """The window's value, the held value (over the last ``span`` steps, 0.0 while fewer)
        and the window's median work per step (all 0.0: no work in it, e.g. a listener); a new
        window."""
        values, works, self.values, self.works = self.values, self.works, [], []
        if not values:
            return 0.0, 0.0, 0.0
        full = len(self.recent) == self.recent.maxlen
        return (lower_quartile(values), lower_quartile(list(self.recent)) if full else 0.0, statistics.median(works))

    def restart(self) -> None:
        """A new group: the steps so far ran among other ranks."""
        self.values, self.works = [], []
        self.recent.clear()


@dataclass(slots=True)
class Verdict:
    """A rank found slow: the ``straggler`` report's body, but the worker's node (the
    coordinator knows it)."""

    rank: int
    """Its slot in the shared numbers: its rank in the epoch's group."""
    key: str
    """The worker, as the caller named the slot (its id)."""
    ratio: float
    """Its held pace over the median of the ranks' held paces, when it was flagged."""
    since_step: int
    """The onset: the first step of the window where it began to be slow."""
    step: int
    """The last step of the window that flagged it."""
    windows: int
    """Windows its held pace spanned."""
    evidence: list[dict[str, float]]
    """The newest windows' numbers: ``{step, value, share, median, ratio, held, z, cusum}``."""

    def report(self, thresholds: Thresholds) -> dict[str, Any]:
        return {
            "kind": "straggler",
            "rank": self.rank,
            "straggler": self.key,
            "ratio": self.ratio,
            "since_step": self.since_step,
            "step": self.step,
            "windows": self.windows,
            "evidence": self.evidence,
            "policy": thresholds.policy,
            "thresholds": {
                "window": thresholds.window,
                "ratio": thresholds.ratio,
                "z": thresholds.z,
                "windows": thresholds.windows,
            },
        }


@dataclass(slots=True)
class _Rank:
    cusum: float = 0.0
    onset: int = 0
    flagged: bool = False
    recent: list[float] = field(default_factory=list)
    """Its values of the last ``windows`` windows."""
    evidence: list[dict[str, float]] = field(default_factory=list)


def share_factors(values: Mapping[int, float], works: Mapping[int, float]) -> dict[int, float]:
    """What a slot's value is divided by for the size of its share: a step's fixed cost (the
    script's and the framework's, per step or per micro-batch) spread over fewer samples makes
    a rank of a smaller share look slower per sample, by up to ``(n + 1) / n`` for shares of
    ``n`` and ``n + 1``. Per level of work (ranks of the same share), the level's lower median
    (of two ranks, the lower: one slow rank does not move it) against that of the level of most
    ranks (ties: the most work), bounded by that worst case. A level of one rank is not
    corrected (it has nothing to be told from): 1.0."""
    levels: dict[float, list[int]] = {}
    for r in values:
        if works.get(r, 0.0) > 0:
            levels.setdefault(round(works[r], 3), []).append(r)
    factors = {r: 1.0 for r in values}
    shared = {w: ranks for w, ranks in levels.items() if len(ranks) >= 2}
    if len(shared) < 2:
        return factors
    ref = max(shared, key=lambda w: (len(shared[w]), w))
    low = {w: statistics.median_low(values[r] for r in ranks) for w, ranks in shared.items()}
    for w, ranks in shared.items():
        bound = ref / w  # a step of fixed cost only: its per-sample value scales as 1 / work
        f = min(max(low[w] / low[ref], min(1.0, bound)), max(1.0, bound))
        for r in ranks:
            factors[r] = f
    return factors


class Detector:
    """Rank 0's verdicts, window after window (see the module docstring). Keyed by the name
    of each slot (a worker id), so a rank's history follows its worker across epochs."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.t = thresholds or Thresholds()
        self._ranks: dict[str, _Rank] = {}

    def observe(
        self,
        first_step: int,
        last_step: int,
        values: list[float],
        keys: list[str] | None = None,
        works: list[float] | None = None,
        held: list[float] | None = None,
    ) -> list[Verdict]:
        """One window (steps ``first_step..last_step``): ``values[r]`` is slot ``r``'s compute
        per unit of work over it (0 or less: no work in it, left out), ``works[r]`` its work
        per step (None: shares not corrected for), ``held[r]`` its held value, over the last
        ``window * windows`` steps (0: fewer steps yet; None: the lower quartile of its last
        ``windows`` window values). The verdicts it brings."""
        keys = keys if keys is not None else [str(r) for r in range(len(values))]
        seen = {r: v for r, v in enumerate(values) if v > 0 and math.isfinite(v)}
        if len(seen) < self.t.min_ranks:
            return []
        log_drift, n = math.log(self.t.drift), self.t.windows
        states = {r: self._ranks.setdefault(keys[r], _Rank()) for r in seen}
        for r, v in seen.items():
            states[r].recent = (states[r].recent + [v])[-n:]
        if held is None:
            kept = {r: lower_quartile(states[r].recent) for r in seen if len(states[r].recent) == n}
        else:
            kept = {r: held[r] for r in seen if held[r] > 0 and math.isfinite(held[r])}
        by_work = dict(enumerate(works)) if works is not None else {}
        share = share_factors(kept if len(kept) >= self.t.min_ranks else seen, by_work)
        share = {r: share.get(r, 1.0) for r in seen}
        med = statistics.median(v / share[r] for r, v in seen.items())
        for r, v in seen.items():
            st = states[r]
            ratio = v / share[r] / med
            st.cusum = max(0.0, st.cusum + math.log(ratio) - log_drift)
            if ratio < (1.0 + self.t.drift) / 2:
                st.onset = 0  # its run of slow windows, if any, ended
            elif not st.onset and ratio >= self.t.drift:
                st.onset = first_step  # the change point: a run of slow windows begins
            st.evidence = (
                st.evidence
                + [
                    {
                        "step": last_step,
                        "value": v,
                        "share": round(share[r], 4),
                        "median": med,
                        "ratio": round(ratio, 4),
                        "held": 0.0,
                        "z": 0.0,
                        "cusum": round(st.cusum, 4),
                    }
                ]
            )[-max(n, _EVIDENCE) :]
        # Held: each rank's pace over its last window * windows steps against the median of
        # the ranks' held paces: a rank is slow when it is slower than the others by ``ratio``
        # at three quarters of those steps.
        fair = {r: h / share[r] for r, h in kept.items()}
        if len(fair) < self.t.min_ranks:
            return []
        held_med = statistics.median(fair.values())
        floor = self.t.mad_floor * held_med
        verdicts = []
        for r, h in fair.items():
            st = states[r]
            # The others' spread: a rank's own slowness does not widen the scale it is judged
            # by (among a few ranks it would be much of the MAD).
            others = [u for q, u in fair.items() if q != r]
            centre = statistics.median(others)
            scale = max(_MAD_SCALE * statistics.median(abs(u - centre) for u in others), floor)
            h_ratio, z = h / held_med, (h - held_med) / scale
            st.evidence[-1].update(held=round(h_ratio, 4), z=round(z, 3))
            if h_ratio >= self.t.ratio and z >= self.t.z and not st.flagged:
                st.flagged = True
                verdicts.append(
                    Verdict(
                        rank=r,
                        key=keys[r],
                        ratio=round(h_ratio, 4),
                        since_step=st.onset or first_step,
                        step=last_step,
                        windows=n,
                        evidence=list(st.evidence),
                    )
                )
            elif st.flagged and h_ratio < self.t.drift:
                st.flagged = False  # recovered: a new slowdown is a new verdict, with its own
                st.cusum = 0.0  # onset
        return verdicts
