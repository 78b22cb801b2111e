"""The data ledger: an auditable record of which samples every committed step trained on.

When ``MAITRE_LEDGER_DIR`` is set, each worker appends to ``<dir>/<worker>.jsonl`` a header
``{"k": "h", "n": num_samples, "t": wall_time, "pid": pid}`` (one per process start), then:

* ``{"k": "a", "e": epoch, "s": step, "d": data_epoch, "i": [indices]}`` before a step's
  gradient allreduce (an *attempt*: this rank's share), and
* ``{"k": "c", "e": epoch, "s": step, "t": wall_time}`` once the step is committed.

A step that committed in membership epoch ``e`` used exactly the attempts logged for ``(e, s)``: an
allreduce completes on any rank only once every member contributed, and every member logs its
attempt before contributing. Attempts of epochs that were lost are ignored. :func:`audit` checks
that the committed steps consumed every sample index exactly once per data epoch.
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
    def __init__(self, directory: str | os.PathLike[str], worker_id: str, num_samples: int) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / f"{worker_id}.jsonl", "a", buffering=1)
        self._file.write(json.dumps({"k": "h", "n": num_samples, "t": time.time(),
                                     "pid": os.getpid()}) + "\n")

    def attempt(self, epoch: int, step: int, data_epoch: int, indices: list[int]) -> None:
        self._file.write(json.dumps({"k": "a", "e": epoch, "s": step, "d": data_epoch,
                                     "i": indices}, separators=(",", ":")) + "\n")

    def commit(self, epoch: int, step: int) -> None:
        self._file.write(json.dumps({"k": "c", "e": epoch, "s": step, "t": time.time()},
                                    separators=(",", ":")) + "\n")

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

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.gaps)

    def describe(self) -> str:
        if self.ok:
            return (f"exactly once: {self.samples} samples in {self.steps} committed steps, "
                    f"{self.complete_data_epochs} complete data epoch(s), none lost or repeated")
        return (f"VIOLATED: {len(self.duplicates)} repeated, {len(self.missing)} lost samples, "
                f"{len(self.gaps)} missing steps (first: {self.duplicates[:3]} {self.missing[:3]} "
                f"{self.gaps[:3]})")


def read(directory: str | os.PathLike[str]) -> tuple[dict[tuple[int, int], list[dict[str, Any]]],
                                                      dict[int, set[int]], int]:
    """Attempts by (epoch, step), the epochs in which each step committed, and the data set size."""
    attempts: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    commits: dict[int, set[int]] = defaultdict(set)
    num_samples = 0
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill -9
                continue
            if rec["k"] == "a":
                attempts[(rec["e"], rec["s"])].append(rec)
            elif rec["k"] == "c":
                commits[rec["s"]].add(rec["e"])
            else:
                num_samples = rec["n"]
    return attempts, commits, num_samples


def audit(directory: str | os.PathLike[str]) -> Audit:
    attempts, commits, num_samples = read(directory)
    result = Audit()
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    last = max(commits, default=0)
    for step in range(1, last + 1):
        epochs = commits.get(step)
        if not epochs:
            result.gaps.append(step)
            continue
        if len(epochs) > 1:  # the same step committed in two epochs: trained twice
            result.duplicates.append((-1, step))
        for rec in attempts.get((min(epochs), step), []):
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
