"""A job's model of its own speed, fitted to the steps it has timed (Pollux's throughput model).

A job whose batch size follows goodput can tell the scheduler more than what it measured: it
knows its gradient statistics (so its statistical efficiency at any batch size) and it has timed
its steps on every placement and per-GPU batch it ran. Fitting a step-time model to those timings
lets it predict its goodput on sizes it never ran, which is what lets a scheduler see that a job
that slows down crossing from one node to two gains again at four.

The model is the one Pollux's jobs fit (Qiao et al., OSDI'21, section 3.2), written here from the
paper's equations:

- compute time of one pass at ``m`` samples per GPU: ``alpha_c + beta_c m``;
- synchronization of ``r`` replicas: none for one replica, else ``alpha + beta (r - 2)`` with
  one pair of constants inside a node and another across nodes;
- a step overlaps the two: ``(compute^gamma + sync^gamma)^(1/gamma)``, ``gamma`` in [1, 10];
- accumulated passes (no synchronization) add ``compute`` each.

The constants minimize the root-mean-square log error of the predicted step and compute times.
What the observations cannot show is fixed optimistically, as Pollux does: a job that never
crossed a node is assumed to synchronize across nodes only 10% slower than inside one, so the
scheduler will try it (and the job then measures, and the model corrects itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_TINY = 1e-8


@dataclass(frozen=True, slots=True)
class PerfParams:
    alpha_c: float
    beta_c: float
    alpha_node: float
    """Sync latency across nodes."""
    beta_node: float
    alpha_local: float
    """Sync latency inside one node."""
    beta_local: float
    gamma: float

    def step_time(self, nodes: int, replicas: int, atomic, accum_steps=0):
        """Seconds per optimizer step (``atomic`` and ``accum_steps`` may be arrays)."""
        compute = self.alpha_c + self.beta_c * np.asarray(atomic, dtype=float)
        sync = _sync(self, np.asarray(nodes), np.asarray(replicas))
        step = (compute**self.gamma + sync**self.gamma) ** (1 / self.gamma)
        return step + compute * np.asarray(accum_steps)


def _sync(p: PerfParams | np.ndarray, nodes: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    a_c, b_c, a_n, b_n, a_l, b_l, _ = (
        p
        if isinstance(p, np.ndarray)
        else (p.alpha_c, p.beta_c, p.alpha_node, p.beta_node, p.alpha_local, p.beta_local, p.gamma)
    )
    alpha = np.where(nodes > 1, a_n, np.where(replicas > 1, a_l, _TINY))
    beta = np.where(nodes > 1, b_n, np.where(replicas > 1, b_l, _TINY))
    return alpha + beta * np.maximum(replicas - 2, _TINY)


def fit(
    nodes: list[int],
    replicas: list[int],
    atomic: list[float],
    step: list[float],
    compute: list[float],
    start: PerfParams | None = None,
) -> PerfParams:
    """Fit the model to timed steps: per observation the placement's node and replica counts,
    the per-GPU batch, the step time and its compute part (step minus synchronization).
    ``start`` is where the search begins (the previous fit: a refit then takes a few steps)."""
    from scipy.optimize import minimize

    n, r, m = (np.asarray(v, dtype=float) for v in (nodes, replicas, atomic))
    t_step, t_comp = np.log(np.asarray(step, float)), np.log(np.asarray(compute, float))

    across = n > 1
    inside = (n == 1) & (r > 1)
    d = np.maximum(r - 2, _TINY)
    count = len(m)

    def loss(x: np.ndarray) -> tuple[float, np.ndarray]:
        """The error and its gradient (written out: a numerical one made fits 10x slower)."""
        comp = x[0] + x[1] * m
        sync = _sync(x, n, r)
        g = x[6]
        cg, sg = comp**g, sync**g
        total = cg + sg
        e1 = np.log(comp) - t_comp
        e2 = np.log(total) / g - t_step
        rms1, rms2 = np.sqrt(np.mean(e1**2)), np.sqrt(np.mean(e2**2))
        # Prefer a small gamma and small per-replica terms: the optimistic model among equals.
        err = rms1 + rms2 + 1e-3 * (g - 1) ** 2 + 1e-2 * ((x[3] / x[2]) ** 2 + (x[5] / x[4]) ** 2)
        w1 = e1 / (count * max(rms1, _TINY))
        w2 = e2 / (count * max(rms2, _TINY))
        d_comp = w1 / comp + w2 * cg / comp / total  # d err / d comp, per observation
        d_sync = w2 * sg / sync / total
        grad = np.array(
            [
                d_comp.sum(),
                (d_comp * m).sum(),
                d_sync[across].sum(),
                (d_sync * d)[across].sum(),
                d_sync[inside].sum(),
                (d_sync * d)[inside].sum(),
                (w2 * ((cg * np.log(comp) + sg * np.log(sync)) / (g * total) - np.log(total) / g**2)).sum()
                + 2e-3 * (g - 1),
            ]
        )
        grad[2] -= 2e-2 * x[3] ** 2 / x[2] ** 3
        grad[3] += 2e-2 * x[3] / x[2] ** 2
        grad[4] -= 2e-2 * x[5] ** 2 / x[4] ** 3
        grad[5] += 2e-2 * x[5] / x[4] ** 2
        return float(err), grad

    x0 = np.array(
        [0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.001]
        if start is None
        else [
            start.alpha_c,
            start.beta_c,
            start.alpha_node,
            start.beta_node,
            start.alpha_local,
            start.beta_local,
            start.gamma,
        ]
    )
    lower = np.array([_TINY] * 6 + [1.0])
    upper = np.array([math.inf] * 6 + [10.0])

    def pin(i: int, value: float = _TINY) -> None:
        x0[i] = lower[i] = upper[i] = value

    if len(np.unique(m)) == 1:  # one batch size: split its compute time evenly
        pin(0, float(np.mean(np.exp(t_comp))) / 2)
    multi_node = bool(np.any(n > 1))
    if not multi_node:
        pin(2), pin(3)
    if not np.any((n == 1) & (r > 1)):
        pin(4), pin(5)
    if not np.any(r > 2):
        pin(3), pin(5)
    bounds = [(lo, None if math.isinf(hi) else hi) for lo, hi in zip(lower, upper)]
    x0 = np.clip(x0, lower, upper)
    x = minimize(loss, x0, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 60}).x
    if not multi_node:  # never crossed a node: assume it costs 10% more than inside one
        x[2], x[3] = max(x[2], 1.1 * x[4]), max(x[3], 1.1 * x[5])
    return PerfParams(*(float(v) for v in x))
