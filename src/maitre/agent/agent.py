"""The agent: one per node. It starts, watches and signals the node's worker processes, and
carries their liveness to the coordinator, so that the coordinator hears from nodes, not workers.

Three paths, each with its own thread (the messages are :mod:`maitre.protocol`'s):

- **Workers to agent.** Each worker beats 10 times a second on the agent's unix socket (a
  private directory: only this user can connect) with its step, whether it is stalled in a
  collective and its trained seconds; the reply is its *view* (epoch closed, change pending,
  leave, stop, suspend), as the coordinator last sent it, and how long ago the coordinator
  last answered the agent (``heard_s``: how old that word may be).
- **Agent to coordinator: the node beat**, every ``heartbeat_s`` (2 s), with the node's slots
  and labels and, for every worker it runs, its progress, how long it has been silent and the
  rhythm of its beats. While a worker is stalled or silent (past ``protocol.SILENT_S``), or when
  one turns so, the agent beats every ``urgent_s`` (0.1 s) instead: that is when the
  coordinator's hang detector needs fresh news. That promise is in every beat (``interval_s``),
  so a beat vouches for the workers it lists as heard until the next is due. In steady state a node
  of 8 workers costs the coordinator one request every 2 s: what a worker must hear comes by
  the watch, so the beat carries only liveness and progress (measured at 1,024 nodes: 1 s beats
  left the coordinator no headroom on this machine).
- **Coordinator to agent: the watch**, a long-poll that returns as soon as the node's orders
  change (workers to start, workers to kill, new views), so news reaches the workers within a
  round trip, not a beat interval.

The node's health probes (:mod:`maitre.agent.health`) run in child processes: one before the
first beat, then periodically and when the orders ask (``probe``: the node is suspect); the
latest result rides every beat, and a new one is news worth a beat at once.

A thread per worker waits on the process and reports its exit at once, with the last line of
its stderr (for a Python exception, ``Type: message``), which is what lets the coordinator tell
a crash from a bug that every rank hits.

Python workers of this interpreter are forked from a fork server that has torch imported
already (:mod:`maitre.agent.warmstart`), so a joiner, or a restart-mode gang started again,
holds its slots idle for milliseconds, not the seconds of its imports. The node's first beat,
which makes it known, waits for those imports (bounded, :func:`~maitre.agent.warmstart.warm`):
the coordinator stops a restart-mode gang to make room for a node as soon as it knows it, and
the next gang would otherwise wait in its process group for the new node's imports. Workers
get torchrun's variables (``LOCAL_RANK``, ``OMP_NUM_THREADS=1``) plus ``MAITRE_*``; they run in
their own session so a signal meant for one never reaches the agent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable, TextIO

from pydantic import ValidationError

from maitre import protocol
from maitre.agent import netaddr, torchrun, warmstart
from maitre.agent.health import HealthMonitor
from maitre.agent.notices import NoticeWatcher
from maitre.wire import ApiError, Client, CoordinatorUnreachable

log = logging.getLogger("maitre.agent")

Output = Callable[[str, str], None]


def print_output(worker_id: str, line: str) -> None:
    sys.stdout.write(f"[{worker_id}] {line}")
    sys.stdout.flush()


class _Worker:
    """One worker: its process, or the processes of a replica that spans several, which live
    and die together (a process lost takes its replica out: the agent kills the others)."""

    def __init__(self, worker_id: str, proc: Any, *more: Any) -> None:
        self.worker_id = worker_id
        self.procs = [proc, *more]
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.threads: list[threading.Thread] = []
        self.codes: dict[int, int] = {}
        """Exit codes by process index, as they come."""
        self.failed: tuple[int, str | None] | None = None
        """The first failing exit (code, its error line): the replica's."""
        self.lock = threading.Lock()
        self.gang: torchrun.GangLink | None = None
        """A restart-mode worker's way to its gang's store (None: maitre's loop's worker)."""
        self.restart: protocol.RestartOrder | None = None
        self.marked = False
        """Its output had the job's success marker."""
        self.terminating = False

    @property
    def proc(self) -> Any:
        """The first process (the one a story's ``kill@``/``hang@`` signals)."""
        return self.procs[0]

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                _signal(p, sig)

    def signal_groups(self, sig: int) -> None:
        """``sig`` to each process's group: its children too (each leads a session of its own).
        A warm worker forked a moment ago may not lead one yet (its ``setsid`` is its first act):
        then to the process itself, which has started nothing yet (a start that ended after its
        agent stopped, SIGKILLed so, trained on: found by the restart benchmark, whose process
        then waited for it at exit)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                _signal(p, sig)

    def terminate(self) -> None:
        """Its gang stops: SIGTERM, and SIGKILL to its process groups (its children too) after
        the grace period (on a thread: the caller goes on)."""
        if self.terminating or self.restart is None:
            return
        self.terminating = True

        def escalate(sig: int) -> None:  # (SIGTERM to the script, SIGKILL to all it started)
            (self.signal_groups if sig == signal.SIGKILL else self.signal)(sig)

        threading.Thread(
            target=torchrun.terminate,
            args=(escalate, self.alive, self.restart.grace_s),
            name="maitre-terminate",
            daemon=True,
        ).start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every process (raises ``subprocess.TimeoutExpired`` past ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))


LOCAL_HEARTBEAT_S = 0.25
"""The beat of agents that share their machine with a coordinator serving a handful of nodes
(``maitre run``, ``maitre up``'s local nodes): the cost is nothing there, and the job's step as
the coordinator shows it (``maitre status``, a scripted story's ``kill@STEP``) is fresh. The
default (2 s) is for clusters, where news for workers comes by the watch, not the beat."""


class WorkerBeats:
    """What the agent knows of one worker from its heartbeats: progress and rhythm."""

    __slots__ = ("step", "stalled", "trained_s", "last", "gap_mean", "gap_var", "gaps")

    def __init__(self) -> None:
        self.step, self.stalled, self.trained_s = 0, False, 0.0
        self.last: float | None = None
        self.gap_mean = self.gap_var = 0.0
        self.gaps = 0

    def beat(self, now: float, step: int, stalled: bool, trained_s: float) -> bool:
        """Record a beat; True when the worker's stall state changed (news worth a beat)."""
        if self.last is not None:  # EWMA of the gaps, so the detector adapts to this worker
            self.gaps += 1
            alpha = max(0.05, 1.0 / self.gaps)
            delta = (now - self.last) - self.gap_mean
            self.gap_mean += alpha * delta
            self.gap_var = (1 - alpha) * (self.gap_var + alpha * delta * delta)
        changed = stalled != self.stalled
        self.last, self.step, self.stalled, self.trained_s = now, step, stalled, trained_s
        return changed

    def report(self, worker_id: str, now: float) -> protocol.WorkerBeat:
        return protocol.WorkerBeat(
            id=worker_id,
            step=self.step,
            stalled=self.stalled,
            trained_s=round(self.trained_s, 4),
            silent_s=None if self.last is None else round(max(0.0, now - self.last), 4),
            gap_mean_s=round(min(self.gap_mean, 3600.0), 4),
            gap_std_s=round(min(math.sqrt(self.gap_var), 3600.0), 4),
        )


def _report(wid: str, procs: dict[int, WorkerBeats], now: float) -> protocol.WorkerBeat:
    """A worker as its processes' beats tell it: a replica is as far as its slowest process,
    stalled if any is, and as silent as its most silent one (a hung process hangs it)."""
    if not procs:  # started, not heard from yet
        return protocol.WorkerBeat(id=wid)
    if len(procs) == 1:
        return next(iter(procs.values())).report(wid, now)
    parts = [b.report(wid, now) for b in procs.values()]
    heard = [r for r in parts if r.silent_s is not None]
    worst = max(heard, key=lambda r: r.silent_s or 0.0) if heard else parts[0]
    return worst.model_copy(
        update={
            "step": min(r.step for r in parts),
            "stalled": any(r.stalled for r in parts),
            "trained_s": min(r.trained_s for r in parts),
        }
    )


_BEAT_ROUTE = re.compile(
    re.escape(protocol.API + protocol.WORKER_HEARTBEAT).replace(r"\{worker\}", "(?P<w>[A-Za-z0-9_.-]+)")
)


FIRST_BEAT_WAIT_S = 60.0
"""How long an agent's first beat waits for a coordinator that stopped answering after the agent
started (a coordinator restarting: ``maitre up`` on its state directory takes seconds)."""


class Agent:
    """Runs the workers the coordinator assigns to this node.

    Args:
        coordinator: ``HOST:PORT`` of the coordinator's HTTP API.
        node_id: a name unique in the cluster (e.g. the host name).
        slots: worker processes this node can run (GPUs; CPU slots here).
        extra_env: added to every worker's environment (e.g. ``MAITRE_LEDGER_DIR``).
        output: where worker output lines go (default: stdout with a ``[worker]`` prefix).
        labels: the node's ``rack``, ``block``, ``capacity_type`` (``on-demand`` or ``spot``)
            and ``accelerator``, for topology-aware placement.
        iface: the network interface workers advertise to their peers (``GLOO_SOCKET_IFNAME``,
            ``NCCL_SOCKET_IFNAME``) unless the environment names one; default: the one this
            node reaches the coordinator through (:mod:`maitre.agent.netaddr`).
        notices: the watch on the node's spot notice source (:mod:`maitre.agent.notices`):
            once it sees a notice, every beat carries it and the coordinator drains the node.
        health: the node's health probes (:mod:`maitre.agent.health`): the first runs before
            the first beat (the node takes no work before it is known), the rest on their
            thread; every beat carries the latest result, a new one is news worth a beat.
    """

    def __init__(
        self,
        coordinator: str,
        node_id: str,
        slots: int,
        *,
        heartbeat_s: float = 2.0,
        urgent_s: float = 0.1,
        extra_env: dict[str, str] | None = None,
        output: Output = print_output,
        token: str | None = None,
        labels: dict[str, str] | None = None,
        iface: str | None = None,
        tls_ca: str | None = None,
        notices: NoticeWatcher | None = None,
        health: HealthMonitor | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.client = Client(coordinator, timeout_s=5.0, token=token, tls_ca=tls_ca)
        self.watcher = Client(coordinator, timeout_s=30.0, token=token, tls_ca=tls_ca)
        self.tls_ca = tls_ca
        self.urgent_s = urgent_s
        self.version = -1
        """The node's orders version the agent last applied (the coordinator's count)."""
        self.agent_id = secrets.token_hex(8)
        """This process's id in its beats: the coordinator tells a restarted agent by it."""
        self.boot: str | None = None
        """The id of the coordinator process that count is of (a restarted one counts anew)."""
        self.heard_at: float | None = None
        """When (``time.monotonic()``) the agent sent the latest request that the coordinator
        answered: the views it holds are the coordinator's word as of then. Each worker's
        heartbeat reply says how long ago that was (``heard_s``)."""
        self.beats: dict[str, dict[int, WorkerBeats]] = {}
        """Each worker's processes' beats (one, or each process of a replica's)."""
        self.views: dict[str, protocol.WorkerView] = {}
        self._poke = threading.Event()
        self._dir = Path(tempfile.mkdtemp(prefix="maitre-agent-"))  # mode 0700: ours only
        self.socket_path = str(self._dir / "agent.sock")
        self._local = _LocalServer(self.socket_path, self)
        self.coordinator = coordinator
        self.node_id = node_id
        self.slots = slots
        self.labels = dict(labels or {})
        self.notices = notices
        self._going = False
        """Stopping with a notice standing: the last beat says the node goes now."""
        if notices is not None:  # a notice is news worth a beat at once
            notices.on_notice = lambda notice: self._poke.set()
        self.health = health
        if health is not None:  # so is a probe's result
            health.on_result = lambda result: self._poke.set()
        self.iface = iface
        self.heartbeat_s = heartbeat_s
        self.extra_env = dict(extra_env or {})
        self.output = output
        self.workers: dict[str, _Worker] = {}
        self._ordered: set[str] = set()
        """Every worker this agent was told to start: the coordinator repeats a start order
        until a beat lists the worker (an answer can be lost), the agent carries out one."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lost = False
        """The node was lost (:meth:`lose`): nothing more is reported."""
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> "Agent":
        self._thread = threading.Thread(target=self.serve, name=f"agent-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        """Heartbeat until stopped (blocking). Raises CoordinatorUnreachable if the coordinator
        cannot be reached at all at start-up (for :data:`FIRST_BEAT_WAIT_S`)."""
        if self.notices is not None:
            self.notices.start()
        warmstart.prewarm()  # (its imports go on while the health probe runs)
        if self.health is not None:
            if self.health.latest is None:
                self.health.first()
            self.health.start()
        self._warm()
        if self._stop.is_set():  # stopped before it was known: nothing to say, nothing started
            return
        if not self._first_beat():
            return
        self._threads = [
            threading.Thread(
                target=self._local.serve_forever,
                kwargs={"poll_interval": 0.2},
                name=f"agent-{self.node_id}-local",
                daemon=True,
            ),
            threading.Thread(target=self._watch, name=f"agent-{self.node_id}-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()
        last = time.monotonic()
        while not self._stop.is_set():
            # Wake often enough to see a worker fall silent within ``urgent_s``: the beats
            # promise the coordinator that (see protocol.SILENT_S); send one only when due.
            poked = self._poke.wait(min(self.urgent_s, self.heartbeat_s))
            self._poke.clear()
            if self._stop.is_set():
                break
            now = time.monotonic()
            if not (poked or self._urgent(now) or now - last >= self.heartbeat_s):
                continue
            last = now
            try:
                self._beat()
            except CoordinatorUnreachable:
                pass  # the coordinator may be restarting; keep our workers running

    def _first_beat(self) -> bool:
        """The beat that makes the node known, False if the agent stopped first. The coordinator
        may restart between the agent's check that it answers and this beat (seconds apart: the
        fork server's imports come between; a chaos run lost three agents so, each restarted
        a moment before the coordinator was killed): its absence is retried, as later beats'
        is, for :data:`FIRST_BEAT_WAIT_S`, and only then raised."""
        deadline = time.monotonic() + FIRST_BEAT_WAIT_S
        while True:
            try:
                self._beat()
                return True
            except CoordinatorUnreachable:
                if time.monotonic() >= deadline:
                    raise
            if self._stop.wait(0.5):
                return False

    def _warm(self) -> None:
        """Wait for the fork server's imports before the first beat, as for the first health
        probe: a node counts as ready (takes work, and a restart-mode gang is stopped to make
        room for it) only once its workers can start in milliseconds (see
        :func:`maitre.agent.warmstart.warm`). Bounded: past it, or if the fork server failed,
        the node goes on and says why."""
        why = warmstart.warm(stop=self._stop)
        if why is not None and not self._stop.is_set():
            log.warning("node %s: %s; it joins now", self.node_id, why)

    def _urgent(self, now: float) -> bool:
        """A worker is stalled or silent: the hang detector needs fresh news, every ``urgent_s``."""
        with self._lock:
            return any(
                b.stalled or (b.last is not None and now - b.last >= protocol.SILENT_S)
                for wid, procs in self.beats.items()
                if wid in self.workers
                for b in procs.values()
            )

    def _watch(self) -> None:
        """Long-poll the node's orders; apply each answer as soon as it comes."""
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                reply = self.watcher.post(
                    protocol.NODE_WATCH.format(node=self.node_id),
                    {"since": self.version, "wait_s": 30.0},
                    timeout_s=45.0,
                )
                orders = protocol.NodeOrders.model_validate(reply)
            except (CoordinatorUnreachable, ApiError):  # restarting, or not yet beaten to
                self._stop.wait(0.5)
                continue
            except ValidationError as exc:  # (the next beat says so, and ends the agent)
                log.error("node %s: the coordinator's orders cannot be read: %s", self.node_id, exc)
                self._stop.wait(0.5)
                continue
            self._apply(orders, sent)

    def stop(self, grace_s: float = 3.0, drain_s: float = 0.0) -> None:
        """Stop heartbeating and end the workers: first wait up to ``drain_s`` for them to exit
        on their own (a finished job's workers run the script's code after the loop, such as
        saving the model), then SIGTERM, then SIGKILL after ``grace_s``."""
        self._stop.set()
        self._poke.set()
        if self.notices is not None:
            self.notices.stop()
        if self.health is not None:
            self.health.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._threads:  # shutdown() would wait forever for a loop that never ran
            self._local.shutdown()
        self._local.server_close()
        for t in self._threads:
            t.join(timeout=1)  # the watch may be inside a long-poll: it is a daemon
        self.watcher.close()
        with self._lock:
            workers = list(self.workers.values())
        drained = time.monotonic() + drain_s
        for w in workers:
            try:
                w.wait(timeout=max(0.0, drained - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in workers:
            w.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in workers:
            try:
                w.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.wait()
            for t in w.threads:
                t.join(timeout=2)
        if self.notices is not None and self.notices.current is not None:
            # A node with a notice that stops is going now: one last beat says so, and the
            # coordinator counts the reclaim at once, not after its detector gave up on us.
            self._going = True
            try:
                self._beat()
            except (CoordinatorUnreachable, RuntimeError, OSError):
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def lose(self) -> None:
        """The node is lost at once, as when its machine dies: it beats no more, its workers are
        SIGKILLed (their process groups) and their exits go unreported. A story's or a
        benchmark's way to take a node out: the coordinator learns of it from the silence, and
        the job from its workers' peers."""
        self._lost = True
        self._stop.set()
        self._poke.set()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.signal_groups(signal.SIGKILL)

    def leave(self) -> None:
        """Make :meth:`serve` return (its caller then calls :meth:`stop`): the node is done,
        as when a notice's drain is over."""
        self._stop.set()
        self._poke.set()

    def running(self) -> list[str]:
        with self._lock:
            return [wid for wid, w in self.workers.items() if w.alive()]

    def pid(self, worker_id: str) -> int:
        return self.workers[worker_id].proc.pid

    # -- coordinator -----------------------------------------------------------------------------
    def _beat(self) -> None:
        now = time.monotonic()
        running = self.running()
        with self._lock:
            workers = [self._gang_report(wid, _report(wid, self.beats.get(wid, {}), now), now) for wid in running]
        notice = self.notices.current if self.notices is not None else None
        beat = protocol.NodeBeat(
            slots=self.slots,
            labels=protocol.Labels(**self.labels),
            workers=workers,
            since=self.version,
            interval_s=self.heartbeat_s,
            agent=self.agent_id,
            notice=None
            if notice is None
            else protocol.SpotNotice(
                notice_s=round(0.0 if self._going else notice.remaining_s(self.notices.clock()), 3),
                action=notice.action[:64],
                source=notice.source[:500],
            ),
            health=self.health.beat() if self.health is not None else None,
        )
        sent = time.monotonic()
        try:
            # (absent fields left out: a beat without a notice carries no "notice", and a
            # thousand nodes' beats stay small)
            body = beat.model_dump(mode="json", exclude_none=True)
            reply = self.client.post(protocol.NODE_HEARTBEAT.format(node=self.node_id), body)
        except ApiError as exc:
            raise RuntimeError(f"coordinator refused node {self.node_id}: {exc.message}") from None
        try:
            orders = protocol.NodeOrders.model_validate(reply)
        except ValidationError as exc:
            raise RuntimeError(f"node {self.node_id}: the coordinator's orders cannot be read: {exc}") from None
        self._apply(orders, sent)

    def _gang_report(self, wid: str, report: protocol.WorkerBeat, now: float) -> protocol.WorkerBeat:
        """A restart-mode worker's report says when it reached its gang's store."""
        w = self.workers.get(wid)
        if w is None or w.gang is None or w.gang.joined_at is None:
            return report
        return report.model_copy(update={"joined_s": round(max(0.0, now - w.gang.joined_at), 4)})

    def _apply(self, orders: protocol.NodeOrders, sent: float) -> None:
        """Carry out the node's orders (from a beat or a watch, in whichever order they come:
        views older than the ones applied are dropped), the answer to a request sent at
        ``sent``. A start order is carried out once, however often it comes."""
        with self._lock:
            views, boot = orders.views, orders.boot
            recount = bool(boot) and self.boot is not None and boot != self.boot
            if boot:
                self.boot = boot
            if recount:  # a restarted coordinator, whose versions count anew from 0
                self.version = -1
            if recount and views is None:  # (views "unchanged since" a count not its own)
                self._poke.set()  # ask again at once, since -1: every view comes
            else:
                if views is not None and orders.version >= self.version:
                    for wid in set(self.views) - set(views):  # no longer live for it
                        self.views[wid] = self.views[wid].model_copy(update={"stop": True})
                    self.views.update(views)
                self.version = max(self.version, orders.version)
                # With the views it brought (or none: nothing changed since ``since``).
                self.heard_at = sent if self.heard_at is None else max(self.heard_at, sent)
            start = [o for o in orders.start if o.worker_id not in self._ordered]
            self._ordered.update(o.worker_id for o in start)
        for order in start:  # off this thread: a start must not delay a beat
            threading.Thread(target=self._spawn, args=(order,), name="maitre-spawn", daemon=True).start()
        for wid in orders.kill:
            w = self.workers.get(wid)
            if w is not None:
                w.signal(signal.SIGKILL)
        for wid in orders.terminate:
            w = self.workers.get(wid)
            if w is not None:
                w.terminate()
        if orders.probe and self.health is not None:
            self.health.request()

    def worker_beat(self, wid: str, beat: protocol.LocalBeat) -> protocol.AgentView:
        """A worker's heartbeat on the local socket; returns its view."""
        now = time.monotonic()
        with self._lock:
            procs = self.beats.setdefault(wid, {})
            beats = procs.get(beat.proc)
            if beats is None:
                beats = procs[beat.proc] = WorkerBeats()
            news = beats.beat(now, beat.step, beat.stalled, beat.trained_s)
            view = self.views.get(wid)
            heard = self.heard_at
        if news:
            self._poke.set()
        heard_s = None if heard is None else round(max(0.0, now - heard), 4)
        return protocol.AgentView(**(view.model_dump() if view is not None else {}), heard_s=heard_s)

    def _spawn(self, order: protocol.StartOrder) -> None:
        wid = order.worker_id
        env = {**os.environ, **self.extra_env, **order.env}
        env.update(netaddr.worker_env(self.coordinator, env, self.iface))  # peers reach it
        for key in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # known only per membership epoch
        # The worker holds its run's token, never the agent's: it opens that worker's own routes
        # and store only (a training script is the user's code).
        env.pop(protocol.TOKEN_FILE, None)
        env[protocol.TOKEN] = order.token
        if self.tls_ca:
            env[protocol.TLS_CA] = str(Path(self.tls_ca).resolve())
        nproc = order.nproc
        env.update(
            {
                protocol.COORDINATOR: self.coordinator,
                protocol.WORKER_ID: wid,
                protocol.JOB_ID: order.job_id,
                protocol.STORE: self._store_address(order.store),
                protocol.STORE_KEY: order.store_key,
                protocol.AGENT: self.socket_path,
                "LOCAL_WORLD_SIZE": str(self.slots),
                "TORCHELASTIC_RUN_ID": order.job_id,
                "PYTHONUNBUFFERED": "1",
            }
        )
        if nproc > 1:
            env.update({protocol.NPROC: str(nproc), protocol.MESH: order.mesh})
        env.setdefault("OMP_NUM_THREADS", "1")
        gang = None
        if order.restart is not None:  # an unmodified script: torchrun's environment, no maitre's
            env = torchrun.scrub(env)
            try:
                gang = torchrun.GangLink(
                    self._store_address(order.store), order.store_key, order.token, on_join=self._poke.set
                )
            except OSError as exc:
                self.output(wid, f"maitre: cannot open the way to the job's store: {exc}\n")
                threading.Thread(target=self._report_exit, args=(wid, 1, f"agent: {exc}"), daemon=True).start()
                return
        per = max(1, order.slots // nproc)  # slots (GPUs) of each process
        procs: list[Any] = []
        for i in range(nproc):
            first = order.local_rank + i * per
            mine = {
                **env,
                "LOCAL_RANK": str(first),
                # The slots (GPUs) it holds on this node: LOCAL_RANK and the ones after it.
                protocol.SLOTS: ",".join(str(first + k) for k in range(per)),
            }
            if nproc > 1 and gang is None:
                mine[protocol.PROC] = str(i)
            if gang is not None and order.restart is not None:
                mine.update(torchrun.environ(order, order.restart, i, gang.port, env.get("CUDA_VISIBLE_DEVICES")))
                mine.pop(protocol.SLOTS, None)
            try:
                if warmstart.enabled(mine) and warmstart.warm_target(order.command):
                    procs.append(warmstart.WarmProcess(order.command, mine))
                else:
                    procs.append(
                        subprocess.Popen(
                            order.command,
                            env=mine,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            start_new_session=True,
                        )
                    )
            except OSError as exc:  # no such program, not executable: the job's error, not ours
                for p in procs:
                    _signal(p, signal.SIGKILL)
                if gang is not None:
                    gang.close()
                self.output(wid, f"maitre: cannot start {order.command[0]!r}: {exc}\n")
                threading.Thread(target=self._report_exit, args=(wid, 127, f"cannot start: {exc}"), daemon=True).start()
                return
        worker = _Worker(wid, *procs)
        if gang is not None:
            gang.pids.update(p.pid for p in procs)
            worker.gang, worker.restart = gang, order.restart
        with self._lock:
            self.views.setdefault(wid, protocol.WorkerView())
        for proc in procs:
            worker.threads += [
                threading.Thread(target=self._pump, args=(worker, proc.stdout, False), daemon=True),
                threading.Thread(target=self._pump, args=(worker, proc.stderr, True), daemon=True),
            ]
        worker.threads += [threading.Thread(target=self._wait, args=(worker, i), daemon=True) for i in range(nproc)]
        with self._lock:
            stopping = self._stop.is_set()
            if not stopping:
                self.workers[wid] = worker
        if stopping:  # (stop() took its list of workers before this one was in it: it ends here)
            worker.signal_groups(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=5)
            if gang is not None:
                gang.close()
            return
        for t in worker.threads:
            t.start()

    def _store_address(self, store: str) -> str:
        """A coordinator bound to every interface (``0.0.0.0``, ``::``) names its store by that
        wildcard: its workers reach it where the agent reaches the coordinator."""
        host, _, port = store.rpartition(":")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            return f"{self.client.host}:{port}"
        return store

    def _pump(self, worker: _Worker, stream: TextIO | None, is_err: bool) -> None:
        assert stream is not None
        marker = worker.restart.success_marker if worker.restart is not None else None
        for line in stream:
            if is_err and line.strip():
                worker.stderr_tail.append(line.rstrip()[:500])
            if marker and marker in line:
                worker.marked = True
            self.output(worker.worker_id, line)

    def _wait(self, worker: _Worker, index: int = 0) -> None:
        code = worker.procs[index].wait()
        nproc = len(worker.procs)
        for t in worker.threads[2 * index : 2 * index + 2]:
            t.join(timeout=2)  # let the last stderr lines in
        # A failing exit's last stderr line is its error (``Type: message`` for Python); a
        # signal's death says nothing about the script, whatever it printed before.
        error = worker.stderr_tail[-1] if code > 0 and worker.stderr_tail else None
        with worker.lock:
            worker.codes[index] = code
            if code != 0 and worker.failed is None:
                worker.failed = (code, error)
            last = len(worker.codes) == nproc
        if code != 0 and nproc > 1:  # a process lost takes its replica out, as a unit
            worker.signal(signal.SIGKILL)
        if last:
            code, error = worker.failed or (0, None)
            told: dict[str, Any] = {}
            if worker.gang is not None and worker.restart is not None:  # what the script cannot say
                worker.gang.close()
                told = {"joined": worker.gang.joined.is_set(), "stderr": list(worker.stderr_tail)}
                if self.notices is not None and self.notices.current is not None:
                    told["noticed"] = True
                if worker.restart.success_marker:
                    told["marked"] = worker.marked
            self._report_exit(worker.worker_id, code, error, told)

    def _report_exit(self, worker_id: str, code: int, error: str | None, told: dict[str, Any] | None = None) -> None:
        """Tell the coordinator, retrying while it is away (it may be restarting)."""
        if self._lost:
            return
        self._poke.set()  # the node beat stops listing it now
        for _ in range(1200):
            try:
                self.client.post(
                    protocol.WORKER_EXIT.format(worker=worker_id),
                    {"code": code, "error": (error or "")[-4000:] or None, **(told or {})},
                )
                return
            except CoordinatorUnreachable:
                if self._stop.wait(0.5):
                    return
            except ApiError:
                return


class _LocalServer(socketserver.ThreadingUnixStreamServer):
    """The agent's unix socket: its workers' heartbeats (one keep-alive connection each)."""

    daemon_threads = True

    def __init__(self, path: str, agent: Agent) -> None:
        self.agent = agent
        super().__init__(path, _LocalHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A worker killed while its beat was answered is no error of the agent's."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _LocalHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _LocalServer

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: 10 beats a second each
        pass

    def address_string(self) -> str:  # a unix socket has no peer address
        return "local"

    def do_POST(self) -> None:
        match = _BEAT_ROUTE.fullmatch(self.path)
        data = json.dumps({"error": f"no route POST {self.path}"}).encode()
        status = 404
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(min(length, 1 << 16)) if length > 0 else b""
            if match:
                beat = protocol.LocalBeat.model_validate_json(body or b"{}")
                status, data = 200, self.server.agent.worker_beat(match["w"], beat).model_dump_json().encode()
        except ValueError as exc:  # (pydantic's ValidationError is one)
            status, data = 400, json.dumps({"error": f"bad heartbeat: {exc}"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _signal(proc: Any, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
