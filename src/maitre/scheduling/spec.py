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
    stragglers: {policy: evict, ratio: 1.3, cooldownSeconds: 600}   # slow ranks: see below
    spares: 1                     # warm spare replicas, started and waiting (at most maxReplicas)

A script that is not written around maitre's loop (a torchrun script, a Hugging Face ``Trainer``,
Lightning) runs with ``elastic: restart``: it gets torchrun's environment and is restarted whole,
at the new size, on every change (:mod:`maitre.control.restarts`)::

    elastic: restart              # inplace (the default: maitre's loop) | restart
    successMarker: "training done"   # restart: the line a finished worker prints (optional)

:class:`JobManifest` is the pydantic model of it (``extra="forbid"``, strict: ``"2"`` or
``true`` is no integer; the API's schema documents it). :func:`parse_manifest` reports every
problem at once, each naming its field (``topology.level``), a misspelt key with the closest
valid one, so a user fixes a manifest in one round.
"""

from __future__ import annotations

import difflib
import re
import shlex
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from maitre.scheduling.model import Job, Topology

PRIORITY_CLASSES = {"low": 0, "normal": 100, "high": 1000}
_NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
_DERIVED = object()
"""The default of a field whose default depends on others (see its ``before`` validator)."""


class ManifestError(ValueError):
    """A manifest with problems; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid job manifest: " + "; ".join(problems))


def _problem(text: str) -> PydanticCustomError:
    """A validator's refusal, worded in full (the text goes in the context: it may hold braces)."""
    return PydanticCustomError("manifest", "{problem}", {"problem": text})


class _Fields(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        field_title_generator=lambda name, f: f.alias or to_camel(name),
        use_attribute_docstrings=True,
        defer_build=True,
    )
    # defer_build: built when first used (maitre.protocol, which every process imports, names
    # the model for the API's schema only)


class TopologySpec(_Fields):
    level: Literal["node", "rack", "block"] = "rack"
    """The domain the job should fit in."""
    mode: Literal["required", "preferred"] = "preferred"
    """required: never placed across domains; preferred: packed, but may spread."""


STRAGGLER_LIMITS: dict[str, tuple[type, float, float]] = {
    # field: (type, lowest, highest), inclusive; the one table of them (the workers' detector,
    # :mod:`maitre.runtime.stragglers`, checks its ``MAITRE_STRAGGLER_*`` variables against it)
    "window": (int, 1, 10_000),
    "ratio": (float, 1.01, 100.0),
    "z": (float, 0.0, 1000.0),
    "windows": (int, 1, 64),
    "mad_floor": (float, 0.001, 1.0),
    "drift": (float, 1.0, 100.0),
}
STRAGGLER_POLICIES = ("report", "evict", "off")


def _limit(name: str, default: float, doc: str) -> Any:
    _, low, high = STRAGGLER_LIMITS[name]
    return Field(default, ge=low, le=high, description=doc)


class StragglerSpec(_Fields):
    """What the job does about slow ranks (:mod:`maitre.runtime.stragglers` finds them: each
    rank's compute per sample against the median across ranks, window after window)."""

    policy: Literal["report", "evict", "off"] = "report"
    """report: a ``straggler`` event, a metric and a mark in the dashboard; evict: that too, and
    the slow rank's replica leaves at a step boundary, its node is avoided until its health
    check passes or ``cooldownSeconds`` end, and a spare or a free slot takes its place; off: no
    timing shared."""
    window: int = _limit("window", 5, "Steps per window: the ranks share their numbers at its last step.")
    ratio: float = _limit(
        "ratio",
        1.3,
        "A rank's held pace (the lower quartile of its compute "
        "per sample over window * windows steps) over the ranks' median that "
        "flags it.",
    )
    z: float = _limit("z", 3.0, "The robust z score of its held pace (the other ranks' MAD).")
    windows: int = _limit("windows", 3, "Windows its held pace spans (window * windows steps).")
    mad_floor: float = _limit("mad_floor", 0.05, "The MAD's floor, a fraction of the median.")
    drift: float = _limit(
        "drift",
        1.15,
        "A window's ratio from which the onset counts, and the "
        "held ratio under which a flagged rank has recovered; at most `ratio`.",
    )
    cooldown_s: float = Field(600.0, ge=0, le=7 * 86400, alias="cooldownSeconds")
    """evict: how long the slow rank's node is avoided unless its health check passes first."""

    @field_validator("drift")
    @classmethod
    def _drift_below_ratio(cls, drift: float, info: ValidationInfo) -> float:
        ratio = info.data.get("ratio")
        if ratio is not None and drift > ratio:
            raise _problem(
                f"stragglers.drift {drift} is above stragglers.ratio {ratio}: the onset would come after the verdict"
            )
        return drift


class MeshSpecFields(_Fields):
    """A replica's mesh (the names are torch's mesh dimensions, spelt as they are)."""

    dp_shard: int = Field(1, ge=1, alias="dp_shard")
    """FSDP2's sharding dimension."""
    tp: int = Field(1, ge=1, alias="tp")
    """Tensor parallelism."""


class JobManifest(_Fields):
    """A job as its user submits it (``maitre submit job.yaml``)."""

    name: str = Field(json_schema_extra={"pattern": _NAME})
    """1-63 lowercase letters, digits or '-', starting and ending with a letter or digit."""
    queue: str = Field(min_length=1)
    """Kueue's LocalQueue, Volcano's queue: one the coordinator knows."""
    priority_class_name: str | None = None
    """low (0), normal (100) or high (1000); or give priority."""
    priority: int = Field(default_factory=lambda: _DERIVED, validate_default=True)
    """Higher runs first (default: priorityClassName's, else 0)."""
    elastic: Literal["inplace", "restart"] = "inplace"
    """inplace: maitre's loop, which workers join and leave at step boundaries; restart: an
    unmodified script (``init_process_group("env://")``) in torchrun's environment, stopped and
    started again whole, at the new size, on every resize, notice or failure."""
    min_replicas: int = Field(1, ge=1)
    """The gang that must start together."""
    max_replicas: int = Field(default_factory=lambda: _DERIVED, validate_default=True, ge=1)
    """At most this many replicas (default: minReplicas, a fixed gang)."""
    nproc_per_replica: int = Field(1, ge=1, le=64)
    """Processes of one replica, started together on one node (FSDP2 or TP inside): the job
    grows and shrinks by whole replicas."""
    mesh: MeshSpecFields | None = None
    """The replica's mesh, e.g. {dp_shard: 4, tp: 2} (default: dp_shard = nprocPerReplica)."""
    gpus_per_replica: int = Field(default_factory=lambda: _DERIVED, validate_default=True, ge=1)
    """Slots (GPUs) of one replica, all on one node (default: nprocPerReplica; a multiple of it)."""
    preemptible: bool = True
    """May be suspended (checkpoint, then stop) for others: needs checkpointDir."""
    grace_period_s: float = Field(30.0, ge=0, alias="gracePeriodSeconds")
    """Seconds to checkpoint when suspended."""
    topology: TopologySpec | None = None
    command: tuple[str, ...]
    """A list of arguments, or one string split like a shell."""
    checkpoint_dir: str | None = Field(None, min_length=1)
    stragglers: StragglerSpec | None = None
    """Slow ranks: how they are found and what is done about them (default: reported)."""
    spares: int = Field(0, ge=0)
    """Warm spare replicas kept started and waiting (imports done, model built, no state), not
    counted as training capacity; one joins at the next step boundary when a replica fails or is
    evicted. At most maxReplicas."""
    success_marker: str | None = Field(None, min_length=1, max_length=200)
    """elastic: restart: a line a worker prints when its training is done; exiting 0 without it
    is a failure (a script that ended early). Without it, exiting 0 is success, as for torchrun."""
    origin: str | None = Field(None, min_length=1, max_length=300)
    """What submitted the job, as it names its own object: the Kubernetes operator writes the
    MaitreJob's ``namespace/name/uid``, and adopts (after a restart) only the jobs whose origin
    is one of its objects. Shown in the job's view; not a field of a MaitreJob's spec."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.fullmatch(_NAME, name):
            raise _problem(
                f"name {name!r} must be 1-63 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit"
            )
        return name

    @field_validator("queue")
    @classmethod
    def _queue(cls, queue: str, info: ValidationInfo) -> str:
        known = (info.context or {}).get("queues")
        if known is not None and queue not in known:
            raise _problem(f"no queue {queue!r} (queues: {', '.join(sorted(known)) or 'none'})")
        return queue

    @field_validator("priority_class_name")
    @classmethod
    def _known_class(cls, name: str | None, info: ValidationInfo) -> str | None:
        classes = _classes(info)
        if name is not None and name not in classes:
            raise _problem(
                f"unknown priorityClassName {name!r} (known: {', '.join(f'{k}={v}' for k, v in classes.items())})"
            )
        return name

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: Any, info: ValidationInfo) -> Any:
        named = info.data.get("priority_class_name")
        if value is _DERIVED:
            return 0 if named is None else _classes(info)[named]
        if named is not None:
            raise _problem("give priority or priorityClassName, not both")
        return value

    @field_validator("max_replicas", mode="before")
    @classmethod
    def _fixed_gang(cls, value: Any, info: ValidationInfo) -> Any:
        return info.data.get("min_replicas", 1) if value is _DERIVED else value

    @field_validator("max_replicas")
    @classmethod
    def _at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")
        if low is not None and value < low:
            raise _problem(f"maxReplicas {value} is less than minReplicas {low}")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_fits(cls, mesh: MeshSpecFields | None, info: ValidationInfo) -> Any:
        nproc = info.data.get("nproc_per_replica")
        if mesh is not None and nproc is not None and mesh.dp_shard * mesh.tp != nproc:
            raise _problem(
                f"mesh dp_shard={mesh.dp_shard} x tp={mesh.tp} is "
                f"{mesh.dp_shard * mesh.tp} processes, nprocPerReplica is {nproc}"
            )
        return mesh

    @field_validator("gpus_per_replica", mode="before")
    @classmethod
    def _slots_of_a_replica(cls, value: Any, info: ValidationInfo) -> Any:
        nproc = info.data.get("nproc_per_replica", 1)
        if value is _DERIVED:
            return nproc
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value % nproc:
            raise _problem(
                f"gpusPerReplica {value} is not a multiple of nprocPerReplica {nproc}"
                " (each process of a replica holds the same number of slots)"
            )
        return value

    @field_validator("mesh", "stragglers", "spares")
    @classmethod
    def _in_place_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Features of maitre's loop: a restart-mode script has none of them."""
        if info.data.get("elastic") == "restart" and value:
            name = str(info.field_name)
            why = {
                "mesh": "a replica's mesh is built by maitre's loop",
                "stragglers": "stragglers are timed by maitre's loop",
                "spares": "a warm spare joins a running job in place (live join)",
            }[name]
            raise _problem(f"{name}: {why}; an elastic: restart job cannot have it (use elastic: inplace)")
        return value

    @field_validator("success_marker")
    @classmethod
    def _restart_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("elastic") != "restart":
            raise _problem("successMarker: only an elastic: restart job has one (maitre's loop says when it is done)")
        return value

    @field_validator("spares")
    @classmethod
    def _spares_fit(cls, spares: int, info: ValidationInfo) -> int:
        high = info.data.get("max_replicas")
        if high is not None and spares > high:
            raise _problem(f"spares {spares} is more than maxReplicas {high}")
        return spares

    @property
    def mesh_text(self) -> str:
        """The replica's mesh as ``MAITRE_MESH`` carries it."""
        dp, tp = (self.nproc_per_replica, 1) if self.mesh is None else (self.mesh.dp_shard, self.mesh.tp)
        return f"dp_shard={dp},tp={tp}"

    @field_validator("command", mode="before", json_schema_input_type=str | list[str | int | float])
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = shlex.split(value)
            except ValueError as exc:
                raise _problem(f"command: {exc}") from None
        elif not isinstance(value, list) or any(
            isinstance(a, bool) or not isinstance(a, (str, int, float)) for a in value
        ):
            raise _problem(f"command must be a string or a list of strings, got {value!r}")
        if not value:
            raise _problem("command is empty")
        return tuple(str(a) for a in value)

    def job(self, submitted_at: float) -> Job:
        """The scheduler's view of this manifest, pending."""
        topology = None if self.topology is None else Topology(self.topology.level, self.topology.mode)
        return Job(
            id=self.name,
            queue=self.queue,
            priority=self.priority,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            slots_per_replica=self.gpus_per_replica,
            preemptible=self.preemptible,
            grace_period_s=self.grace_period_s,
            topology=topology,
            submitted_at=submitted_at,
        )


def manifest_record(manifest: JobManifest) -> dict[str, Any]:
    """The manifest as the coordinator's store keeps it: every field, by the names a manifest
    spells, as parsed (its priority resolved). :func:`manifest_from_record` reads it back."""
    return manifest.model_dump(mode="json", by_alias=True, exclude_none=True)


def manifest_from_record(record: dict[str, Any]) -> JobManifest:
    """A stored manifest, equal to the one stored: its priority is the one resolved at
    submission, whatever the priority classes are now. Older records wrote absent fields as
    null, and some fields not at all (they take their defaults)."""
    doc = {k: v for k, v in record.items() if v is not None}
    named = doc.get("priorityClassName")
    classes = None
    if named is not None and "priority" in doc:
        classes = {named: doc.pop("priority")}
    return JobManifest.model_validate(doc, context={"priority_classes": classes})


def _classes(info: ValidationInfo) -> dict[str, int]:
    classes: dict[str, int] | None = (info.context or {}).get("priority_classes")
    return PRIORITY_CLASSES if classes is None else classes


def parse_manifest(
    source: str | dict[str, Any], *, queues: set[str] | None = None, priority_classes: dict[str, int] | None = None
) -> JobManifest:
    """Check and parse a manifest (YAML text or an already-loaded mapping); raises
    :class:`ManifestError` naming every problem. ``queues``, when given, are the known ones."""
    if isinstance(source, str):
        import yaml  # only here: maitre.protocol (every process) imports this module

        try:
            doc = yaml.safe_load(source)
        except yaml.YAMLError as exc:
            raise ManifestError([f"not valid YAML: {' '.join(str(exc).split())}"]) from None
    else:
        doc = source
    if doc is None:
        raise ManifestError(["the manifest is empty"])
    if not isinstance(doc, dict):
        raise ManifestError([f"a manifest is a mapping of fields, got {type(doc).__name__}"])
    try:
        return JobManifest.model_validate(doc, context={"queues": queues, "priority_classes": priority_classes})
    except ValidationError as exc:
        raise ManifestError([_say(e) for e in exc.errors()]) from None


_SAYS = {
    "missing": "{at} is required",
    "int_type": "{at} must be an integer, got {got}",
    "float_type": "{at} must be a number, got {got}",
    "bool_type": "{at} must be true or false, got {got}",
    "string_type": "{at} must be a string, got {got}",
    "string_too_short": "{at} must not be empty",
    "greater_than_equal": "{at} must be at least {ge}, got {got}",
    "less_than_equal": "{at} must be at most {le}, got {got}",
    "literal_error": "{at} must be {expected}, got {got}",
    "model_type": "{at} must be a mapping of {keys}, got {got}",
}
"""pydantic's errors, in this module's words (any other: its own message)."""


def _say(error: Any) -> str:
    loc = error["loc"]
    at = ".".join(str(part) for part in loc)
    if error["type"] == "manifest":
        return str(error["ctx"]["problem"])
    if error["type"] in ("extra_forbidden", "invalid_key"):  # a misspelt key, or no string
        close = difflib.get_close_matches(str(loc[-1]), _keys(loc[:-1]), n=1)
        return f"unknown field {at!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    says = _SAYS.get(error["type"])
    if says is None:
        return f"{at}: {error['msg']}"
    keys = ", ".join(_keys(loc)) if "{keys}" in says else ""
    return says.format(at=at, got=repr(error.get("input")), keys=keys, **error.get("ctx", {}))


def _keys(loc: tuple[Any, ...]) -> list[str]:
    """The fields of the mapping at ``loc`` (``()``: the manifest's own; ``("topology",)``)."""
    model: type[BaseModel] = JobManifest
    for part in loc:
        field = next(f for n, f in model.model_fields.items() if (f.alias or n) == part)
        model = next(
            t
            for t in get_args(field.annotation) or (field.annotation,)
            if isinstance(t, type) and issubclass(t, BaseModel)
        )
    return [f.alias or n for n, f in model.model_fields.items()]
