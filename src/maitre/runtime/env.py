"""How a worker process finds out where it runs: maitre's variables, else torchrun's.

Under ``maitre`` the agent sets ``MAITRE_COORDINATOR``, ``MAITRE_WORKER_ID``, ``MAITRE_STORE``,
``MAITRE_AGENT`` and ``LOCAL_RANK``; rank and world size are not known at start and come from each
membership epoch: a script reads them from the loop (``loop.rank``, ``loop.world_size``), never
from the environment, which the library leaves as the process found it. Under plain
``torchrun`` the usual ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` make a fixed
group. With neither, the script runs as a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from maitre.protocol import (
    AGENT,
    COORDINATOR,
    COORDINATOR_TIMEOUT_S,
    HEARTBEAT_S,
    JOB_ID,
    JOIN,
    JOIN_MODES,
    LEDGER_DIR,
    MESH,
    NPROC,
    PROC,
    RUN_ID,
    STORE,
    STORE_KEY,
    TLS_CA,
    TOKEN,
    WORKER_ID,
)


class Mode(str, Enum):
    ELASTIC = "elastic"  # under maitre: membership epochs from the coordinator
    STATIC = "static"  # under torchrun: one fixed group
    SINGLE = "single"  # plain `python script.py`


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    mode: Mode
    worker_id: str
    local_rank: int
    coordinator: str = ""
    store: str = ""
    agent: str = ""
    """The agent's unix socket (heartbeats go there)."""
    job_id: str = ""
    ledger_dir: str = ""
    run_id: str = ""
    token: str = ""
    """Its run's token (the API's worker routes, the store's door)."""
    tls_ca: str = ""
    """Set: the coordinator speaks HTTPS, signed by these certificates."""
    heartbeat_s: float = 0.1
    coordinator_timeout_s: float = 300.0
    store_key: str = ""
    """Its run's name at the store's door."""
    nproc: int = 1
    proc: int = 0
    """Processes of its replica, and its index among them (a replica that spans several)."""
    mesh: str = ""
    join: str = "stream"
    """How a member behind gets the state (``MAITRE_JOIN``: ``stream`` or ``pause``)."""
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        env = os.environ if env is None else env
        local_rank = int(env.get("LOCAL_RANK", "0"))
        common = {"local_rank": local_rank, "ledger_dir": env.get(LEDGER_DIR, ""), "run_id": env.get(RUN_ID, "")}
        if env.get(COORDINATOR):
            missing = [k for k in (WORKER_ID, STORE, AGENT) if not env.get(k)]
            if missing:
                raise RuntimeError(
                    f"{COORDINATOR} is set but {', '.join(missing)} is not: workers must be started by a maitre agent"
                )
            return cls(
                mode=Mode.ELASTIC,
                worker_id=env[WORKER_ID],
                coordinator=env[COORDINATOR],
                store=env[STORE],
                agent=env[AGENT],
                job_id=env.get(JOB_ID, ""),
                token=env.get(TOKEN, ""),
                tls_ca=env.get(TLS_CA, ""),
                store_key=env.get(STORE_KEY, ""),
                nproc=int(env.get(NPROC, "1")),
                proc=int(env.get(PROC, "0")),
                mesh=env.get(MESH, ""),
                join=_join_mode(env),
                heartbeat_s=float(env.get(HEARTBEAT_S, "0.1")),
                coordinator_timeout_s=float(env.get(COORDINATOR_TIMEOUT_S, "300")),
                **common,
            )
        if "WORLD_SIZE" in env and "RANK" in env:
            rank = int(env["RANK"])
            return cls(
                mode=Mode.STATIC, worker_id=f"rank{rank}", rank=rank, world_size=int(env["WORLD_SIZE"]), **common
            )
        return cls(mode=Mode.SINGLE, worker_id="single", **common)


def _join_mode(env: Mapping[str, str]) -> str:
    mode = env.get(JOIN, "stream") or "stream"
    if mode not in JOIN_MODES:
        raise RuntimeError(f"{JOIN}={mode!r}: expected one of {', '.join(JOIN_MODES)}")
    return mode
