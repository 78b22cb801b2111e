"""What an unmodified script (``elastic: restart``) finds in its environment: torchrun's.

``torchrun --nnodes MIN:MAX --nproc-per-node N`` gives each process ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_USE_AGENT_STORE``; so
does maitre's agent, for a replica of ``nproc`` processes at ``group_rank`` in a gang of
``group_world_size`` replicas (:class:`maitre.protocol.RestartOrder`): a replica is what torchrun
calls a node. So ``LOCAL_RANK`` counts the replica's processes from 0 and ``LOCAL_WORLD_SIZE`` is
``nproc``, as a script (or Lightning's ``devices * num_nodes == WORLD_SIZE`` check) expects; and
since a maitre node may run several replicas, ``CUDA_VISIBLE_DEVICES`` is narrowed to the
replica's slots (through the node's own ``CUDA_VISIBLE_DEVICES``, if it sets one), so that
``cuda:LOCAL_RANK`` is the process's own GPU.

The store: torchrun's agent keeps a ``TCPStore`` that the workers join as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``: torch's ``env://`` and ``tcp://`` rendezvous then connect
to ``MASTER_ADDR:MASTER_PORT`` as clients; torch 2.13 prefixes no key by the attempt, so each
restart needs a new store). maitre's is a store per gang on the coordinator, behind its door
(:mod:`maitre.control.storedoor`); the script's ``MASTER_ADDR:MASTER_PORT`` is a loopback port of
its agent that leads there (:class:`GangLink`), for that worker's processes only. Gradients never
pass through it: gloo and NCCL connect the ranks directly.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from maitre import protocol
from maitre.runtime.storelink import StoreLink, descendants


class GangLink:
    """A worker's way to its gang's store (see the module docstring), and whether it came."""

    def __init__(self, door: str, run_key: str, token: str, on_join: Callable[[], None] = lambda: None) -> None:
        """``on_join``: called when the first connection comes (the agent's news)."""
        host, _, port = door.rpartition(":")
        self.pids: set[int] = set()
        """The worker's own processes (their children may connect too)."""
        self.joined = threading.Event()
        """Set once one of them connected: the script called ``init_process_group``."""
        self.joined_at: float | None = None
        """When (``time.monotonic``)."""
        self._on_join = on_join
        self._link = StoreLink(
            (host.strip("[]"), int(port)),
            run_key,
            token,
            owners=lambda: descendants(self.pids),
            on_connect=self._connected,
        )
        self.port = self._link.port

    def _connected(self) -> None:
        if self.joined_at is None:
            self.joined_at = time.monotonic()
            self.joined.set()
            self._on_join()

    def close(self) -> None:
        self._link.close()


def environ(
    order: protocol.StartOrder, restart: protocol.RestartOrder, index: int, port: int, visible: str | None = None
) -> dict[str, str]:
    """The torchrun variables of process ``index`` of the replica ``order`` starts; ``visible``:
    the node's ``CUDA_VISIBLE_DEVICES``, if it sets one (see the module docstring)."""
    nproc = order.nproc
    world = restart.group_world_size * nproc
    rank = restart.group_rank * nproc + index
    devices = visible.split(",") if visible else [str(k) for k in range(order.local_rank + order.slots)]
    mine = devices[order.local_rank : order.local_rank + order.slots]
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(index),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "CUDA_VISIBLE_DEVICES": ",".join(mine),
        "GROUP_RANK": str(restart.group_rank),
        "GROUP_WORLD_SIZE": str(restart.group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restart.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(restart.max_restarts),
        "TORCHELASTIC_RUN_ID": order.job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


MAITRE_ONLY = (
    protocol.COORDINATOR,
    protocol.WORKER_ID,
    protocol.STORE,
    protocol.STORE_KEY,
    protocol.AGENT,
    protocol.TOKEN,
    protocol.NPROC,
    protocol.MESH,
    protocol.PROC,
    protocol.SLOTS,
)
"""What maitre's loop reads and an unmodified script must not see: with them, a script that
happens to use maitre's loop would take it for an in-place worker; without them it runs as
under torchrun (and the run's token stays with the agent)."""


def scrub(env: dict[str, str]) -> dict[str, str]:
    """``env`` without :data:`MAITRE_ONLY`."""
    return {k: v for k, v in env.items() if k not in MAITRE_ONLY}


def terminate(signal_all: Callable[[int], None], alive: Callable[[], bool], grace_s: float) -> None:
    """SIGTERM, then SIGKILL once ``grace_s`` passed with a process still alive (a thread's
    work: it waits)."""
    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        signal_all(signal.SIGKILL)
