"""What a simulation runs: jobs built from a workload for a policy, and clusters.

How a Pollux workload row becomes a job depends on the policy, as in Pollux's evaluation:

- ``fifo`` and ``tiresias`` run each job as a fixed gang of its ``num_replicas`` at its
  ``batch_size``;
- ``optimus`` keeps the batch size and scales the replicas from 1 up to what the batch allows;
- ``pollux`` scales from 1 and lets the scheduler pick the batch size by goodput (ncf keeps
  32768 on one GPU, as in Pollux's runs);
- ``maitre`` scales from 1 at the workload's batch size (maitre's default: the job learns what a
  fixed-size run learns), or at the goodput-best batch size when ``adaptive_batch`` is asked
  for, which is what makes it comparable with Pollux. Such a job, like Pollux's, also reports
  the goodput its fitted step-time model (:mod:`maitre.sim.perfmodel`) predicts on sizes up to
  ``explore`` times the largest it ran (2: Pollux's exploration limit).
"""

from __future__ import annotations

import math
import random

from maitre.sim.jobs import ProfiledJob, Recovery, SimJob, TraceJob
from maitre.sim.profiles import application
from maitre.sim.simulator import NodeEvent, SimNode
from maitre.sim.workload import Arrival, TraceArrival

STATIC = ("fifo", "tiresias")


def elastic_cap(app_name: str) -> int:
    """Most replicas a scaling policy may give a model (Pollux's cap, without its profiling
    warm-up): as many as the largest batch allows at the smallest per-GPU batch, at most 64."""
    app = application(app_name)
    if app_name == "ncf":
        return 1
    return min(64, app.max_batch_size // app.min_local_bsz)


def pollux_jobs(
    arrivals: list[Arrival],
    policy: str,
    *,
    recovery: Recovery | None = None,
    adaptive_batch: bool = False,
    gpus_per_node: int = 4,
    explore: float = 2.0,
) -> list[SimJob]:
    jobs: list[SimJob] = []
    for a in arrivals:
        app = application(a.application)
        kw = dict(recovery=recovery, gpus_per_node=gpus_per_node)
        if policy in STATIC:
            jobs.append(
                ProfiledJob(
                    a.name,
                    a.time,
                    app,
                    replicas=a.num_replicas,
                    batch_size=a.batch_size,
                    min_replicas=a.num_replicas,
                    **kw,
                )
            )
            continue
        if policy == "optimus":
            cap = 1 if app.name == "ncf" else a.batch_size // app.min_local_bsz
            jobs.append(
                ProfiledJob(
                    a.name,
                    a.time,
                    app,
                    replicas=a.num_replicas,
                    batch_size=a.batch_size,
                    max_replicas=max(1, cap),
                    **kw,
                )
            )
            continue
        adaptive = policy == "pollux" or adaptive_batch
        batch = a.batch_size
        if app.name == "ncf" and adaptive:
            batch, adaptive = 32768, False
        jobs.append(
            ProfiledJob(
                a.name,
                a.time,
                app,
                replicas=a.num_replicas,
                batch_size=None if adaptive else batch,
                explore=explore if policy == "maitre" and adaptive else 0.0,
                max_replicas=elastic_cap(app.name) if adaptive else max(1, min(64, batch // app.min_local_bsz)),
                **kw,
            )
        )
    return jobs


def cluster(
    nodes: int, gpus: int, *, price: float = 2.5, spot_nodes: int = 0, spot_price: float = 0.75
) -> list[SimNode]:
    """``nodes`` nodes of ``gpus`` GPUs; the last ``spot_nodes`` of them are spot."""
    if nodes < 1 or gpus < 1:
        raise ValueError(f"a cluster needs at least one node and one GPU per node, got {nodes}x{gpus}")
    if not 0 <= spot_nodes <= nodes:
        raise ValueError(f"spot nodes must be between 0 and {nodes}, got {spot_nodes}")
    return [
        SimNode(
            index=i, gpus=gpus, price=spot_price if i >= nodes - spot_nodes else price, spot=i >= nodes - spot_nodes
        )
        for i in range(nodes)
    ]


def parse_cluster(text: str) -> tuple[int, int]:
    """``16x4`` -> (16, 4)."""
    parts = text.lower().split("x")
    try:
        nodes, gpus = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--cluster must be NODESxGPUS such as 16x4, got {text!r}") from None
    if not (1 <= nodes <= 100_000 and 1 <= gpus <= 64):
        raise ValueError(f"--cluster {text}: need 1-100000 nodes of 1-64 GPUs")
    return nodes, gpus


# -- the Philly-derived trace ------------------------------------------------------------------


def philly_jobs(arrivals: list[TraceArrival], policy: str, *, recovery: Recovery | None = None) -> list[SimJob]:
    """Trace jobs: a fixed gang of the requested GPUs for the static policies; for the others,
    elastic between half and twice the request (an assumption: the trace does not say)."""
    jobs: list[SimJob] = []
    for a in arrivals:
        if policy in STATIC:
            lo = hi = a.gpus
        else:
            lo, hi = max(1, a.gpus // 2), a.gpus * 2
        jobs.append(
            TraceJob(
                a.name,
                a.time,
                a.duration_s,
                replicas=a.gpus,
                min_replicas=lo,
                max_replicas=hi,
                queue=a.team,
                recovery=recovery,
            )
        )
    return jobs


def philly_cluster_size(arrivals: list[TraceArrival], gpus_per_node: int = 8, headroom: float = 1.25) -> int:
    """Nodes for the trace: its mean GPU demand times ``headroom``, and at least its largest
    job."""
    span = max(a.time for a in arrivals) or 1.0
    demand = sum(a.duration_s * a.gpus for a in arrivals) / span
    biggest = max(a.gpus for a in arrivals)
    return max(math.ceil(demand * headroom / gpus_per_node), math.ceil(biggest / gpus_per_node))


# -- capacity that comes and goes --------------------------------------------------------------


def daytime_inference(
    nodes: int = 8,
    gpus: int = 4,
    inference_nodes: int = 6,
    days: int = 3,
    day_start_h: float = 8.0,
    day_end_h: float = 20.0,
    notice_s: float = 60.0,
) -> list[NodeEvent]:
    """A shared cluster where inference takes ``inference_nodes`` of the nodes from
    ``day_start_h`` to ``day_end_h`` every day (with ``notice_s`` of warning) and gives them back
    at night: on 8 nodes of 4 GPUs, a training job goes 32 -> 8 -> 32 GPUs. The run starts at
    midnight."""
    if not 0 <= inference_nodes <= nodes:
        raise ValueError(f"inference nodes must be between 0 and {nodes}")
    events = []
    taken = range(nodes - inference_nodes, nodes)
    for d in range(days):
        start, end = (d * 24 + day_start_h) * 3600, (d * 24 + day_end_h) * 3600
        for n in taken:
            events.append(NodeEvent(start - notice_s, n, "notice", notice_s))
            events.append(NodeEvent(end, n, "up"))
    return events


def pressure_curve(
    nodes: int,
    period_s: float = 6 * 3600,
    low: float = 0.25,
    step_s: float = 600,
    horizon_s: float = 2 * 86400,
    notice_s: float = 60.0,
) -> list[NodeEvent]:
    """Free capacity following a periodic pressure curve: the nodes left to training swing
    between ``low`` and all of them as ``(1 + cos(2 pi t / period)) / 2``, updated every
    ``step_s``; nodes leave with ``notice_s`` of warning, the highest indices first."""
    if not (0 <= low <= 1 and period_s > 0 and step_s > 0):
        raise ValueError("pressure curve: need 0 <= low <= 1 and positive period and step")
    events, up = [], nodes
    t = step_s
    while t <= horizon_s:
        frac = low + (1 - low) * (1 + math.cos(2 * math.pi * t / period_s)) / 2
        want = max(1, round(nodes * frac))
        for n in range(want, up):
            events.append(NodeEvent(t - notice_s, n, "notice", notice_s))
        for n in range(up, want):
            events.append(NodeEvent(t, n, "up"))
        up = want
        t += step_s
    return events


def spot_reclaims(
    nodes: list[SimNode],
    *,
    mean_life_s: float = 4 * 3600,
    notice_s: float = 120.0,
    back_after_s: float = 1800.0,
    horizon_s: float = 30 * 86400,
    seed: int = 0,
) -> list[NodeEvent]:
    """Reclaims of the spot nodes: each lives an exponential time of mean ``mean_life_s``, is
    reclaimed with ``notice_s`` of warning, and is replaced ``back_after_s`` later (a new spot
    node at the same price). Deterministic for a seed."""
    events = []
    for node in nodes:
        if not node.spot:
            continue
        rng = random.Random(f"{seed}:spot:{node.index}")
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mean_life_s)
            if t > horizon_s:
                break
            events.append(NodeEvent(t, node.index, "notice", notice_s))
            t += notice_s + back_after_s
            events.append(NodeEvent(t, node.index, "up"))
    return sorted(events, key=lambda e: (e.time, e.node))
