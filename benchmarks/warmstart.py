"""Worker start-up benchmark: a cold start (``exec`` of a fresh interpreter, as torchrun and
``subprocess`` do) against maitre's warm start (a fork of a fork server that imported torch once).

    python benchmarks/warmstart.py [--repeats 3] [--workers 1,8] [--smoke]
                                   [--out benchmarks/results/warmstart.json]

Each start runs ``examples/train.py --steps 1`` alone (one process, no coordinator): imports,
data, model, optimizer, one step, exit. That is what a joiner does before it can train, so the
time is the time its slot is held and idle. Measured for 1 and for 8 workers started at once
(``--workers``), cold and warm alternating, ``--repeats`` times; prints medians and writes them
as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from _results import parse, write_results  # noqa: E402
from maitre.agent import warmstart  # noqa: E402

COMMAND = [sys.executable, str(HERE.parent / "examples" / "train.py"), "--steps", "1"]


def cold(n: int, env: dict[str, str]) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(COMMAND, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]
    codes = [p.wait() for p in procs]
    assert codes == [0] * n, codes
    return time.perf_counter() - start


def warm(n: int, env: dict[str, str]) -> float:
    start = time.perf_counter()
    procs = [warmstart.WarmProcess(COMMAND, env) for _ in range(n)]
    for p in procs:
        p.stdout.read()
        p.stderr.read()
    codes = [p.wait() for p in procs]
    assert codes == [0] * n, codes
    return time.perf_counter() - start


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: medians of ``repeats`` starts."""
    lines = ["| workers started at once | cold (exec) | warm (fork server) | speedup |", "|---|---|---|---|"]
    lines += [
        f"| {r['workers']} | {r['cold_s']:.3f} s | {r['warm_s']:.3f} s | {r['speedup']:.1f}x |" for r in result["rows"]
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", default="1,8", help="workers started at once, comma-separated")
    args = parse(p, "warmstart", smoke={"repeats": 1, "workers": "1"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAITRE_")}
    env.update(OMP_NUM_THREADS="1")
    warmstart.prewarm()
    warm(1, env)  # the fork server's own start (its imports) is paid once per agent, not here
    rows = []
    for n in (int(w) for w in args.workers.split(",")):
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            times["cold"].append(cold(n, env))
            times["warm"].append(warm(n, env))
        c, w = statistics.median(times["cold"]), statistics.median(times["warm"])
        rows.append(
            {
                "workers": n,
                "cold_s": round(c, 3),
                "warm_s": round(w, 3),
                "speedup": round(c / w, 1),
                "cold_all_s": times["cold"],
                "warm_all_s": times["warm"],
            }
        )
    print(f"{'workers started at once':>24} | {'cold (exec) s':>13} | {'warm (fork) s':>13} | speedup")
    for r in rows:
        print(f"{r['workers']:>24} | {r['cold_s']:>13.3f} | {r['warm_s']:>13.3f} | {r['speedup']:>6.1f}x")
    result = {"command": "examples/train.py --steps 1", "cpus": os.cpu_count(), "repeats": args.repeats, "rows": rows}
    write_results(args.out, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
