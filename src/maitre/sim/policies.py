"""Scheduling policies the simulator compares, behind one interface.

Every policy is called once per scheduling round with the active jobs (submitted, not finished,
in submission order), the usable nodes (index -> GPUs) and the current allocations, and returns
the new allocations: one node index per replica, in the order given. A job absent from the
answer holds nothing. The simulator applies the answer and charges each changed job its resize.

- ``fifo``: static gangs in strict submission order at their requested size; the head of the
  queue blocks the rest (no backfill), nothing is ever preempted.
- ``tiresias``: 2D-LAS with two queues (Gu et al., NSDI'19), as in Pollux's artifact: a job is
  demoted from the first queue once it has run 16 GPU-hours; each round walks both queues in order
  and runs every job that still fits, preempting the others; new gangs take the nodes with the
  most free GPUs first.
- ``optimus``: Optimus (Peng et al., EuroSys'18) with an oracle, as in Pollux's artifact: every job
  gets one GPU, then GPUs go one at a time to the job whose remaining time drops most, with the
  true step times of the profiles.
- ``pollux``: goodput-maximizing in the manner of Pollux (Qiao et al., OSDI'21), greedily instead of
  by a genetic search: one GPU per job by least attained service, then GPUs by marginal goodput
  speedup, with Pollux's restart penalty, at the batch size that maximizes goodput.
- ``maitre``: maitre's own policy, :func:`maitre.scheduling.schedule`, through the same data model
  as the live coordinator: gang admission at ``min_replicas``, preemption that shrinks before it
  suspends, elastic fill by gain per replica on the speedup curve each job reports (with a
  look-ahead past node crossings), least-served first.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

from maitre.scheduling import Cluster, Job, JobState, Node, PolicyConfig, Queue, schedule
from maitre.scheduling.assign import repair
from maitre.sim.jobs import ProfiledJob, SimJob
from maitre.sim.profiles import even_placement

Allocations = dict[str, list[int]]


class Policy(Protocol):
    name: str

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations: ...


def _take(free: dict[int, int], count: int) -> list[int]:
    """``count`` GPUs, each time from the node with the most free (lowest index on ties)."""
    out: list[int] = []
    while len(out) < count:
        node = max(free, key=lambda n: (free[n], -n))
        k = min(free[node], count - len(out))
        if k <= 0:
            raise AssertionError("no free GPU left to take")
        out += [node] * k
        free[node] -= k
    return out


def _free(nodes: dict[int, int], allocs: Allocations) -> dict[int, int]:
    free = dict(nodes)
    for alloc in allocs.values():
        for n in alloc:
            free[n] -= 1
    return free


class Fifo:
    name = "fifo"

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations:
        allocs = {j.name: prev[j.name] for j in jobs if prev.get(j.name)}
        free = _free(nodes, allocs)
        for j in jobs:
            if j.name in allocs:
                continue
            if j.replicas > sum(free.values()):
                break
            allocs[j.name] = _take(free, j.replicas)
        return allocs


class Tiresias:
    name = "tiresias"

    def __init__(self, threshold_gpu_s: float = 16 * 3600) -> None:
        self.threshold = threshold_gpu_s
        self.queues: tuple[list[str], list[str]] = ([], [])
        self.running: dict[str, bool] = {}
        self.last_check: dict[str, int] = {}
        self.executed: dict[str, int] = {}

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations:
        t = int(now)
        by_name = {j.name: j for j in jobs}
        q0, q1 = (list(filter(by_name.__contains__, q)) for q in self.queues)
        self.running = {k: v for k, v in self.running.items() if k in by_name}
        allocs = {k: v for k, v in prev.items() if k in by_name}
        for j in jobs:
            if j.name not in self.running:
                self.running[j.name] = False
                q0.append(j.name)
        for j in jobs:  # attained service, in wall time while the job is running
            elapsed = int(t - self.last_check.get(j.name, 0))
            self.last_check[j.name] = t
            if self.running[j.name]:
                self.executed[j.name] = self.executed.get(j.name, 0) + elapsed
                if j.name in q0 and self.executed[j.name] * j.replicas >= self.threshold:
                    q0.remove(j.name)
                    q1.append(j.name)
        self.queues = (q0, q1)
        gpus = sum(nodes.values())
        for name in q0 + q1:
            need = by_name[name].replicas
            self.running[name] = need <= gpus
            if self.running[name]:
                gpus -= need
            else:
                allocs.pop(name, None)
        free = _free(nodes, allocs)
        for name in q0 + q1:
            if self.running[name] and not allocs.get(name):
                allocs[name] = _take(free, by_name[name].replicas)
        return allocs


def _step_time(job: SimJob, replicas: int) -> float:
    """Seconds per step (Optimus' oracle: the profiles' true step time)."""
    if isinstance(job, ProfiledJob):
        cfg = job.app.fixed_batch(job.batch_size, replicas, single_gets_accum=True)
        return job.app.iteration_time(even_placement(replicas, job.gpus_per_node), cfg)
    return 1.0 / job.rate(replicas)


class Optimus:
    name = "optimus"

    def _limits(self, job: SimJob) -> tuple[int, float]:
        """(most replicas, steps left)."""
        if isinstance(job, ProfiledJob):
            app = job.app
            top = 1 if app.name == "ncf" else job.batch_size // app.min_local_bsz
            end = app.completion_epoch
            left = (
                1.0
                if end <= job.epoch
                else (app.iterations(job.batch_size, end) - app.iterations(job.batch_size, job.epoch))
            )
            return top, left
        return job.max_replicas, job.remaining()

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations:
        gpus = sum(nodes.values())
        count: dict[str, int] = {}
        gain: dict[str, float] = {}
        limits = {j.name: self._limits(j) for j in jobs}

        def marginal(j: SimJob) -> float:
            top, left = limits[j.name]
            n = count[j.name]
            if n + 1 > top or gpus < 1:
                return 0.0
            return (_step_time(j, n) - _step_time(j, n + 1)) * left

        for j in jobs:
            if gpus < 1:
                count[j.name], gain[j.name] = 0, 0.0
                continue
            count[j.name] = 1
            gpus -= 1
            gain[j.name] = marginal(j)
        by_name = {j.name: j for j in jobs}
        while gpus > 0 and gain and max(gain.values()) > 0:
            best = max(gain, key=gain.__getitem__)
            count[best] += 1
            gain[best] = marginal(by_name[best])
            gpus -= 1
        allocs = {k: v for k, v in prev.items() if k in count and len(v) == count[k]}
        free = _free(nodes, allocs)
        for name in sorted(count, key=count.__getitem__):
            if count[name] > 0 and not allocs.get(name):
                allocs[name] = _take(free, count[name])
        return allocs


class PolluxLike:
    """Goodput-greedy with Pollux's restart penalty (see the module docstring)."""

    name = "pollux"

    def __init__(self, restart_penalty_s: float = 30.0) -> None:
        self.restart_penalty_s = restart_penalty_s

    @staticmethod
    def _cap(job: SimJob) -> int:
        if isinstance(job, ProfiledJob):
            if job.app.name == "ncf":
                return 1
            return min(64, job.app.max_batch_size // job.app.min_local_bsz)
        return job.max_replicas

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations:
        gpus = sum(nodes.values())
        order = sorted(jobs, key=lambda j: (j.attained_s, j.submitted, j.name))
        base = {j.name: j.rate(1) for j in jobs}
        count = {j.name: 0 for j in jobs}
        for j in order:
            if gpus == 0:
                break
            count[j.name], gpus = 1, gpus - 1

        def value(j: SimJob, n: int) -> float:
            """Speedup over one GPU, discounted as Pollux does for a job that would restart."""
            s = j.rate(n) / base[j.name] if n else 0.0
            if n != len(prev.get(j.name, ())) and prev.get(j.name):
                age = max(now - j.submitted, 0.0)
                s *= max(age - (j.restarts + 1) * self.restart_penalty_s, 0.0) / (age + self.restart_penalty_s)
            return s

        while gpus > 0:
            best, best_gain = None, 1e-9
            for j in order:
                n = count[j.name]
                if 0 < n < self._cap(j):
                    g = value(j, n + 1) - value(j, n)
                    if g > best_gain:
                        best, best_gain = j, g
            if best is None:
                break
            count[best.name] += 1
            gpus -= 1
        allocs = {k: v for k, v in prev.items() if count.get(k) == len(v) and v}
        free = _free(nodes, allocs)
        for j in sorted(order, key=lambda j: -count[j.name]):
            if count[j.name] and j.name not in allocs:
                allocs[j.name] = _pack(free, count[j.name])
        return allocs


def _pack(free: dict[int, int], count: int) -> list[int]:
    """``count`` GPUs on as few nodes as possible: one node that fits them all (the tightest),
    else the fullest nodes first."""
    fits = [n for n in free if free[n] >= count]
    if fits:
        node = min(fits, key=lambda n: (free[n], n))
        free[node] -= count
        return [node] * count
    return _take(free, count)


class Maitre:
    """:func:`maitre.scheduling.schedule` on the simulated cluster."""

    name = "maitre"

    def __init__(self, cfg: PolicyConfig | None = None, rack_size: int = 8) -> None:
        self.cfg = cfg or PolicyConfig()
        self.rack_size = rack_size
        self.resized_at: dict[str, float] = {}

    def allocate(self, now: float, jobs: list[SimJob], nodes: dict[int, int], prev: Allocations) -> Allocations:
        queues = sorted({j.queue for j in jobs}) or ["default"]
        cluster = Cluster.of(
            [Node(str(n), g, rack=f"r{n // self.rack_size}") for n, g in nodes.items()], [Queue(q) for q in queues]
        )
        views = []
        for j in jobs:
            alloc = prev.get(j.name, [])
            placement: dict[str, int] = {}
            for n in alloc:
                placement[str(n)] = placement.get(str(n), 0) + 1
            state = JobState.RUNNING if alloc else (JobState.SUSPENDED if j.restarts >= 0 else JobState.PENDING)
            views.append(
                Job(
                    id=j.name,
                    queue=j.queue,
                    priority=j.priority,
                    min_replicas=j.min_replicas,
                    max_replicas=j.max_replicas,
                    submitted_at=j.submitted,
                    state=state,
                    placement=placement,
                    last_resize_at=self.resized_at.get(j.name, -math.inf),
                    throughput=dict(j.throughput),
                    attained_slot_s=j.attained_s,
                )
            )
        # The live coordinator runs a pass every 0.5 s: a preemptor admitted a pass after its
        # victims let go starts within a second. Here the passes run back to back.
        # A gang that lost replicas below its minimum (a node failed) gets them back first, on
        # free slots, as the coordinator does before its pass.
        repair(cluster, views)
        cfg = self.cfg
        for _ in range(4):
            plan = schedule(cluster, views, now, cfg)
            cfg = replace(self.cfg, rebalance_gain=0.0)  # later passes only fill what was freed
            if not plan.actions_of("preempting") and not any(a.reason.startswith("rebalance") for a in plan.actions):
                break
            for v in views:
                placement = {n: r for n, r in plan.placements.get(v.id, {}).items() if r}
                if placement != v.placement:
                    v.last_resize_at = now
                if v.placement and not placement:  # (a view of this pass, not a job: set)
                    v.state = JobState.SUSPENDED
                elif placement:
                    v.state = JobState.RUNNING
                v.placement = placement
        out: Allocations = {}
        for j in jobs:
            target = {int(n): r for n, r in plan.placements.get(j.name, {}).items() if r}
            old = prev.get(j.name, [])
            if not target:
                continue
            kept: list[int] = []
            left = dict(target)
            for n in old:  # keep the replicas that stay, in their order
                if left.get(n, 0) > 0:
                    kept.append(n)
                    left[n] -= 1
            for n, r in sorted(left.items()):
                kept += [n] * r
            out[j.name] = kept
            if sorted(kept) != sorted(old):
                self.resized_at[j.name] = now
        return out


POLICIES = {"fifo": Fifo, "tiresias": Tiresias, "optimus": Optimus, "pollux": PolluxLike, "maitre": Maitre}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
