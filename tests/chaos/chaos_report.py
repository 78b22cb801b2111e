"""The chaos run's report in Markdown: what ``test_chaos.py`` prints at the end of a run, and what
the docs render from ``benchmarks/results/chaos.json`` (``docs/hooks.py`` loads this file by its
path: it imports nothing but the standard library)."""

from __future__ import annotations

import statistics


def table(report: dict) -> str:
    """The report (``benchmarks/results/chaos.json``) in Markdown, as docs/tests.md shows it: a
    summary line, then a row per kind of fault."""
    by: dict[str, list[dict]] = {}
    for f in report["per_fault"]:
        by.setdefault(f["kind"], []).append(f)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"

    rows = [
        f"{report['faults']} faults of {len(report['kinds'])} kinds (seed {report['seed']}, "
        f"{report['steps']} steps): {report['lost']} samples lost, {report['repeated']} "
        f"repeated, parameters {report['param_rel_err']:.1e} from the fault-free run's, "
        f"{report['corrupt_loaded']} corrupt checkpoints loaded ({len(report['refused'])} "
        f"refused), {report['leftover_processes']} processes left; back to training in "
        f"{report['recovery_s_p50']:.1f} s (median), {report['recovery_s_max']:.1f} s (max).",
        "",
        "| fault | count | detected (s, median / max) | trains again (s, median / max) |",
        "|---|---:|---:|---:|",
    ]
    for kind in sorted(by, key=lambda k: (-len(by[k]), k)):
        faults = by[kind]
        rows.append(
            f"| {kind} | {len(faults)} "
            f"| {spread([f['detected_s'] for f in faults if 'detected_s' in f])} "
            f"| {spread([f['recovered_s'] for f in faults if 'recovered_s' in f])} |"
        )
    return "\n".join(rows)
