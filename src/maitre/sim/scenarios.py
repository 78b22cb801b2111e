"""What a simulation runs: jobs built from a workload for a policy, and clusters.

How a Pollux workload row becomes a job depends on the policy, as in Pollux's evaluation:

- ``fifo`` and ``tiresias`` run each job as a fixed gang of its ``num_replicas`` at its
  ``batch_size``;
- ``optimus`` keeps the batch size and scales the replicas from 1 up to what the batch allows;
- ``pollux`` scales from 1 and lets the scheduler pick the batch size by goodput (ncf keeps
  32768 on one GPU, as in Pollux's runs);
- ``maitre`` scales from 1 at the workload's batch size (maitre's default: the job learns what a
  fixed-size run learns), or at the goodput-best batch size when ``adaptive_batch`` is asked
  for, which is what makes it comparable with Pollux.
"""

from __future__ import annotations

from maitre.sim.jobs import ProfiledJob, Recovery, SimJob
from maitre.sim.profiles import application
from maitre.sim.simulator import SimNode
from maitre.sim.workload import Arrival

STATIC = ("fifo", "tiresias")


def elastic_cap(app_name: str) -> int:
    """Most replicas a scaling policy may give a model (Pollux's cap, without its profiling
    warm-up): as many as the largest batch allows at the smallest per-GPU batch, at most 64."""
    app = application(app_name)
    if app_name == "ncf":
        return 1
    return min(64, app.max_batch_size // app.min_local_bsz)


def pollux_jobs(arrivals: list[Arrival], policy: str, *, recovery: Recovery | None = None,
                adaptive_batch: bool = False, gpus_per_node: int = 4) -> list[SimJob]:
    jobs: list[SimJob] = []
    for a in arrivals:
        app = application(a.application)
        kw = dict(recovery=recovery, gpus_per_node=gpus_per_node)
        if policy in STATIC:
            jobs.append(ProfiledJob(a.name, a.time, app, replicas=a.num_replicas,
                                    batch_size=a.batch_size, min_replicas=a.num_replicas, **kw))
            continue
        if policy == "optimus":
            cap = 1 if app.name == "ncf" else a.batch_size // app.min_local_bsz
            jobs.append(ProfiledJob(a.name, a.time, app, replicas=a.num_replicas,
                                    batch_size=a.batch_size, max_replicas=max(1, cap), **kw))
            continue
        adaptive = policy == "pollux" or adaptive_batch
        batch = a.batch_size
        if app.name == "ncf" and adaptive:
            batch, adaptive = 32768, False
        jobs.append(ProfiledJob(a.name, a.time, app, replicas=a.num_replicas,
                                batch_size=None if adaptive else batch,
                                max_replicas=elastic_cap(app.name) if adaptive else
                                max(1, min(64, batch // app.min_local_bsz)), **kw))
    return jobs


def cluster(nodes: int, gpus: int, *, price: float = 2.5, spot_nodes: int = 0,
            spot_price: float = 0.75) -> list[SimNode]:
    """``nodes`` nodes of ``gpus`` GPUs; the last ``spot_nodes`` of them are spot."""
    if nodes < 1 or gpus < 1:
        raise ValueError(f"a cluster needs at least one node and one GPU per node, got "
                         f"{nodes}x{gpus}")
    if not 0 <= spot_nodes <= nodes:
        raise ValueError(f"spot nodes must be between 0 and {nodes}, got {spot_nodes}")
    return [SimNode(index=i, gpus=gpus, price=spot_price if i >= nodes - spot_nodes else price,
                    spot=i >= nodes - spot_nodes) for i in range(nodes)]


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
