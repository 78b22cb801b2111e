"""Scheduler benchmark: one scheduling pass over a large cluster, many times.

    python benchmarks/scheduler.py [--nodes 1024] [--slots 8] [--jobs 1000] [--passes 60]
                                   [--smoke] [--out benchmarks/results/scheduler.json]

The cluster has ``--nodes`` nodes of ``--slots`` GPUs in racks of 32 and blocks of 8 racks, and
four queues with guarantees. ``--jobs`` jobs of mixed shapes (1 to 8 GPUs per replica, fixed
gangs and elastic jobs, four priority levels) arrive; the first passes admit and place them
until the cluster is full and the rest queue, so that a measured pass sees about 1,000 running
and queued jobs with admission, preemption and elastic fill all in play. Each measured pass runs
on a fresh state (a new seed), from the same starting point as the live coordinator would:
the jobs' current placements. Prints p50 / p99 and writes them as JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from _results import parse, write_results  # noqa: E402
from maitre.scheduling import Cluster, Job, JobState, Node, Queue, schedule  # noqa: E402


def build(seed: int, nodes: int, slots: int, num_jobs: int) -> tuple[Cluster, list[Job]]:
    rng = random.Random(seed)
    total = nodes * slots
    queues = [Queue(f"team{i}", guaranteed=total // 5, borrowing_limit=None, weight=1.0 + i % 2) for i in range(4)]
    cluster = Cluster.of(
        [Node(f"n{i:04d}", slots, rack=f"r{i // 32:02d}", block=f"b{i // 256}") for i in range(nodes)], queues
    )
    jobs = []
    for i in range(num_jobs):
        per = rng.choice([1, 1, 2, 4, 8, 8])
        lo = rng.choice([1, 1, 2, 4])
        hi = lo if rng.random() < 0.3 else lo * rng.choice([2, 4])
        jobs.append(
            Job(
                id=f"j{i}",
                queue=rng.choice(queues).name,
                priority=rng.choice([0, 0, 0, 5, 5, 10]),
                min_replicas=lo,
                max_replicas=hi,
                slots_per_replica=per,
                submitted_at=float(i),
                throughput={1: 100.0, 2: 100.0 * (2 - rng.random() * 0.3)},
            )
        )
    # Arrivals in four waves, each followed by a pass carried out at once, so the measured
    # pass starts from a full cluster with a queue.
    now = 0.0
    for wave in range(4):
        now += 100.0
        for j in jobs[wave * num_jobs // 4 : (wave + 1) * num_jobs // 4]:
            j.submitted_at = now
        arrived = [j for j in jobs if j.submitted_at <= now]
        plan = schedule(cluster, arrived, now)
        for a in plan.actions:
            j = next(x for x in arrived if x.id == a.job)
            if a.kind in ("admit", "grow", "shrink"):
                j.placement, j.state, j.last_resize_at = dict(a.placement), JobState.RUNNING, now
            elif a.kind == "suspend":
                j.placement, j.state = {}, JobState.SUSPENDED
    return cluster, jobs


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: one scheduling pass over fresh states."""
    return "\n".join(
        [
            "| nodes x GPUs | jobs | states | running / queued (medians) | pass p50 | pass p99 |",
            "|---|---|---|---|---|---|",
            f"| {result['nodes']:,} x {result['slots_per_node']} | {result['jobs']:,} | "
            f"{result['passes']} | {result['running_median']:.0f} / {result['queued_median']:.0f} | "
            f"{result['pass_ms_p50']:.1f} ms | {result['pass_ms_p99']:.1f} ms |",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--passes", type=int, default=60)
    args = parse(p, "scheduler", smoke={"nodes": 16, "jobs": 40, "passes": 2})

    times, running, queued = [], [], []
    for seed in range(args.passes):
        cluster, jobs = build(seed, args.nodes, args.slots, args.jobs)
        running.append(sum(1 for j in jobs if j.placement))
        queued.append(sum(1 for j in jobs if not j.placement))
        start = time.perf_counter()
        schedule(cluster, jobs, 1000.0)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    result = {
        "pass_ms_p50": statistics.median(times),
        "pass_ms_p99": times[min(len(times) - 1, int(0.99 * len(times)))],
        "passes": len(times),
        "nodes": args.nodes,
        "slots_per_node": args.slots,
        "jobs": args.jobs,
        "running_median": statistics.median(running),
        "queued_median": statistics.median(queued),
    }
    print(
        f"| cluster | jobs (running / queued) | pass p50 | pass p99 |\n|---|---|---|---|\n"
        f"| {args.nodes} x {args.slots} | {args.jobs} ({result['running_median']:.0f} / "
        f"{result['queued_median']:.0f}) | {result['pass_ms_p50']:.1f} ms | "
        f"{result['pass_ms_p99']:.1f} ms |"
    )
    write_results(args.out, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
