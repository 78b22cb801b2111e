"""Straggler benchmark: how well slow ranks are found, and what acting on them gains.

    python benchmarks/stragglers.py [--runs 5] [--steps 120] [--trials 1000] [--ms-per-sample 8]
                                    [--skip-eviction] [--skip-spares] [--smoke] [--out ...]

Real runs, side by side in one run of this script: ``maitre run`` (embedded) with 4 workers of
the example (tiny, float64), global batch 14 (uneven shares: 4, 4, 3, 3), a device-like 8 ms
per sample (a sleep; ``--ms-per-sample``), and on every rank a random part, up to 30%, of its
compute slept each step (``MAITRE_STEP_JITTER=0.3``). Three cases, ``--runs`` runs each: noise only; one random
rank 1.5x slower from a random onset step (``MAITRE_SLOW_RANK=RANK:0.5:ONSET``); the same at 3x.

* ``detect_rate``: runs whose slow rank was flagged within 20 steps of its onset;
* ``false_positive_rate``: noise-only runs with any verdict (a slow run's verdict naming another
  rank is counted apart, as ``wrong_rank``);
* ``median_detect_steps``: the verdict's step less the onset, median over the detected runs.

Real runs are few, so also an offline study: every rank's per-step timing recorded in the
noise-only runs (``MAITRE_STRAGGLER_TRACE``), replayed through the same window and detector
the loop runs (:mod:`maitre.runtime.stragglers`, default thresholds). A trial takes one
noise-only run, its ranks in a random order and a random circular shift common to them all (so
that the load they shared stays shared), and, but for the noise-only trials, one rank's compute
times 1.5 or 3 from a random onset: ``--trials`` trials a case. The top-level rates are the
offline study's (``"source"`` says so; the real runs' are under ``"real"``), the median delay
that of its 1.5x case.

``throughput_recovered_pct`` comes from ``benchmarks/eviction.py``'s ``measure()`` and
``spare_join_s`` / ``cold_join_s`` from ``benchmarks/spares.py``'s, when those files exist
(``--skip-eviction``, ``--skip-spares``: null). ``--smoke`` loads those two and checks that their
``measure()`` takes their ``SMOKE`` arguments, without running them (their own ``--smoke`` does).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import random
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
from maitre.launch import Run, RunConfig  # noqa: E402
from maitre.runtime.stragglers import Detector, Thresholds, Window  # noqa: E402

EXAMPLE = HERE.parent / "src" / "maitre" / "examples" / "train.py"
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
    "14",
    "--micro-batch",
    "4",
    "--log-every",
    "1000",
]
RANKS = 4
JITTER = "0.3"
BUDGET = 20
"""Steps from the onset within which a slow rank must be flagged."""
FACTORS = {"1_5x": 1.5, "3x": 3.0}
WARMUP = 3


# -- real runs ----------------------------------------------------------------------------------
def real_run(steps: int, slow: tuple[int, float, int] | None, work: Path, ms_per_sample: float) -> dict[str, Any]:
    """One run of 4 workers: its verdicts, and every rank's timing per step."""
    trace = work / "trace"
    env = {protocol.STEP_JITTER: JITTER, protocol.STRAGGLER_TRACE: str(trace)}
    if slow is not None:
        env[protocol.SLOW_RANK] = f"{slow[0]}:{slow[1] - 1:g}:{slow[2]}"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run = Run(
            RunConfig(
                command=[
                    sys.executable,
                    str(EXAMPLE),
                    "--steps",
                    str(steps),
                    *TINY,
                    "--device-ms-per-sample",
                    str(ms_per_sample),
                ],
                min_nodes=RANKS,
                max_nodes=RANKS,
                local_nodes=RANKS,
                max_restarts=0,
                run_dir=work / "run",
                ledger=False,
                quiet_workers=True,
            ),
            out=lambda s: None,
        )
        began = time.monotonic()
        code = run.start().wait()
        seconds = time.monotonic() - began
        job = run.job()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if code != 0:
        raise RuntimeError(f"the run failed (exit {code}): {work}")
    verdicts = [
        {"rank": r["rank"], "step": r["step"], "since_step": r["since_step"], "ratio": r["ratio"]}
        for r in job["reports"]
        if r["kind"] == "straggler"
    ]
    return {"verdicts": verdicts, "series": read_trace(trace), "seconds": round(seconds, 2)}


def read_trace(trace: Path) -> list[list[tuple[float, float]]]:
    """Each rank's (compute_s, work) per step, over the steps every rank trained (by rank)."""
    by_rank: dict[int, dict[int, tuple[float, float]]] = {}
    for path in sorted(trace.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_rank.setdefault(rec["rank"], {})[rec["step"]] = (rec["compute_s"], rec["work"])
    steps = sorted(set.intersection(*(set(s) for s in by_rank.values()))) if by_rank else []
    return [[by_rank[r][s] for s in steps] for r in sorted(by_rank)]


def judge(verdicts: list[dict[str, Any]], slow: tuple[int, float, int] | None) -> dict[str, Any]:
    """A run's outcome: flagged in time (and how late), or a false positive."""
    if slow is None:
        return {"false_positive": bool(verdicts)}
    mine = [v for v in verdicts if v["rank"] == slow[0] and v["step"] >= slow[2]]
    delay = mine[0]["step"] - slow[2] if mine else None
    return {
        "detected": delay is not None and delay <= BUDGET,
        "delay": delay,
        "wrong_rank": any(v["rank"] != slow[0] for v in verdicts),
    }


def rates(outcomes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The three numbers of a set of outcomes (by case: noise, 1_5x, 3x)."""
    out: dict[str, Any] = {}
    noise = outcomes.get("noise", [])
    out["false_positive_rate"] = sum(o["false_positive"] for o in noise) / len(noise) if noise else None
    for case in FACTORS:
        got = outcomes.get(case, [])
        delays = [o["delay"] for o in got if o["detected"]]
        out[f"detect_rate_{case}"] = sum(o["detected"] for o in got) / len(got) if got else None
        out[f"median_detect_steps_{case}"] = statistics.median(delays) if delays else None
        out[f"max_detect_steps_{case}"] = max(delays) if delays else None
        out[f"wrong_rank_rate_{case}"] = sum(o["wrong_rank"] for o in got) / len(got) if got else None
        out[f"n_{case}"] = len(got)
    out["n_noise"] = len(noise)
    return out


# -- the offline study --------------------------------------------------------------------------
def replay(
    series: list[list[tuple[float, float]]], slow: tuple[int, float, int] | None, t: Thresholds
) -> list[dict[str, Any]]:
    """The verdicts the loop's detector gives on these per-rank timings (the slow rank's
    compute times its factor from its onset step on)."""
    det = Detector(t)
    windows = [Window(t.window * t.windows) for _ in series]
    verdicts = []
    for i in range(len(series[0])):
        step = i + 1
        for r, s in enumerate(series):
            compute_s, work = s[i]
            if slow is not None and r == slow[0] and step >= slow[2]:
                compute_s *= slow[1]
            windows[r].add(compute_s, work)
        if step % t.window == 0:
            values, held, works = zip(*(w.take() for w in windows))
            verdicts += [
                {"rank": v.rank, "step": v.step, "since_step": v.since_step}
                for v in det.observe(step - t.window + 1, step, list(values), None, list(works), list(held))
            ]
    return verdicts


def offline(
    runs: list[list[list[tuple[float, float]]]], trials: int, seed: int, t: Thresholds
) -> dict[str, list[dict[str, Any]]]:
    """``trials`` trials a case on the recorded noise-only series (see the module docstring)."""
    rng = random.Random(seed)
    # (the first steps left out: every rank's warm-up, which a shift would put mid-run)
    runs = [[s[WARMUP:] for s in r] for r in runs if len(r) == RANKS and len(r[0]) >= 60]
    outcomes: dict[str, list[dict[str, Any]]] = {"noise": [], **{c: [] for c in FACTORS}}
    if not runs:
        return outcomes
    for case, factor in [("noise", None), *FACTORS.items()]:
        for _ in range(trials):
            run = rng.choice(runs)
            ranks = rng.sample(run, len(run))
            shift = rng.randrange(len(ranks[0]))
            series = [s[shift:] + s[:shift] for s in ranks]
            slow = None
            if factor is not None:
                slow = (
                    rng.randrange(len(series)),
                    factor,
                    rng.randrange(t.window * t.windows, len(series[0]) - BUDGET),
                )
            outcomes[case].append(judge(replay(series, slow, t), slow))
    return outcomes


# -- the other engineers' numbers ----------------------------------------------------------------
def borrowed(
    name: str, skip: bool, keys: tuple[str, ...], smoke: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``benchmarks/<name>.py``'s ``measure()``: (its numbers for ``keys``, all it gave), nulls
    when skipped or absent. ``smoke``: only checks that ``measure`` takes the module's ``SMOKE``
    arguments (nulls, and that check in place of all it gave)."""
    path = HERE / f"{name}.py"
    if skip or not path.exists():
        return {k: None for k in keys}, None
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if smoke:
        inspect.signature(module.measure).bind(**module.SMOKE)  # (a TypeError if it does not)
        return {k: None for k in keys}, {"smoke": f"measure(**{module.SMOKE}) not run"}
    result = module.measure()
    return {k: result.get(k) for k in keys}, result


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: the real runs beside the offline study
    (the real noise-only timings replayed), then what the eviction and spares benchmarks gave."""
    real, offline = result["real"], result["offline"]

    def counted(rate: float, n: int) -> str:
        return f"{round(rate * n)} of {n}"

    def share(rate: float, n: int) -> str:
        return f"{100 * rate:g}% of {n}"

    lines = ["| | real runs | real noise, replayed |", "|---|---|---|"]
    for key, label in (("1_5x", "1.5x"), ("3x", "3x")):
        lines.append(
            f"| detected, {label} slow | {counted(real[f'detect_rate_{key}'], real[f'n_{key}'])} "
            f"| {share(offline[f'detect_rate_{key}'], offline[f'n_{key}'])} |"
        )
    lines.append(
        f"| false positives, noise only | {counted(real['false_positive_rate'], real['n_noise'])} "
        f"| {share(offline['false_positive_rate'], offline['n_noise'])} |"
    )
    lines.append(
        "| steps from onset to verdict, 1.5x: median (worst) | "
        f"{real['median_detect_steps_1_5x']:.0f} ({real['max_detect_steps_1_5x']:.0f}) | "
        f"{offline['median_detect_steps_1_5x']:.0f} ({offline['max_detect_steps_1_5x']:.0f}) |"
    )
    if result.get("throughput_recovered_pct") is not None:
        reps = result.get("raw", {}).get("eviction", {}).get("reps")
        lines.append(
            f"| throughput after eviction / a run never slow | "
            f"{result['throughput_recovered_pct']:.1f}%"
            f"{f' (median of {reps} pairs)' if reps else ''} | |"
        )
    if result.get("spare_join_s") is not None:
        lines.append(
            f"| a warm spare training after the failure's detection | "
            f"{result['spare_join_s']:.3f} s (cold start: {result['cold_join_s']:.3f} s) | |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="real runs per case (default 5)")
    p.add_argument("--steps", type=int, default=120, help="steps per real run (default 120)")
    p.add_argument("--trials", type=int, default=1000, help="offline trials per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ms-per-sample",
        type=float,
        default=8.0,
        help="device-like wait per sample (default 8: steps of ~40 ms; with 2, "
        "~12 ms steps mostly CPU, on a loaded machine the OS's imbalance shows)",
    )
    p.add_argument("--skip-eviction", action="store_true")
    p.add_argument("--skip-spares", action="store_true")
    args = parse(p, "stragglers", smoke={"runs": 1, "steps": 60, "trials": 5, "ms_per_sample": 2.0})
    if args.runs < 1 or args.steps < 60 or args.trials < 1 or not args.ms_per_sample >= 0:
        p.error("--runs and --trials must be at least 1, --steps at least 60, --ms-per-sample at least 0")

    rng = random.Random(args.seed)
    t = Thresholds()
    real: dict[str, list[dict[str, Any]]] = {"noise": [], **{c: [] for c in FACTORS}}
    raw_runs: list[dict[str, Any]] = []
    noise_series = []
    with tempfile.TemporaryDirectory(prefix="maitre-stragglers-") as tmp:
        for i in range(args.runs):  # the cases side by side, run after run
            for case, factor in [("noise", None), *FACTORS.items()]:
                slow = (
                    None
                    if factor is None
                    else (rng.randrange(RANKS), factor, rng.randrange(21, args.steps - BUDGET - 10))
                )
                result = real_run(args.steps, slow, Path(tmp) / f"{case}-{i}", args.ms_per_sample)
                outcome = judge(result["verdicts"], slow)
                real[case].append(outcome)
                if case == "noise":
                    noise_series.append(result["series"])
                raw_runs.append(
                    {
                        "case": case,
                        "slow": slow,
                        "seconds": result["seconds"],
                        "verdicts": result["verdicts"],
                        **outcome,
                    }
                )
                print(f"  {case:>5} run {i + 1}: {outcome}", flush=True)
    study = offline(noise_series, args.trials, args.seed, t)
    real_rates, offline_rates = rates(real), rates(study)

    eviction, eviction_raw = borrowed("eviction", args.skip_eviction, ("throughput_recovered_pct",), args.smoke)
    spares, spares_raw = borrowed("spares", args.skip_spares, ("spare_join_s", "cold_join_s"), args.smoke)
    source = offline_rates if study["noise"] else real_rates
    result = {
        "detect_rate_1_5x": source["detect_rate_1_5x"],
        "detect_rate_3x": source["detect_rate_3x"],
        "false_positive_rate": source["false_positive_rate"],
        "median_detect_steps": source["median_detect_steps_1_5x"],
        **eviction,
        **spares,
        "source": (
            "detect_rate_*, false_positive_rate, median_detect_steps (1.5x): the offline "
            "study (real noise-only timings replayed, 'offline'); the real runs' own under "
            "'real'"
            if study["noise"]
            else "the real runs (no traces to replay)"
        ),
        "real": real_rates,
        "offline": offline_rates,
        "setup": {
            "ranks": RANKS,
            "steps": args.steps,
            "runs": args.runs,
            "trials": args.trials,
            "global_batch": 14,
            "shares": [4, 4, 3, 3],
            "device_ms_per_sample": args.ms_per_sample,
            "jitter": float(JITTER),
            "budget_steps": BUDGET,
            "thresholds": {
                "window": t.window,
                "windows": t.windows,
                "ratio": t.ratio,
                "z": t.z,
                "mad_floor": t.mad_floor,
                "drift": t.drift,
            },
        },
        "raw": {
            "real_runs": raw_runs,
            "eviction": eviction_raw,
            "spares": spares_raw,
            "noise_series_ms_per_unit": [[[round(c / w * 1000, 3) for c, w in s] for s in run] for run in noise_series],
        },
    }
    write_results(args.out, result, smoke=args.smoke)

    def show(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    print(f"\n{'':28}{'real':>10}{'offline':>10}")
    for key in (
        "detect_rate_1_5x",
        "detect_rate_3x",
        "false_positive_rate",
        "median_detect_steps_1_5x",
        "median_detect_steps_3x",
        "max_detect_steps_1_5x",
        "wrong_rank_rate_1_5x",
        "n_noise",
        "n_1_5x",
    ):
        print(f"{key:28}{show(real_rates[key]):>10}{show(offline_rates[key]):>10}")
    for key in ("throughput_recovered_pct", "spare_join_s", "cold_join_s"):
        print(f"{key:28}{show(result[key]):>10}")


if __name__ == "__main__":
    main()
