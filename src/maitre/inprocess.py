"""Ranks as threads: a coordinator, its nodes and their workers, all in this process.

The real :class:`~maitre.control.coordinator.Coordinator` (membership epochs, scheduling, failure
detection), one real c10d store per run, and the real :class:`~maitre.runtime.loop.ElasticLoop`
in every worker thread, over gloo. What a process boundary adds is left out: HTTP, agents,
processes. Each in-process node plays its agent: it beats for its workers (their rhythm measured
as an agent measures it, :class:`~maitre.agent.agent.WorkerBeats`), carries out its orders (start:
a thread runs the job's function; kill: the worker's thread is stopped at its next call to the
link) and hands each worker its view. A worker reaches all of it through an
:class:`InProcessLink`, the in-process side of :class:`~maitre.runtime.link.CoordinatorLink`::

    def train(env: WorkerEnv, link: CoordinatorLink) -> None:
        loop = maitre.ElasticLoop(model, optimizer, sampler, env=env, link=link)
        for batch in loop.run(max_steps=100):
            ...

    with InProcessCluster(tmp_path, nodes=2) as cluster:
        cluster.submit("j", train, min_replicas=1, max_replicas=3)
        cluster.wait_for("j", lambda job: job["state"] == "COMPLETED", timeout_s=60)

Faults, as the tests make them: a worker's function raises (a crash: its exit is reported with
its error, as an agent reports a process's), or calls :meth:`InProcessCluster.hang` (its beats
stop and its thread blocks, as a stopped process's, until the coordinator orders it killed).
Nodes join with :meth:`~InProcessCluster.add_node`; a job is resized with the coordinator's
:meth:`~maitre.control.coordinator.Coordinator.scale`. The recovery paths of the loop run this
way in seconds (``tests/test_inprocess.py``); what needs a process (SIGKILL, SIGSTOP, a network
cut) stays with real processes and namespaces.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from pydantic import TypeAdapter, ValidationError

from maitre import protocol as p
from maitre.agent.agent import WorkerBeats
from maitre.control.cluster import ClusterState
from maitre.control.coordinator import Coordinator
from maitre.control.detectors import DetectorConfig
from maitre.control.storedoor import Stores
from maitre.errors import ApiError, CoordinatorUnreachable, RequestError
from maitre.runtime.env import WorkerEnv
from maitre.runtime.link import CoordinatorLink
from maitre.scheduling.model import Queue
from maitre.scheduling.policy import PolicyConfig

QUEUE = "in-process"
POLICY = PolicyConfig(resize_cooldown_s=0.0, min_gain=-math.inf, rebalance_gain=0.0)
"""As ``maitre run``'s: a job grows into a slot as soon as one is free."""

Train = Callable[[WorkerEnv, CoordinatorLink], None]
"""A job's function: one worker's whole life (build the model, run the loop)."""


class Killed(BaseException):
    """Raised in a worker's thread at its next call to its link once the coordinator ordered
    it killed (a thread cannot be killed from outside; a hung one is released to raise it)."""


@dataclass(eq=False)
class _Worker:
    id: str
    node: "_Node"
    beats: WorkerBeats = field(default_factory=WorkerBeats)
    heard: bool = False
    killed: threading.Event = field(default_factory=threading.Event)
    hung: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


@dataclass(eq=False)
class _Node:
    name: str
    slots: int
    version: int = -1
    boot: str = ""
    heard_at: float | None = None
    workers: dict[str, _Worker] = field(default_factory=dict)
    views: dict[str, p.WorkerView] = field(default_factory=dict)
    down: bool = False


class InProcessLink:
    """One worker's :class:`~maitre.runtime.link.CoordinatorLink` to an :class:`InProcessCluster`."""

    def __init__(self, cluster: "InProcessCluster", worker: _Worker) -> None:
        self._cluster = cluster
        self._worker = worker

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        self._cluster._alive(self._worker)
        try:
            return method(*args)
        except RequestError as exc:  # what the API would have answered
            raise ApiError(exc.status, exc.message) from None

    def rendezvous(self, request: p.RendezvousRequest, timeout_s: float) -> p.Assignment:
        co = self._cluster.co
        answer = self._call(co.rendezvous, self._worker.id, request)
        self._cluster._alive(self._worker)  # (killed while it waited)
        return p.Assignment.model_validate(answer)

    def left(self) -> None:
        self._call(self._cluster.co.worker_left, self._worker.id)

    def done(self, step: int, suspended: bool = False) -> None:
        self._call(self._cluster.co.worker_done, self._worker.id, p.DoneRequest(step=step, suspended=suspended))

    def report(self, report: dict[str, Any], timeout_s: float) -> None:
        try:  # checked as the API checks it (a malformed one is a 400)
            checked = _REPORT.validate_python(report).model_dump()
        except ValidationError as exc:
            raise ApiError(400, f"malformed report: {exc}") from None
        self._call(self._cluster.co.worker_report, self._worker.id, checked)

    def beat(self, beat: p.LocalBeat, timeout_s: float) -> p.AgentView:
        w = self._worker
        while w.hung.is_set() and not w.killed.is_set():  # a stopped process beats no more
            time.sleep(0.05)
        if w.killed.is_set():  # (its heartbeat thread: as a dead agent socket looks)
            raise CoordinatorUnreachable(f"{w.id} was killed")
        now = time.monotonic()
        with self._cluster._lock:
            w.beats.beat(now, beat.step, beat.stalled, beat.trained_s)
            w.heard = True
            view = w.node.views.get(w.id)
            heard = w.node.heard_at
        heard_s = None if heard is None else round(max(0.0, now - heard), 4)
        return p.AgentView(**(view.model_dump() if view is not None else {}), heard_s=heard_s)

    def store(self, answer: p.Assignment) -> dist.Store:
        run = self._cluster.stores.lookup(answer.store_key or "")
        if run is None:
            raise ApiError(404, f"no store for run {answer.store_key!r}")
        return dist.TCPStore("127.0.0.1", run.port, is_master=False, timeout=timedelta(seconds=60))

    def close(self) -> None:
        pass


_REPORT: TypeAdapter[Any] = TypeAdapter(p.WorkerReport)


class InProcessCluster:
    """A coordinator with ``nodes`` nodes of ``slots`` slots each, in this process (see the module
    docstring). A context manager: leaving it stops the nodes and waits for every worker thread."""

    def __init__(
        self,
        run_dir: Path,
        nodes: int = 2,
        *,
        slots: int = 1,
        detector: DetectorConfig | None = None,
        max_restarts: int = 10,
        tick_s: float = 0.02,
        heartbeat_s: float = 0.05,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.stores = Stores()
        self.detector = detector or DetectorConfig()
        cluster = ClusterState(
            [Queue(QUEUE)], run_dir=self.run_dir, policy=POLICY, detector=self.detector, max_restarts=max_restarts
        )
        self.co = Coordinator("127.0.0.1:0", self.detector, cluster=cluster, stores=self.stores, pass_s=0.1)
        self.tick_s = tick_s
        self.heartbeat_s = heartbeat_s
        self.nodes: dict[str, _Node] = {}
        self.functions: dict[str, Train] = {}
        self.errors: dict[str, str | None] = {}
        """Each worker that ended, and its error (None: it returned)."""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maitre-inprocess", daemon=True)
        for _ in range(nodes):
            self.add_node(slots)

    # -- the cluster -----------------------------------------------------------------------------
    def __enter__(self) -> "InProcessCluster":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop beating, release every worker (killed at its next call) and wait for them."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            workers = [w for n in self.nodes.values() for w in n.workers.values()]
        for w in workers:
            w.killed.set()
        deadline = time.monotonic() + timeout_s
        for w in workers:
            if w.thread is not None:
                w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        left = [w.id for w in workers if w.thread is not None and w.thread.is_alive()]
        if left:
            raise RuntimeError(f"worker threads still running after {timeout_s:.0f}s: {', '.join(left)}")

    def add_node(self, slots: int = 1) -> str:
        with self._lock:
            name = f"node{len(self.nodes)}"
            self.nodes[name] = _Node(name, slots)
        return name

    def submit(self, name: str, train: Train, *, min_replicas: int, max_replicas: int, **manifest: Any) -> None:
        """Submit a job whose workers run ``train`` (its manifest's other fields as keywords,
        e.g. ``checkpointDir``); ``env`` (a keyword) is its workers' environment."""
        env = manifest.pop("env", None)
        with self._lock:
            self.functions[name] = train
        body = {
            "name": name,
            "queue": QUEUE,
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "command": ["in-process"],
            **manifest,
        }
        self.co.submit(body, env=env)

    def job(self, name: str) -> dict[str, Any]:
        return self.co.job_status(name)

    def wait_for(self, name: str, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """Wait until ``predicate(job status)`` holds; raises TimeoutError with the job's state."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(name)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {name}: still {job['state']} at step {job['step']} after {timeout_s:.0f}s")
            time.sleep(0.02)

    # -- faults ----------------------------------------------------------------------------------
    def hang(self, worker_id: str) -> None:
        """Called from a worker's own thread: it hangs as a stopped process does (its beats stop,
        its thread blocks) until the coordinator has it killed; then :class:`Killed` is raised."""
        w = self._worker(worker_id)
        w.hung.set()
        w.killed.wait()
        raise Killed(worker_id)

    def _worker(self, worker_id: str) -> _Worker:
        with self._lock:
            for node in self.nodes.values():
                if worker_id in node.workers:
                    return node.workers[worker_id]
        raise KeyError(worker_id)

    def _alive(self, w: _Worker) -> None:
        if w.killed.is_set():
            raise Killed(w.id)

    # -- the nodes' agents -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                nodes = [n for n in self.nodes.values() if not n.down]
            for node in nodes:
                self._beat(node)
            self.co.tick()

    def _beat(self, node: _Node) -> None:
        now = time.monotonic()
        with self._lock:
            reports = [
                w.beats.report(w.id, now) if w.heard else p.WorkerBeat(id=w.id)
                for w in node.workers.values()
                if w.thread is None or w.thread.is_alive()
            ]
        beat = p.NodeBeat(slots=node.slots, since=node.version, workers=reports, interval_s=self.tick_s)
        orders = self.co.node_heartbeat(node.name, beat)
        with self._lock:
            node.heard_at = now
            if orders.boot and orders.boot != node.boot:
                node.boot, node.version = orders.boot, -1
            if orders.views is not None and orders.version >= node.version:
                for wid in set(node.views) - set(orders.views):
                    node.views[wid] = node.views[wid].model_copy(update={"stop": True})
                node.views.update(orders.views)
            node.version = max(node.version, orders.version)
            for wid in orders.kill:
                if wid in node.workers:
                    node.workers[wid].killed.set()
        for order in orders.start:
            self._start(node, order)

    def _start(self, node: _Node, order: p.StartOrder) -> None:
        env = WorkerEnv.from_environ(
            {
                **order.env,
                p.COORDINATOR: "in-process",
                p.WORKER_ID: order.worker_id,
                p.JOB_ID: order.job_id,
                p.STORE: order.store,
                p.STORE_KEY: order.store_key,
                p.AGENT: "in-process",
                p.TOKEN: order.token,
                p.HEARTBEAT_S: str(self.heartbeat_s),
                "LOCAL_RANK": str(order.local_rank),
            }
        )
        w = _Worker(order.worker_id, node)
        train = self.functions[order.job_id]
        w.thread = threading.Thread(target=self._live, args=(w, train, env), name=f"worker-{w.id}", daemon=True)
        with self._lock:
            node.workers[w.id] = w
            node.views.setdefault(w.id, p.WorkerView())
        w.thread.start()

    def _live(self, w: _Worker, train: Train, env: WorkerEnv) -> None:
        error: str | None = None
        code = 0
        try:
            train(env, InProcessLink(self, w))
        except Killed:
            error, code = "killed", -9
        except BaseException as exc:  # noqa: BLE001 -- a crash: reported as an agent reports one
            error, code = f"{type(exc).__name__}: {exc}"[:4000], 1
        with self._lock:
            self.errors[w.id] = error
        if not self._stop.is_set():
            self.co.worker_exit(w.id, p.ExitRequest(code=code, error=error))
