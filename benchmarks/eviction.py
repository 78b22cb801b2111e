"""Eviction benchmark: a job of 3 replicas with one node slow, under ``stragglers: {policy:
evict}``: how fast it trains before the straggler is found, between the verdict and the
replacement's first step, and after, against the same world size on nodes never slow.

    python benchmarks/eviction.py [--steps 400] [--factor 2.0] [--ms-per-sample 4] [--ratio R]
                                  [--reps 3] [--smoke] [--out benchmarks/results/eviction.json]

Pairs of runs, ``--reps`` (3), each a slow run then its reference (a local cluster, ``maitre
up``'s, of single-slot nodes on this machine); the medians over the pairs, each pair's numbers
in ``pairs``:

* **slow**: nodes node-0..2 (node-0's agent gives its workers ``MAITRE_SLOW_FACTOR``: each step's
  compute there takes ``1 + factor`` times as long, a node whose CPUs a neighbour steals), the
  job admitted on them, then node-3 joins free. The detector flags node-0's rank, the
  coordinator evicts its replica (it leaves at a step boundary), node-0 turns suspect and the
  job grows onto node-3 at once.
* **reference**: the same job on three nodes that are never slow.

Throughput is committed steps per second from the data ledger (each step's first commit time):
``throughput_before`` from the 5th step to the ``straggler`` event, ``throughput_during`` from
it to the first step of the epoch with the replacement in, ``throughput_after`` from 10 steps
after that to the end, ``throughput_reference`` over the reference run's same steps as
``after``; ``throughput_recovered_pct`` = after / reference * 100 (issue 15's target: within
5%, i.e. at least 95). Raw numbers come along: the steps of each phase, ``detect_steps`` (from
the first step to the verdict's), ``evict_to_join_s``.

Imported by ``benchmarks/stragglers.py`` (``measure(**opts) -> dict``; ``SMOKE``: its
``--smoke``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from _results import parse, write_results  # noqa: E402
from maitre import protocol  # noqa: E402
from maitre.agent.health import HealthConfig  # noqa: E402
from maitre.local import LocalCluster, UpConfig  # noqa: E402
from maitre.scheduling.model import Queue  # noqa: E402
from maitre.scheduling.policy import PolicyConfig  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "train.py"
TINY = [
    "--dtype",
    "float64",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--block",
    "16",
    "--global-batch",
    "12",
    "--micro-batch",
    "4",
    "--log-every",
    "1000",
]
SKIP_START, SKIP_AFTER = 5, 10
SMOKE = {"steps": 60, "reps": 1}
""":func:`measure`'s arguments for ``--smoke`` (here and in ``benchmarks/stragglers.py``): one
pair, long enough for the verdict (15 steps of windows), the replacement and 10 steps after."""


def step_times(ledger: Path) -> dict[int, float]:
    """Each committed step's first commit time (wall clock), from the job's ledger."""
    first: dict[int, float] = {}
    for path in sorted(ledger.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("k") == "c":
                first[rec["s"]] = min(rec["t"], first.get(rec["s"], float("inf")))
    return first


def rate(times: dict[int, float], lo: float, hi: float) -> tuple[float | None, int]:
    """Steps per second of the steps committed in [lo, hi] (None with fewer than 3)."""
    inside = sorted(t for t in times.values() if lo <= t <= hi)
    if len(inside) < 3:
        return None, len(inside)
    return (len(inside) - 1) / (inside[-1] - inside[0]), len(inside)


def run(
    work: Path,
    *,
    slow: bool,
    steps: int = 400,
    factor: float = 2.0,
    ms_per_sample: float = 4.0,
    timeout_s: float = 300.0,
    stragglers: dict[str, Any] | None = None,
    probes: bool = False,
) -> dict[str, Any]:
    """One run (see the module docstring); its events, step times and final job status.
    ``stragglers``: the manifest's detector settings beyond ``policy: evict``. ``probes``: each
    node's agent runs a health check that passes (``true``), at start and when asked: a suspect
    node is cleared by the probe its agent is asked for."""
    health = HealthConfig(builtin=False, interval_s=0, timeout_s=10, command=["true"]) if probes else None
    lines: list[str] = []
    cluster = LocalCluster(
        UpConfig(state_dir=work / "state", queues=[Queue("q")], policy=PolicyConfig(resize_cooldown_s=1.0)),
        out=lines.append,
    ).start()
    co = cluster.coordinator
    try:
        cluster.add_node(slots=1, env={protocol.SLOW_FACTOR: str(factor)} if slow else None, health=health)
        cluster.add_node(slots=1, health=health)
        cluster.add_node(slots=1, health=health)
        _wait(lambda: len(co.nodes_view()) == 3, 30, "three nodes", lines)
        co.submit(
            {
                "name": "a",
                "queue": "q",
                "minReplicas": 2,
                "maxReplicas": 3,
                "command": [
                    sys.executable,
                    str(EXAMPLE),
                    "--steps",
                    str(steps),
                    *TINY,
                    "--device-ms-per-sample",
                    f"{ms_per_sample:g}",
                    "--out",
                    str(work / "final.pt"),
                ],
                "stragglers": {**(stragglers or {}), "policy": "evict", "cooldownSeconds": 600},
            }
        )
        _wait(
            lambda: co.job_status("a")["step"] >= 1 or co.job_status("a")["state"] == "FAILED",
            120,
            "the first step",
            lines,
        )
        if slow:
            cluster.add_node(slots=1, health=health)  # node-3: free, for the replacement
        _wait(lambda: co.job_status("a")["state"] in ("COMPLETED", "FAILED"), timeout_s, "the job to end", lines)
        status = co.job_status("a")
        events = list(cluster.db.events())
        nodes = co.nodes_view()
    finally:
        cluster.stop(drain_s=10)
    return {
        "status": status,
        "events": events,
        "nodes": nodes,
        "lines": lines,
        "times": step_times(work / "state" / "ledger" / "a"),
        "ledger": work / "state" / "ledger" / "a",
    }


def phases(slow: dict[str, Any]) -> dict[str, Any]:
    """The slow run's phases: before the verdict, to the replacement's epoch, after."""
    times, events = slow["times"], slow["events"]
    verdict = next((e for e in events if e["kind"] == "straggler"), None)
    if verdict is None:
        return {"detected": False}
    t_found = verdict["t"]
    gone = verdict["worker"]
    joined = next(
        (
            e
            for e in events
            if e["kind"] == "epoch"
            and e.get("job") == "a"
            and e["t"] > t_found
            and gone not in e["members"]
            and len(e["members"]) == 3
        ),
        None,
    )
    t_join = joined["t"] if joined is not None else float("inf")
    start = times.get(SKIP_START, min(times.values()))
    after_steps = sorted(s for s, t in times.items() if t >= t_join)
    settled = after_steps[SKIP_AFTER] if len(after_steps) > SKIP_AFTER else None
    end = max(times.values())
    before, n_before = rate(times, start, t_found)
    during, n_during = rate(times, t_found, t_join)
    after, n_after = rate(times, times[settled], end) if settled is not None else (None, 0)
    return {
        "detected": True,
        "verdict": verdict,
        "t_found": t_found,
        "t_join": t_join,
        "settled_step": settled,
        "throughput_before": before,
        "steps_before": n_before,
        "throughput_during": during,
        "steps_during": n_during,
        "throughput_after": after,
        "steps_after": n_after,
        "detect_steps": verdict["step"] - min(times),
        "evict_to_join_s": None if joined is None else round(t_join - t_found, 3),
    }


def measure(
    steps: int = 400,
    factor: float = 2.0,
    ms_per_sample: float = 4.0,
    work: Path | None = None,
    stragglers: dict[str, Any] | None = None,
    reps: int = 3,
) -> dict[str, Any]:
    """``reps`` pairs of runs, a slow one then its reference, one after the other (the load of
    a shared machine drifts: a pair's two runs see about the same), and the medians of their
    numbers, each pair's in ``pairs`` (see the module docstring). ``stragglers``: the
    detector's settings (the manifest's ``stragglers`` keys: ``ratio``, ``z``, ``windows``...)."""
    with tempfile.TemporaryDirectory(prefix="maitre-eviction-") as tmp:
        root = Path(work or tmp)
        pairs = [_pair(root / f"pair{k}", steps, factor, ms_per_sample, stragglers) for k in range(reps)]
    out: dict[str, Any] = {
        "steps": steps,
        "slow_factor": 1 + factor,
        "reps": reps,
        "ms_per_sample": ms_per_sample,
        "stragglers": dict(stragglers or {}),
    }
    for key in (
        "detect_steps",
        "throughput_before",
        "throughput_during",
        "throughput_after",
        "throughput_reference",
        "throughput_recovered_pct",
        "evict_to_join_s",
    ):
        values = [p[key] for p in pairs if p.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["evicted"] = all(p["evicted"] for p in pairs)
    for key in ("evictions", "reference_evictions", "failures"):
        out[key] = sum(p[key] for p in pairs)
    out["pairs"] = pairs
    return out


def _pair(
    root: Path, steps: int, factor: float, ms_per_sample: float, stragglers: dict[str, Any] | None
) -> dict[str, Any]:
    """A slow run and its reference, and their numbers."""
    slow = run(root / "slow", slow=True, steps=steps, factor=factor, ms_per_sample=ms_per_sample, stragglers=stragglers)
    ref = run(
        root / "reference", slow=False, steps=steps, factor=factor, ms_per_sample=ms_per_sample, stragglers=stragglers
    )
    out: dict[str, Any] = {}
    p = phases(slow)
    out.update({k: v for k, v in p.items() if k not in ("verdict", "t_found", "t_join")})
    out["evicted"] = any(e["kind"] == "node_suspect" for e in slow["events"])
    out["evictions"] = sum(1 for e in slow["events"] if e["kind"] == "node_suspect")
    out["reference_evictions"] = sum(1 for e in ref["events"] if e["kind"] == "node_suspect")
    out["failures"] = slow["status"]["failures"]
    reference = None
    if p.get("settled_step") is not None:
        lo = ref["times"].get(p["settled_step"])
        if lo is not None:
            reference, _ = rate(ref["times"], lo, max(ref["times"].values()))
    out["throughput_reference"] = reference
    after = p.get("throughput_after")
    out["throughput_recovered_pct"] = None if not (after and reference) else round(100.0 * after / reference, 1)
    ref_all = sorted(ref["times"].values())
    out["reference_step_ms_median"] = (
        round(1000 * statistics.median(b - a for a, b in zip(ref_all, ref_all[1:])), 2) if len(ref_all) > 2 else None
    )
    for k, v in list(out.items()):
        if isinstance(v, float):
            out[k] = round(v, 3)
    return out


def _wait(cond, timeout_s: float, what: str, lines: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}:\n" + "\n".join(lines[-30:]))


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: medians over the pairs of runs, steps per
    second before the verdict, from it to the replacement's epoch, after (from 10 steps later),
    and the reference run's same steps."""
    pairs = ", ".join(
        f"{p['throughput_recovered_pct']:.1f}%"
        for p in result.get("pairs", [])
        if p.get("throughput_recovered_pct") is not None
    )
    return "\n".join(
        [
            "| found after | verdict to the replacement training | steps/s before | during | after | "
            "reference | after / reference (each pair) | evictions (slow runs / references) |",
            "|---|---|---|---|---|---|---|---|",
            f"| {result['detect_steps']} steps | {result['evict_to_join_s']:.2f} s | "
            f"{result['throughput_before']:.1f} | {result['throughput_during']:.1f} | "
            f"{result['throughput_after']:.1f} | {result['throughput_reference']:.1f} | "
            f"{result['throughput_recovered_pct']:.1f}% ({pairs or '-'}) | "
            f"{result['evictions']} / {result['reference_evictions']} |",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--factor", type=float, default=2.0, help="MAITRE_SLOW_FACTOR of the slow node (its compute x 1+factor)"
    )
    parser.add_argument("--ms-per-sample", type=float, default=4.0)
    parser.add_argument(
        "--ratio", type=float, help="the detector's ratio (stragglers.ratio; default the manifest's, 1.3)"
    )
    parser.add_argument("--reps", type=int, default=3, help="pairs of runs (default 3)")
    args = parse(parser, "eviction", smoke=SMOKE)
    result = measure(
        steps=args.steps,
        factor=args.factor,
        ms_per_sample=args.ms_per_sample,
        stragglers={"ratio": args.ratio} if args.ratio else None,
        reps=args.reps,
    )
    width = max(len(k) for k in result)
    for k, v in result.items():
        if k != "pairs":  # (in the JSON)
            print(f"{k:<{width}}  {v}")
    write_results(args.out, result, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
