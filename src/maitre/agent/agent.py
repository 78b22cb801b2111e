"""The agent: one per node. It starts, watches and signals the node's worker processes.

Every ``heartbeat_s`` the agent tells the coordinator how many slots the node has and which of
its workers are running; the reply lists workers to start (command, environment, slot) and
workers to kill (hung ones the coordinator removed, or leftovers of a finished job). A thread per
worker waits on the process and reports its exit at once, with the last line of its stderr (for
a Python exception, ``Type: message``), which is what lets the coordinator tell a crash from a
bug that every rank hits.

Python workers of this interpreter are forked from a fork server that has torch imported
already (:mod:`maitre.agent.warmstart`), so a joiner holds its slot idle for milliseconds, not
the seconds of its imports. Workers get torchrun's variables (``LOCAL_RANK``, ``OMP_NUM_THREADS=1``) plus ``MAITRE_*``; they
run in their own session so a signal meant for one never reaches the agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, TextIO

from maitre.agent import warmstart
from maitre.runtime import env as envvars
from maitre.wire import ApiError, Client, CoordinatorUnreachable

Output = Callable[[str, str], None]


def print_output(worker_id: str, line: str) -> None:
    sys.stdout.write(f"[{worker_id}] {line}")
    sys.stdout.flush()


class _Worker:
    def __init__(self, worker_id: str, proc: Any) -> None:
        self.worker_id = worker_id
        self.proc = proc
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.threads: list[threading.Thread] = []


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
    """

    def __init__(self, coordinator: str, node_id: str, slots: int, *, heartbeat_s: float = 0.25,
                 extra_env: dict[str, str] | None = None, output: Output = print_output,
                 token: str | None = None, labels: dict[str, str] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.client = Client(coordinator, timeout_s=5.0, token=token)
        self.token = token
        self.coordinator = coordinator
        self.node_id = node_id
        self.slots = slots
        self.labels = dict(labels or {})
        self.heartbeat_s = heartbeat_s
        self.extra_env = dict(extra_env or {})
        self.output = output
        self.workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> "Agent":
        warmstart.prewarm()
        self._thread = threading.Thread(target=self.serve, name=f"agent-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        """Heartbeat until stopped (blocking). Raises CoordinatorUnreachable if the coordinator
        cannot be reached at all at start-up."""
        self._beat()
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
            except CoordinatorUnreachable:
                pass  # the coordinator may be restarting; keep our workers running

    def stop(self, grace_s: float = 3.0, drain_s: float = 0.0) -> None:
        """Stop heartbeating and end the workers: first wait up to ``drain_s`` for them to exit
        on their own (a finished job's workers run the script's code after the loop, such as
        saving the model), then SIGTERM, then SIGKILL after ``grace_s``."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            workers = list(self.workers.values())
        drained = time.monotonic() + drain_s
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, drained - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in workers:
            if w.proc.poll() is None:
                _signal(w.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(w.proc, signal.SIGKILL)
                w.proc.wait()
            for t in w.threads:
                t.join(timeout=2)

    def running(self) -> list[str]:
        with self._lock:
            return [wid for wid, w in self.workers.items() if w.proc.poll() is None]

    def pid(self, worker_id: str) -> int:
        return self.workers[worker_id].proc.pid

    # -- coordinator -----------------------------------------------------------------------------
    def _beat(self) -> None:
        try:
            reply = self.client.post(f"/nodes/{self.node_id}/heartbeat",
                                     {"slots": self.slots, "labels": self.labels,
                                      "running": self.running()})
        except ApiError as exc:
            raise RuntimeError(f"coordinator refused node {self.node_id}: {exc.message}") from None
        for order in reply.get("start", []):  # off this thread: a start must not delay a beat
            threading.Thread(target=self._spawn, args=(order,), name="maitre-spawn",
                             daemon=True).start()
        for wid in reply.get("kill", []):
            w = self.workers.get(wid)
            if w is not None and w.proc.poll() is None:
                _signal(w.proc, signal.SIGKILL)

    def _spawn(self, order: dict) -> None:
        wid = order["worker_id"]
        env = {**os.environ, **self.extra_env, **order.get("env", {})}
        for key in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # known only per membership epoch
        if self.token:
            env[envvars.TOKEN] = self.token
        env.update({
            envvars.COORDINATOR: self.coordinator, envvars.WORKER_ID: wid,
            envvars.JOB_ID: order["job_id"], envvars.STORE: order["store"],
            "LOCAL_RANK": str(order["local_rank"]), "LOCAL_WORLD_SIZE": str(self.slots),
            "TORCHELASTIC_RUN_ID": order["job_id"], "PYTHONUNBUFFERED": "1",
            # The slots (GPUs) it holds on this node: LOCAL_RANK and the ones after it.
            envvars.SLOTS: ",".join(str(order["local_rank"] + i)
                                    for i in range(order.get("slots", 1))),
        })
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            if warmstart.enabled(env) and warmstart.warm_target(order["command"]):
                proc: Any = warmstart.WarmProcess(order["command"], env)
            else:
                proc = subprocess.Popen(order["command"], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as exc:  # no such program, not executable: the job's error, not ours
            self.output(wid, f"maitre: cannot start {order['command'][0]!r}: {exc}\n")
            threading.Thread(target=self._report_exit, args=(wid, 127, f"cannot start: {exc}"),
                             daemon=True).start()
            return
        worker = _Worker(wid, proc)
        worker.threads = [
            threading.Thread(target=self._pump, args=(worker, proc.stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(worker, proc.stderr, True), daemon=True),
            threading.Thread(target=self._wait, args=(worker,), daemon=True),
        ]
        with self._lock:
            self.workers[wid] = worker
        for t in worker.threads:
            t.start()

    def _pump(self, worker: _Worker, stream: TextIO | None, is_err: bool) -> None:
        assert stream is not None
        for line in stream:
            if is_err and line.strip():
                worker.stderr_tail.append(line.rstrip())
            self.output(worker.worker_id, line)

    def _wait(self, worker: _Worker) -> None:
        code = worker.proc.wait()
        for t in worker.threads[:2]:
            t.join(timeout=2)  # let the last stderr lines in
        # A failing exit's last stderr line is its error (``Type: message`` for Python); a
        # signal's death says nothing about the script, whatever it printed before.
        error = worker.stderr_tail[-1] if code > 0 and worker.stderr_tail else None
        self._report_exit(worker.worker_id, code, error)

    def _report_exit(self, worker_id: str, code: int, error: str | None) -> None:
        """Tell the coordinator, retrying while it is away (it may be restarting)."""
        for _ in range(1200):
            try:
                self.client.post(f"/workers/{worker_id}/exit", {"code": code, "error": error})
                return
            except CoordinatorUnreachable:
                if self._stop.wait(0.5):
                    return
            except ApiError:
                return


def _signal(proc: Any, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
