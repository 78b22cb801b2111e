"""``maitre run``: the embedded default. Coordinator, local agents and workers on one machine.

It starts a coordinator (HTTP API plus the door to the c10d stores) on a cluster of one queue,
submits the job there as ``maitre up`` would (the same controller, scheduling and job
states; its policy grows the job into every free slot at once, see :data:`RUN_POLICY`), starts
``--local-nodes`` agents that each run ``--nproc-per-node`` workers, and prints the job's
membership events as they happen. More nodes can join from anywhere with
``maitre agent --coordinator HOST:PORT``. An optional scripted story (``--events``) kills,
stops, adds and removes workers at given steps, so a newcomer can watch the job survive each.
At the end it prints a summary: steps, every membership change with its recovery time, and the
exactly-once audit of the data.

With ``--checkpoint-dir`` the workers checkpoint there, and the first SIGINT or SIGTERM suspends
the job instead of killing it: every member checkpoints after its current step and exits, within
``--grace-period``. ``maitre run --resume`` with the same directory continues from the newest
complete checkpoint, at any number of workers.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from maitre import procs
from maitre.agent.agent import LOCAL_HEARTBEAT_S, Agent
from maitre.checkpoint import checkpointer as ckpt_env
from maitre.checkpoint.loader import newest_complete
from maitre import protocol
from maitre.protocol import DATA_WORKER_NAME
from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.control.detectors import DetectorConfig
from maitre.control.membership import WorkerState
from maitre.scheduling.lifecycle import JobState
from maitre.runtime.ledger import audit
from maitre.scheduling import PolicyConfig, Queue
from maitre.scheduling.spec import ManifestError, parse_manifest
from maitre.story import StoryEvent

RUN_QUEUE = "run"
RUN_POLICY = PolicyConfig(resize_cooldown_s=0.0, min_gain=-math.inf, rebalance_gain=0.0)
"""``maitre run``'s one job owns its nodes: it grows into a slot as soon as one is free (no
cooldown, no gain threshold), as ``torchrun --nnodes MIN:MAX`` takes every node that comes."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    command: list[str]
    min_nodes: int
    max_nodes: int
    nproc_per_node: int = 1
    """Slots (processes) of each node."""
    nproc_per_replica: int = 1
    """Processes of one replica (FSDP2 or TP inside): a node runs nproc_per_node // it."""
    mesh: str | None = None
    """The replica's mesh, ``dp_shard=N,tp=M`` (default: dp_shard = nproc_per_replica)."""
    max_restarts: int = 3
    local_nodes: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    job_id: str = "job"
    events: list[StoryEvent] = field(default_factory=list)
    run_dir: Path | None = None
    ledger: bool = True
    quiet_workers: bool = False
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int = 3
    mtbf_s: float | None = None
    resume: bool = False
    grace_period_s: float = 60.0
    elastic: str = "inplace"
    """``restart``: an unmodified script, restarted whole at each change (the job's manifest)."""
    success_marker: str | None = None


class Run:
    """One embedded run; :meth:`wait` returns the process exit code."""

    def __init__(self, cfg: RunConfig, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.out = out
        self.t0 = time.time()
        self.token = secrets.token_urlsafe(32)  # every API call and agent must present it
        if cfg.nproc_per_node % cfg.nproc_per_replica:
            raise ValueError(
                f"a node of {cfg.nproc_per_node} processes does not hold whole replicas of {cfg.nproc_per_replica}"
            )
        per_node = cfg.nproc_per_node // cfg.nproc_per_replica  # replicas on a node
        manifest = {
            "name": cfg.job_id,
            "queue": RUN_QUEUE,
            "minReplicas": cfg.min_nodes * per_node,
            "maxReplicas": cfg.max_nodes * per_node,
            "command": cfg.command,
            "nprocPerReplica": cfg.nproc_per_replica,
            "elastic": cfg.elastic,
            "gracePeriodSeconds": cfg.grace_period_s,
        }
        if cfg.success_marker:
            manifest["successMarker"] = cfg.success_marker
        if cfg.mesh:
            from maitre.runtime.replica import MeshSpec

            mesh = MeshSpec.parse(cfg.mesh)
            manifest["mesh"] = {"dp_shard": mesh.dp_shard, "tp": mesh.tp}
        if cfg.checkpoint_dir is not None:
            manifest["checkpointDir"] = str(cfg.checkpoint_dir.resolve())
            manifest["gracePeriodSeconds"] = cfg.grace_period_s
        try:
            parse_manifest(manifest, queues={RUN_QUEUE})
        except ManifestError as exc:  # e.g. a --job-id that is no job name
            raise ValueError(str(exc)) from None
        self.manifest = manifest
        self.run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix=f"maitre-{cfg.job_id}-"))
        cluster = ClusterState(
            [Queue(RUN_QUEUE)],
            run_dir=self.run_dir,
            policy=RUN_POLICY,
            detector=DetectorConfig(),
            max_restarts=cfg.max_restarts,
        )
        self.server = CoordinatorServer(
            cluster, cfg.host, cfg.port, cfg=DetectorConfig(), on_event=self._on_event, token=self.token
        )  # may refuse
        self.token_file = self.run_dir / "token"
        self.ledger_dir = self.run_dir / "ledger"
        if self.ledger_dir.exists() and not cfg.resume:  # a resumed job's ledger goes on
            shutil.rmtree(self.ledger_dir)
        self.run_id = f"{os.getpid()}-{time.time_ns()}"
        self._stop_signal: str | None = None
        self._suspend_deadline: float | None = None
        self.agents: list[Agent] = []
        self._lock = threading.Lock()
        self.data_kills: list[DataKill] = []
        """The data workers the story killed (``kill-data``), as they were just before."""
        self.story_failures: list[str] = []
        """Story events that could not be carried out (``kill-data`` with no data worker)."""

    @property
    def coordinator(self):  # the in-process Coordinator
        return self.server.coordinator

    def start(self) -> "Run":
        cfg = self.cfg
        self.server.start()
        # The run's own: one data ledger for all its runs (a resumed job's goes on), told apart
        # by the run id, and the checkpoint settings that are not part of a manifest.
        env = {protocol.RUN_ID: self.run_id, protocol.LEDGER_DIR: str(self.ledger_dir) if cfg.ledger else ""}
        if cfg.checkpoint_dir is not None:
            if cfg.checkpoint_every:
                env[ckpt_env.EVERY_ENV] = str(cfg.checkpoint_every)
            if cfg.mtbf_s:
                env[ckpt_env.MTBF_ENV] = str(cfg.mtbf_s)
            env[ckpt_env.KEEP_ENV] = str(cfg.checkpoint_keep)
        self.coordinator.submit(self.manifest, env=env)
        write_token(self.token_file, self.token)
        self.out(
            f"maitre: coordinator at {self.server.address}; add a node with "
            f"`maitre agent --coordinator {self.server.address} --token-file "
            f"{self.token_file} --nproc-per-node {cfg.nproc_per_node}`"
        )
        for _ in range(cfg.min_nodes if cfg.local_nodes is None else cfg.local_nodes):
            self.add_node()
        return self

    def add_node(self) -> Agent:
        output = (lambda wid, line: None) if self.cfg.quiet_workers else _prefixed(self.out)
        with self._lock:
            agent = Agent(
                self.server.address,
                f"local{len(self.agents)}",
                self.cfg.nproc_per_node,
                output=output,
                token=self.token,
                heartbeat_s=LOCAL_HEARTBEAT_S,
            )
            self.agents.append(agent)
        return agent.start()

    # -- the story -------------------------------------------------------------------------------
    def job(self) -> dict[str, Any]:
        return self.coordinator.job_status(self.cfg.job_id)

    def pid_of(self, worker_id: str) -> int | None:
        for agent in self.agents:
            if worker_id in agent.workers:
                return agent.pid(worker_id)
        return None

    def apply(self, event: StoryEvent, job: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
        """Carry out one story event; returns a predicate that holds once it was absorbed."""
        epoch, size = job["epoch"], len(job["members"])
        next_epoch: Callable[[dict[str, Any]], bool] = lambda j: j["epoch"] > epoch
        active = [
            w["id"] for w in job["workers"] if w["state"] == WorkerState.ACTIVE.value and w["id"] in job["members"]
        ]
        if event.kind in ("kill", "hang"):
            victims = [w for w in active if w != job["members"][0]] or active
            victim = random.Random(event.step).choice(victims)
            pid = self.pid_of(victim)
            if pid is not None:
                sig = signal.SIGKILL if event.kind == "kill" else signal.SIGSTOP
                self.out(f"maitre: story: step {job['step']}: {sig.name} worker {victim}")
                os.kill(pid, sig)
            return next_epoch
        if event.kind == "kill-data":
            self._kill_data_worker(event, job, active)
            step = job["step"]
            return lambda j: j["step"] > step
        if event.kind == "join":
            self.out(f"maitre: story: step {job['step']}: a node joins")
            self.add_node()
            return lambda j: len(j["members"]) > size
        target = max(job["min_workers"], size - 1)
        self.out(f"maitre: story: step {job['step']}: scale down to {target} workers")
        self.coordinator.scale(self.cfg.job_id, target)
        return next_epoch

    def _kill_data_worker(self, event: StoryEvent, job: dict[str, Any], active: list[str]) -> None:
        """SIGKILL one data worker (a :class:`maitre.data.Loader`'s, found by its process name
        below a training process, wherever it sits: a child of the training process, or of the
        fork server the training process started). None found within
        :data:`DATA_WORKER_WAIT_S` (the loader was between two sets of workers, say) is no
        silent no-op: the run says so now and exits 1 at its end."""
        step = job["step"]
        start = time.monotonic()
        rng = random.Random(event.step)
        while True:
            found = [
                (wid, pid, victim)
                for wid in active
                if (pid := self.pid_of(wid)) is not None
                for victim in data_workers(pid)
            ]
            if found:
                wid, pid, victim = rng.choice(found)
                kill = DataKill.of(victim, pid, wid)
                if kill is not None:  # (still a data worker of that process: not gone meanwhile)
                    self.out(
                        f"maitre: story: step {step}: SIGKILL data worker {victim} ({kill.name}, "
                        f"child of {kill.parent}{' (the fork server)' if kill.under_fork_server else ''}) "
                        f"of worker {wid} (pid {pid})"
                    )
                    try:
                        os.kill(victim, signal.SIGKILL)
                        self.data_kills.append(kill)
                        return
                    except ProcessLookupError:  # (it ended just now: look again)
                        pass
            if (
                time.monotonic() - start > DATA_WORKER_WAIT_S
                or self._stop_signal
                or self.job()["state"] != JobState.RUNNING.value
            ):
                break
            time.sleep(0.1)
        failure = (
            f"kill-data@{event.step}: no data worker found in {time.monotonic() - start:.0f} s below any of "
            f"{len(active)} training process(es) (a data worker is a maitre.data.Loader's, "
            f"named {DATA_WORKER_NAME}-N): the drill did not happen"
        )
        self.out(f"maitre: story: step {step}: FAILED: {failure}; the run will exit 1")
        self.story_failures.append(failure)

    def wait(self) -> int:
        """Play the story, wait for the job to end, print the summary; returns the exit code.

        Each story event waits for its step and for the previous event to have been absorbed
        (a new epoch running with the expected membership), so a slow joiner's start-up cannot
        make two events collide."""
        pending = list(self.cfg.events)
        self.played: list[StoryEvent] = []
        settled: Callable[[dict[str, Any]], bool] = lambda job: True
        job = self.job()
        ended = {s.value for s in JobState if s.run_over}
        try:
            while True:
                job = self.job()
                if job["state"] in ended:
                    break
                if self._stop_signal and self._suspend_deadline is None:
                    self._suspend(job)
                elif self._suspend_deadline is not None and time.monotonic() > self._suspend_deadline:
                    self.out(
                        f"maitre: the job did not suspend within its grace period of "
                        f"{self.cfg.grace_period_s:.0f}s; stopping its workers"
                    )
                    break
                if (
                    pending
                    and job["state"] == JobState.RUNNING.value
                    and settled(job)
                    and job["step"] >= pending[0].step
                ):
                    self.played.append(pending.pop(0))
                    settled = self.apply(self.played[-1], job)
                time.sleep(0.1)
        finally:
            finished = job["state"] in (JobState.COMPLETED.value, JobState.SUSPENDED.value)
            self.shutdown(drain_s=60.0 if finished else 0.0)
        if pending:
            self.out(f"maitre: the job ended before the story's {', '.join(f'{e.kind}@{e.step}' for e in pending)}")
        self.out(summary(job, self.ledger_dir if self.cfg.ledger else None, self.run_dir, self.cfg.checkpoint_dir))
        for failure in self.story_failures:
            self.out(f"maitre: the story failed: {failure}")
        if job["state"] == JobState.SUSPENDED.value:
            self.out("maitre: suspended; continue with the same command plus --resume")
            return 1 if self.story_failures else 0
        return 0 if job["state"] == JobState.COMPLETED.value and not self.story_failures else 1

    def request_stop(self, signame: str) -> None:
        """A signal handler's part: suspend the job (the wait loop carries it out). Without
        checkpoints there is nothing to suspend to, so the run just stops."""
        if self.cfg.checkpoint_dir is None or self._stop_signal is not None:
            raise KeyboardInterrupt
        self._stop_signal = signame

    def _suspend(self, job: dict[str, Any]) -> None:
        self.out(
            f"maitre: {self._stop_signal}: suspending the job at step {job['step']}: every "
            f"worker checkpoints, then stops (grace period {self.cfg.grace_period_s:.0f}s; "
            "signal again to stop at once)"
        )
        self._suspend_deadline = time.monotonic() + self.cfg.grace_period_s
        try:
            self.coordinator.suspend(self.cfg.job_id, f"{self._stop_signal} to maitre run")
        except Exception as exc:  # noqa: BLE001 -- the job ended meanwhile
            self.out(f"maitre: could not suspend: {exc}")

    def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop agents and coordinator; ``drain_s`` lets a completed job's workers finish the
        script's code after the loop (saving the model) before they are signalled."""
        for agent in self.agents:
            agent.stop(drain_s=drain_s)
        self.server.stop()

    def _on_event(self, job_id: str, event: dict[str, Any]) -> None:
        if quiet(event):
            return
        self.out(f"maitre: {time.time() - self.t0:7.2f}s  {describe(event)}")


def write_token(path: Path, token: str) -> None:
    """The token file: readable by its owner only, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)


DATA_WORKER_WAIT_S = 30.0
"""How long ``kill-data`` looks for a data worker: one may be between two sets of workers (the
loader starts new ones after a resize or a lost one; each imports what the dataset needs)."""


def is_data_worker_name(name: str) -> bool:
    return name == DATA_WORKER_NAME or name.startswith(f"{DATA_WORKER_NAME}-")


def data_workers(pid: int, table: dict[int, procs.Proc] | None = None) -> list[int]:
    """The live data workers of the training process ``pid``: its descendants named as a
    :class:`maitre.data.Loader`'s data worker names itself (``maitre-data-N``), at any depth:
    children of the training process (fork, spawn) or of the fork server it started
    (forkserver: a warm-started worker's default). Not the fork server nor the resource tracker."""
    table = procs.table() if table is None else table
    return [p for p in procs.descendants(pid, table) if is_data_worker_name(table[p].name)]


@dataclass(frozen=True, slots=True)
class DataKill:
    """A data worker the story killed, as ``/proc`` showed it just before."""

    pid: int
    name: str
    parent: int
    parent_cmdline: str
    training_pid: int
    worker: str

    @property
    def under_fork_server(self) -> bool:
        return self.parent != self.training_pid and "forkserver" in self.parent_cmdline

    @classmethod
    def of(cls, pid: int, training_pid: int, worker: str) -> "DataKill | None":
        """``pid`` as it is now, when it is (still) a data worker of ``training_pid``."""
        table = procs.table()
        if pid not in table or pid not in data_workers(training_pid, table):
            return None
        parent, name = table[pid].parent, table[pid].name
        try:
            cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = ""
        return cls(pid, name, parent, cmdline.strip(), training_pid, worker)


_children = procs.children  # (benchmarks/restart.py's name, until it imports procs)


def _prefixed(out: Callable[[str], None]) -> Callable[[str, str], None]:
    return lambda wid, line: out(f"[{wid}] {line.rstrip()}")


def quiet(event: dict[str, Any]) -> bool:
    """Events a run's output leaves out: progress (one a second: the workers print their own),
    and the recovery reports of members other than rank 0 (which speaks for the epoch)."""
    return event["kind"] == "progress" or (event["kind"] == "report" and event.get("rank") != 0)


def describe(event: dict[str, Any]) -> str:
    kind = event["kind"]
    if kind == "epoch":
        extra = (
            "" if event.get("closed_for_s") is None else f" after {event['closed_for_s'] * 1000:.0f} ms of rendezvous"
        )
        return f"epoch {event['epoch']} opened with {len(event['members'])} workers ({event['reason']}){extra}"
    if kind == "epoch_closed":
        return f"epoch {event['epoch']} closed: {event['reason']}"
    if kind == "report":
        return (
            f"epoch {event['epoch']}: resumed training at step {event['step']} "
            f"{event['to_next_step_s'] * 1000:.0f} ms after detection (rendezvous "
            f"{event['rendezvous_s'] * 1000:.0f} ms, group {event['group_s'] * 1000:.0f} ms, "
            f"state {event['state_s'] * 1000:.0f} ms / {event['state_bytes'] / 1e6:.2f} MB)"
        )
    if kind == "caught_up":
        return (
            f"epoch {event['epoch']}: {event['worker']} caught up at step {event['step']}, "
            f"{event['state_bytes'] / 1e6:.2f} MB streamed and {event['replayed']} step(s) "
            f"replayed in {event['listened_s'] * 1000:.0f} ms while the job trained; "
            f"{event['world_size']} workers train"
        )
    if kind == "gang_stopped":
        return f"gang {event['epoch']} stopped in {event['seconds'] * 1000:.0f} ms ({event['reason']})"
    if kind == "gang_joined":
        since = event.get("since_stop_s")
        after = "" if since is None else f"; {since:.1f} s after the last gang began to stop"
        return f"gang {event['epoch']} in its process group {event['seconds']:.1f} s after its start{after}"
    if kind == "worker_done":
        return f"{event['worker']} exited 0"
    if kind == "checkpoint":
        every = (
            f"every {event['interval_steps']} steps"
            if event.get("interval_steps")
            else f"interval {event.get('interval_s') or 0:.0f}s"
        )
        if not event.get("ok"):
            return f"checkpoint at step {event['step']} failed: {event.get('error')}"
        return (
            f"checkpoint at step {event['step']}: {event['bytes'] / 1e6:.2f} MB, snapshot "
            f"{event['snapshot_s'] * 1000:.0f} ms, persisted in {event['persist_s'] * 1000:.0f}"
            f" ms ({every})"
        )
    if kind == "prices":
        return "prices per slot-hour: " + ", ".join(f"{k} {v:g}" for k, v in event["prices"].items())
    if kind == "straggler":  # its windows' numbers stay in the event log and the dashboard
        where = f" on {event['node']}" if event.get("node") else ""
        return (
            f"straggler: {event['worker']}{where} (rank {event['rank']}) computes "
            f"{event['ratio']:.2f}x the median since step {event['since_step']} "
            f"(found at step {event['step']}; policy {event.get('policy', 'report')})"
        )
    if kind == "restore":
        return (
            f"restored step {event['step']} from {event['source']} in "
            f"{event['seconds'] * 1000:.0f} ms ({event['bytes'] / 1e6:.2f} MB)"
        )
    if kind in ("admit", "grow", "shrink", "preempting"):
        where = " ".join(f"{n}x{r}" for n, r in sorted(event.get("placement", {}).items()))
        why = f" ({event['reason']})" if event.get("reason") else ""
        if kind == "admit" and event.get("resumes"):
            why += " (resumes from its checkpoint)"
        return f"{kind} -> {sum(event.get('placement', {}).values())} on {where or 'nothing'}{why}"
    fields = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("kind", "t"))
    return f"{kind}: {fields}"


def epoch_reports(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per membership epoch (of each incarnation), the recovery report of the running member
    that paused longest: a joiner's own start-up is not a pause of the job."""
    by_epoch: dict[tuple[int, int], dict[str, Any]] = {}

    def weight(r: dict[str, Any]) -> tuple[bool, float]:  # running members before joiners
        return r["reason"] != "join", r["to_next_step_s"]

    for r in reports:
        if r.get("kind") != "recovery":
            continue
        key = (r.get("incarnation", 1), r["epoch"])
        if key not in by_epoch or weight(r) > weight(by_epoch[key]):
            by_epoch[key] = r
    return [by_epoch[k] for k in sorted(by_epoch)]


def summary(job: dict[str, Any], ledger_dir: Path | None, run_dir: Path, checkpoint_dir: Path | None = None) -> str:
    where = (
        f"after {job['epoch']} gang(s) of workers restarted whole"
        if job.get("elastic") == "restart"
        else f"at step {job['step']} after {job['epoch']} membership epoch(s)"
    )
    lines = ["", f"maitre: job {job['job_id']} {job['state']} {where}, {job['failures']} failure(s)"]
    if job.get("failure"):
        lines.append(f"maitre: job failed: {job['failure']}")
    reports = epoch_reports(job.get("reports", []))
    if reports:
        lines.append(
            f"  {'epoch':>5}  {'world':>5}  {'reason':<44} {'rdzv ms':>8} {'group ms':>8} "
            f"{'state ms':>8} {'to step ms':>10}"
        )
        for r in reports:
            lines.append(
                f"  {r['epoch']:>5}  {r['world_size']:>5}  {r['reason'][:44]:<44} "
                f"{r['rendezvous_s'] * 1000:>8.0f} {r['group_s'] * 1000:>8.0f} "
                f"{r['state_s'] * 1000:>8.0f} {r['to_next_step_s'] * 1000:>10.0f}"
            )
    if job.get("restarts"):
        # restart: from the decision to stop the last gang to every process of this one started;
        # to group: to every process of it in its process group (its init_process_group)
        lines.append(f"  {'gang':>5}  {'world':>5}  {'cause':<56} {'restart ms':>10} {'to group ms':>11}")
        for r in job["restarts"]:
            took, joined = (("" if r.get(k) is None else f"{r[k] * 1000:.0f}") for k in ("restart_s", "joined_s"))
            lines.append(f"  {r['epoch']:>5}  {r['size']:>5}  {str(r['cause'])[:56]:<56} {took:>10} {joined:>11}")
    if ledger_dir is not None and ledger_dir.exists() and any(ledger_dir.iterdir()):
        lines.append(f"  data: {audit(ledger_dir).describe()}")
    if checkpoint_dir is not None:
        newest = newest_complete(checkpoint_dir)
        lines.append(f"  newest complete checkpoint: {newest or 'none'}")
    lines.append(f"  run directory: {run_dir}")
    return "\n".join(lines)
