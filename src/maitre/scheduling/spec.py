"""Job manifests: the YAML a user submits, checked whole before anything is stored.

The field names are the ones users know from Kubeflow's training operators, Volcano and Kueue::

    name: bert-large              # lowercase letters, digits and '-', at most 63 characters
    queue: team-a                 # Kueue's LocalQueue / Volcano's queue
    priorityClassName: high       # or `priority: 1000` (not both)
    minReplicas: 2                # the gang that must start together
    maxReplicas: 8                # minReplicas == maxReplicas: a fixed gang, never resized
    gpusPerReplica: 1
    preemptible: true             # may be suspended (checkpoint, then stop) for others
    gracePeriodSeconds: 60        # time to checkpoint when suspended
    topology: {level: rack, mode: preferred}   # node | rack | block; required | preferred
    command: ["python", "train.py", "--steps", "300"]   # or one string, split like a shell
    checkpointDir: /shared/ckpt/bert-large

:func:`parse_manifest` reports every problem at once (a misspelt key with the closest valid
one), so a user fixes a manifest in one round.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from maitre.scheduling.model import Job, Topology

PRIORITY_CLASSES = {"low": 0, "normal": 100, "high": 1000}
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_FIELDS = {"name", "queue", "priorityClassName", "priority", "minReplicas", "maxReplicas",
           "gpusPerReplica", "preemptible", "gracePeriodSeconds", "topology", "command",
           "checkpointDir"}
_REQUIRED = ("name", "queue", "command")


class ManifestError(ValueError):
    """A manifest with problems; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid job manifest: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class JobManifest:
    name: str
    queue: str
    priority: int
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int
    preemptible: bool
    grace_period_s: float
    topology: Topology | None
    command: tuple[str, ...]
    checkpoint_dir: str | None

    def job(self, submitted_at: float) -> Job:
        """The scheduler's view of this manifest, pending."""
        return Job(id=self.name, queue=self.queue, priority=self.priority,
                   min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                   slots_per_replica=self.gpus_per_replica, preemptible=self.preemptible,
                   grace_period_s=self.grace_period_s, topology=self.topology,
                   submitted_at=submitted_at)


def parse_manifest(source: str | dict[str, Any], *, queues: set[str] | None = None,
                   priority_classes: dict[str, int] | None = None) -> JobManifest:
    """Check and parse a manifest (YAML text or an already-loaded mapping); raises
    :class:`ManifestError` naming every problem. ``queues``, when given, are the known ones."""
    classes = PRIORITY_CLASSES if priority_classes is None else priority_classes
    if isinstance(source, str):
        try:
            doc = yaml.safe_load(source)
        except yaml.YAMLError as exc:
            raise ManifestError([f"not valid YAML: {' '.join(str(exc).split())}"]) from None
    else:
        doc = source
    if not isinstance(doc, dict):
        raise ManifestError([f"a manifest is a mapping of fields, got {type(doc).__name__}"])
    problems: list[str] = []
    for key in doc:
        if key not in _FIELDS:
            close = difflib.get_close_matches(str(key), sorted(_FIELDS), n=1)
            problems.append(f"unknown field {key!r}" + (f" (did you mean {close[0]!r}?)"
                                                         if close else ""))
    for key in _REQUIRED:
        if key not in doc:
            problems.append(f"{key} is required")

    def integer(key: str, default: int | None, low: int) -> int | None:
        value = doc.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key} must be an integer, got {value!r}")
            return None
        if value < low:
            problems.append(f"{key} must be at least {low}, got {value}")
            return None
        return value

    name = doc.get("name")
    if "name" in doc and not (isinstance(name, str) and _NAME.fullmatch(name)):
        problems.append(f"name {name!r} must be 1-63 lowercase letters, digits or '-', "
                        "starting and ending with a letter or digit")
    queue = doc.get("queue")
    if "queue" in doc:
        if not isinstance(queue, str) or not queue:
            problems.append(f"queue must be a name, got {queue!r}")
        elif queues is not None and queue not in queues:
            problems.append(f"no queue {queue!r} (queues: {', '.join(sorted(queues)) or 'none'})")

    priority = 0
    if "priority" in doc and "priorityClassName" in doc:
        problems.append("give priority or priorityClassName, not both")
    elif "priorityClassName" in doc:
        cls = doc["priorityClassName"]
        if cls not in classes:
            problems.append(f"unknown priorityClassName {cls!r} (known: "
                            f"{', '.join(f'{k}={v}' for k, v in classes.items())})")
        else:
            priority = classes[cls]
    elif "priority" in doc:
        value = doc["priority"]
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"priority must be an integer, got {value!r}")
        else:
            priority = value

    lo = integer("minReplicas", 1, 1)
    hi = integer("maxReplicas", lo if lo is not None else 1, 1)
    if lo is not None and hi is not None and hi < lo:
        problems.append(f"maxReplicas {hi} is less than minReplicas {lo}")
    gpus = integer("gpusPerReplica", 1, 1)

    preemptible = doc.get("preemptible", True)
    if not isinstance(preemptible, bool):
        problems.append(f"preemptible must be true or false, got {preemptible!r}")
    grace = doc.get("gracePeriodSeconds", 30)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        problems.append(f"gracePeriodSeconds must be a number >= 0, got {grace!r}")

    topology = None
    if "topology" in doc:
        raw = doc["topology"]
        if not isinstance(raw, dict) or set(raw) - {"level", "mode"}:
            problems.append(f"topology must be {{level, mode}}, got {raw!r}")
        else:
            try:
                topology = Topology(level=raw.get("level", "rack"),
                                    mode=raw.get("mode", "preferred"))
            except ValueError as exc:
                problems.append(str(exc))

    command: tuple[str, ...] = ()
    if "command" in doc:
        raw = doc["command"]
        if isinstance(raw, str):
            try:
                command = tuple(shlex.split(raw))
            except ValueError as exc:
                problems.append(f"command: {exc}")
        elif isinstance(raw, list) and all(isinstance(a, (str, int, float)) for a in raw):
            command = tuple(str(a) for a in raw)
        else:
            problems.append(f"command must be a string or a list of strings, got {raw!r}")
        if not command and not any(p.startswith("command") for p in problems):
            problems.append("command is empty")

    checkpoint = doc.get("checkpointDir")
    if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
        problems.append(f"checkpointDir must be a path, got {checkpoint!r}")

    if problems:
        raise ManifestError(problems)
    return JobManifest(name=name, queue=queue, priority=priority, min_replicas=lo,
                       max_replicas=hi, gpus_per_replica=gpus, preemptible=preemptible,
                       grace_period_s=float(grace), topology=topology, command=command,
                       checkpoint_dir=checkpoint)  # type: ignore[arg-type]
