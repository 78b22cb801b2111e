"""The simulated job: progress, speed by placement, and what resizes and failures cost it.

A job holds an *allocation*: one node index per replica, in the order they were given (Pollux's
throughput tables key placements by it). Its clock is advanced lazily to the simulation's: time
with an allocation is *held*; held time not spent paused (resizing, restarting, redoing lost work,
writing a checkpoint) is *useful*; the utilization eta of a run is useful over held GPU-time.

Two kinds of job, one interface:

- :class:`ProfiledJob`: one of Pollux's six models (:mod:`maitre.sim.profiles`). Progress is in
  units of the statistical efficiency model (steps of the smallest batch); its speed depends on the
  placement, the batch split and the epoch. This is Pollux's job model, replayed the same way so
  the ported baselines can be checked against their published results: progress crosses epochs one
  at a time, the time to an epoch's end is rounded to whole seconds, and every reallocation pauses
  the job for the resize cost.
- :class:`TraceJob`: a trace row with a duration at a requested size and no profile (the Philly
  trace). Its work is the duration; elsewhere than its requested size it runs at the ratio of a
  speedup model ``n / (1 + c (n - 1))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from maitre.sim.perfmodel import PerfParams, fit
from maitre.sim.profiles import Application, BatchConfig, even_placement


@dataclass(kw_only=True, slots=True)
class Recovery:
    """What a job pays for resizes and failures (see :class:`maitre.sim.simulator.SimConfig`)."""

    resize_s: float = 30.0
    """Pause of every reallocation (start, grow, shrink): Pollux assumes a 30 s restart."""
    peer_recovery: bool = False
    """On a node failure, survivors carry on from their live state (maitre) instead of every
    replica restarting from the last checkpoint."""
    failure_pause_s: float = 30.0
    """Pause after a failure before training resumes (detection plus rebuild or restart)."""
    checkpoint_s: float = 0.0
    """Training time a checkpoint blocks (0: no checkpoints are modelled)."""


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimizes expected lost time: ``sqrt(2 delta M)`` (Young),
    with Daly's correction ``- delta`` when the cost is not small against the MTBF."""
    if checkpoint_s <= 0 or not math.isfinite(mtbf_s):
        return math.inf
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    return max(checkpoint_s, math.sqrt(2 * checkpoint_s * mtbf_s) - checkpoint_s)


class SimJob:
    """What every simulated job has; subclasses say how fast it goes and when it is done."""

    def __init__(
        self,
        name: str,
        submitted: float,
        *,
        replicas: int,
        min_replicas: int = 1,
        max_replicas: int | None = None,
        queue: str = "default",
        priority: int = 0,
        recovery: Recovery | None = None,
    ) -> None:
        self.name = name
        self.submitted = submitted
        self.replicas = replicas
        """Requested replicas: the fixed size of the static baselines."""
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas if max_replicas is not None else replicas
        self.queue = queue
        self.priority = priority
        self.recovery = recovery or Recovery()
        self.alloc: list[int] = []
        self.clock = submitted
        self.completed: float | None = None
        self.started: float | None = None
        self.paused_s = 0.0
        self.owed_s = 0.0
        """Pause still owed from a failure, paid at the next reallocation."""
        self.attained_s = 0.0
        """GPU-seconds held so far (Tiresias' attained service, Pollux's ordering key)."""
        self.useful_s = 0.0
        """GPU-seconds spent training (held minus paused)."""
        self.held_s = 0.0
        """GPU-seconds held, until the allocation is released (after completion too)."""
        self.restarts = -1
        self.failures = 0
        self.checkpoint_interval_s = math.inf
        self._measured: dict[int, float] = {}

    @property
    def throughput(self) -> dict[int, float]:
        """Measured speed by replica count, the last seen at each: what maitre's speedup model
        is fitted to, as the live coordinator's measurements are."""
        return dict(self._measured)

    # -- allocation ---------------------------------------------------------------------------

    @property
    def placement(self) -> tuple[int, ...]:
        """GPUs per node, in the order the allocation first names each node."""
        counts: dict[int, int] = {}
        for n in self.alloc:
            counts[n] = counts.get(n, 0) + 1
        return tuple(counts.values())

    def reallocate(self, alloc: list[int], now: float) -> None:
        """Take a new allocation at ``now`` (the clock must have been advanced to it)."""
        self.alloc = list(alloc)
        if alloc:
            self.restarts += 1
            self.paused_s = self.recovery.resize_s + self.owed_s
            self.owed_s = 0.0
            if self.started is None:
                self.started = now
            self._reconfigure()

    def _reconfigure(self) -> None:
        """The allocation changed: recompute what depends on it."""

    def lose(self, seconds: float, pause_s: float) -> None:
        """A failure: ``seconds`` of training are redone after a pause of ``pause_s`` (which
        replaces the resize pause of the reallocation that follows)."""
        self.failures += 1
        self.owed_s += seconds + max(0.0, pause_s - self.recovery.resize_s)

    # -- time ---------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Run from the job's clock to ``now``."""
        seconds = now - self.clock
        if seconds <= 0:
            return
        gpus = len(self.alloc)
        self.held_s += seconds * gpus
        if not gpus or self.completed is not None:
            self.clock = now
            return
        delay = min(self.paused_s, seconds)
        self.paused_s -= delay
        self.attained_s += delay * gpus
        self.clock += delay
        seconds -= delay
        if seconds > 0:
            ran = self._run(seconds)
            self.attained_s += ran * gpus
            self.useful_s += ran * gpus
        self.clock = now

    def _run(self, seconds: float) -> float:
        """Train for ``seconds`` from ``self.clock`` (set ``completed`` if done); returns the
        seconds actually trained."""
        raise NotImplementedError

    def _overhead(self) -> float:
        """Fraction of time left to training once checkpoints at the interval are written."""
        if not math.isfinite(self.checkpoint_interval_s):
            return 1.0
        interval = self.checkpoint_interval_s
        return interval / (interval + self.recovery.checkpoint_s)

    def rate(self, replicas: int) -> float:
        """Progress per second at ``replicas`` on as few nodes as possible (for policies)."""
        raise NotImplementedError

    def remaining(self) -> float:
        """Progress still to make."""
        raise NotImplementedError


class ProfiledJob(SimJob):
    def __init__(
        self,
        name: str,
        submitted: float,
        app: Application,
        *,
        replicas: int,
        batch_size: int | None,
        adaptive: bool = False,
        gpus_per_node: int = 4,
        explore: float = 0.0,
        **kw,
    ) -> None:
        super().__init__(name, submitted, replicas=replicas, **kw)
        self.app = app
        self.batch_size = batch_size
        self.adaptive = adaptive or batch_size is None
        """Let the scheduler pick the batch size by goodput (changes the trajectory)."""
        self.gpus_per_node = gpus_per_node
        self.epoch = 0
        self.progress = 0.0
        self.cfg: BatchConfig | None = None
        self._seen: dict[int, tuple[tuple[int, ...], BatchConfig]] = {}
        self.explore = explore
        """A goodput-following job also reports the goodput its fitted step-time model predicts
        on sizes it has not run, up to this many times the largest it ran (0: none)."""
        self._timed: dict[tuple[int, int, int], tuple[float, float]] = {}
        """(nodes, replicas, per-GPU batch) -> (step, sync) seconds, as the job timed them."""
        self._perf: PerfParams | None = None
        self._perf_basis: tuple[frozenset, int] = (frozenset(), 0)
        self._predicted: tuple[tuple, dict[int, float]] = ((), {})

    @property
    def throughput(self) -> dict[int, float]:
        """What the job has measured, per replica count it ran at: samples per second, as the
        live coordinator measures; for a job whose batch size follows goodput, the goodput on
        each placement it ran on at the batch size it would pick there now (samples per second
        times statistical efficiency, under the current gradient statistics), since samples per
        second alone would favour the large batches it gives up."""
        epoch = min(self.epoch, self.app.completion_epoch)
        out = {}
        for n, (placement, cfg) in self._seen.items():
            if self.adaptive:
                cfg = self.app.best_batch(placement, epoch)
                out[n] = self.app.goodput(placement, cfg, epoch) * self.app.init_batch_size
            else:
                out[n] = cfg.batch_size / self.app.iteration_time(placement, cfg)
        if self.adaptive and self.explore and self._timed:
            for n, rate in self._predictions(epoch).items():
                out.setdefault(n, rate)
        return out

    def _perf_model(self) -> PerfParams:
        """The step-time model, refitted when the job has run on a new shape (nodes, replicas)
        or has four times the timings of the last fit."""
        sizes = frozenset(k[:2] for k in self._timed)
        basis, count = self._perf_basis
        if self._perf is None or not sizes <= basis or len(self._timed) >= 4 * count:
            keys = list(self._timed)
            self._perf = fit(
                [k[0] for k in keys],
                [k[1] for k in keys],
                [k[2] for k in keys],
                [self._timed[k][0] for k in keys],
                [self._timed[k][0] - self._timed[k][1] for k in keys],
                start=self._perf,
            )
            self._perf_basis = (sizes, len(self._timed))
        return self._perf

    def _predictions(self, epoch: int) -> dict[int, float]:
        """Predicted goodput (as ``throughput`` reports it) at powers of two up to ``explore``
        times the largest size run."""
        limit = min(self.max_replicas, int(self.explore * max(self._seen)))
        params = self._perf_model()
        key = (params, epoch, limit)  # by value: a refit's new object may reuse an old id
        if self._predicted[0] == key:
            return self._predicted[1]
        app, out, n = self.app, {}, 1
        while n <= limit:
            placement = even_placement(n, self.gpus_per_node)
            grid = app.batch_grid(n)
            if grid:
                steps = params.step_time(len(placement), n, [c.atomic for c in grid], [c.accum_steps for c in grid])
                gains = np.array([app.gain(c.batch_size, epoch) for c in grid])
                out[n] = float(np.max(gains / steps)) * app.init_batch_size
            n *= 2
        self._predicted = (key, out)
        return out

    def _config(self, placement: tuple[int, ...]) -> BatchConfig:
        if self.adaptive:  # (a finished job may still be moved before it lets go)
            return self.app.best_batch(placement, min(self.epoch, self.app.completion_epoch))
        return self.app.fixed_batch(self.batch_size, sum(placement))

    def _reconfigure(self) -> None:
        self.cfg = self._config(self.placement)

    def _run(self, seconds: float) -> float:
        app, placement, ran = self.app, self.placement, 0.0
        overhead = self._overhead()
        while seconds > 0 and self.completed is None:
            seconds_per_step = app.iteration_time(placement, self.cfg)
            rate = app.gain(self.cfg.batch_size, self.epoch) / seconds_per_step * overhead
            self._seen[len(self.alloc)] = (placement, self.cfg)
            if self.explore:
                key = (sum(1 for c in placement if c), len(self.alloc), self.cfg.atomic)
                if key not in self._timed:
                    self._timed[key] = app.step_time(placement, self.cfg.atomic)
            target = app.progress_at(self.epoch + 1)
            if self.progress + rate * seconds < target:
                self.progress += rate * seconds
                ran += seconds
                break
            self.epoch += 1
            delta = round((target - self.progress) / rate)
            if self.epoch > app.completion_epoch:
                self.completed = self.clock + ran + delta
            self.progress = target
            ran += delta
            seconds -= delta
            if self.adaptive and self.completed is None:
                self.cfg = self._config(placement)
        return ran

    def rate(self, replicas: int) -> float:
        if replicas <= 0:
            return 0.0
        placement = even_placement(replicas, self.gpus_per_node)
        epoch = min(self.epoch, self.app.completion_epoch)
        if self.adaptive:
            cfg = self.app.best_batch(placement, epoch)
        else:
            cfg = self.app.fixed_batch(self.batch_size, replicas)
        return self.app.goodput(placement, cfg, epoch)

    def remaining(self) -> float:
        return max(0.0, self.app.progress_at(self.app.max_epochs) - self.progress)


class TraceJob(SimJob):
    def __init__(
        self, name: str, submitted: float, duration_s: float, *, replicas: int, comm_cost: float = 0.05, **kw
    ) -> None:
        super().__init__(name, submitted, replicas=replicas, **kw)
        self.work = float(duration_s)
        self.done = 0.0
        self.comm_cost = comm_cost

    def _speedup(self, n: int) -> float:
        return n / (1 + self.comm_cost * (n - 1)) if n > 0 else 0.0

    def rate(self, replicas: int) -> float:
        return self._speedup(replicas) / self._speedup(self.replicas)

    def _run(self, seconds: float) -> float:
        rate = self.rate(len(self.alloc)) * self._overhead()
        self._measured[len(self.alloc)] = rate
        left = (self.work - self.done) / rate
        if left <= seconds:
            self.done = self.work
            self.completed = self.clock + left
            return left
        self.done += rate * seconds
        return seconds

    def remaining(self) -> float:
        return self.work - self.done
