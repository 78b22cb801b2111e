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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


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
    return args


def measured(*, smoke: bool = False) -> dict[str, Any]:
    """The commit of this tree (``-dirty`` with uncommitted changes to tracked files, ``unknown``
    outside a git checkout) and the UTC time now."""
    stamp: dict[str, Any] = {"commit": _commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if smoke:
        stamp["smoke"] = True  # figures of the smallest run: they mean nothing
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
