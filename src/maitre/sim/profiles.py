"""Measured job profiles: how fast each of Pollux's six models trains, by placement and batch size.

A profile (``sim/traces/pollux_app_profiles/<app>/``) is what Pollux's authors measured on real
training runs, and what their simulator replays; this module reads it the same way, so that the
baselines ported here can be checked against their published numbers:

- **Throughput.** ``placements.csv`` gives step and all-reduce (sync) time per iteration for a
  placement (GPUs per node, e.g. ``(2, 4)``) and a per-GPU batch size; between measured batch sizes
  it is interpolated linearly. A placement that was not measured is interpolated over
  ``(nodes, replicas, per-GPU batch)`` across every measurement (``scalability.csv`` adds large
  ones), linearly over a Delaunay triangulation (scipy's ``LinearNDInterpolator``, as Pollux).
- **Statistical efficiency.** ``validation-<B>.csv`` holds, per epoch of a run at total batch B,
  the progress reached and the gradient's squared norm and variance. A step at batch ``b`` makes
  ``gain = (var + sqr) / (var / s + sqr)`` units of progress, ``s = b / B0`` (``B0`` the smallest
  batch measured): the gradient-noise-scale model. Progress is thus counted in steps of the
  smallest batch; times ``B0`` it is samples of that batch's worth of learning.
- **Length.** A job is done after a fixed number of epochs per model (bert 2, cifar10 100, ncf 10,
  imagenet 90, deepspeech2 80, yolov3 50); an epoch ends at the least progress any batch size
  needed for it.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from functools import cache
from importlib.resources.abc import Traversable

import numpy as np

from maitre.sim.workload import DATA

PROFILES = DATA / "pollux_app_profiles"
_EPS = 1e-8
# Epochs to completion per model (Pollux's simulator), and the per-GPU batch limits it overrides.
_MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
_MAX_LOCAL_BSZ = {"yolov3": 8}


def _read(path: Traversable) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How a job splits its batch: ``atomic`` samples per GPU per pass, ``accum_steps`` extra
    passes accumulated before each all-reduce."""

    replicas: int
    atomic: int
    accum_steps: int

    @property
    def batch_size(self) -> int:
        return self.replicas * self.atomic * (self.accum_steps + 1)


@dataclass(eq=False)
class Application:
    name: str
    max_epochs: int
    validation: dict[int, dict[str, np.ndarray]]
    """Per measured total batch size: per-epoch columns progress, iteration, grad_sqr, grad_var."""
    placements: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per measured placement: local batch sizes (sorted), step times, sync times."""
    points: np.ndarray
    """(nodes, replicas, local batch) of every measurement, for the interpolator."""
    values: np.ndarray
    """(step time, sync time) at ``points``."""
    init_batch_size: int = 0
    max_batch_size: int = 0
    min_local_bsz: int = 0
    max_local_bsz: int = 0
    _interp: object = field(default=None, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, name: str, root: Traversable = PROFILES) -> "Application":
        folder = root / name
        if not folder.is_dir():
            raise ValueError(f"no profile for application {name!r} in {root}")
        validation = {}
        for path in folder.iterdir():
            if not (path.name.startswith("validation-") and path.name.endswith(".csv")):
                continue
            rows = _read(path)
            validation[int(path.name.removesuffix(".csv").split("-")[-1])] = {
                col: np.array([float(r[col]) for r in rows])
                for col in ("progress", "iteration", "grad_sqr", "grad_var")
            }
        validation = dict(sorted(validation.items()))
        groups: dict[tuple[int, ...], list[tuple[float, float, float]]] = {}
        for r in _read(folder / "placements.csv"):
            key = tuple(int(c) for c in r["placement"])
            groups.setdefault(key, []).append((float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])))
        placements = {k: tuple(np.array(c) for c in zip(*sorted(v))) for k, v in groups.items()}
        # The interpolation points: the mean of each (nodes, replicas, local batch) measured in
        # placements.csv, in sorted order, then scalability.csv's rows as they are.
        means: dict[tuple[int, int, float], list[tuple[float, float]]] = {}
        for key, (bsz, step, sync) in placements.items():
            for b, s, y in zip(bsz, step, sync):
                means.setdefault((len(key), sum(key), b), []).append((s, y))
        pts = [(*k, *np.mean(v, axis=0)) for k, v in sorted(means.items())]
        pts += [
            (
                float(r["num_nodes"]),
                float(r["num_replicas"]),
                float(r["local_bsz"]),
                float(r["step_time"]),
                float(r["sync_time"]),
            )
            for r in _read(folder / "scalability.csv")
        ]
        table = np.array(pts, dtype=float)
        local = np.concatenate([b for b, _, _ in placements.values()])
        return cls(
            name=name,
            max_epochs=_MAX_EPOCHS.get(name, min(len(v["progress"]) for v in validation.values())),
            validation=validation,
            placements=placements,
            points=table[:, :3],
            values=table[:, 3:],
            init_batch_size=min(validation),
            max_batch_size=max(validation),
            min_local_bsz=int(local.min()),
            max_local_bsz=_MAX_LOCAL_BSZ.get(name, int(local.max())),
        )

    # -- length and progress ------------------------------------------------------------------

    @property
    def completion_epoch(self) -> int:
        """The epoch whose end completes the job (epochs count from 0)."""
        return self.max_epochs - 1

    def progress_at(self, epoch: int) -> float:
        """Progress needed to finish ``epoch`` epochs."""
        if epoch == 0:
            return 0.0
        return min(float(v["progress"][epoch - 1]) for v in self.validation.values())

    def _bracket(self, batch_size: float) -> tuple[int, int]:
        lower = upper = None
        for b in self.validation:
            if b <= batch_size:
                lower = b
            if b >= batch_size:
                upper = b
                break
        if lower is None or upper is None:
            raise ValueError(
                f"{self.name}: batch size {batch_size} is outside the measured "
                f"{self.init_batch_size}..{self.max_batch_size}"
            )
        return lower, upper

    def _lerp(self, batch_size: float, column: str, epoch: int) -> float:
        lo, hi = self._bracket(batch_size)
        a, b = float(self.validation[lo][column][epoch]), float(self.validation[hi][column][epoch])
        if lo == hi:
            return a
        return ((batch_size - lo) * b + (hi - batch_size) * a) / (hi - lo)

    def iterations(self, batch_size: float, epoch: int) -> float:
        """Optimizer steps at ``batch_size`` to the end of ``epoch``."""
        return self._lerp(batch_size, "iteration", epoch)

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        key = ("grad", batch_size, epoch)
        if key not in self._memo:
            self._memo[key] = (self._lerp(batch_size, "grad_sqr", epoch), self._lerp(batch_size, "grad_var", epoch))
        return self._memo[key]

    def gain(self, batch_size: float, epoch: int) -> float:
        """Progress made by one step at ``batch_size`` during ``epoch``."""
        sqr, var = self.grad_stats(batch_size, epoch)
        scale = batch_size / self.init_batch_size
        return (var + sqr) / (var / scale + sqr)

    # -- speed --------------------------------------------------------------------------------

    def step_time(self, placement: tuple[int, ...], atomic_bsz: int) -> tuple[float, float]:
        """(step time, sync time) in seconds of one pass at ``atomic_bsz`` per GPU on
        ``placement`` (GPUs per node)."""
        key = (placement, atomic_bsz)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._step_time(placement, atomic_bsz)
        return hit

    def _step_time(self, placement: tuple[int, ...], atomic_bsz: int) -> tuple[float, float]:
        p = tuple(c for c in placement if c)
        if not p:
            raise ValueError("empty placement")
        p = min(p[i:] + p[:i] for i in range(len(p)))  # the measured tables key rotations so
        measured = self.placements.get(p)
        if measured is not None:
            bsz, step, sync = measured
            if not bsz[0] <= atomic_bsz <= bsz[-1]:
                raise ValueError(
                    f"{self.name}: per-GPU batch {atomic_bsz} on {p} is outside the measured {bsz[0]:g}..{bsz[-1]:g}"
                )
            return float(np.interp(atomic_bsz, bsz, step)), float(np.interp(atomic_bsz, bsz, sync))
        if self._interp is None:
            from scipy.interpolate import LinearNDInterpolator

            self._interp = LinearNDInterpolator(self.points, self.values)
        out = self._interp([min(len(p), 16), sum(p), atomic_bsz])[0]
        if not np.all(np.isfinite(out)):
            raise ValueError(
                f"{self.name}: no throughput for {p} at per-GPU batch {atomic_bsz} (outside what was measured)"
            )
        return float(out[0]), float(out[1])

    def fixed_batch(self, batch_size: int, replicas: int, single_gets_accum: bool = False) -> BatchConfig:
        """How ``batch_size`` is split over ``replicas`` GPUs: as little accumulation as the
        per-GPU limit allows. One GPU accumulates at least one extra pass when the batch exceeds
        the smallest measured one (Pollux's rule: the gradient-noise estimate needs two)."""
        local = math.ceil(batch_size / replicas - _EPS)
        accum = math.ceil(local / self.max_local_bsz - _EPS) - 1
        if replicas == 1 and (single_gets_accum or batch_size > self.init_batch_size):
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - _EPS)
        atomic = min(atomic, int(self.max_batch_size / (replicas * (accum + 1))))
        return BatchConfig(replicas, atomic, accum)

    def iteration_time(self, placement: tuple[int, ...], cfg: BatchConfig) -> float:
        """Seconds per optimizer step (accumulated passes included)."""
        step, sync = self.step_time(placement, cfg.atomic)
        return step + (step - sync) * cfg.accum_steps

    def goodput(self, placement: tuple[int, ...], cfg: BatchConfig, epoch: int) -> float:
        """Progress per second at this placement and batch split during ``epoch``."""
        return self.gain(cfg.batch_size, epoch) / self.iteration_time(placement, cfg)

    def batch_grid(self, replicas: int) -> list[BatchConfig]:
        """The batch splits a goodput-following job may take on ``replicas`` GPUs: total batch
        sizes on a geometric grid from the smallest allowed to the largest measured, each split
        as little as the per-GPU limit allows."""
        key = ("grid", replicas)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        lo = max(self.init_batch_size, self.min_local_bsz * replicas)
        grid = []
        for b in np.geomspace(lo, max(lo, self.max_batch_size), 24):
            local = b / replicas
            accum = math.ceil(local / self.max_local_bsz - _EPS) - 1
            if replicas == 1 and local > self.init_batch_size + _EPS:
                accum = max(accum, 1)
            atomic = math.ceil(local / (accum + 1) - _EPS)
            if not self.min_local_bsz <= atomic <= self.max_local_bsz:
                continue
            cfg = BatchConfig(replicas, atomic, accum)
            if cfg.batch_size <= self.max_batch_size:
                grid.append(cfg)
        self._memo[key] = grid
        return grid

    def best_batch(self, placement: tuple[int, ...], epoch: int) -> BatchConfig:
        """The batch split with the most goodput on ``placement`` (the ``adaptive`` batch
        size): total batch sizes on a geometric grid from the smallest allowed to the largest
        measured, each split as little as the per-GPU limit allows."""
        key = ("best", placement, epoch)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        best, best_rate = None, -1.0
        for cfg in self.batch_grid(sum(placement)):
            try:
                rate = self.goodput(placement, cfg, epoch)
            except ValueError:
                continue
            if rate > best_rate:
                best, best_rate = cfg, rate
        if best is None:
            replicas = sum(placement)
            best = self.fixed_batch(max(self.init_batch_size, self.min_local_bsz * replicas), replicas)
        self._memo[key] = best
        return best


@cache
def application(name: str) -> Application:
    """The profile of ``name`` (loaded once per process)."""
    return Application.load(name)


def even_placement(replicas: int, per_node: int = 4) -> tuple[int, ...]:
    """``replicas`` packed onto nodes of ``per_node`` GPUs: (4, 4, 2) for 10."""
    full, rest = divmod(replicas, per_node)
    return (per_node,) * full + ((rest,) if rest else ())
