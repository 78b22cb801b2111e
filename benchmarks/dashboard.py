"""Dashboard benchmark: the page's load with 1,000 nodes and 10,000 events, and how soon a live
change shows in it.

    python benchmarks/dashboard.py [--repeats 5] [--nodes 1000] [--events 10000] [--jobs 3000]
                                   [--changes 40] [--smoke]
                                   [--out benchmarks/results/dashboard.json]

- **Load**: a simulation of the Philly trace (its first 3,000 jobs, ``--jobs``) on 1,000 nodes
  x 8 GPUs, 50 of them spot, cut to its first 10,000 events (1,001 of them the nodes and
  prices), replayed by ``maitre dashboard``'s server and opened in headless Chromium (Debian's,
  as in the tests): the time from the navigation's start to the first complete render of each
  view (the page fetched the events, built its model and drew), medians over ``--repeats`` fresh
  pages. Then the cost of a render alone (moving to the view again).
- **Live**: a coordinator, the page open on it, and 40 nodes (``--changes``) registering 50 ms
  apart: from each event's time on the coordinator's clock to the page's first render that shows
  it (median and worst). Same machine, same clock.

Target (issue 14): a page load under 1 s with 1,000 nodes and 10,000 events; a live change in the
page within 1 s of the coordinator's event. ``--smoke``: 20 nodes, 50 jobs, 400 events, one page
a view, 3 live changes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))

from _results import parse, write_results  # noqa: E402
from browser import ARGS, CHROMIUM  # noqa: E402
from maitre.control.api import CoordinatorServer  # noqa: E402
from maitre.control.cluster import ClusterState  # noqa: E402
from maitre.dashboard.server import ReplayServer  # noqa: E402
from maitre.sim import run as sim_run  # noqa: E402

VIEWS = ["scaling", "rendezvous", "checkpoints", "spot"]
TOKEN = "benchmark"


def big_log(out: Path, nodes: int, events: int, jobs: int = 3000) -> tuple[Path, dict[str, int]]:
    opts = sim_run.SimOptions(
        workload="philly", policies=["maitre"], cluster=(nodes, 8), spot=0.05, spot_life_h=48.0, limit=jobs, plots=False
    )
    sim_run.main(opts, out / "sim", progress=False)
    lines = (out / "sim" / "events-maitre.jsonl").read_text().splitlines()[:events]
    path = out / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    kinds: dict[str, int] = {}
    for line in lines:
        kind = json.loads(line)["kind"]
        kinds[kind] = kinds.get(kind, 0) + 1
    return path, kinds


def load_times(browser, url: str, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for view in VIEWS:
        loads, renders, parts = [], [], []
        for _ in range(repeats):
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            page.goto(f"{url}#/{view}")
            page.wait_for_function("window.__maitre && window.__maitre.ready", timeout=60000)
            assert not errors and not page.evaluate("window.__maitre.failed"), errors
            loads.append(page.evaluate("window.__maitre.loadedMs") / 1000)
            parts.append(page.evaluate("window.__maitre.timings"))
            renders.append(
                page.evaluate("""(() => { const t = performance.now();
                window.dispatchEvent(new HashChangeEvent('hashchange'));
                return (performance.now() - t) / 1000; })()""")
            )
            page.close()
        out[view] = {
            "load_s": statistics.median(loads),
            "load_worst_s": max(loads),
            "render_s": statistics.median(renders),
            "fetched_s": statistics.median(p["fetchedMs"] for p in parts) / 1000,
            "model_s": statistics.median(p["modelMs"] for p in parts) / 1000,
            "first_render_s": statistics.median(p["renderMs"] for p in parts) / 1000,
        }
    return out


def live_latency(browser, tmp: Path, changes: int = 40) -> dict[str, float]:
    import httpx

    with CoordinatorServer(ClusterState([], run_dir=tmp), token=TOKEN) as srv:
        page = browser.new_page()
        page.goto(f"http://{srv.address}/dashboard/?token={TOKEN}")
        page.wait_for_function("window.__maitre && window.__maitre.ready", timeout=60000)
        with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            for k in range(changes):
                c.post(f"http://{srv.address}/v1/nodes/n{k}/heartbeat", json={"slots": 8})
                time.sleep(0.05)
        page.wait_for_function(f"window.__maitre.model().nodes.size === {changes}", timeout=30000)
        time.sleep(0.3)
        lags = page.evaluate("""(() => { const seen = window.__maitre.seen; const out = [];
            for (const n of window.__maitre.model().nodes.values()) for (const e of n.events)
              if (seen[e.seq]) out.push(seen[e.seq] / 1000 - e.t);
            return out; })()""")
        page.close()
    assert len(lags) == changes, lags
    return {"changes": changes, "median_s": statistics.median(lags), "worst_s": max(lags)}


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown, medians. load: from the navigation's start
    to the first complete render; fetched: the page and the events in; model: the events
    reduced; drawn: the view's first render; redraw: a render alone."""
    lines = [
        f"{result['nodes']:,} nodes, {result['events']:,} events "
        f"({result['log_bytes'] / 1e6:.1f} MB of JSON lines), {result['repeats']} fresh pages "
        "a view:",
        "",
        "| view | load | worst | fetched | model | drawn | redraw |",
        "|---|---|---|---|---|---|---|",
    ]
    for view, v in result["views"].items():
        lines.append(
            f"| {view} | "
            + " | ".join(
                f"{v[k]:.3f} s"
                for k in ("load_s", "load_worst_s", "fetched_s", "model_s", "first_render_s", "render_s")
            )
            + " |"
        )
    live = result.get("live")
    if live:
        lines += [
            "",
            f"live: {live['changes']} changes, each in the page a median "
            f"{1000 * live['median_s']:.0f} ms (worst {1000 * live['worst_s']:.0f} ms) after its "
            "event",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--jobs", type=int, default=3000, help="the Philly trace's first JOBS jobs")
    p.add_argument("--changes", type=int, default=40, help="nodes registering, for the live part")
    args = parse(p, "dashboard", smoke={"repeats": 1, "nodes": 20, "events": 400, "jobs": 50, "changes": 3})
    if CHROMIUM is None:
        sys.exit("benchmarks/dashboard.py needs chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="maitre-dashboard-bench-"))
    try:
        path, kinds = big_log(tmp, args.nodes, args.events, args.jobs)
        total = sum(kinds.values())
        with ReplayServer(path, TOKEN) as srv, sync_playwright() as pw:
            chromium = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            browser = chromium.new_context(viewport={"width": 1300, "height": 900})
            try:  # (one context: its pages share the cookie the first one signs in with)
                warm = browser.new_page()
                warm.goto(f"{srv.url}?token={TOKEN}")  # signs in: the cookie stays
                warm.wait_for_function("window.__maitre && window.__maitre.ready")
                warm.close()
                loads = load_times(browser, srv.url, args.repeats)
                live = live_latency(browser, tmp, args.changes)
            finally:
                chromium.close()
        size = path.stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "nodes": args.nodes,
        "events": total,
        "log_bytes": size,
        "kinds": kinds,
        "repeats": args.repeats,
        "views": loads,
        "live": live,
        "targets": {"load_s": 1.0, "live_s": 1.0},
    }
    print(
        f"{args.nodes} nodes, {total} events ({size / 1e6:.1f} MB of JSON lines), median of {args.repeats} fresh pages:"
    )
    print(f"{'view':<12} {'load':>8} {'worst':>8} {'fetched':>8} {'model':>8} {'drawn':>8} {'redraw':>8}")
    for view, v in loads.items():
        print(
            f"{view:<12} {v['load_s']:>7.3f}s {v['load_worst_s']:>7.3f}s "
            f"{v['fetched_s']:>7.3f}s {v['model_s']:>7.3f}s {v['first_render_s']:>7.3f}s "
            f"{v['render_s']:>7.3f}s"
        )
    print(
        f"live: {live['changes']} changes, median {live['median_s'] * 1000:.0f} ms, "
        f"worst {live['worst_s'] * 1000:.0f} ms from the coordinator's event to the page"
    )
    write_results(args.out, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
