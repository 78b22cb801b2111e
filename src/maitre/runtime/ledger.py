"""The data ledger: an auditable record of which samples every committed step trained on.

When ``MAITRE_LEDGER_DIR`` is set, each worker appends to ``<dir>/<worker>.jsonl`` a header
``{"k": "h", "n": num_samples, "t": wall_time, "pid": pid, "run": run_id}`` (one per process
start; ``run_id`` names one ``maitre run``), then:

* ``{"k": "a", "e": epoch, "s": step, "d": data_epoch, "i": [indices]}`` before a step's
  gradient allreduce (an *attempt*: this rank's share),
* ``{"k": "c", "e": epoch, "s": step, "t": wall_time}`` once the step is committed,
* ``{"k": "x", "e": epoch, "s": step}`` when the step was skipped (a loss scaler's overflow: it
  commits nothing and is trained again in the same epoch; the attempt before it is void), and
* ``{"k": "r", "s": step, "t": wall_time}`` when the process resumed from a checkpoint of ``step``.

A step that committed in membership epoch ``e`` of run ``r`` used exactly the attempts logged for
``(r, e, s)``: an allreduce completes on any rank only once every member contributed, and every
member logs its attempt before contributing. Attempts of epochs that were lost are ignored. A
resume from the checkpoint of step ``S`` rolls back every step after ``S`` committed before it:
those are trained again and only the new commit counts. :func:`audit` checks that the committed
steps consumed every sample index exactly once per data epoch.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Ledger:
    def __init__(self, directory: str | os.PathLike[str], worker_id: str, num_samples: int, run_id: str = "") -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / f"{worker_id}.jsonl", "a", buffering=1)
        self._file.write(
            json.dumps({"k": "h", "n": num_samples, "t": time.time(), "pid": os.getpid(), "run": run_id}) + "\n"
        )

    def resumed(self, step: int) -> None:
        self._file.write(json.dumps({"k": "r", "s": step, "t": time.time()}) + "\n")

    def attempt(self, epoch: int, step: int, data_epoch: int, indices: list[int]) -> None:
        self._file.write(
            json.dumps({"k": "a", "e": epoch, "s": step, "d": data_epoch, "i": indices}, separators=(",", ":")) + "\n"
        )

    def skipped(self, epoch: int, step: int) -> None:
        self._file.write(json.dumps({"k": "x", "e": epoch, "s": step}, separators=(",", ":")) + "\n")

    def commit(self, epoch: int, step: int) -> None:
        self._file.write(json.dumps({"k": "c", "e": epoch, "s": step, "t": time.time()}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass(slots=True)
class Audit:
    steps: int = 0
    samples: int = 0
    complete_data_epochs: int = 0
    duplicates: list[tuple[int, int]] = field(default_factory=list)
    """(data epoch, sample index) consumed more than once."""
    missing: list[tuple[int, int]] = field(default_factory=list)
    """(data epoch, sample index) never consumed in a data epoch that was finished."""
    gaps: list[int] = field(default_factory=list)
    """Steps in 1..last that never committed."""
    rolled_back: int = 0
    """Commits undone by a resume from an older state (a checkpoint, or step 0 when every
    worker holding the state was lost with no checkpoint): trained again, counted once."""

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.gaps)

    def describe(self) -> str:
        if self.ok:
            again = (
                f"; {self.rolled_back} committed steps were rolled back and trained again" if self.rolled_back else ""
            )
            return (
                f"exactly once: {self.samples} samples in {self.steps} committed steps, "
                f"{self.complete_data_epochs} complete data epoch(s), none lost or "
                f"repeated{again}"
            )
        return (
            f"VIOLATED: {len(self.duplicates)} repeated, {len(self.missing)} lost samples, "
            f"{len(self.gaps)} missing steps (first: {self.duplicates[:3]} {self.missing[:3]} "
            f"{self.gaps[:3]})"
        )


Key = tuple[str, int, int]  # run, membership epoch, step


def read(directory: str | os.PathLike[str]) -> tuple[dict[Key, list[dict[str, Any]]], dict[int, set[Key]], int, int]:
    """Attempts by (run, epoch, step), the committed (run, epoch, step) of each step with
    rolled-back commits left out, the data set size and the number of rolled-back commits."""
    attempts: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    committed: list[tuple[Key, float]] = []
    resumes: list[tuple[float, int]] = []
    num_samples = 0
    for path in sorted(Path(directory).glob("*.jsonl")):
        run = ""
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill -9
                continue
            if rec["k"] == "a":
                rec["w"] = path.name
                attempts[(run, rec["e"], rec["s"])].append(rec)
            elif rec["k"] == "x":  # this worker's attempt of that step is void
                recs = attempts[(run, rec["e"], rec["s"])]
                for i in range(len(recs) - 1, -1, -1):
                    if recs[i].get("w") == path.name:
                        del recs[i]
                        break
            elif rec["k"] == "c":
                committed.append(((run, rec["e"], rec["s"]), rec["t"]))
            elif rec["k"] == "r":
                resumes.append((rec["t"], rec["s"]))
            else:
                num_samples, run = rec["n"], rec.get("run", "")
    commits: dict[int, set[Key]] = defaultdict(set)
    undone: set[Key] = set()
    for key, t in committed:
        if not any(t < resumed_at and from_step < key[2] for resumed_at, from_step in resumes):
            commits[key[2]].add(key)
        else:
            undone.add(key)
    return attempts, commits, num_samples, len(undone)


def audit(directory: str | os.PathLike[str]) -> Audit:
    attempts, commits, num_samples, rolled_back = read(directory)
    result = Audit(rolled_back=rolled_back)
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    last = max(commits, default=0)
    for step in range(1, last + 1):
        keys = commits.get(step)
        if not keys:
            result.gaps.append(step)
            continue
        if len(keys) > 1:  # the same step committed in two epochs: trained twice
            result.duplicates.append((-1, step))
        for rec in attempts.get(min(keys), []):
            seen[rec["d"]].update(rec["i"])
            result.samples += len(rec["i"])
        result.steps += 1
    for data_epoch, counts in sorted(seen.items()):
        result.duplicates += [(data_epoch, i) for i, n in counts.items() if n > 1]
        finished = data_epoch < max(seen)
        if finished:
            result.complete_data_epochs += 1
            result.missing += [(data_epoch, i) for i in range(num_samples) if i not in counts]
        elif len(counts) == num_samples:
            result.complete_data_epochs += 1
    return result
