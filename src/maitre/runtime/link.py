"""The worker's link to the world outside its process: its coordinator, its node's agent, and
the run's c10d store. Everything :class:`~maitre.runtime.loop.ElasticLoop` asks of them, and
nothing else.

=================  ==============================================================================
``rendezvous``     leave the current epoch, get the next one's place (or: wait, leave, stop)
``left``           this worker left the job when told to (the first process of a replica speaks)
``done``           it committed the job's last step (or its suspension's)
``report``         a progress, checkpoint, restore, recovery or straggler report (a background
                   thread sends them: :class:`~maitre.runtime.telemetry.Reporter`)
``beat``           the heartbeat thread's beat to its agent, answered with the coordinator's view
``store``          the run's c10d store, on which each epoch's group is built
=================  ==============================================================================

Errors are :mod:`maitre.errors`': :class:`CoordinatorUnreachable` (the caller retries or keeps
its last view) and :class:`ApiError` (an answer that says no).

:class:`HttpLink` is what a worker started by ``maitre run``, an agent or a Slurm step uses: the
coordinator over HTTP(S) with the run's token, the agent on its unix socket, the store through its
door (:class:`~maitre.runtime.storelink.StoreLink`). :class:`maitre.control.inprocess.InProcessLink`
is the same contract against a coordinator object in the same process: the recovery tests run
the real loop with ranks as threads against it, in seconds.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from maitre import protocol
from maitre.runtime.env import WorkerEnv
from maitre.runtime.storelink import StoreLink, StoreLinkError
from maitre.wire import Client, UnixClient, parse_address


class CoordinatorLink(Protocol):
    """What the loop needs from outside its process (see the module docstring)."""

    def rendezvous(self, request: protocol.RendezvousRequest, timeout_s: float) -> protocol.Assignment: ...

    def left(self) -> None: ...

    def done(self, step: int, suspended: bool = False) -> None: ...

    def report(self, report: dict[str, Any], timeout_s: float) -> None: ...

    def beat(self, beat: protocol.LocalBeat, timeout_s: float) -> protocol.AgentView: ...

    def store(self, answer: protocol.Assignment) -> dist.Store:
        """The run's store for a train answer: connected again when ``answer.store_id`` differs
        from the last one's (a coordinator that restarted). Raises :class:`StoreLinkError`."""
        ...

    def close(self) -> None: ...


class HttpLink:
    """The coordinator at ``env.coordinator``, the agent at ``env.agent`` (see the module
    docstring). Reading an answer (pydantic) raises ``ValidationError`` when it is another
    version's."""

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self._client = Client(env.coordinator, token=env.token or None, tls_ca=env.tls_ca or None)
        self._agent = UnixClient(env.agent)
        self._store_link: StoreLink | None = None

    def _worker(self, route: str) -> str:
        return route.format(worker=self.env.worker_id)

    def rendezvous(self, request: protocol.RendezvousRequest, timeout_s: float) -> protocol.Assignment:
        answer = self._client.post(self._worker(protocol.WORKER_RENDEZVOUS), request.model_dump(), timeout_s=timeout_s)
        return protocol.Assignment.model_validate(answer)

    def left(self) -> None:
        self._client.post(self._worker(protocol.WORKER_LEFT))

    def done(self, step: int, suspended: bool = False) -> None:
        body = protocol.DoneRequest(step=step, suspended=suspended)
        self._client.post(self._worker(protocol.WORKER_DONE), body.model_dump(exclude_defaults=True))

    def report(self, report: dict[str, Any], timeout_s: float) -> None:
        self._client.post(self._worker(protocol.WORKER_REPORT), report, timeout_s=timeout_s)

    def beat(self, beat: protocol.LocalBeat, timeout_s: float) -> protocol.AgentView:
        answer = self._agent.post(self._worker(protocol.WORKER_HEARTBEAT), beat.model_dump(), timeout_s=timeout_s)
        return protocol.AgentView.model_validate(answer)

    def store(self, answer: protocol.Assignment) -> dist.Store:
        """``TCPStore`` connects to the door's link on loopback; the link proves the run's token
        at the door. A door that refuses ends the wait at once, one that is not there yet (a
        coordinator restarting) is tried for 60 s, as long as ``TCPStore``'s own connect."""
        host, port = parse_address(answer.store or self.env.store)
        if host.strip("[]") in ("0.0.0.0", "::"):  # bound everywhere: where we reach it
            host = parse_address(self.env.coordinator)[0]
        if self._store_link is not None:
            self._store_link.close()
        self._store_link = StoreLink((host.strip("[]"), port), answer.store_key or "", self.env.token)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._store_link.check()
                break
            except StoreLinkError as exc:
                if exc.refused or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # the coordinator restarting: its door opens again
        return dist.TCPStore("127.0.0.1", self._store_link.port, is_master=False, timeout=timedelta(seconds=60))

    def close(self) -> None:
        if self._store_link is not None:
            self._store_link.close()
            self._store_link = None
        self._client.close()
        self._agent.close()
