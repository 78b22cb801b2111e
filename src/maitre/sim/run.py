"""``maitre simulate``: resolve a workload, build each policy's jobs and cluster, run, report.

A workload is a file (a Pollux workload CSV, or a duration trace with Philly's columns) or a
built-in name:

- ``pollux-N`` or ``pollux-N@LOAD``: Pollux's workload N (1-8) at load 0.5, 1.0, 1.5 or 2.0,
  on 16 nodes x 4 GPUs unless ``--cluster`` says otherwise;
- ``philly``: the whole Philly-derived trace (82,247 jobs), on 8-GPU nodes sized to its mean
  demand with 25% headroom;
- ``daytime-inference``: one training job that may use 8 to 32 GPUs on 8 nodes x 4 GPUs, where
  inference takes 6 of the nodes from 08:00 to 20:00 (a minute's notice) and gives them back at
  night; the static baseline is a gang of 8;
- ``pressure``: Pollux's workload-6 on 16 x 4, with the nodes left to training following a
  periodic pressure curve (between a quarter and all of them, every 6 hours).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from maitre.sim import scenarios
from maitre.sim.jobs import Recovery, SimJob, TraceJob
from maitre.sim.policies import POLICIES, make_policy
from maitre.sim.simulator import NodeEvent, SimConfig, SimNode, SimResult, Simulation
from maitre.sim.workload import is_philly, load_philly, load_workload, pollux_workload

# In the repository, not in the package: an installed package uses the constants below.
_RECOVERY_JSON = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "recovery.json"
# maitre's measured costs (benchmarks/results/recovery.json, the median of 3 runs): the pause of
# the running workers while a joiner enters, and a crash to the next step with the survivors.
MEASURED_RESIZE_S = 0.031
MEASURED_FAILURE_S = 0.071


def measured_costs() -> tuple[float, float]:
    """(resize, failure) seconds from the recovery benchmark's last run, or the constants
    above when the file is not there (an installed package)."""
    try:
        data = json.loads(_RECOVERY_JSON.read_text())["maitre"]
        return float(data["join_pause_s"]), float(data["crash_to_step_s"])
    except (OSError, KeyError, ValueError, TypeError):
        return MEASURED_RESIZE_S, MEASURED_FAILURE_S


@dataclass(kw_only=True)
class SimOptions:
    workload: str
    policies: list[str]
    cluster: tuple[int, int] | None = None
    resize: str = "30"
    """Seconds, or ``measured`` (maitre's own from the recovery benchmark)."""
    adaptive_batch: bool = False
    spot: float = 0.0
    """Fraction of nodes that are spot."""
    price: float = 2.5
    spot_price: float = 0.75
    spot_life_h: float = 4.0
    notice_s: float = 120.0
    mtbf_h: float = math.inf
    checkpoint_s: float = 0.0
    interval_s: float = 60.0
    seed: int = 0
    limit: int | None = None
    plots: bool = True
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError("a policy is named twice")
        if not 0 <= self.spot <= 1:
            raise ValueError(f"--spot is a fraction of the nodes, 0..1; got {self.spot}")
        for name in ("price", "spot_price", "spot_life_h", "notice_s", "mtbf_h", "checkpoint_s", "interval_s"):
            v = getattr(self, name)
            if not v >= 0 or (name in ("interval_s", "spot_life_h", "mtbf_h") and not v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
        if self.resize != "measured":
            try:
                ok = float(self.resize) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--resize is seconds >= 0 or 'measured', got {self.resize!r}")

    def recovery(self, policy: str) -> Recovery:
        if self.resize == "measured":
            resize, failure = measured_costs()
        else:
            resize = failure = float(self.resize)
        return Recovery(
            resize_s=resize,
            failure_pause_s=max(failure, resize),
            peer_recovery=policy == "maitre",
            checkpoint_s=self.checkpoint_s,
        )


@dataclass
class Setup:
    jobs: Callable[[str, Recovery], list[SimJob]]
    nodes: int
    gpus: int
    events: list[NodeEvent] = field(default_factory=list)


def resolve(opts: SimOptions) -> Setup:
    """The workload's jobs (per policy), default cluster and capacity events."""
    name = opts.workload
    m = re.fullmatch(r"pollux-([1-8])(?:@(0\.5|1\.0|1|1\.5|2\.0|2))?", name)
    if m:
        arrivals = load_workload(pollux_workload(int(m[1]), float(m[2] or 1.0)))
        return _pollux(arrivals[: opts.limit] if opts.limit else arrivals, opts)
    if name == "philly":
        return _philly(load_philly(limit=opts.limit))
    if name == "pressure":
        setup = _pollux(load_workload(pollux_workload(6, 1.0)), opts)
        nodes = opts.cluster[0] if opts.cluster else setup.nodes
        setup.events = scenarios.pressure_curve(nodes, horizon_s=4 * 86400)
        return setup
    if name == "daytime-inference":

        def jobs(policy: str, rec: Recovery) -> list[SimJob]:
            static = policy in scenarios.STATIC
            return [
                TraceJob(
                    "train", 0.0, 4 * 86400, replicas=8, min_replicas=8, max_replicas=8 if static else 32, recovery=rec
                )
            ]

        return Setup(jobs, 8, 4, scenarios.daytime_inference(days=8))
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"--workload {name!r}: no such file, and not one of pollux-N[@LOAD], philly, daytime-inference, pressure"
        )
    if is_philly(path):
        return _philly(load_philly(path, limit=opts.limit))
    arrivals = load_workload(path)
    return _pollux(arrivals[: opts.limit] if opts.limit else arrivals, opts)


def _pollux(arrivals, opts: SimOptions) -> Setup:
    return Setup(
        lambda policy, rec: scenarios.pollux_jobs(
            arrivals,
            policy,
            recovery=rec,
            adaptive_batch=opts.adaptive_batch,
            gpus_per_node=opts.cluster[1] if opts.cluster else 4,
        ),
        16,
        4,
    )


def _philly(arrivals) -> Setup:
    return Setup(
        lambda policy, rec: scenarios.philly_jobs(arrivals, policy, recovery=rec),
        scenarios.philly_cluster_size(arrivals),
        8,
    )


def _progress_bar(policy: str) -> Callable[[int, int, float], None]:
    state = {"shown": -1}

    def show(done: int, total: int, now: float) -> None:
        pct = int(100 * done / total) if total else 100
        if pct == state["shown"]:
            return
        state["shown"] = pct
        bar = "#" * (pct // 4)
        sys.stderr.write(f"\r{policy:>9} [{bar:<25}] {pct:3d}%  {done}/{total} jobs  t={now / 3600:.1f} h")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def simulate(opts: SimOptions, progress: bool = False, setup: Setup | None = None) -> list[SimResult]:
    setup = setup or resolve(opts)
    nodes, gpus = opts.cluster or (setup.nodes, setup.gpus)
    results = []
    for policy in opts.policies:
        spot_nodes = round(nodes * opts.spot)
        cluster: list[SimNode] = scenarios.cluster(
            nodes, gpus, price=opts.price, spot_nodes=spot_nodes, spot_price=opts.spot_price
        )
        events = list(setup.events)
        if spot_nodes:
            events += scenarios.spot_reclaims(
                cluster,
                mean_life_s=opts.spot_life_h * 3600,
                notice_s=opts.notice_s,
                seed=opts.seed,
                horizon_s=400 * 86400,
            )
        sim = Simulation(
            setup.jobs(policy, opts.recovery(policy)),
            cluster,
            make_policy(policy),
            SimConfig(interval_s=opts.interval_s, node_mtbf_s=opts.mtbf_h * 3600, seed=opts.seed),
            node_events=events,
            prices={"on-demand": opts.price, "spot": opts.spot_price},
            progress=_progress_bar(policy) if progress and sys.stderr.isatty() else None,
        )
        results.append(sim.run())
    return results


def main(opts: SimOptions, out: Path, progress: bool = True) -> list[SimResult]:
    """Run, print the table, write the outputs."""
    from maitre.sim import report

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if opts.limit is not None and opts.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {opts.limit}")
    setup = resolve(opts)
    results = simulate(opts, progress=progress, setup=setup)
    nodes, gpus = opts.cluster or (setup.nodes, setup.gpus)
    meta = {
        "workload": opts.workload,
        "cluster": f"{nodes}x{gpus}",
        "resize": opts.resize,
        "adaptive_batch": opts.adaptive_batch,
        "spot": opts.spot,
        "seed": opts.seed,
        **opts.meta,
    }
    print(
        f"workload {opts.workload} on {nodes}x{gpus} GPUs, resize cost {opts.resize}"
        + (" s" if opts.resize != "measured" else "")
    )
    print(report.table(results))
    files = report.write(results, out, meta, plots=opts.plots)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return results
