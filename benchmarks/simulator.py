"""Simulator benchmark: speed, fidelity and what maitre's policy gives on the Pollux workloads.

    .venv/bin/python benchmarks/simulator.py          # about 27 minutes on 2 cores
        [--workloads 1,2,3,4,5,6,7,8] [--loads 0.5,1.5,2.0] [--limit JOBS] [--smoke]
        [--out benchmarks/results/simulator.json]

- speed: workload-6 with Tiresias (Pollux's own simulator: 32 s on this machine) and the whole
  Philly-derived trace (82,247 jobs) on a cluster sized to it;
- fidelity: Tiresias and Optimus mean JCT over the 8 workloads at load 1.0 against Pollux's
  published results;
- maitre's policy (goodput batch size, as Pollux) over the 8 workloads at load 1.0, with
  Pollux's 30 s resize and with maitre's measured resize, against Pollux's published 2751 s,
  and at loads 0.5, 1.5 and 2.0 (a held-out check: the policy's settings were chosen at 1.0);
- the scenarios: daytime inference (elastic vs a static gang) and spot vs on-demand.

``--limit`` keeps the first JOBS jobs of each workload and of the Philly trace (``--smoke``: 2
jobs of workload 8, load 0.5 alone). Writes benchmarks/results/simulator.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _results import parse, write_results  # noqa: E402
from maitre.sim.jobs import Recovery  # noqa: E402
from maitre.sim.policies import make_policy  # noqa: E402
from maitre.sim.run import SimOptions, measured_costs, simulate  # noqa: E402
from maitre.sim.scenarios import (  # noqa: E402
    cluster,
    philly_cluster_size,
    philly_jobs,
    pollux_jobs,
)
from maitre.sim.simulator import Simulation  # noqa: E402
from maitre.sim.workload import DATA, load_philly, load_workload, pollux_workload  # noqa: E402

WORKLOADS: list[int] = list(range(1, 9))
"""The Pollux workloads averaged over (``--workloads``)."""
LIMIT: int | None = None
"""The first jobs of each workload and trace (``--limit``; None: all)."""


def _avg_jct(args: tuple[str, int, float, float, bool, int | None]) -> float:
    policy, number, load, resize_s, adaptive, limit = args
    jobs = pollux_jobs(
        load_workload(pollux_workload(number, load))[:limit],
        policy,
        recovery=Recovery(resize_s=resize_s),
        adaptive_batch=adaptive,
    )
    return Simulation(jobs, cluster(16, 4), make_policy(policy)).run().avg_jct_s


def pollux_mean(policy: str, resize_s: float = 30.0, adaptive: bool = False, load: float = 1.0) -> float:
    """Mean over the workloads (8) of the average JCT (two workloads at a time)."""
    with ProcessPoolExecutor(2) as pool:
        return sum(pool.map(_avg_jct, [(policy, n, load, resize_s, adaptive, LIMIT) for n in WORKLOADS])) / len(
            WORKLOADS
        )


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: the mean over the 8 Pollux workloads of the
    average JCT at load 1.0 against the results Pollux published, maitre's policy at the other
    loads, the speed, and the scenarios."""

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    lines = ["| policy | maitre's simulator | published |", "|---|---|---|"]
    for policy, r in result["load1_mean_avg_jct_s"].items():
        published = "-" if r["published"] is None else f"{r['published']:.0f} s"
        lines.append(f"| {policy} | {r['ours']:.0f} s | {published} |")
    lines += ["", "| load (held out) | maitre, goodput batch | Pollux, published |", "|---|---|---|"]
    for load, r in result["maitre_goodput_batch_by_load"].items():
        lines.append(f"| {load} | {r['ours']:.0f} s | {r['published_pollux']:.0f} s |")
    lines += [
        "",
        f"Speed ({result['machine']}): Pollux's workload-6 with Tiresias in "
        f"{result['workload6_tiresias_s']:.2f} s (Pollux's own simulator: "
        f"{result['pollux_simulator_workload6_tiresias_s']:.0f} s); the Philly-derived trace, "
        f"{result['philly_full_jobs']:,} jobs on {result['philly_cluster']} GPUs with Tiresias, "
        f"in {result['philly_full_s']:.1f} s.",
        "",
        "| scenario/policy | avg JCT | makespan | allocation | util η | cost $ |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["scenarios"].items():
        lines.append(
            f"| {name} | {r['avg_jct_s']:.0f} | {r['makespan_s']:.0f} | "
            f"{pct(r['allocation'])} | {pct(r['utilization'])} | {r['cost']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    global WORKLOADS, LIMIT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="1,2,3,4,5,6,7,8", help="the Pollux workloads averaged over, comma-separated")
    p.add_argument("--loads", default="0.5,1.5,2.0", help="the held-out loads, comma-separated")
    p.add_argument("--limit", type=int, help="the first JOBS jobs of each workload and trace")
    args = parse(p, "simulator", smoke={"workloads": "8", "loads": "0.5", "limit": 2})
    WORKLOADS = [int(n) for n in args.workloads.split(",")]
    LIMIT = args.limit
    res: dict = {"machine": f"{platform.machine()}, python {platform.python_version()}"}
    if LIMIT is not None or WORKLOADS != list(range(1, 9)):
        res["subset"] = {"workloads": WORKLOADS, "jobs_per_workload": LIMIT}
    t = time.perf_counter()
    jobs = pollux_jobs(load_workload(pollux_workload(6, 1.0))[:LIMIT], "tiresias")
    r = Simulation(jobs, cluster(16, 4), make_policy("tiresias")).run()
    res["workload6_tiresias_s"] = round(time.perf_counter() - t, 2)
    res["workload6_tiresias_avg_jct_s"] = round(r.avg_jct_s, 1)
    res["pollux_simulator_workload6_tiresias_s"] = 32.0

    arrivals = load_philly(limit=LIMIT)
    nodes = philly_cluster_size(arrivals)
    t = time.perf_counter()
    r = Simulation(philly_jobs(arrivals, "tiresias"), cluster(nodes, 8), make_policy("tiresias")).run()
    res["philly_full_s"] = round(time.perf_counter() - t, 1)
    res["philly_full_jobs"] = len(r.jcts)
    res["philly_cluster"] = f"{nodes}x8"
    res["philly_tiresias"] = r.summary()
    print(
        f"workload-6 tiresias {res['workload6_tiresias_s']} s; philly {res['philly_full_s']} s "
        f"for {len(r.jcts)} jobs on {nodes}x8",
        flush=True,
    )

    published = {
        p: json.loads((DATA / "pollux_reference_results" / f"{p}-1.0.summary.json").read_text())["mean"]
        for p in ("tiresias", "optimus", "pollux")
    }
    resize, _ = measured_costs()
    rows = {
        "tiresias": (pollux_mean("tiresias"), published["tiresias"]),
        "optimus": (pollux_mean("optimus"), published["optimus"]),
        "pollux (greedy)": (pollux_mean("pollux"), published["pollux"]),
        "maitre, fixed batch": (pollux_mean("maitre"), None),
        "maitre, goodput batch": (pollux_mean("maitre", adaptive=True), published["pollux"]),
        f"maitre, goodput batch, {resize * 1000:.0f} ms resize": (
            pollux_mean("maitre", resize, adaptive=True),
            published["pollux"],
        ),
    }
    res["load1_mean_avg_jct_s"] = {
        k: {"ours": round(v, 1), "published": p and round(p, 1)} for k, (v, p) in rows.items()
    }
    print(f"\nmean of {len(WORKLOADS)} Pollux workloads' average JCT at load 1.0, 16x4 GPUs")
    print(f"{'policy':<36} {'maitre sim':>10} {'published':>10}")
    for k, (v, p) in rows.items():
        print(f"{k:<36} {v:>10.0f} {'-' if p is None else str(round(p)):>10}")

    # The policy's settings were chosen on load 1.0; the other loads are the held-out check.
    by_load = {}
    for load in (float(x) for x in args.loads.split(",")):
        ref = json.loads((DATA / "pollux_reference_results" / f"pollux-{load}.summary.json").read_text())["mean"]
        by_load[str(load)] = {
            "ours": round(pollux_mean("maitre", adaptive=True, load=load), 1),
            "published_pollux": round(ref, 1),
        }
        print(
            f"load {load}: maitre, goodput batch {by_load[str(load)]['ours']:.0f} s, Pollux published {ref:.0f} s",
            flush=True,
        )
    res["maitre_goodput_batch_by_load"] = by_load

    scen = {}
    for name, policies, extra in [
        ("daytime-inference", ["maitre", "fifo"], {}),
        ("pressure", ["maitre", "fifo"], {}),
        ("pollux-6", ["maitre"], {"adaptive_batch": True}),
        ("pollux-6", ["maitre"], {"adaptive_batch": True, "spot": 1.0}),
        ("pollux-6", ["tiresias"], {"spot": 1.0}),
    ]:
        opts = SimOptions(workload=name, policies=policies, limit=LIMIT, **extra)
        for r in simulate(opts):
            key = f"{name}/{r.policy}" + ("/spot" if extra.get("spot") else "")
            scen[key] = r.summary()
    res["scenarios"] = scen
    print("\nscenario              avg JCT s  makespan s  alloc   util η   cost $")
    for k, v in scen.items():
        print(
            f"{k:<30} {v['avg_jct_s']:>9.0f} {v['makespan_s']:>10.0f} {v['allocation']:>6.1%} "
            f"{v['utilization']:>7.1%} {v['cost']:>8,.0f}"
        )
    print()
    write_results(args.out, res, smoke=args.smoke, indent=1)


if __name__ == "__main__":
    sys.exit(main())
