"""What each node's agent is told: workers to start, workers to kill, and its workers' views.

A node's orders are computed when its agent beats or its watch answers (:meth:`Orders.of`):

- **start**: replicas the scheduler placed on the node that it does not run yet, on free slots,
  and warm spares of the jobs that keep some, on slots no allocation holds (so the scheduler,
  which counts them free, never waits for them); a job that finds no free slot takes back its
  own spare there (promoted: it is the replica the job wants, and warm) or others' spares go.
  An order the agent did not act on is sent again (:data:`RESEND_AFTER_S`).
- **kill**: workers the coordinator gave up on, leftovers of ended runs, and any process no
  job of this coordinator knows, until their exits are in.
- **views**: each live worker's view, only when the node's version moved since the agent's.

The coordinator owns the state; this module reads it and records the orders it sends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from maitre import protocol as p
from maitre.control.membership import LIVE, Membership, Worker, WorkerState
from maitre.control.restarts import RestartRun
from maitre.scheduling.assign import free_slot

if TYPE_CHECKING:
    from maitre.control.coordinator import Coordinator

log = logging.getLogger("maitre.coordinator")

RESEND_AFTER_S = 3.0
"""A start order is sent again once a beat that came this long after it does not list the
worker (the agent starts a worker within milliseconds, and carries out an order once)."""


class Orders:
    """The node orders of a :class:`~maitre.control.coordinator.Coordinator` (called under its
    lock)."""

    def __init__(self, co: "Coordinator") -> None:
        self.co = co

    def of(self, node: str, since: int, now: float) -> p.NodeOrders:
        co = self.co
        entry = co.nodes[node]
        running = entry.running
        kill = sorted(co.nodes.take_kills(node))
        terminate: list[str] = []
        # Slots in use: processes the agent runs, and workers it was asked to start that it
        # does not list yet (it starts them off its heartbeat thread).
        used: set[int] = set()
        here = co.workers.on(node)
        for wid in list(here):
            ms = co.workers.run(wid)
            w = ms.workers[wid]
            listed = wid in running
            if listed or (w.state in LIVE and w.ended_at is None and w.exit_code is None):
                used.update(range(w.slot, w.slot + w.slots))
            elif w.state not in LIVE:
                co.workers.freed(node, wid)  # gone: its slots are free
            # Processes the coordinator gave up on, or leftovers of an ended run, until their
            # exit is in (the node's list is up to a beat old: asking again after the exit made
            # every order of a cancelled gang's nodes repeat its kills, once per exit).
            if (
                listed
                and wid not in kill
                and w.exit_code is None
                and (w.state == WorkerState.DEAD or (ms.over and w.state not in (WorkerState.DONE, WorkerState.LEFT)))
            ):
                (terminate if isinstance(ms, RestartRun) else kill).append(wid)
            elif listed and isinstance(ms, RestartRun) and w.state == WorkerState.LEAVING and w.exit_code is None:
                terminate.append(wid)  # its gang stops (the agent signals once, however often told)
        for wid in running:
            if wid not in co.workers and wid not in kill:
                kill.append(wid)  # no job of this coordinator knows it
        start = self._resent(node, running, entry.beat_at, now)
        fresh = self._start_orders(node, entry.slots, used, now)
        for order in fresh:  # (most beats start nothing)
            co.nodes.sent(node, order, now)
        start += fresh
        co.flush()  # (may bump this node: the views below are as of the version returned)
        version = co.nodes.version(node)
        views: dict[str, p.WorkerView] | None = None
        if version > since or start:
            here = co.workers.on(node)  # with the workers just started
            views = {
                wid: co.workers.run(wid).view(wid, now)
                for wid in sorted(here)
                if co.workers.run(wid).workers[wid].state in LIVE
            }
        return p.NodeOrders(
            version=version,
            boot=co.boot,
            start=start,
            kill=kill,
            terminate=terminate,
            views=views,
            probe=co.cluster.wants_probe(node),
        )

    def _resent(self, node: str, running: set[str], beat_at: float, now: float) -> list[p.StartOrder]:
        """The start orders of ``node`` to send again: those whose worker is still starting and
        that a beat which came :data:`RESEND_AFTER_S` after them did not list."""
        co = self.co
        unacked = co.nodes.unacked(node)
        if not unacked:
            return []
        again = []
        for order, sent_at in unacked:
            wid = order.worker_id
            ms = co.workers.get(wid)
            w = None if ms is None else ms.workers.get(wid)
            if wid in running or w is None or w.state != WorkerState.STARTING or w.node != node:
                co.nodes.acked(node, wid)  # running (acknowledged), or past starting either way
            elif beat_at >= sent_at + RESEND_AFTER_S:
                log.info(
                    "node %s: its agent does not run %s, started %.1f s ago: the start order again",
                    node,
                    wid,
                    now - sent_at,
                )
                co.nodes.sent(node, order, now)
                again.append(order)
        return again

    def _start_orders(self, node: str, slots: int, used: set[int], now: float) -> list[p.StartOrder]:
        co = self.co
        state = co.cluster.nodes.get(node)
        if state is None or not state.takes_work:
            return []
        candidates = [co.jobs[j] for j in co.cluster.allocated_on(node) if j in co.jobs]
        start: list[p.StartOrder] = []
        for job in candidates:
            want = job.wants_workers()
            per = 1
            if want:
                staying_here = sum(
                    1
                    for wid in co.workers.on(node)
                    if co.workers.run(wid) is job
                    and job.workers[wid].state in (WorkerState.STARTING, WorkerState.READY, WorkerState.ACTIVE)
                    and not job.workers[wid].spare
                )
                want = min(want, co.cluster.allowed_on(job.spec.job_id, node, staying_here))
                per = co.cluster.slots_per_worker(job.spec.job_id)
            for started in range(want):
                slot = free_slot(used, slots, per)
                if slot is None:  # spares here give their slots back first (they hold no state)
                    self.release_spares(
                        node, f"its slot went to job {job.spec.job_id}", now, need=(want - started) * per, job=job
                    )
                    break
                start.append(self._start_order(job, job.add_worker(node, slot, now, slots=per), used))
        return start + self._start_spares(node, slots, used, now)

    def _start_order(self, job: Membership, worker: Worker, used: set[int]) -> p.StartOrder:
        co = self.co
        slot, per = worker.slot, worker.slots
        used.update(range(slot, slot + per))
        if (job.spec.nproc_per_replica > 1 or isinstance(job, RestartRun)) and co.stores is not None:
            # Its processes build their replica's own group on the run's store first (an
            # unmodified script's whole group, on its gang's own store).
            co.stores.open(job.store_key(worker), job.spec.token)
        co.workers.add(job, worker)
        co.touch(job.spec.job_id)
        return self.order(job, worker)

    def order(self, job: Membership, worker: Worker) -> p.StartOrder:
        """What the agent needs to start ``worker``."""
        co = self.co
        return p.StartOrder(
            worker_id=worker.id,
            job_id=job.spec.job_id,
            command=job.spec.command,
            env=dict(job.spec.env),
            local_rank=worker.slot,
            slots=worker.slots,
            store=co.store_address,
            token=job.spec.token,
            store_key=job.store_key(worker),
            nproc=job.spec.nproc_per_replica,
            mesh=job.spec.mesh,
            restart=p.RestartOrder(**job.restart_order(worker)) if isinstance(job, RestartRun) else None,
        )

    # -- warm spares (see maitre.control.membership) -------------------------------------------
    def _spares_here(self, node: str) -> list[Worker]:
        co = self.co
        return [
            w
            for wid in sorted(co.workers.on(node))
            if (w := co.workers.run(wid).workers[wid]).spare and w.state in LIVE
        ]

    def _start_spares(self, node: str, slots: int, used: set[int], now: float) -> list[p.StartOrder]:
        """Spares of the jobs that want some, on this node's slots that no allocation holds (so
        the scheduler, which counts them free, never waits for them)."""
        co = self.co
        wanting = [
            ms for job_id in sorted(co.spare_jobs) if (ms := co.jobs.get(job_id)) is not None and ms.spares_wanted()
        ]
        state = co.cluster.nodes.get(node)
        if not wanting or state is None or not state.takes_work or state.health.suspect:
            return []  # (a suspect node's spare would be as slow as the worker it replaced)
        if state.node.reserved_for:  # one job's node: that job's spares only
            wanting = [ms for ms in wanting if ms.spec.job_id == state.node.reserved_for]
        allocated = sum(
            co.cluster.managed[j].job.placement.get(node, 0) * co.cluster.slots_per_worker(j)
            for j in co.cluster.allocated_on(node)
        )
        room = slots - allocated - sum(w.slots for w in self._spares_here(node))
        start: list[p.StartOrder] = []
        for ms in wanting:
            per = co.cluster.slots_per_worker(ms.spec.job_id)
            for _ in range(ms.spares_wanted()):
                slot = free_slot(used, slots, per) if room >= per else None
                if slot is None:
                    return start
                room -= per
                start.append(self._start_order(ms, ms.add_spare(node, slot, now, slots=per), used))
        return start

    def release_spares(
        self, node: str, reason: str, now: float, need: int | None = None, job: Membership | None = None
    ) -> None:
        """Spares here stop, enough of them for ``need`` slots (None: all): a job allocated here
        finds no free slot, or the node goes. Their slots are free once their processes
        exited, a beat later. A spare of ``job`` itself (the job that wants the slot) is
        promoted in its place instead: it is the replica the job wants, and warm."""
        co = self.co
        spares = self._spares_here(node)
        if job is not None:  # its own first
            spares.sort(key=lambda w: co.workers.run(w.id) is not job)
        for w in spares:
            if need is not None and need <= 0:
                return
            need = None if need is None else need - w.slots
            ms = co.workers.run(w.id)
            if ms is job and ms.promote_spare(None, now, spare=w.id) is not None:
                co.touch(ms.spec.job_id)
                continue
            ms.release_spare(w.id, reason, now)
            co.nodes.kill(node, w.id)
            co.touch(ms.spec.job_id)
            co.bump(node)

    def spares_moved(self, job_id: str, ms: Membership) -> None:
        """The job's allocation follows its promoted spares (:meth:`ClusterState.take_spares`)."""
        co = self.co
        m = co.cluster.managed.get(job_id)
        if m is None or m.incarnation == 0:
            ms.take_promotions()
            return
        before = set(m.job.placement)
        if co.cluster.take_spares(m, ms, co.clock()):
            co.cluster.index_allocations()
            for node in before | set(m.job.placement):
                co.bump(node)
            co.persist({job_id})
