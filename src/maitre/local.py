"""``maitre up``: a scheduled cluster on this machine. The coordinator, its state and local agents.

The coordinator keeps its state in ``<state-dir>/state.db`` (SQLite, WAL) and its token in
``<state-dir>/token`` (mode 0600). Started again on the same state directory it takes the same
ports and token, reloads nodes, queues and jobs, and running jobs re-attach: their workers kept
training while it was away (only a membership change waits for it). Local agents (``--nodes``)
are threads of this process; ``--nodes 0`` runs the coordinator alone, for agents started with
``maitre agent`` elsewhere (or in other processes, so that they outlive a coordinator crash).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from maitre.agent.agent import LOCAL_HEARTBEAT_S, Agent
from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.control.detectors import DetectorConfig, PhiConfig
from maitre.control.store import Store
from maitre.launch import describe, quiet, write_token
from maitre.scheduling.model import Queue
from maitre.scheduling.policy import PolicyConfig


@dataclass(kw_only=True, slots=True)
class UpConfig:
    state_dir: Path
    queues: list[Queue] = field(default_factory=list)
    """Queues to create or update; a restart keeps the stored ones it is not given."""
    nodes: int = 0
    slots_per_node: int = 1
    racks: int = 1
    """Local nodes are spread over this many racks (labels ``rack-0``...)."""
    host: str = "127.0.0.1"
    port: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    max_restarts: int = 3
    quiet_workers: bool = True
    tls_cert: str | None = None
    """With ``tls_key``: the API is served over HTTPS (``tls_ca`` checks it, for local nodes)."""
    tls_key: str | None = None
    tls_ca: str | None = None


class LocalCluster:
    """A coordinator with a cluster and a store, plus ``cfg.nodes`` in-process agents."""

    def __init__(self, cfg: UpConfig, out: Callable[[str], None] = print,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.out = out
        self.t0 = time.time()
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.db = Store(cfg.state_dir / "state.db")  # may raise StoreError
        self.token_file = cfg.state_dir / "token"
        token = self.token_file.read_text().strip() if self.token_file.exists() else ""
        self.token = token or secrets.token_urlsafe(32)
        ports = self.db.meta("ports") or {}
        port = cfg.port or ports.get("http", 0)
        cluster = ClusterState(cfg.queues or [Queue("default")], run_dir=cfg.state_dir,
                               policy=cfg.policy, phi=PhiConfig(), detector=DetectorConfig(),
                               max_restarts=cfg.max_restarts)
        self.server = CoordinatorServer(cluster, cfg.host, port, ports.get("store", 0),
                                        on_event=on_event or self._print_event,
                                        token=self.token, db=self.db,
                                        tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        for q in cfg.queues:
            self.db.put_queue(q)
            cluster.queues[q.name] = q
        self.db.put_meta("ports", {"http": self.server.port,
                                   "store": self.server.door.port})
        write_token(self.token_file, self.token)
        self.agents: list[Agent] = []
        self._lock = threading.Lock()

    @property
    def coordinator(self):
        return self.server.coordinator

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def dashboard_url(self) -> str:
        """The dashboard's page, with the token that signs the browser in (it then keeps it in
        a cookie, and the address bar loses it)."""
        scheme = "https" if self.cfg.tls_cert else "http"
        return f"{scheme}://{self.address}/dashboard/?token={self.token}"

    def start(self) -> "LocalCluster":
        self.server.start()
        for _ in range(self.cfg.nodes):
            self.add_node()
        return self

    def add_node(self, slots: int | None = None, labels: dict[str, str] | None = None) -> Agent:
        with self._lock:
            index = len(self.agents)
            rack = f"rack-{index % max(1, self.cfg.racks)}"
            output = (lambda wid, line: None) if self.cfg.quiet_workers else \
                (lambda wid, line: self.out(f"[{wid}] {line.rstrip()}"))
            agent = Agent(self.address, f"node-{index}", slots or self.cfg.slots_per_node,
                          output=output, token=self.token, labels=labels or {"rack": rack},
                          heartbeat_s=LOCAL_HEARTBEAT_S, tls_ca=self.cfg.tls_ca)
            self.agents.append(agent)
        return agent.start()

    def pid_of(self, worker_id: str) -> int | None:
        for agent in self.agents:
            if worker_id in agent.workers:
                return agent.pid(worker_id)
        return None

    def stop(self, drain_s: float = 0.0) -> None:
        for agent in self.agents:
            agent.stop(drain_s=drain_s)
        self.server.stop()
        self.db.close()

    def _print_event(self, job_id: str, event: dict[str, Any]) -> None:
        if quiet(event):
            return
        prefix = f"{job_id}: " if job_id else ""
        self.out(f"maitre: {time.time() - self.t0:7.2f}s  {prefix}{describe(event)}")
