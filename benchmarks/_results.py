"""What every benchmark shares: ``--smoke`` and ``--out``, and its JSON stamped with the commit
and the date it was measured on.

Every script in benchmarks/ (but this helper and ``workload.py``, the training process that
``recovery.py`` starts) takes

* ``--smoke``: the smallest state, steps and repetitions that still go through every code path
  of the script, in seconds. Its figures mean nothing; its JSON goes to ``--out`` or to a new
  temporary directory, never to benchmarks/results/. ``tests/test_benchmarks.py`` runs every
  script so, so that a change of maitre's API that breaks a benchmark fails the suite;
* ``--out PATH``: a directory for ``<name>.json``, or a file ending in ``.json`` (by default
  ``benchmarks/results/<name>.json``).

:func:`write_results` puts ``"measured": {"commit", "date"}`` first in the JSON: ``git rev-parse
HEAD`` of this tree, with ``-dirty`` when a tracked file has changes not committed, and the UTC
time of the write. A reader (and the docs, whose tables quote it) can tell a fresh figure from
a stale one. ``tests/chaos`` loads this file by its path to stamp ``chaos.json`` the same way.

The stamp also holds the machine (:func:`machine`), since a figure moves with it: ``cpu`` (its
model), ``cores`` (``os.cpu_count()``) and ``affinity`` (the cores this process may run on),
``copy_gb_s`` (one thread's memory copy, the best of a few copies of ``copy_mb`` MB, measured
once a run, when it writes), ``load_start`` and ``load_end`` (the 1-minute load average when
:func:`parse` ran and when the results were written), ``run_s`` and ``run_cpus`` (the cores the
run's own processes used on average: its CPU time and its children's, over ``run_s``), and
``loaded``: true when the load at the start was above ``cores``, or the load at the end, less
the run's own ``run_cpus`` (its processes count in the load average), was. A loaded run's table
says so in the docs.

The scripts whose figures head the README's table (``HEADLINE_ROUNDS``) also record how many
rounds (runs, repetitions) each such figure is the median of, ``"rounds": {"argument",
"count"}``; asked for fewer than ``MIN_ROUNDS`` they say, as they start, that the figure is a
single run, and the docs' line under their table says it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
HEADLINE_ROUNDS = {"checkpoint": "reps", "data": "reps", "recovery": "reps", "restart": "reps", "throughput": "rounds"}
"""For the results the README's table draws on (docs/hooks.py's ``SUMMARY_RESULTS``), the
argument that counts the rounds (runs, repetitions) their headline figures are the median of.
``gpu.json`` has none (each figure the median of the steps of one run of each mode), nor has
``simulator.json`` (simulated time: a rerun gives the same figures)."""
MIN_ROUNDS = 3
"""Fewer rounds than this for a headline figure and the run says it is a single run."""
COPY_MB = 256
"""The buffer the copy bandwidth is measured on (larger than any last-level cache); 16 MB for
``--smoke``, whose figures mean nothing."""
SMOKE_COPY_MB = 16


class _Mark(NamedTuple):
    """Where the run stood at one moment: monotonic seconds, ``os.times()``, the 1-min load."""

    at: float
    times: tuple[float, ...]
    load: float | None


def _mark() -> _Mark:
    try:
        load: float | None = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # (no load average on this platform)
        load = None
    return _Mark(time.monotonic(), tuple(os.times())[:4], load)


_RUN: dict[str, Any] = {"start": _mark(), "rounds": None}
"""This process's run: its start (the import, then :func:`parse`) and its rounds, if the script
is one of ``HEADLINE_ROUNDS``."""
_COPY: dict[int, float] = {}  # copy_mb: GB/s, measured once a process


def parse(
    parser: argparse.ArgumentParser, name: str, smoke: dict[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser``'s arguments with ``--smoke`` and ``--out`` added. With ``--smoke``, each of
    ``smoke`` (argument name: value) replaces its argument where the command line left the
    default. ``args.out`` comes back as the path of the JSON to write."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run that goes through every code path (seconds; "
        "tests/test_benchmarks.py); its JSON goes to --out or a temporary "
        "directory, never to benchmarks/results/",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"a directory for {name}.json, or a .json file (default: benchmarks/results/{name}.json)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in smoke.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix=f"maitre-{name}-smoke-")) if args.smoke else RESULTS
    out = args.out if args.out.suffix == ".json" else args.out / f"{name}.json"
    if args.smoke and out.resolve().parent == RESULTS:
        parser.error("--smoke never writes to benchmarks/results/ (give --out a temporary directory)")
    args.out = out
    _RUN["start"], _RUN["rounds"] = _mark(), None
    if name in HEADLINE_ROUNDS:
        key = HEADLINE_ROUNDS[name]
        count, flag = getattr(args, key), "--" + key.replace("_", "-")
        _RUN["rounds"] = {"argument": flag, "count": count}
        if count < MIN_ROUNDS:
            print(f"{name}: {rounds_words(flag, count)}", flush=True)
    return args


def rounds_words(flag: str, count: int) -> str:
    """What a run of ``count`` rounds (``flag``) says of its headline figures, below
    ``MIN_ROUNDS``: that each is a single run (or the median of that few)."""
    if count <= 1:
        return f"each headline figure is a single run ({flag} {count}), not a median of {MIN_ROUNDS} rounds or more"
    return f"each headline figure is the median of {count} runs ({flag} {count}), fewer than {MIN_ROUNDS}"


def copy_gb_s(mb: int = COPY_MB, copies: int = 5) -> float:
    """One thread's memory copy bandwidth, GB/s (1e9 bytes): the best of ``copies`` copies of a
    ``mb`` MB buffer into another, after one that maps the pages. Measured once a process for
    each size (a second write of the results reuses it)."""
    if mb not in _COPY:
        n = mb << 20
        src, dst = b"\x5a" * n, bytearray(n)  # (written: a buffer of zero pages copies from cache)
        dst[:] = src
        best = float("inf")
        for _ in range(copies):
            t = time.perf_counter()
            dst[:] = src  # (a memcpy)
            best = min(best, time.perf_counter() - t)
        del src, dst
        _COPY[mb] = round(n / best / 1e9, 2)
    return _COPY[mb]


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine(*, smoke: bool = False) -> dict[str, Any]:
    """The machine this run is on, and its load at the start and now (see the module's
    docstring); the copy is measured after the load and the run's CPU time are read."""
    start, now = _RUN["start"], _mark()
    cores = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        affinity = cores
    run_s = now.at - start.at
    run_cpus = (sum(now.times) - sum(start.times)) / run_s if run_s > 0 else 0.0
    mb = SMOKE_COPY_MB if smoke else COPY_MB
    stamp: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": cores,
        "affinity": affinity,
        "copy_gb_s": copy_gb_s(mb),
        "copy_mb": mb,
        "load_start": start.load,
        "load_end": now.load,
        "run_s": round(run_s, 1),
        "run_cpus": round(run_cpus, 2),
    }
    stamp["loaded"] = loaded(stamp)
    return stamp


def loaded(stamp: dict[str, Any]) -> bool:
    """Whether a machine stamp's load was above its cores: at the start, or at the end less the
    run's own ``run_cpus``."""
    cores, start, end = stamp["cores"], stamp.get("load_start"), stamp.get("load_end")
    return bool((start is not None and start > cores) or (end is not None and end - stamp.get("run_cpus", 0.0) > cores))


def measured(*, smoke: bool = False) -> dict[str, Any]:
    """The commit of this tree (``-dirty`` with uncommitted changes to tracked files, ``unknown``
    outside a git checkout), the UTC time now, the machine (:func:`machine`) and, for a script
    of ``HEADLINE_ROUNDS``, its rounds."""
    stamp: dict[str, Any] = {"commit": _commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if smoke:
        stamp["smoke"] = True  # figures of the smallest run: they mean nothing
    stamp["machine"] = machine(smoke=smoke)
    if _RUN["rounds"] is not None:
        stamp["rounds"] = dict(_RUN["rounds"])
    return stamp


def write_results(out: Path, payload: dict[str, Any], *, smoke: bool = False, indent: int = 2) -> Path:
    """``payload`` as JSON at ``out``, ``measured`` (:func:`measured`) first; returns ``out``."""
    doc = {"measured": measured(smoke=smoke), **{k: v for k, v in payload.items() if k != "measured"}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent) + "\n")
    print(f"wrote {out}", flush=True)
    return out


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    if os.environ.get("MAITRE_BENCHMARK_COMMIT"):  # a copy of the tree (a GPU machine's): its
        return os.environ["MAITRE_BENCHMARK_COMMIT"]  # .git, if any, is not this tree's
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")
