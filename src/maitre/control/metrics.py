"""``/metrics``: the coordinator's state and its event log, in Prometheus's text format.

Two sources, one registry per coordinator (never prometheus-client's global one: tests run many
coordinators in one process, and a registry is what one scrape reads):

- **counters and histograms** follow the event log: :meth:`Metrics.observe` sees every event as
  the coordinator emits it (``Coordinator._emit``: membership, cluster and report events alike)
  and counts it, a dictionary lookup for most kinds;
- **gauges** are read at scrape time from the coordinator's state under its lock
  (:class:`_StateCollector`): slots held and busy per job, the cluster's capacity, allocation and
  utilization, jobs by state and waiting by queue, nodes by state, each job's latest progress.

Names follow Prometheus's conventions: the ``maitre_`` prefix, base units (seconds, bytes),
``_total`` on counters (prometheus-client adds it), ratios as ``_ratio``. docs/metrics.md
lists them all; the route needs the coordinator's token
(:data:`maitre.protocol.METRICS`). Counters start at zero with each coordinator process (a
restart is a counter reset, which ``rate()`` handles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from maitre.control import accounting
from maitre.control.membership import LIVE, WorkerState
from maitre.scheduling.lifecycle import JobState

if TYPE_CHECKING:
    from maitre.control.coordinator import Coordinator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no ``_created`` series beside every counter (the process's only user)

_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_SNAPSHOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PERSIST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_RESIZES = ("grow", "shrink")
_PHASES = ("rendezvous", "group", "state")

# What ended an epoch, from the reason its next ``epoch`` event gives (the coordinator's words
# for a loss it detected, or a member's for a collective that failed): first match wins.
_CAUSES = (
    ("hung", "hang"),  # detectors.hung: silent while its peers waited
    ("sent no heartbeat", "lost"),  # detectors.lost: silent past dead_after_s
    ("(no agent heartbeat)", "node_lost"),
    ("now has", "node_lost"),  # its node came back smaller
    ("grace period", "preempted"),  # killed when its suspension's grace ran out
    ("resize", "resize"),  # a member saw a change at a step boundary
    (" left", "leave"),
    ("killed by signal", "crash"),
    ("exited", "crash"),
    ("(reported by", "crash"),  # a member's collective failed: a peer or link died
)


def cause_of(reason: str) -> str:
    """The cause label of a membership change, from its epoch's reason (``start``: the first
    epoch of a run, no recovery; ``other``: none of the known ones)."""
    if not reason or reason == "start":
        return "start"
    for needle, cause in _CAUSES:
        if needle in reason:
            return cause
    return "other"


class Metrics:
    """One coordinator's metrics (see the module docstring)."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events = Counter("maitre_events", "Events in the coordinator's event log, by kind.", ["kind"], registry=r)
        self.resizes = Counter("maitre_resizes", "Resizes the scheduler decided, by kind.", ["kind"], registry=r)
        self.worker_failures = Counter(
            "maitre_worker_failures", "Workers declared dead (crashed, hung, lost, evicted).", registry=r
        )
        self.recoveries = Counter(
            "maitre_recoveries",
            "Membership changes a job trained on after (its first step "
            "committed in the new epoch), by what ended the previous epoch.",
            ["cause"],
            registry=r,
        )
        self.recovery = Histogram(
            "maitre_recovery_duration_seconds",
            "From the change noticed to the first step "
            "committed after it (a running member's to_next_step_s), by cause.",
            ["cause"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.recovery_phase = Histogram(
            "maitre_recovery_phase_duration_seconds",
            "The parts of a recovery: rendezvous, building the group, getting the state (transfer or load), by cause.",
            ["cause", "phase"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.checkpoints = Counter(
            "maitre_checkpoints",
            "Checkpoints finished, by result (ok: complete on disk; failed).",
            ["result"],
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "maitre_checkpoint_written_bytes", "Bytes of complete checkpoints written.", registry=r
        )
        self.snapshot = Histogram(
            "maitre_checkpoint_snapshot_duration_seconds",
            "A checkpoint's blocking copy into host memory (training waits for it).",
            buckets=_SNAPSHOT_BUCKETS,
            registry=r,
        )
        self.persist = Histogram(
            "maitre_checkpoint_persist_duration_seconds",
            "A complete checkpoint's background write, fsync and rename.",
            buckets=_PERSIST_BUCKETS,
            registry=r,
        )
        self.restores = Counter("maitre_restores", "Jobs started from a checkpoint, by source.", ["source"], registry=r)
        self.restore = Histogram(
            "maitre_restore_duration_seconds",
            "Finding, verifying and loading a checkpoint at a start.",
            buckets=_PERSIST_BUCKETS,
            registry=r,
        )
        self.spot_notices = Counter("maitre_spot_notices", "Spot interruption notices received.", registry=r)
        self.spot_reclaims = Counter("maitre_spot_reclaims", "Spot nodes reclaimed after a notice.", registry=r)
        self.spot_drain = Histogram(
            "maitre_spot_drain_duration_seconds",
            "From a spot notice to the last of the node's workers gone (node_drained).",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.stragglers = Counter(
            "maitre_stragglers",
            "Slow ranks found (straggler events: a rank slower than its peers' median for several windows), by job.",
            ["job"],
            registry=r,
        )
        self.health_failures = Counter(
            "maitre_health_probe_failures",
            "Node health probes that failed (node_health events with ok false: the node is drained).",
            registry=r,
        )
        self.evictions = Counter(
            "maitre_evictions",
            "Stragglers' replicas moved off their node (policy evict: evict events), by job.",
            ["job"],
            registry=r,
        )
        self.spare_promotions = Counter(
            "maitre_spares_promoted",
            "Warm spares that joined an epoch in place of a lost or evicted worker, by job.",
            ["job"],
            registry=r,
        )
        self.spare_join = Histogram(
            "maitre_spare_promotion_duration_seconds",
            "From a spare's promotion (the loss found) to the epoch that has it.",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "maitre_gang_restarts",
            "Restart-mode jobs' gangs stopped and started again whole (a resize, a notice or a failure), by job.",
            ["job"],
            registry=r,
        )
        self.restart = Histogram(
            "maitre_gang_restart_duration_seconds",
            "A restart-mode job's restart: from the decision to stop its gang to every process of the next "
            "one in its process group.",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.passes = Histogram(
            "maitre_scheduling_pass_duration_seconds",
            "A scheduling pass: the cluster brought up to date, the policy, its plan carried out.",
            buckets=_PASS_BUCKETS,
            registry=r,
        )
        for kind in _RESIZES:  # present from the first scrape, at zero
            self.resizes.labels(kind)
        for result in ("ok", "failed"):
            self.checkpoints.labels(result)
        self._epoch_cause: dict[str, tuple[int, str]] = {}
        """Per job, its newest epoch and what ended the one before."""
        self._recovered: dict[str, tuple[int, int, bool]] = {}
        """Per job, the (incarnation, epoch) of its last recovery counted, and whether its
        duration was observed."""
        self.checkpoint_interval: dict[str, tuple[int | None, float | None]] = {}
        """Per job, the interval its last checkpoint was taken at (steps, seconds)."""
        self._observers = {
            "grow": self._resize,
            "shrink": self._resize,
            "worker_dead": self._worker_dead,
            "epoch": self._epoch,
            "report": self._report,
            "checkpoint": self._checkpoint,
            "restore": self._restore,
            "spot_notice": self._spot_notice,
            "node_reclaimed": self._spot_reclaim,
            "node_drained": self._spot_drained,
            "straggler": self._straggler,
            "node_health": self._node_health,
            "evict": self._eviction,
            "spare_promoted": self._spare_promoted,
            "gang_joined": self._gang_joined,
        }
        r.register(_StateCollector(coordinator, self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- from the event log ----------------------------------------------------------------------
    def observe(self, job: str | None, kind: str, event: dict[str, Any]) -> None:
        """An event as the coordinator emits it (under its lock)."""
        self.events.labels(kind).inc()
        observer = self._observers.get(kind)
        if observer is not None:
            observer(job or "", kind, event)

    def scheduling_pass(self, seconds: float) -> None:
        self.passes.observe(seconds)

    def _resize(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.resizes.labels(kind).inc()

    def _worker_dead(self, job: str, kind: str, event: dict[str, Any]) -> None:
        # A warm spare lost, or a worker told to leave and in no epoch, is no job's failure.
        if not event.get("spare") and not event.get("leaving"):
            self.worker_failures.inc()

    def _spare_promoted(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.spare_promotions.labels(job).inc()
        self.spare_join.observe(max(0.0, float(event.get("seconds", 0.0))))

    def _gang_joined(self, job: str, kind: str, event: dict[str, Any]) -> None:
        since = event.get("since_stop_s")
        if since is not None:  # (None: the run's first gang, no restart)
            self.restarts.labels(job).inc()
            self.restart.observe(max(0.0, float(since)))

    def _epoch(self, job: str, kind: str, event: dict[str, Any]) -> None:
        cause = cause_of(str(event.get("reason", "")))
        self._epoch_cause[job] = (int(event.get("epoch", 0)), cause)

    def _report(self, job: str, kind: str, event: dict[str, Any]) -> None:
        """Every member reports its first step after a change: the first report of an epoch
        counts the recovery; the duration is a running member's (a joiner's own start-up is no
        pause of the job), or a joiner's when nobody held live state (a whole-job restart)."""
        epoch = int(event.get("epoch", 0))
        known_epoch, cause = self._epoch_cause.get(job, (-1, "other"))
        if known_epoch != epoch:
            cause = "other"
        if cause == "start":
            return
        key = (int(event.get("incarnation", 1)), epoch)
        seen = self._recovered.get(job)
        if seen is None or seen[:2] != key:
            self.recoveries.labels(cause).inc()
            seen = (*key, False)
        running = event.get("reason") != "join" or event.get("state_source") != "peer"
        if not seen[2] and running:
            self.recovery.labels(cause).observe(max(0.0, float(event.get("to_next_step_s", 0.0))))
            for phase in _PHASES:
                self.recovery_phase.labels(cause, phase).observe(max(0.0, float(event.get(f"{phase}_s", 0.0))))
            seen = (*key, True)
        self._recovered[job] = seen

    def _checkpoint(self, job: str, kind: str, event: dict[str, Any]) -> None:
        ok = bool(event.get("ok"))
        self.checkpoints.labels("ok" if ok else "failed").inc()
        self.snapshot.observe(float(event.get("snapshot_s", 0.0)))
        if ok:
            self.persist.observe(float(event.get("persist_s", 0.0)))
            self.checkpoint_bytes.inc(int(event.get("bytes", 0)))
        self.checkpoint_interval[job] = (event.get("interval_steps"), event.get("interval_s"))

    def _restore(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.restores.labels(str(event.get("source", "disk"))).inc()
        self.restore.observe(float(event.get("seconds", 0.0)))

    def _spot_notice(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.spot_notices.inc()

    def _spot_reclaim(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.spot_reclaims.inc()

    def _straggler(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.stragglers.labels(job).inc()

    def _node_health(self, job: str, kind: str, event: dict[str, Any]) -> None:
        if not event.get("ok", True):
            self.health_failures.inc()

    def _eviction(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.evictions.labels(job or "").inc()

    def _spot_drained(self, job: str, kind: str, event: dict[str, Any]) -> None:
        self.spot_drain.observe(max(0.0, float(event.get("seconds", 0.0))))


class _StateCollector(Collector):
    """The gauges, read from the coordinator's state at each scrape (under its lock)."""

    def __init__(self, co: "Coordinator", metrics: Metrics) -> None:
        self.co = co
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())  # (no fixed set of samples: read at scrape time)

    def collect(self) -> Iterator[Metric]:
        co = self.co
        held = GaugeMetricFamily(
            "maitre_job_slots_held", "Slots held by the job's live workers (its warm spares apart).", labels=["job"]
        )
        spare = GaugeMetricFamily(
            "maitre_job_spare_slots",
            "Slots held by the job's warm spares, waiting (no training capacity).",
            labels=["job"],
        )
        busy = GaugeMetricFamily(
            "maitre_job_slots_busy",
            "Slots of the job's members training in its open epoch (not stalled).",
            labels=["job"],
        )
        step = GaugeMetricFamily(
            "maitre_job_step", "The job's committed steps (its latest progress report).", labels=["job"]
        )
        rate = GaugeMetricFamily(
            "maitre_job_steps_per_second", "Steps per second over the latest progress report's window.", labels=["job"]
        )
        samples = GaugeMetricFamily(
            "maitre_job_samples_per_second",
            "Samples per second over the latest progress report's window.",
            labels=["job"],
        )
        skipped = GaugeMetricFamily(
            "maitre_job_skipped_samples",
            "Samples left out of the committed steps because their data could not be read (on_error='skip').",
            labels=["job"],
        )
        loss = GaugeMetricFamily(
            "maitre_job_loss",
            "The last step's global mean loss (latest progress report, when the script logs it).",
            labels=["job"],
        )
        world = GaugeMetricFamily("maitre_job_world_size", "Workers training (latest progress report).", labels=["job"])
        seen = GaugeMetricFamily(
            "maitre_job_progress_timestamp_seconds",
            "When the latest progress report came (coordinator clock, Unix seconds).",
            labels=["job"],
        )
        every_s = GaugeMetricFamily(
            "maitre_job_checkpoint_interval_seconds",
            "The interval the job's last checkpoint was taken at (Young/Daly).",
            labels=["job"],
        )
        every_steps = GaugeMetricFamily(
            "maitre_job_checkpoint_interval_steps",
            "The fixed interval, in steps, of the job's last checkpoint.",
            labels=["job"],
        )
        jobs = GaugeMetricFamily("maitre_jobs", "Jobs by state.", labels=["state"])
        waiting = GaugeMetricFamily(
            "maitre_jobs_waiting",
            "Jobs waiting to be admitted (pending or suspended, not held by a user), by queue.",
            labels=["queue"],
        )
        nodes = GaugeMetricFamily("maitre_nodes", "Nodes by state.", labels=["state"])
        capacity = GaugeMetricFamily("maitre_cluster_slots", "Slots of the live nodes.")
        cluster_held = GaugeMetricFamily("maitre_cluster_slots_held", "Slots held by live workers (warm spares apart).")
        cluster_busy = GaugeMetricFamily("maitre_cluster_slots_busy", "Slots of members training in an open epoch.")
        allocation = GaugeMetricFamily(
            "maitre_cluster_allocation_ratio",
            "Slot-seconds held "
            "over slot-seconds of capacity while jobs waited or "
            "could grow (since the coordinator started).",
        )
        utilization = GaugeMetricFamily(
            "maitre_cluster_utilization_ratio", "Slot-seconds in committed steps over slot-seconds held, every job."
        )
        with co.lock:
            now = co.clock()
            by_state = dict.fromkeys((s.value for s in JobState), 0)
            by_queue = dict.fromkeys(co.cluster.queues, 0)
            total_held = total_busy = 0
            for job_id, m in co.cluster.managed.items():
                state = m.job.state
                by_state[state.value] += 1
                if state.waiting and not m.held:
                    by_queue[m.job.queue] = by_queue.get(m.job.queue, 0) + 1
                if state.ended:
                    continue
                ms = co.jobs.get(job_id)
                h = b = sp = 0
                if ms is not None and not ms.over:
                    members = set(ms.members) if ms.open else set()
                    for w in ms.workers.values():
                        if w.ended_at is None and w.state in LIVE and w.spare:
                            sp += w.slots
                        elif w.ended_at is None and w.state in LIVE:
                            h += w.slots
                            if (
                                w.id in members
                                and not w.stalled
                                and w.state in (WorkerState.ACTIVE, WorkerState.LEAVING)
                            ):
                                b += w.slots
                held.add_metric([job_id], h)
                if ms is not None and ms.spec.spares:
                    spare.add_metric([job_id], sp)
                busy.add_metric([job_id], b)
                total_held += h
                total_busy += b
                report = co.progress.get(job_id)
                if report is not None:
                    step.add_metric([job_id], report["step"])
                    rate.add_metric([job_id], report["steps_per_s"])
                    if report.get("samples_per_s") is not None:
                        samples.add_metric([job_id], report["samples_per_s"])
                    skipped.add_metric([job_id], report.get("skipped_samples", 0))
                    if report.get("loss") is not None:
                        loss.add_metric([job_id], report["loss"])
                    world.add_metric([job_id], report["world_size"])
                    seen.add_metric([job_id], report["t"])
                steps_every, seconds_every = self.metrics.checkpoint_interval.get(job_id, (None, None))
                if seconds_every is not None:
                    every_s.add_metric([job_id], seconds_every)
                if steps_every is not None:
                    every_steps.add_metric([job_id], steps_every)
            alive = sum(1 for s in co.cluster.nodes.values() if s.alive)
            nodes.add_metric(["alive"], alive)
            nodes.add_metric(["dead"], len(co.cluster.nodes) - alive)
            capacity.add_metric([], sum(s.node.slots for s in co.cluster.nodes.values() if s.alive))
            report_all = accounting.report(co.cluster, co.jobs, now)
        for state_name, count in by_state.items():
            jobs.add_metric([state_name], count)
        for queue, count in by_queue.items():
            waiting.add_metric([queue], count)
        cluster_held.add_metric([], total_held)
        cluster_busy.add_metric([], total_busy)
        if report_all["allocation"] is not None:
            allocation.add_metric([], report_all["allocation"])
        if report_all["utilization"] is not None:
            utilization.add_metric([], report_all["utilization"])
        yield from (
            held,
            spare,
            busy,
            step,
            rate,
            samples,
            skipped,
            loss,
            world,
            seen,
            every_s,
            every_steps,
            jobs,
            waiting,
            nodes,
            capacity,
            cluster_held,
            cluster_busy,
            allocation,
            utilization,
        )
