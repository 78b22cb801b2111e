"""What a simulation leaves behind: the table, ``summary.json``, CSV timelines and PNG plots.

``summary.json`` maps each policy to ``avg_jct_s, p99_jct_s, makespan_s, utilization (eta: useful
over held GPU-time), allocation (held over available GPU-time), gpu_hours, cost`` and counts.
``timeline.csv`` has one row per policy and scheduling round; ``allocations.csv`` one row per
allocation change (the dashboard's replay reads both). The plots are drawn with matplotlib's
file-only backend: utilization over time, the JCT CDF, allocations per job, cumulative cost.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

from maitre.sim.simulator import SimResult

_COLUMNS = [
    ("policy", "{}"),
    ("avg JCT s", "{:.0f}"),
    ("p99 JCT s", "{:.0f}"),
    ("makespan s", "{:.0f}"),
    ("util η", "{:.1%}"),
    ("alloc", "{:.1%}"),
    ("GPU-h", "{:.1f}"),
    ("cost $", "{:,.0f}"),
]


def table(results: list[SimResult]) -> str:
    rows = [
        [
            fmt.format(v)
            for (_, fmt), v in zip(
                _COLUMNS,
                (r.policy, r.avg_jct_s, r.p99_jct_s, r.makespan_s, r.utilization, r.allocation, r.gpu_hours, r.cost),
            )
        ]
        for r in results
    ]
    head = [c for c, _ in _COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write(results: list[SimResult], out: Path, meta: dict | None = None, plots: bool = True) -> list[Path]:
    """Write everything under ``out`` (created if missing); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta or {}, **{r.policy: r.summary() for r in results}}
    files = [out / "summary.json", out / "timeline.csv", out / "allocations.csv"]
    _atomic_write(files[0], lambda f: f.write(json.dumps(summary, indent=2) + "\n"))

    def timeline(f) -> None:
        w = csv.writer(f)
        w.writerow(["policy", "time_s", "available_gpus", "allocated_gpus", "running_jobs", "queued_jobs", "cost"])
        for r in results:
            tl = r.timeline
            for i, t in enumerate(tl.time):
                w.writerow(
                    [
                        r.policy,
                        f"{t:.0f}",
                        tl.available[i],
                        tl.allocated[i],
                        tl.running[i],
                        tl.queued[i],
                        f"{tl.cost[i]:.2f}",
                    ]
                )

    def allocations(f) -> None:
        w = csv.writer(f)
        w.writerow(["policy", "time_s", "job", "gpus"])
        for r in results:
            for t, job, gpus in r.timeline.changes:
                w.writerow([r.policy, f"{t:.0f}", job, gpus])

    _atomic_write(files[1], timeline)
    _atomic_write(files[2], allocations)
    for r in results:  # `maitre dashboard DIR` replays these
        path = out / f"events-{r.policy}.jsonl"
        _atomic_write(path, lambda f, r=r: f.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in r.events))
        files.append(path)
    if plots:
        files += _plots(results, out)
    return files


def _plots(results: list[SimResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    hours = lambda ts: [t / 3600 for t in ts]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in results:
        tl = r.timeline
        ax.step(
            hours(tl.time),
            [a / v if v else 0 for a, v in zip(tl.allocated, tl.available)],
            where="post",
            label=r.policy,
            lw=1,
        )
    ax.set(xlabel="hours", ylabel="GPUs allocated / available", ylim=(0, 1.05), title="Utilization over time")
    ax.legend(loc="lower right")
    save(fig, "utilization.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        v = sorted(r.jcts.values())
        ax.step(
            [x / 3600 for x in v],
            [(i + 1) / len(v) for i in range(len(v))],
            where="post",
            label=f"{r.policy} (avg {r.avg_jct_s / 3600:.2f} h)",
        )
    ax.set(xscale="log", xlabel="job completion time, hours", ylabel="fraction of jobs", title="JCT CDF")
    ax.legend(loc="lower right")
    save(fig, "jct_cdf.png")

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.2 * len(results)), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], results):
        series: dict[str, tuple[list[float], list[int]]] = {}
        for t, job, gpus in r.timeline.changes:
            xs, ys = series.setdefault(job, ([], []))
            xs.append(t / 3600)
            ys.append(gpus)
        for xs, ys in list(series.values())[:400]:
            ax.step(xs, ys, where="post", lw=0.7, alpha=0.7)
        ax.set(ylabel="GPUs", title=f"{r.policy}: allocation per job")
    axes[-1, 0].set_xlabel("hours")
    save(fig, "allocations.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in results:
        ax.plot(hours(r.timeline.time), r.timeline.cost, label=f"{r.policy} (${r.cost:,.0f})")
    ax.set(xlabel="hours", ylabel="cumulative cost, $", title="Cost")
    ax.legend(loc="upper left")
    save(fig, "cost.png")
    return written
