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
from maitre.agent.health import HealthConfig, HealthMonitor
from maitre.agent.notices import NoticeWatcher, source
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
    store_port: int = 0
    """The runs' c10d store (0: the stored one, else any free port)."""
    token: str | None = None
    """The API token (a Kubernetes Secret's); None: ``<state-dir>/token``'s, else a new one."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    max_restarts: int = 3
    quiet_workers: bool = True
    tls_cert: str | None = None
    """With ``tls_key``: the API is served over HTTPS (``tls_ca`` checks it, for local nodes)."""
    tls_key: str | None = None
    tls_ca: str | None = None
    prices: dict[str, float] | None = None
    """Per slot-hour by capacity type (None: :data:`~maitre.control.cluster.DEFAULT_PRICES`)."""
    spot_nodes: int = 0
    """The last ``spot_nodes`` local nodes are spot (``capacity_type=spot``); each watches
    ``<state-dir>/notices/<node>.json`` for a notice (:meth:`LocalCluster.notice_file`)."""
    notice_interval_s: float = 0.5
    """How often a local spot node looks at its notice file."""


class LocalCluster:
    """A coordinator with a cluster and a store, plus ``cfg.nodes`` in-process agents."""

    def __init__(
        self,
        cfg: UpConfig,
        out: Callable[[str], None] = print,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.out = out
        self.t0 = time.time()
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.db = Store(cfg.state_dir / "state.db")  # may raise StoreError
        self.token_file = cfg.state_dir / "token"
        token = self.token_file.read_text().strip() if self.token_file.exists() else ""
        self.token = cfg.token or token or secrets.token_urlsafe(32)
        ports = self.db.meta("ports") or {}
        port = cfg.port or ports.get("http", 0)
        cluster = ClusterState(
            cfg.queues or [Queue("default")],
            run_dir=cfg.state_dir,
            policy=cfg.policy,
            phi=PhiConfig(),
            detector=DetectorConfig(),
            max_restarts=cfg.max_restarts,
            prices=cfg.prices,
        )
        store_port = cfg.store_port or ports.get("store", 0)
        self.server = CoordinatorServer(
            cluster,
            cfg.host,
            port,
            store_port,
            on_event=on_event or self._print_event,
            token=self.token,
            db=self.db,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
        )
        for q in cfg.queues:
            self.db.put_queue(q)
            cluster.queues[q.name] = q
        self.db.put_meta("ports", {"http": self.server.port, "store": self.server.door.port})
        write_token(self.token_file, self.token)
        self.agents: list[Agent] = []
        self._added = 0
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
        for index in range(self.cfg.nodes):
            spot = index >= self.cfg.nodes - self.cfg.spot_nodes
            self.add_node(spot=spot)
        return self

    def add_node(
        self,
        slots: int | None = None,
        labels: dict[str, str] | None = None,
        spot: bool = False,
        notice: str | None = None,
        health: HealthConfig | None = None,
        env: dict[str, str] | None = None,
    ) -> Agent:
        """A local node. ``spot``: labelled so, watching its :meth:`notice_file` (or the
        ``notice`` source given: ``file:PATH``, a URL) for a reclaim notice. ``health``: its
        probes (:mod:`maitre.agent.health`; default none). ``env``: its workers' environment
        beyond this process's (a node's own, such as :data:`maitre.protocol.SLOW_FACTOR`)."""
        with self._lock:
            index = self._added
            self._added += 1
            name = f"node-{index}"
            rack = f"rack-{index % max(1, self.cfg.racks)}"
            output = (
                (lambda wid, line: None)
                if self.cfg.quiet_workers
                else (lambda wid, line: self.out(f"[{wid}] {line.rstrip()}"))
            )
            labels = dict(labels or {"rack": rack})
            watcher = None
            if spot:
                labels["capacity_type"] = "spot"
                if notice is None:
                    path = self.notice_file(name)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.unlink(missing_ok=True)  # an earlier run's notice
                    notice = f"file:{path}"
                watcher = NoticeWatcher(source(notice), interval_s=self.cfg.notice_interval_s)
            agent = Agent(
                self.address,
                name,
                slots or self.cfg.slots_per_node,
                output=output,
                token=self.token,
                labels=labels,
                heartbeat_s=LOCAL_HEARTBEAT_S,
                tls_ca=self.cfg.tls_ca,
                notices=watcher,
                extra_env=env,
                health=HealthMonitor(health) if health is not None else None,
            )
            self.agents.append(agent)
        return agent.start()

    def remove_node(self, node: str) -> None:
        """Stop a local node's agent and its workers (the machine goes away)."""
        with self._lock:
            agents = [a for a in self.agents if a.node_id == node]
            self.agents = [a for a in self.agents if a.node_id != node]
        for agent in agents:
            agent.stop()

    def notice_file(self, node: str) -> Path:
        """Where local spot node ``node`` looks for its notice (``{"notice_s": 30}``)."""
        return self.cfg.state_dir / "notices" / f"{node}.json"

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
