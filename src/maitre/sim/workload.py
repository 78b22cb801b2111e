"""Workloads: the jobs a simulation replays, read from the Pollux workload CSVs (``sim/traces``,
package data: :data:`DATA`).

A Pollux workload file has one row per job: ``name,time,application,num_replicas,batch_size``
(submission time in seconds; the replicas and batch size the fixed-size baselines use). Every
row is checked; a bad file is refused whole with the line and the reason of each problem.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

DATA = resources.files("maitre") / "sim" / "traces"
"""The bundled traces and profiles: package data, so an installed wheel has them too."""
APPLICATIONS = ("cifar10", "ncf", "deepspeech2", "bert", "yolov3", "imagenet")
_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


class WorkloadError(ValueError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        super().__init__(f"{source}: " + "; ".join(shown))


@dataclass(frozen=True, slots=True)
class Arrival:
    name: str
    time: float
    """Submission time, seconds from the start of the workload."""
    application: str
    num_replicas: int
    batch_size: int


def load_workload(path: str | Traversable) -> list[Arrival]:
    """The jobs of a Pollux workload CSV (a path, or a file of :data:`DATA`), in submission
    order."""
    path = Path(path) if isinstance(path, str) else path
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    return parse_workload(text, str(path))


def parse_workload(text: str, source: str = "workload") -> list[Arrival]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise WorkloadError(
            source, [f"missing column(s) {', '.join(missing)} (a Pollux workload has {','.join(_COLUMNS)})"]
        )
    problems: list[str] = []
    jobs: list[Arrival] = []
    names: set[str] = set()
    for line, row in enumerate(reader, start=2):
        try:
            time = float(row["time"])
            replicas, batch = int(row["num_replicas"]), int(row["batch_size"])
        except (TypeError, ValueError):
            problems.append(f"line {line}: time, num_replicas and batch_size must be numbers")
            continue
        name, app = (row["name"] or "").strip(), (row["application"] or "").strip()
        bad = []
        if not name or name in names:
            bad.append(f"name {name!r} is empty or repeated")
        if not math.isfinite(time) or time < 0:
            bad.append(f"time {row['time']} is not a time >= 0")
        if app not in APPLICATIONS:
            bad.append(f"application {app!r} is not one of {', '.join(APPLICATIONS)}")
        if replicas < 1 or batch < 1:
            bad.append("num_replicas and batch_size must be at least 1")
        if bad:
            problems += [f"line {line}: {b}" for b in bad]
            continue
        names.add(name)
        jobs.append(Arrival(name, time, app, replicas, batch))
    if problems:
        raise WorkloadError(source, problems)
    if not jobs:
        raise WorkloadError(source, ["no jobs"])
    return sorted(jobs, key=lambda j: (j.time, j.name))


def pollux_workload(number: int, load: float = 1.0) -> Traversable:
    """The bundled file of Pollux workload ``number`` (1-8) at ``load`` (0.5, 1.0, 1.5, 2.0)."""
    folder = {0.5: "workloads-0.5", 1.0: "workloads", 1.5: "workloads-1.5", 2.0: "workloads-2.0"}
    if load not in folder or not 1 <= number <= 8:
        raise ValueError(f"Pollux workloads are 1-8 at loads 0.5, 1.0, 1.5, 2.0; got {number} at {load}")
    return DATA / "pollux_workloads" / folder[load] / f"workload-{number}.csv"


@dataclass(frozen=True, slots=True)
class TraceArrival:
    """A row of a duration trace (the Philly-derived one): no model, a run time at a size."""

    name: str
    time: float
    duration_s: float
    gpus: int
    team: str


_PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "cluster")


def load_philly(path: str | Traversable | None = None, limit: int | None = None) -> list[TraceArrival]:
    """The Philly-derived trace (``timestamp,duration,num_gpus,gpu_time,cluster``): submission
    times in seconds from the first row, durations in seconds, teams from the virtual cluster."""
    from datetime import datetime, timezone

    if not path:
        path = DATA / "philly_pollux" / "philly_jobs.csv"
    elif isinstance(path, str):
        path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in _PHILLY_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise WorkloadError(str(path), [f"missing column(s) {', '.join(missing)}"])
    rows, problems = [], []
    for line, row in enumerate(reader, start=2):
        try:
            t = datetime.fromisoformat(row["timestamp"]).replace(tzinfo=timezone.utc).timestamp()
            duration, gpus = float(row["duration"]), int(row["num_gpus"])
        except (TypeError, ValueError):
            problems.append(f"line {line}: timestamp must be YYYY-MM-DD HH:MM:SS, duration and num_gpus numbers")
            continue
        if not (math.isfinite(duration) and duration > 0 and gpus >= 1):
            problems.append(f"line {line}: duration must be > 0 and num_gpus >= 1")
            continue
        rows.append((t, duration, gpus, row["cluster"] or "default"))
        if limit and len(rows) >= limit:
            break
    if problems:
        raise WorkloadError(str(path), problems)
    if not rows:
        raise WorkloadError(str(path), ["no jobs"])
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceArrival(f"philly-{i}", t - t0, d, g, team) for i, (t, d, g, team) in enumerate(rows)]


def is_philly(path: str | Path) -> bool:
    with Path(path).open() as f:
        header = f.readline()
    return all(c in header for c in _PHILLY_COLUMNS)
