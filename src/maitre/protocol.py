"""maitre's protocol: every route of the coordinator, every message shape, every ``MAITRE_*``
variable. Both sides import this module and nothing else of each other.

Who talks to whom::

    CLI / dashboard ──(token)──────────────▶ coordinator   jobs, nodes, queues, report
    agent (one per node) ──(token)─────────▶ coordinator   node heartbeat (its workers' liveness
                                                           and progress in one beat, a spot
                                                           notice while one stands, its latest
                                                           health probe), watch
                                                           (long-poll for orders), worker exits
    worker ──(token)───────────────────────▶ coordinator   rendezvous (long-poll), done, left,
                                                           recovery reports: per change, never
                                                           per step; checkpoint and restore
                                                           reports; rank 0's progress, at
                                                           most once a second
    worker ──(unix socket, 10 Hz)──────────▶ its agent     heartbeat; the reply is the worker's
                                                           view (epoch closed, change pending,
                                                           leave, stop, suspend)

The hot path is per node, not per worker: a node of 8 workers costs the coordinator one beat a
second in steady state, plus a watch reply whenever something its workers must know changed.
Step-boundary decisions never pass through the coordinator: they ride in the gradient allreduce.

Requests are validated here (``extra="forbid"``: a misspelt field is an error, not ignored;
``strict``: ``"2"`` or ``true`` is no integer); the coordinator's API (:mod:`maitre.control.api`)
turns every problem into a 4xx whose JSON body names the field. Replies are models too, and
their readers parse them (the agent its :class:`NodeOrders`, the worker its :class:`AgentView`):
a reader ignores fields it does not know, so an agent or a worker one version behind the
coordinator still reads its answers. The worker's side talks with a small stdlib client
(:mod:`maitre.wire`), so the training process needs no HTTP library.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.spec import JobManifest, StragglerSpec

API = "/v1"
"""Every route below is under this prefix."""

DATA_ERROR = "maitre.data.shards.DataError: "
"""How a worker's error line (its last stderr line) begins when its data could not be read (a
corrupt shard): the data's fault, not the worker's, so the coordinator fails the job at once
rather than hand the same record to a peer or a replacement."""

# -- environment variables -------------------------------------------------------------------
COORDINATOR = "MAITRE_COORDINATOR"
"""``HOST:PORT`` of the coordinator's HTTP API (workers, agents and the CLI)."""
TOKEN = "MAITRE_TOKEN"
"""The token this process presents: the coordinator's (the CLI, agents), or its run's (a worker:
its agent sets it from the start order; it opens the worker's own routes and store only)."""
TLS_CA = "MAITRE_TLS_CA"
"""A PEM file of the certificate(s) that sign the coordinator's: set, clients speak HTTPS to it
and check its certificate (the CLI's default for ``--tls-ca``; agents pass it to workers)."""
TOKEN_FILE = "MAITRE_TOKEN_FILE"
"""A file holding the token (the CLI's default for ``--token-file``)."""
WORKER_ID = "MAITRE_WORKER_ID"
JOB_ID = "MAITRE_JOB_ID"
STORE = "MAITRE_STORE"
"""``HOST:PORT`` of the c10d store the job's process groups rendezvous on."""
AGENT = "MAITRE_AGENT"
"""Path of the agent's unix socket: where a worker sends its heartbeats."""
SIGTERM_DRAINS = "MAITRE_SIGTERM_DRAINS"
"""Set by an agent whose own SIGTERM is a notice (``--sigterm-notice``): its workers let a
SIGTERM of their own pass, since the agent drains them at a step boundary. Slurm's
``proctrack/cgroup`` signals every process of the step, the workers too."""
SLOTS = "MAITRE_SLOTS"
"""The node's slots (GPU indices) a worker process holds, comma-separated: its share of
``gpusPerReplica``."""
NPROC = "MAITRE_NPROC_PER_REPLICA"
"""Processes of a replica (``nprocPerReplica``): the agent starts them together as one worker."""
PROC = "MAITRE_PROC"
"""This process's index in its replica, 0 .. NPROC-1 (its rank in the replica's own group)."""
MESH = "MAITRE_MESH"
"""The replica's mesh, ``dp_shard=N,tp=M`` (:func:`maitre.replica_mesh` checks the script's)."""
STORE_KEY = "MAITRE_STORE_KEY"
"""Its run's name at the store's door: a replica of several processes builds its own group on
the run's store before its first rendezvous."""
JOIN = "MAITRE_JOIN"
"""How a member that is behind (a joiner, a replacement) gets the job's state: ``stream`` (the
default: it listens while a peer streams it a snapshot, and the job trains on) or ``pause``
(the job waits while the state is broadcast: no snapshot in memory, no queue of steps)."""
JOIN_MODES = ("stream", "pause")
TRANSFER_DELAY_S = "MAITRE_TRANSFER_DELAY_S"
"""Fault injection (tests, drills): a streamed snapshot lands this many seconds late on the
listener, as over a slow network, so that it has many steps to replay."""
SLOW_RANK = "MAITRE_SLOW_RANK"
"""Fault injection (tests, drills): ``RANK:FACTOR[:STEP]``, e.g. ``1:0.5``: the worker of data
rank ``RANK`` sleeps ``FACTOR`` times its step's compute each step (from step ``STEP`` on, 1 if
not given) before the step's allreduce, as a throttled GPU would (a straggler for
:mod:`maitre.runtime.stragglers` to find)."""
STEP_JITTER = "MAITRE_STEP_JITTER"
"""Fault injection (tests, benchmarks): ``FRACTION``, e.g. ``0.3``: every rank sleeps a random
part, uniform in [0, ``FRACTION``), of its step's compute each step: noise on every rank, which
the straggler detector must not take for a slow rank."""
STRAGGLER_TRACE = "MAITRE_STRAGGLER_TRACE"
"""Diagnostics (benchmarks): a directory where every rank appends one JSON line per step of
its timing, ``{step, epoch, rank, world_size, work, compute_s, cpu_s}`` (``cpu_s``: its main
thread's CPU time over the same span), to ``<worker>.jsonl``."""
SLOW_FACTOR = "MAITRE_SLOW_FACTOR"
"""Fault injection (tests, drills), node-scoped: set in an agent's environment, every worker it
starts sleeps ``FACTOR`` times its step's compute each step before the step's allreduce, as on a
node whose CPUs a neighbour steals. Unlike :data:`SLOW_RANK` it stays with the node: a rank that
moves away is no longer slow (the ``evict`` policy's test)."""
STRAGGLER_WINDOW = "MAITRE_STRAGGLER_WINDOW"
"""Steps per window of the per-rank timing (default 5): the ranks share their numbers at each
window's last step, in slots of that step's reduction."""
STRAGGLER_RATIO = "MAITRE_STRAGGLER_RATIO"
"""A rank's held pace (the lower quartile of its compute per unit of work over its last
``MAITRE_STRAGGLER_WINDOW`` * ``MAITRE_STRAGGLER_WINDOWS`` steps) over the median of the ranks'
that makes it a straggler (default 1.3)."""
STRAGGLER_Z = "MAITRE_STRAGGLER_Z"
"""The robust z score of its held pace (median and MAD across the other ranks; default 3)."""
STRAGGLER_WINDOWS = "MAITRE_STRAGGLER_WINDOWS"
"""Windows the held pace spans (default 3: 15 steps)."""
STRAGGLER_MAD_FLOOR = "MAITRE_STRAGGLER_MAD_FLOOR"
"""The MAD's floor as a fraction of the median (default 0.05)."""
STRAGGLER_DRIFT = "MAITRE_STRAGGLER_DRIFT"
"""A window's ratio from which a rank's onset counts, and the held ratio under which a flagged
rank has recovered (default 1.15)."""
STRAGGLER_POLICY = "MAITRE_STRAGGLER_POLICY"
"""What a straggler found does: ``report`` (the default: a ``straggler`` event and metric),
``evict`` (reported, and the coordinator moves its replica off its node) or ``off`` (no timing
shared, no detector). A managed job sets these from its manifest's ``stragglers``."""


def straggler_environ(settings: StragglerSpec) -> dict[str, str]:
    """The workers' ``MAITRE_STRAGGLER_*`` variables for a manifest's ``stragglers``."""
    named = {
        "window": STRAGGLER_WINDOW,
        "ratio": STRAGGLER_RATIO,
        "z": STRAGGLER_Z,
        "windows": STRAGGLER_WINDOWS,
        "mad_floor": STRAGGLER_MAD_FLOOR,
        "drift": STRAGGLER_DRIFT,
    }
    env = {var: str(getattr(settings, name)) for name, var in named.items()}
    env[STRAGGLER_POLICY] = settings.policy
    return env


LEDGER_DIR = "MAITRE_LEDGER_DIR"
"""Where workers record the samples they commit (the exactly-once audit)."""
RUN_ID = "MAITRE_RUN_ID"
HEARTBEAT_S = "MAITRE_HEARTBEAT_S"
"""Seconds between a worker's heartbeats to its agent (default 0.1)."""
COORDINATOR_TIMEOUT_S = "MAITRE_COORDINATOR_TIMEOUT_S"
"""How long a worker in rendezvous waits for an unreachable coordinator before it gives up."""
CHECKPOINT_DIR = "MAITRE_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "MAITRE_CHECKPOINT_EVERY"
CHECKPOINT_KEEP = "MAITRE_CHECKPOINT_KEEP"
MTBF_S = "MAITRE_MTBF_S"
CHECKPOINT_FAULT = "MAITRE_CHECKPOINT_FAULT"
"""Fault injection for tests: make the checkpoint writer fail at a chosen point."""
WARM_START = "MAITRE_WARM_START"
"""``0`` starts workers with a fresh interpreter instead of forking them warm."""
DATA_WORKER_NAME = "maitre-data"
"""The process name (``/proc/PID/comm``) of a :class:`maitre.data.Loader`'s data worker, with its
index: ``maitre-data-0``. ``maitre run --events kill-data`` finds them by it among a training
process's descendants, wherever they sit (children of a fork server under warm start)."""
LOG = "MAITRE_LOG"
"""The CLI's log level for maitre's loggers (``debug``, ``info``, ``warning``: the default)."""

ENV_PREFIX = "MAITRE_"

# -- the agent's promise -------------------------------------------------------------------------
SILENT_S = 0.3
"""A worker silent this long makes its agent beat at once (and every ``urgent_s`` while it stays
so). A node beat that lists a worker as silent for less therefore vouches for it until the
agent's next beat is due (``NodeBeat.interval_s``): the coordinator's hang detector counts no
silence for it till then (:func:`maitre.control.detectors.silence`)."""

# -- routes (relative to API) ----------------------------------------------------------------
HEALTH = "/health"
JOBS = "/jobs"
JOB = "/jobs/{job}"
JOB_SCALE = "/jobs/{job}/scale"
JOB_SUSPEND = "/jobs/{job}/suspend"
JOB_RESUME = "/jobs/{job}/resume"
JOB_CANCEL = "/jobs/{job}/cancel"
NODES = "/nodes"
QUEUES = "/queues"
REPORT = "/report"
EVENTS = "/events"
EVENTS_STREAM = "/events/stream"
NODE_HEARTBEAT = "/nodes/{node}/heartbeat"
NODE_WATCH = "/nodes/{node}/watch"
WORKER_EXIT = "/workers/{worker}/exit"
WORKER_RENDEZVOUS = "/workers/{worker}/rendezvous"
WORKER_DONE = "/workers/{worker}/done"
WORKER_LEFT = "/workers/{worker}/left"
WORKER_REPORT = "/workers/{worker}/report"
WORKER_HEARTBEAT = "/workers/{worker}/heartbeat"
"""On the agent's unix socket only: the coordinator never sees a worker's heartbeat."""

METRICS = "/metrics"
"""Prometheus's scrape path, at the root (not under :data:`API`: where scrape configs look by
default), in Prometheus's text format; it needs the coordinator's token like every other route
(:mod:`maitre.control.metrics`)."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""Job, node and worker names in paths."""

MAX_BODY = 1 << 20
"""Largest request body the coordinator reads (a manifest is a few hundred bytes)."""

LABELS = ("rack", "block", "capacity_type", "accelerator", "reserved_for")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Reply(BaseModel):
    # A reader ignores the fields it does not know (a newer sender's: see the docstring); the
    # schema still says that this coordinator sends none but these.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"additionalProperties": False})


# -- errors ----------------------------------------------------------------------------------
class Problem(_Reply):
    field: str
    """Where in the request: ``body.slots``, ``path.job``, ``header.authorization``..."""
    message: str


class ErrorReply(_Reply):
    """Every 4xx and 5xx: ``error`` in one line, ``problems`` one per field."""

    error: str
    problems: list[Problem] = []


# -- the CLI's requests ----------------------------------------------------------------------
class Health(_Reply):
    ok: bool


class SubmitRequest(_Request):
    manifest: Annotated[
        str | dict[str, Any], BeforeValidator(lambda given: given, json_schema_input_type=str | JobManifest)
    ]
    """The job's manifest: YAML text, or the mapping it parses to (see
    :mod:`maitre.scheduling.spec`). The schema documents its fields; the coordinator checks them
    (:func:`~maitre.scheduling.spec.parse_manifest`: every problem at once, with the closest field
    for a misspelt one), so here it is only text or a mapping."""


class Submitted(_Reply):
    job_id: str
    queue: str
    priority: int


class ScaleRequest(_Request):
    workers: int = Field(ge=0, le=1_000_000)


class Scaled(_Reply):
    target: int
    leaving: list[str]
    max_replicas: int | None = None


class SuspendRequest(_Request):
    reason: str = Field("suspended by request", max_length=500)


class JobStateReply(_Reply):
    state: JobState


class WorkerSummary(_Reply):
    id: str
    node: str
    slot: int
    state: str
    rank: int
    epoch: int
    step: int
    exit_code: int | None
    error: str | None
    trained_s: float
    spare: bool = False
    """A warm spare: started and waiting, held back from every epoch (no rank, no slot of the
    job's allocation)."""


class JobSummary(_Reply):
    job_id: str
    state: JobState
    """Where the job is in its state machine (:mod:`maitre.scheduling.lifecycle`)."""
    epoch: int
    epoch_open: bool
    """Its members train in ``epoch`` (False before the first, and while the next is agreed)."""
    members: list[str]
    target: int
    min_workers: int
    max_workers: int
    step: int
    failures: int
    failure: str | None
    workers: list[WorkerSummary]
    # The scheduler's side.
    queue: str | None = None
    priority: int | None = None
    placement: dict[str, int] = {}
    incarnation: int | None = None
    held: bool | None = None
    waiting_for: str = ""
    throughput: dict[str, float] = {}
    """Steps per second it measured at each world size (the speedup the scheduler grows it by)."""
    spares: list[str] = []
    """Its warm spares started and waiting (they are no part of ``placement``)."""
    spares_wanted: int = 0
    """How many it keeps (the manifest's ``spares``)."""
    elastic: str = "inplace"
    """inplace (maitre's loop) or restart (an unmodified script, restarted whole)."""
    restarts: list[dict[str, Any]] = []
    """A restart-mode job's gangs started after another: ``epoch``, ``cause``, ``size`` and
    ``restart_s`` (from the decision to stop the last gang to every process of this one
    started)."""
    origin: str | None = None
    """What submitted it, as the manifest's ``origin`` says (the Kubernetes operator: its
    MaitreJob's ``namespace/name/uid``)."""


class JobStatus(JobSummary):
    events: list[dict[str, Any]]
    reports: list[dict[str, Any]]
    """Its workers' recovery, caught-up, checkpoint, restore and straggler reports (the newest
    few thousand; the event log keeps them all)."""
    progress: dict[str, Any] | None = None
    """Its rank 0's latest progress report (``t``: when it came), if any."""


class JobList(_Reply):
    jobs: list[JobSummary]


class NodeHealthSummary(_Reply):
    ok: bool
    detail: str
    seconds: float
    probe: str
    age_s: float
    """Seconds since the coordinator heard of this probe."""


class NodeSuspect(_Reply):
    reason: str
    until: float
    """Coordinator time when the cool-down ends (unless a health probe passes first)."""


class NodeSummary(_Reply):
    node: str
    slots: int
    labels: dict[str, str]
    alive: bool
    price: float | None = None
    """Per slot (GPU) hour, from the coordinator's price table by capacity type (None: none
    configured for it)."""
    draining: bool = False
    """A spot notice stands: nothing new is placed here; its workers leave."""
    reclaimed: bool = False
    """The noticed node went away (a reclaim, not a failure)."""
    phi: float | None
    used: int
    workers: list[str]
    last_heartbeat_s: float
    health: NodeHealthSummary | None = None
    """Its latest health probe (None: its agent sent none)."""
    unhealthy: bool = False
    """Its latest probe failed: drained, and given no work until one passes."""
    suspect: NodeSuspect | None = None
    """Avoided by the scheduler since a straggler was evicted from it (policy ``evict``)."""


class NodeList(_Reply):
    nodes: list[NodeSummary]


class QueueSummary(_Reply):
    queue: str
    guaranteed: int
    borrowing_limit: int | None
    weight: float
    allocated: int
    jobs: int


class QueueList(_Reply):
    queues: list[QueueSummary]


class JobReport(_Reply):
    state: str
    queue: str
    priority: int
    incarnations: int
    waited_s: float
    ran_s: float
    productive_s: float
    ettr: float | None
    held_slot_s: float
    trained_slot_s: float
    throughput: dict[str, float]
    spot_slot_s: float = 0.0
    """Of ``held_slot_s``, what its workers held on spot nodes."""
    spare_slot_s: float = 0.0
    """Of ``held_slot_s``, what its warm spares held while they waited."""
    cost: float | None = None
    """The slot-seconds it held, each at its node's price (per slot-hour): None when a node's
    capacity type has no price."""
    on_demand_cost: float | None = None
    """The same slot-seconds, all at the on-demand price: what spot saved is the difference."""


class QueueCost(_Reply):
    held_slot_s: float
    spot_slot_s: float
    cost: float | None
    on_demand_cost: float | None


class Report(_Reply):
    allocation: float | None
    contended_s: float
    utilization: float | None
    held_slot_s: float
    trained_slot_s: float
    jobs: dict[str, JobReport]
    spot_slot_s: float = 0.0
    cost: float | None = None
    on_demand_cost: float | None = None
    queues: dict[str, QueueCost] = {}
    """Each queue's jobs' costs, summed."""
    prices: dict[str, float] = {}
    """The price table: currency units per slot (GPU) hour, by capacity type."""
    reclaims: int = 0
    """Spot nodes that went after a notice (none of them counts as a failure)."""


class EventPage(_Reply):
    """Events of the coordinator's log (:mod:`maitre.control.eventlog`), oldest first."""

    events: list[dict[str, Any]]
    """Each ``{"seq", "t", "job", "kind", ...}``: ``seq`` counts from 1, ``t`` is the
    coordinator's clock (seconds since the epoch), ``job`` is null for the cluster's own."""
    last: int
    """The newest ``seq`` of the log: ask again with ``since`` = the last one returned."""


# -- agents ----------------------------------------------------------------------------------
class Labels(_Request):
    rack: str | None = Field(None, min_length=1, max_length=128)
    block: str | None = Field(None, min_length=1, max_length=128)
    capacity_type: Literal["on-demand", "spot"] | None = None
    accelerator: str | None = Field(None, min_length=1, max_length=128)
    reserved_for: str | None = Field(None, pattern=NAME_PATTERN)
    """The one job whose workers the node takes (a Slurm replica job's node)."""

    def given(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class WorkerBeat(_Request):
    """What the agent knows of one worker process it runs."""

    id: str = Field(pattern=NAME_PATTERN)
    step: int = Field(0, ge=0)
    """The worker's committed steps."""
    stalled: bool = False
    """Waiting in a collective (or for a new group's members) past its stall threshold."""
    trained_s: float = Field(0.0, ge=0)
    """Seconds it spent in steps that committed."""
    silent_s: float | None = Field(None, ge=0)
    """Seconds since the worker's last heartbeat to the agent (None: it never sent one, it is
    still starting)."""
    gap_mean_s: float = Field(0.0, ge=0, le=3600)
    gap_std_s: float = Field(0.0, ge=0, le=3600)
    """The rhythm of the worker's heartbeats to the agent: mean and deviation of their gaps
    (the coordinator's hang detector adapts to it)."""
    joined_s: float | None = Field(None, ge=0)
    """A restart-mode worker: seconds since its processes reached their gang's store (called
    ``init_process_group``); None: not yet, or not such a worker."""


class SpotNotice(_Request):
    """The node will be taken away (a spot reclaim), as its agent's notice source said."""

    notice_s: float = Field(ge=0, le=7 * 86400)
    """Seconds left until the node goes, as of this beat (relative: the agent's and the
    coordinator's clocks need not agree)."""
    action: str = Field("terminate", min_length=1, max_length=64)
    """What the source said will happen: AWS's ``terminate``/``stop``, GCE's ``preempt``..."""
    source: str = Field(min_length=1, max_length=500)
    """The notice source's description (``file:PATH``, ``http://...``)."""


class NodeHealth(_Request):
    """The node's latest health probe (:mod:`maitre.agent.health`), sent with every beat."""

    id: int = Field(ge=1)
    """The agent's count of probes: a new one is news; the same one again is not."""
    ok: bool
    detail: str = Field("", max_length=2000)
    """What failed (or what was measured), the last lines of a site check's output."""
    seconds: float = Field(ge=0, le=86400, allow_inf_nan=False)
    """How long the probe took."""
    probe: str = Field(min_length=1, max_length=64)
    """Which probe decided: ``builtin`` (compute and memory, and each visible GPU), ``command``
    (the site's ``--health-check``)."""


class NodeBeat(_Request):
    slots: int = Field(ge=1, le=4096)
    labels: Labels = Labels()
    notice: SpotNotice | None = None
    """A spot notice stands for this node: it is sent with every beat while it does (so a
    coordinator that restarted hears it again), and the first one drains the node."""
    health: NodeHealth | None = None
    """The node's latest health probe (None: none ran yet, or the agent runs none). A failing
    one drains the node; no work goes there until one passes."""
    workers: list[WorkerBeat] = Field([], max_length=4096)
    """The worker processes the agent runs now, with their liveness and progress."""
    since: int = Field(-1, ge=-1)
    """The orders version the agent last saw (views come back only when newer)."""
    agent: str = Field("", max_length=64)
    """This agent process's own id (its first beat comes before any order): a node beating
    with another one than before has a restarted agent, and its predecessor's workers are
    gone with it."""
    interval_s: float | None = Field(None, gt=0, le=60)
    """The agent beats again within this long, or at once when a worker falls silent past
    :data:`SILENT_S` (None: no such promise; its workers' silence counts from their last beat)."""


class WatchRequest(_Request):
    since: int = Field(ge=-1)
    wait_s: float = Field(10.0, ge=0, le=60)


class RestartOrder(_Reply):
    """A restart-mode worker's place in its gang (:mod:`maitre.control.restarts`): the agent
    gives it torchrun's environment from this."""

    group_rank: int
    """Its replica's rank in the gang (torchrun's ``GROUP_RANK``, a node's rank)."""
    group_world_size: int
    """Replicas in the gang (``GROUP_WORLD_SIZE``)."""
    restart_count: int
    """Gangs of this run before this one (``TORCHELASTIC_RESTART_COUNT``)."""
    max_restarts: int
    grace_s: float
    """When its gang stops: SIGTERM, then SIGKILL after this long."""
    success_marker: str | None = None
    """A line of its output that says it finished (the agent tells whether it came)."""


class StartOrder(_Reply):
    worker_id: str
    job_id: str
    command: list[str]
    env: dict[str, str]
    local_rank: int
    slots: int
    store: str
    token: str
    """The run's token: the worker presents it to the API and at its store's door."""
    store_key: str = ""
    nproc: int = 1
    """Processes to start for this worker (a replica that spans them); they share its slots."""
    mesh: str = ""
    restart: RestartOrder | None = None
    """A restart-mode worker (an unmodified script): its gang and torchrun's environment."""


class WorkerView(_Reply):
    """What a worker must know between two steps (the agent hands it over at 10 Hz). The
    defaults are the view of a worker the coordinator said nothing about yet."""

    job_state: JobState | None = None
    """The job's state (None: no view came yet)."""
    epoch: int = 0
    """The job's membership epoch."""
    member_epoch: int = 0
    """The epoch the worker is a member of (a view of an older one is stale news)."""
    closed: bool = False
    """The worker's epoch is over (a peer died, hung or left): abandon the collective."""
    change: bool = False
    """Stop at the next step boundary and rendezvous (a joiner is ready, a member leaves)."""
    leave: bool = False
    stop: bool = False
    suspend: bool = False
    """Checkpoint after the current step and exit."""
    failures: int = 0
    """The job's failures so far, and its age: the checkpoint interval's failure rate."""
    age_s: float = 0.0


class LocalBeat(_Request):
    """A worker process's heartbeat to its agent (:data:`WORKER_HEARTBEAT`, on the node's
    unix socket, 10 a second)."""

    step: int = Field(0, ge=0)
    """Its committed steps."""
    stalled: bool = False
    """Waiting in a collective past its stall threshold."""
    trained_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds it spent in steps that committed."""
    proc: int = Field(0, ge=0, le=4096)
    """Its index among its replica's processes (the agent tells them apart by it)."""


class AgentView(WorkerView):
    """The agent's answer to a :class:`LocalBeat`: the worker's view as the coordinator last
    sent it, and how old that word is."""

    heard_s: float | None = None
    """Seconds since the agent sent the request the coordinator answered last (None: none
    answered yet): the worker's loop does not commit a step on older news than it needs."""


class NodeOrders(_Reply):
    version: int
    """The node's orders version: send it back as ``since``."""
    boot: str = ""
    """This coordinator process's own id: a restarted coordinator counts versions anew, so an
    agent that sees another one sends ``since: -1`` once, for every view."""
    start: list[StartOrder] = []
    kill: list[str] = []
    terminate: list[str] = []
    """Restart-mode workers whose gang stops: SIGTERM, then SIGKILL after their grace period."""
    views: dict[str, WorkerView] | None = None
    """Every live worker's view, when it changed since ``since`` (else None)."""
    probe: bool = False
    """Run a health probe now (the node is suspect: a passing probe clears it)."""


class ExitRequest(_Request):
    code: int = Field(ge=-255, le=255)
    """The process's exit code; negative: killed by that signal."""
    error: str | None = Field(None, max_length=4000)
    joined: bool | None = None
    """A restart-mode worker: whether it reached its process group's store (None: not one)."""
    marked: bool | None = None
    """A restart-mode worker with a success marker: whether it printed it."""
    noticed: bool | None = None
    """A restart-mode worker whose node had a notice when it exited (Slurm's preemption signals
    every process of the job): its end is the notice's, not a failure of the script."""
    stderr: list[str] = Field([], max_length=20)
    """Its last lines of stderr (a restart-mode worker's: the job's failure quotes them)."""


# -- workers ---------------------------------------------------------------------------------
class RendezvousRequest(_Request):
    from_epoch: int = Field(ge=0)
    """The epoch this worker leaves (0 for a joiner)."""
    step: int = Field(0, ge=0)
    reason: str = Field("", max_length=500)
    wait_s: float = Field(5.0, ge=0, le=30)
    group_failed: bool = False
    """The epoch's process group could not be built: its members could not all connect (a
    failure of the epoch, counted like a crash)."""
    unreachable: list[str] = Field([], max_length=64)
    """The peer addresses the backend could not reach, when it named them."""


class Assignment(_Reply):
    """A rendezvous's answer: ``train`` in an epoch (with everything below but ``reason``),
    ``wait`` and ask again, ``leave`` the job, or ``stop`` (``reason`` says why)."""

    action: Literal["train", "wait", "leave", "stop"]
    reason: str | None = None
    epoch: int | None = None
    rank: int | None = None
    world_size: int | None = None
    store_prefix: str | None = None
    members: list[str] | None = None
    state_lost: bool | None = None
    store: str | None = None
    """``HOST:PORT`` of the door to the run's c10d store."""
    store_key: str | None = None
    """The run's name at that door."""
    store_id: str | None = None
    """Changes when the store is a new one (a restart): the worker connects again."""

    @model_validator(mode="after")
    def _train_is_whole(self) -> Assignment:
        missing = [f for f in ("epoch", "rank", "world_size", "store_prefix") if getattr(self, f) is None]
        if self.action == "train" and missing:
            raise ValueError(f"a train answer without {', '.join(missing)}")
        return self


class DoneRequest(_Request):
    step: int = Field(0, ge=0)
    suspended: bool = False


class _Report(_Request):
    epoch: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    step: int = Field(ge=0)
    state_bytes: int = Field(ge=0)


class RecoveryReport(_Report):
    """The first step a member committed after a membership change, and where the time went."""

    kind: Literal["recovery"]
    reason: str = Field(max_length=500)
    detected_at: float
    rendezvous_s: float
    group_s: float
    state_s: float
    to_next_step_s: float
    state_source: Literal["peer", "disk", "none"]
    """Where the state this member started the epoch with came from: ``peer``, live in the
    job's group (its own, kept since the last epoch, or received from a member ahead);
    ``disk``, the newest complete checkpoint; ``none``, nowhere (the initial state: step 0)."""


class CaughtUpReport(_Report):
    """A listener caught up (``MAITRE_JOIN=stream``): from the next step every member trains
    (``world_size`` of them)."""

    kind: Literal["caught_up"]
    listened_s: float = Field(ge=0)
    """From the epoch's start to the step it trains next: the snapshot's transfer and replay."""
    replayed: int = Field(ge=0)
    """Steps heard while the snapshot streamed in, replayed after it landed."""
    transfer_s: float = Field(0.0, ge=0)
    """The bytes' time on the wire (from the pair's group built to the last byte)."""


class CheckpointReport(_Request):
    """A checkpoint of the job is complete (or failed), from the one process that knows: the
    committing rank, once the manifest is renamed into place."""

    kind: Literal["checkpoint"]
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    """The ranks that wrote it."""
    snapshot_s: float = Field(ge=0, allow_inf_nan=False)
    """The copy into host memory: the only part that blocked training."""
    persist_s: float = Field(ge=0, allow_inf_nan=False)
    """The background write, fsync and rename (from the hand-off to the rename)."""
    bytes: int = Field(ge=0)
    """Every file of the checkpoint (all ranks' parts and the metadata)."""
    interval_steps: int | None = Field(None, ge=1)
    """The interval it was taken at: a fixed count of steps (``every_steps``) ..."""
    interval_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    """... or the seconds the Young/Daly policy chose (:mod:`maitre.checkpoint.policy`)."""
    ok: bool
    error: str | None = Field(None, max_length=2000)


class RestoreReport(_Request):
    """The job started from disk: rank 0 loaded a checkpoint (no live member held the state)."""

    kind: Literal["restore"]
    step: int = Field(ge=0)
    source: Literal["disk"]
    seconds: float = Field(ge=0, allow_inf_nan=False)
    """Finding, reading, verifying and loading it."""
    bytes: int = Field(ge=0)


class ProgressReport(_Request):
    """Rank 0's training progress, at most about once a second (dropped rather than delayed)."""

    kind: Literal["progress"]
    step: int = Field(ge=0)
    """The committed steps."""
    loss: float | None = Field(None, allow_inf_nan=False)
    """The global mean loss of the last step, when the script logs it (``batch.log_loss``,
    ``batch.backward``), and finite."""
    world_size: int = Field(ge=1)
    steps_per_s: float = Field(ge=0, allow_inf_nan=False)
    """Committed steps over the wall time since the last report (pauses included)."""
    samples_per_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    skipped_samples: int = Field(0, ge=0)
    """Samples left out of the committed steps so far because their data could not be read
    (``on_error="skip"``): part of the job's committed state."""


class StragglerWindow(_Request):
    """One window of a straggler's evidence (:mod:`maitre.runtime.stragglers`)."""

    step: int = Field(ge=0)
    """The window's last step."""
    value: float = Field(ge=0, allow_inf_nan=False)
    """The rank's compute per unit of work at its fastest step of the window (seconds per
    sample or token)."""
    share: float = Field(1.0, gt=0, allow_inf_nan=False)
    """What its value was divided by for the size of its share (1: not corrected)."""
    median: float = Field(ge=0, allow_inf_nan=False)
    """The median of every rank's value in that window (each divided by its ``share``)."""
    ratio: float = Field(ge=0, allow_inf_nan=False)
    """Its value (over its ``share``) over that median."""
    held: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Its lowest value over its last ``windows`` windows over the median of the ranks' lowest
    values (0: fewer windows yet): what flags it."""
    z: float = Field(allow_inf_nan=False)
    """The robust z score of its held value: (held - their median) / (1.4826 MAD of the
    others', floored)."""
    cusum: float = Field(ge=0, allow_inf_nan=False)
    """The onset's CUSUM of log(ratio / drift) up to this window."""


class StragglerReport(_Request):
    """Rank 0 found a rank slower than its peers for several windows (policy ``report`` or
    ``evict``)."""

    kind: Literal["straggler"]
    straggler: str = Field(pattern=NAME_PATTERN)
    """The slow worker (the coordinator adds its node)."""
    rank: int = Field(ge=0)
    """Its rank in the epoch's group."""
    epoch: int = Field(ge=0)
    world_size: int = Field(ge=1)
    ratio: float = Field(gt=0, allow_inf_nan=False)
    """Its compute per unit of work over the median across ranks, held over the windows that
    flagged it (its lowest value in them against the ranks' median lowest)."""
    since_step: int = Field(ge=0)
    """The onset: the first step of the window where it began to be slow."""
    step: int = Field(ge=0)
    """The last step of the window that flagged it."""
    windows: int = Field(ge=1)
    """Consecutive windows it was slow in."""
    evidence: list[StragglerWindow] = Field(max_length=64)
    policy: Literal["report", "evict"]
    thresholds: dict[str, float] = Field(max_length=16)
    """The detector's settings: ``window`` (steps), ``ratio``, ``z``, ``windows``."""


WorkerReport = Annotated[
    RecoveryReport | CaughtUpReport | CheckpointReport | RestoreReport | ProgressReport | StragglerReport,
    Field(discriminator="kind"),
]


class Empty(_Reply):
    pass
