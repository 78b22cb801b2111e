"""The live control plane without processes: a coordinator with a cluster and a store, agents and
workers simulated by calling it with the messages they send over HTTP, on an injected clock.
Workers' liveness and progress travel in their node's beat, as the agent carries them; a worker
reads the view its agent got (views come only when they changed, as the agent caches them).

Every node heartbeat checks the invariant the scheduler promises: the workers a node runs never
hold more slots than it has, not even between a shrink and the preemptor's start.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from maitre import protocol as p
from maitre.control.cluster import ClusterState
from maitre.control.coordinator import Coordinator
from maitre.control.detectors import PhiAccrual, PhiConfig
from maitre.control.membership import WorkerState
from maitre.control.store import Store
from maitre.errors import BadRequest
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Job, Queue
from maitre.scheduling.policy import PolicyConfig
from maitre.scheduling.spec import JobManifest, parse_manifest
from maitre.control.restarts import RestartRun

pytestmark = pytest.mark.timeout(60)


class Sim:
    """A coordinator plus simulated agents (``nodes``) and workers, stepped by :meth:`advance`."""

    def __init__(
        self,
        tmp: Path,
        nodes: dict[str, int],
        queues: list[Queue],
        cooldown_s: float = 10.0,
        db: Store | None = None,
        t: float = 1000.0,
    ) -> None:
        self.t = t
        self.tmp = tmp
        self.slots = dict(nodes)
        self.queues = queues
        self.cooldown_s = cooldown_s
        self.db = db if db is not None else Store(tmp / "state.db")
        self.co = self._coordinator()
        self.running: dict[str, set[str]] = {n: set() for n in nodes}
        self.down: set[str] = set()
        self.steps: dict[str, int] = {}
        self.views: dict[str, p.WorkerView] = {}
        self.version: dict[str, int] = {n: -1 for n in nodes}
        self.labels: dict[str, dict[str, str]] = {}
        """Each node's labels, as its agent sends them (none by default)."""
        self.notices: dict[str, p.SpotNotice] = {}
        """Spot notices the agents carry in their beats (tests/test_spot.py)."""
        self.health: dict[str, p.NodeHealth] = {}
        """Health probe results the agents carry in their beats (tests/test_health.py)."""
        self.probe_asked: dict[str, bool] = {}
        """Whether the node's latest orders asked for a health probe."""
        self.agents: dict[str, str] = {}
        """Each node's agent process id, as its beats carry it (none by default)."""
        self.lose_starts: set[str] = set()
        """Nodes whose next answer that carries start orders is lost on its way (its agent
        died with a watch pending, a link dropped it): the agent never sees it."""
        self.silent_leavers = False
        """Workers answered ``leave`` drop out without a word (no ``left``, no exit report; their
        node's beats stop listing them): what the control-plane benchmark's simulated agent
        did before issue 41, and what a leaver killed on its way out looks like."""

    def _coordinator(self) -> Coordinator:
        cluster = ClusterState(
            list(self.queues), run_dir=self.tmp, policy=PolicyConfig(resize_cooldown_s=self.cooldown_s)
        )
        return Coordinator("127.0.0.1:1", clock=lambda: self.t, cluster=cluster, store=self.db, pass_s=0.5)

    def restart(self) -> None:
        """A new coordinator process on the same store (the old one is gone without a word)."""
        self.co = self._coordinator()
        self.version = {n: -1 for n in self.slots}  # a new coordinator counts anew

    def submit(
        self,
        name: str,
        queue: str,
        lo: int,
        hi: int,
        priority: str = "normal",
        checkpoint: bool = True,
        preemptible: bool = True,
    ) -> None:
        manifest = {
            "name": name,
            "queue": queue,
            "minReplicas": lo,
            "maxReplicas": hi,
            "priorityClassName": priority,
            "preemptible": preemptible,
            "command": ["python", "train.py"],
        }
        if checkpoint:
            manifest["checkpointDir"] = str(self.tmp / "ck" / name)
        self.co.submit(manifest)

    def job(self, name: str) -> dict:
        return self.co.job_status(name)

    def members(self, name: str) -> int:
        return len(self.job(name)["members"])

    def advance(self, seconds: float, dt: float = 0.25) -> None:
        """Time passes: agents beat, workers start, join, train, leave as asked."""
        end = self.t + seconds
        while self.t < end:
            self.t += dt
            for node in self.slots:
                if node not in self.down:
                    self.beat(node)
            for node in self.slots:
                if node not in self.down:
                    for wid in sorted(self.running[node]):
                        self._worker(node, wid)
            self.co.tick()

    def beat(self, node: str) -> None:
        """One beat of ``node``'s agent: its workers' progress; it carries its orders out."""
        beat = p.NodeBeat(
            slots=self.slots[node],
            since=self.version[node],
            labels=p.Labels(**self.labels.get(node, {})),
            notice=self.notices.get(node),
            health=self.health.get(node),
            agent=self.agents.get(node, ""),
            workers=[p.WorkerBeat(id=w, step=self.steps.get(w, 0), silent_s=0.0) for w in sorted(self.running[node])],
        )
        reply = self.co.node_heartbeat(node, beat)
        if reply.start and node in self.lose_starts:
            self.lose_starts.discard(node)
            return
        self.version[node] = reply.version
        self.probe_asked[node] = reply.probe
        if reply.views is not None:
            self.views.update(reply.views)
        for wid in reply.kill:
            self._exit(node, wid, -9)
        for wid in reply.terminate:  # (a restart-mode gang that stops: SIGTERM ends it)
            self._exit(node, wid, -15)
        for order in reply.start:
            self.running[node].add(order.worker_id)
        held = sum(self.co.workers.run(w).workers[w].slots for w in self.running[node])
        assert held <= self.slots[node], f"{node} over-committed: {self.running[node]}"

    def _worker(self, node: str, wid: str) -> None:
        ms = self.co.workers.run(wid)
        w = ms.workers[wid]
        if isinstance(ms, RestartRun):
            return  # an unmodified script says nothing: its exit does
        hb = self.views[wid]
        if hb.stop:
            self._exit(node, wid, 0)
            return
        news = hb.member_epoch == w.epoch  # as the loop reads it: older views are stale
        if w.state in (WorkerState.STARTING, WorkerState.READY) or (news and (hb.closed or hb.change or hb.leave)):
            answer = self.co.rendezvous(
                wid, p.RendezvousRequest(from_epoch=w.epoch, wait_s=0, step=self.steps.get(wid, 0))
            )
            if answer["action"] == "leave" and self.silent_leavers:
                self.running[node].discard(wid)
            elif answer["action"] == "leave":
                self.co.worker_left(wid)
                self._exit(node, wid, 0)
            elif answer["action"] == "stop":
                self._exit(node, wid, 0)
            return
        if ms.state.value == "RUNNING":
            self.steps[wid] = max(self.steps.get(m, 0) for m in ms.members) + 1

    def _exit(self, node: str, wid: str, code: int) -> None:
        if wid in self.running[node]:
            self.running[node].discard(wid)
            restart = isinstance(self.co.workers.run(wid), RestartRun)
            self.co.worker_exit(wid, p.ExitRequest(code=code, joined=True if restart else None))

    def finish(self, name: str) -> None:
        """The job's members finish their loop."""
        ms = self.co.jobs[name]
        for wid in list(ms.members):
            self.co.worker_done(wid, p.DoneRequest(step=self.steps.get(wid, 0)))
            node = ms.workers[wid].node
            self._exit(node, wid, 0)


def two_teams(tmp_path: Path, **kw) -> Sim:
    return Sim(
        tmp_path,
        {"n0": 2, "n1": 2, "n2": 2, "n3": 2},
        [Queue("team-a", guaranteed=4), Queue("team-b", guaranteed=2)],
        **kw,
    )


def test_elastic_jobs_fill_the_cluster_then_shrink_for_a_high_priority_gang(tmp_path: Path) -> None:
    sim = two_teams(tmp_path)
    sim.submit("a", "team-a", 1, 6)
    sim.submit("b", "team-b", 1, 6)
    sim.advance(5)
    assert sim.members("a") + sim.members("b") == 8
    before = {w for n in sim.running.values() for w in n}

    sim.submit("urgent", "team-a", 4, 4, priority="high", preemptible=False)
    sim.advance(5)
    a, b, urgent = sim.job("a"), sim.job("b"), sim.job("urgent")
    assert urgent["state"] == "RUNNING" and len(urgent["members"]) == 4
    assert a["state"] == b["state"] == "RUNNING"  # shrunk, not suspended
    assert len(a["members"]) + len(b["members"]) == 4
    assert len(b["members"]) >= 2, "team-b keeps its guarantee"
    gone = before - {w for n in sim.running.values() for w in n}
    for wid in gone:  # every worker that made room left gracefully; none was killed
        w = sim.co.workers.run(wid).workers[wid]
        assert w.state == WorkerState.LEFT and w.exit_code == 0, (wid, w)
    assert a["failures"] == b["failures"] == 0

    sim.finish("urgent")
    sim.advance(3)
    assert sim.members("a") + sim.members("b") == 4, "damping: no regrowth within the cooldown"
    sim.advance(10)
    assert sim.members("a") + sim.members("b") == 8, "grown back once the cooldown passed"
    kinds = [e["kind"] for e in sim.db.events()]
    assert "shrink" in kinds and "grow" in kinds and "suspend" not in kinds


def test_a_gang_waits_whole_and_takes_no_slot_while_it_does_not_fit(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 2}, [Queue("q")])
    sim.submit("fixed", "q", 3, 3, preemptible=False, checkpoint=False)
    sim.advance(3)
    sim.submit("big", "q", 3, 3, preemptible=False, checkpoint=False)
    sim.advance(3)
    assert sim.job("big")["state"] == "PENDING" and sim.job("big")["placement"] == {}
    assert not any(w.startswith("big") for n in sim.running.values() for w in n)
    sim.finish("fixed")
    sim.advance(3)
    assert sim.members("big") == 3


def test_a_start_order_lost_on_its_way_is_sent_again(tmp_path: Path) -> None:
    """A node's answer with a start order never reaches its agent: the next beat that does not
    list the worker, a few seconds on, brings the same order again; the worker starts, the
    job trains with no failure and no replacement worker."""
    sim = Sim(tmp_path, {"n0": 1, "n1": 1}, [Queue("q")])
    sim.lose_starts = {"n0"}
    sim.submit("a", "q", 2, 2)
    sim.advance(2)
    assert sim.lose_starts == set(), "no answer with a start order was lost"
    assert not sim.running["n0"] and sim.job("a")["state"] != "RUNNING"
    sim.advance(4)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and len(job["members"]) == 2, job
    assert sorted(w["id"] for w in job["workers"]) == ["a-w1", "a-w2"], job["workers"]
    assert job["failures"] == 0
    sim.advance(10)  # acknowledged by the beats that list it: not sent a third time
    assert sim.job("a")["epoch"] == 1


def test_a_restarted_agents_first_beat_ends_the_workers_of_the_one_before(tmp_path: Path) -> None:
    """An agent SIGKILLed and started again within a beat or two: the node never went silent,
    but its workers went with the old agent. The new agent's first beat (another agent id)
    makes them dead at once, and the job recovers and grows back there within seconds rather
    than after their heartbeats' silence (15 s)."""
    sim = Sim(tmp_path, {"n0": 1, "n1": 1}, [Queue("q")], cooldown_s=0)
    sim.agents = {"n0": "agent-a", "n1": "agent-b"}
    sim.submit("a", "q", 1, 2)
    sim.advance(3)
    [old] = sim.running["n0"]
    assert sim.members("a") == 2
    sim.agents["n0"], sim.running["n0"] = "agent-a2", set()  # killed, restarted, no exit report
    sim.advance(0.25)
    w = sim.co.workers.run(old).workers[old]
    assert w.state == WorkerState.DEAD, w
    dead = [e for e in sim.db.events() if e["kind"] == "worker_dead"]
    assert [e["worker"] for e in dead] == [old] and "agent restarted" in dead[0]["reason"], dead
    sim.advance(3)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and len(job["members"]) == 2, job
    assert sim.running["n0"] and old not in sim.running["n0"]
    sim.agents["n1"] = "agent-b"  # the same agent again: nothing happens
    sim.advance(2)
    assert sim.job("a")["epoch"] == job["epoch"]


def test_a_dead_node_is_detected_and_its_replicas_placed_elsewhere(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 2, "n2": 2}, [Queue("q")])
    sim.submit("a", "q", 2, 4)
    sim.advance(5)
    placement = sim.job("a")["placement"]
    assert sum(placement.values()) == 4
    victim = max(placement, key=placement.get)
    sim.down.add(victim)  # the agent and its workers fall silent
    sim.advance(10)
    nodes = {n["node"]: n for n in sim.co.nodes_view()}
    assert nodes[victim]["alive"] is False
    job = sim.job("a")
    assert victim not in job["placement"] and job["state"] == "RUNNING"
    assert len(job["members"]) >= 2
    assert any(e["kind"] == "node_dead" and e["node"] == victim for e in sim.db.events())


def test_the_coordinator_restarts_from_its_store_and_workers_reattach(tmp_path: Path) -> None:
    sim = two_teams(tmp_path)
    sim.submit("a", "team-a", 1, 4)
    sim.submit("b", "team-b", 2, 2, preemptible=False)
    sim.advance(5)
    before = {j: sim.job(j) for j in ("a", "b")}
    assert all(j["state"] == "RUNNING" for j in before.values())
    served = {j: sim.co.cluster.managed[j].job.attained_slot_s for j in ("a", "b")}
    assert 0 < served["b"] <= 2 * 5.0  # b held its 2 slots for at most the 5 s that passed
    sim.advance(0.25)
    sim.co.tick()

    sim.t += 30.0  # the coordinator is away for 30 s (longer than any worker timeout)...
    sim.restart()  # ...and a new one reads the store
    sim.advance(3)
    for name, old in before.items():
        job = sim.job(name)
        assert job["state"] == "RUNNING" and job["epoch"] == old["epoch"], (name, job)
        assert job["members"] == old["members"] and job["failures"] == 0
        assert job["step"] > old["step"]
    assert any(e["kind"] == "coordinator_restarted" for e in sim.db.events())
    for name, was in served.items():  # the service a job had (LAS ordering) survives too
        assert sim.co.cluster.managed[name].job.attained_slot_s > was
    sim.submit("c", "team-b", 1, 2)  # and it schedules on
    sim.advance(3)
    assert sim.job("c")["state"] == "RUNNING"


def test_a_user_suspension_holds_until_resume_and_cancel_ends_a_job(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2}, [Queue("q")])
    sim.submit("a", "q", 1, 2)
    sim.advance(3)
    sim.co.suspend("a", "by a test")
    # The members checkpoint and report themselves suspended.
    for wid in list(sim.co.jobs["a"].members):
        sim.co.worker_done(wid, p.DoneRequest(step=5, suspended=True))
        sim._exit("n0", wid, 0)
    sim.advance(3)
    assert sim.job("a")["state"] == "SUSPENDED" and sim.job("a")["held"] is True
    sim.co.resume("a")
    sim.advance(3)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and job["incarnation"] == 2
    assert all(w["id"] not in ("a-w1", "a-w2") for w in job["workers"])  # new ids
    # Its epochs count from 1 again, under store keys the first run never used.
    assert job["epoch"] == 1 and sim.co.jobs["a"].store_prefix() == "job/a/g0i2/e1/"
    sim.co.cancel("a")
    sim.advance(2)
    assert sim.job("a")["state"] == "CANCELLED"
    assert not any(sim.running.values())
    with pytest.raises(BadRequest, match="already CANCELLED"):
        sim.co.cancel("a")


def test_an_invalid_manifest_names_every_problem_and_stores_nothing(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2}, [Queue("q")])
    with pytest.raises(BadRequest) as err:
        sim.co.submit({"name": "Bad_Name", "queue": "nope", "minReplicas": 3, "maxReplicas": 2, "command": []})
    text = str(err.value)
    for problem in ("Bad_Name", "no queue 'nope'", "maxReplicas 2 is less than minReplicas 3", "command is empty"):
        assert problem in text
    assert sim.db.jobs() == []
    with pytest.raises(BadRequest, match="manifest"):
        sim.co.submit(["not", "a", "manifest"])


def test_scale_sets_a_managed_jobs_ceiling(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 2}, [Queue("q")])
    sim.submit("a", "q", 1, 4)
    sim.advance(3)
    assert sim.members("a") == 4
    sim.co.scale("a", 2)
    sim.advance(3)
    assert sim.members("a") == 2 and sim.job("a")["max_workers"] == 2
    with pytest.raises(BadRequest, match="below its minReplicas"):
        sim.co.scale("a", 0)


@pytest.mark.parametrize("nodes", [4, 1024], ids=["4x8", "1024x8-filled"])
def test_joiners_a_scale_turned_away_that_go_silent_are_no_failure_of_the_job(tmp_path: Path, nodes: int) -> None:
    """Issue 41: benchmarks/control_plane.py at 1,024 nodes x 8 submitted ``grow`` (8 to 16
    workers) and scaled it to 8 at once; on a busy coordinator the scheduling pass admitted it
    at 16 and the start orders went out before the scale landed. The scale turned 8 of the
    joiners away (LEAVING), they were answered ``leave`` and went silent (the simulated agent
    reported nothing); 15 s on each was declared lost, each a failure of its own, and the
    fourth failed the job at epoch 1 with its 8 members training. A worker that was told to
    leave and holds nothing the job needs (it is in no epoch the job counts on) is no failure
    when it is lost; the job trains on. At 1,024 nodes the cluster is filled as the benchmark
    fills it (gangs of 256 and one of 240 submitted right after the scale)."""
    sim = Sim(tmp_path, {f"n{i}": 8 for i in range(nodes)}, [Queue("q")])
    sim.silent_leavers = True
    sim.advance(1, dt=1.0)  # every node beating
    sim.submit("grow", "q", 8, 16, checkpoint=False)
    sim.co.tick()  # the pass the submission asked for admits it at 16...
    assert sum(sim.job("grow")["placement"].values()) == 16
    for node in sim.slots:  # ...and its agents get the start orders...
        sim.beat(node)
    assert sum(len(r) for r in sim.running.values()) == 16
    sim.co.scale("grow", 8)  # ...before the scale lands
    leaving = {w.id for w in sim.co.jobs["grow"].workers.values() if w.state == WorkerState.LEAVING}
    assert len(leaving) == 8
    [scaled] = [e for e in sim.db.events() if e["kind"] == "scale" and e.get("job") == "grow"]
    assert set(scaled["turned_away"]) == leaving and scaled["leaving"] == [], scaled
    gangs = {f"fill-{i}": 256 for i in range(nodes * 8 // 256 - 1)}
    if gangs:
        gangs["fill-rest"] = 240
    for name, size in gangs.items():
        sim.submit(name, "q", size, size, checkpoint=False)
    sim.advance(3, dt=1.0)
    job = sim.job("grow")
    assert job["state"] == "RUNNING" and len(job["members"]) == 8 and not leaving & set(job["members"])
    assert not leaving & {w for r in sim.running.values() for w in r}, "the leavers went"
    sim.advance(20, dt=2.0)  # past dead_after_s (15 s) of their silence, beats 2 s apart
    job = sim.job("grow")
    assert job["state"] == "RUNNING" and job["epoch"] == 1 and len(job["members"]) == 8, job
    assert job["failures"] == 0 and job["failure"] is None, job
    dead = [e for e in sim.db.events() if e["kind"] == "worker_dead" and e.get("job") == "grow"]
    assert {e["worker"] for e in dead} == leaving and all(e.get("leaving") for e in dead), dead
    assert sim.co.metrics.worker_failures._value.get() == 0
    for name, size in gangs.items():  # (fill-rest took the slots the leavers held once they were dead)
        assert (sim.job(name)["state"], sim.members(name)) == ("RUNNING", size), name


def test_phi_accrual_adapts_to_the_heartbeat_rhythm() -> None:
    cfg = PhiConfig(threshold=8.0, min_std_s=0.05, acceptable_pause_s=0.0)
    steady, jittery = PhiAccrual(cfg, 0.0), PhiAccrual(cfg, 0.0)
    t = u = 0.0
    for i in range(200):
        t += 0.25
        u += 0.6 if i % 2 else 0.1  # irregular: gaps of 0.1 s and 0.6 s
        steady.heartbeat(t)
        jittery.heartbeat(u)
    last = max(t, u)
    steady.last = jittery.last = last
    assert steady.phi(last + 0.1) < 1 and jittery.phi(last + 0.1) < 1
    assert steady.dead(last + 1.0)  # a metronome that stops is soon dead...
    assert not jittery.dead(last + 1.0)  # ...an irregular node gets more rope
    assert jittery.dead(last + 10.0)
    assert math.isfinite(steady.phi(last + 1e6))


def test_a_gang_that_loses_a_node_below_its_minimum_is_placed_again(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 1, "n1": 1, "n2": 1}, [Queue("q")])
    sim.submit("gang", "q", 2, 2, preemptible=False, checkpoint=False)
    sim.advance(3)
    placement = sim.job("gang")["placement"]
    assert sum(placement.values()) == 2
    victim = sorted(placement)[0]
    spare = ({"n0", "n1", "n2"} - set(placement)).pop()
    sim.down.add(victim)
    sim.advance(12)
    job = sim.job("gang")
    assert job["state"] == "RUNNING" and len(job["members"]) == 2, job
    assert set(job["placement"]) == set(placement) - {victim} | {spare}
    assert any(e["kind"] == "repair" for e in sim.db.events())


def test_a_job_without_checkpoints_is_never_suspended_and_a_reused_name_gets_a_new_ledger(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2}, [Queue("q")])
    sim.submit("plain", "q", 2, 2, checkpoint=False)  # preemptible: true, but nothing to resume
    sim.advance(2)
    with pytest.raises(BadRequest, match="no checkpointDir"):
        sim.co.suspend("plain", "by a test")
    sim.submit("vip", "q", 2, 2, priority="high")
    sim.advance(3)
    assert sim.job("plain")["state"] == "RUNNING" and sim.job("vip")["state"] == "PENDING"
    first = sim.co.jobs["plain"].spec.env["MAITRE_LEDGER_DIR"]
    sim.co.cancel("plain")
    sim.advance(2)
    sim.submit("plain", "q", 1, 1, checkpoint=False)
    sim.co.cancel("vip")
    sim.advance(3)
    second = sim.co.jobs["plain"].spec.env["MAITRE_LEDGER_DIR"]
    assert first.endswith("/ledger/plain") and second.endswith("/ledger/plain.1")
    assert sim.job("plain")["state"] == "RUNNING"
    assert not set(sim.co.jobs["plain"].workers) & {"plain-w1", "plain-w2"}


def test_a_node_that_comes_back_with_fewer_slots_is_never_over_committed(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 4}, [Queue("q")])
    sim.submit("a", "q", 1, 4)
    sim.advance(3)
    assert sim.members("a") == 4
    sim.slots["n0"] = 2  # the agent restarts with 2 slots (a GPU went bad)
    sim.advance(6)  # (every heartbeat checks that n0 runs at most its slots)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and sum(job["placement"].values()) <= 2
    assert 1 <= len(job["members"]) <= 2
    assert any(e["kind"] == "node_shrunk" for e in sim.db.events())


def test_throughput_is_timed_by_when_steps_were_reached_not_by_when_beats_arrive(tmp_path: Path) -> None:
    """A node beats every 2 s, carrying each worker's step as of its last heartbeat to the
    agent (at most 0.1 s old); then the members wait in a collective, their step standing
    still while they go on beating (their agents at once and often, as for a stall). The job trains
    at 20 steps/s, and that is what the scheduler measures: neither the age of a node beat nor
    the wait counts as training time."""
    sim = Sim(tmp_path, {"n0": 1, "n1": 1}, [Queue("q")])
    sim.submit("j", "q", 2, 2)
    sim.advance(3)
    ms = sim.co.jobs["j"]
    epoch = ms.epoch
    assert ms.state.value == "RUNNING" and len(ms.members) == 2
    managed = sim.co.cluster.managed["j"]
    managed.job.throughput.clear()  # and what was measured of the simulated workers' steps
    managed.window = None
    base, start, rate, trains_s = max(sim.steps.values()), sim.t, 20.0, 10.0
    phase = {"n0": 0, "n1": 23}  # the two agents beat every 40 ticks of 50 ms, out of phase
    for tick in range(1, 14 * 20 + 1):
        sim.t = start + tick * 0.05
        heard = start + (tick // 2) * 0.1  # the workers' last heartbeats to their agents
        step = base + int(rate * min(heard - start, trains_s))
        stalled = heard - start > trains_s + 0.5
        for node in sim.slots:
            if (tick + phase[node]) % 40 and not stalled:
                continue
            beat = p.NodeBeat(
                slots=1,
                since=sim.version[node],
                workers=[
                    p.WorkerBeat(id=w, step=step, stalled=stalled, silent_s=round(sim.t - heard, 4))
                    for w in sorted(sim.running[node])
                ],
            )
            sim.version[node] = sim.co.node_heartbeat(node, beat).version
        sim.co.tick()
    assert ms.state.value == "RUNNING" and ms.epoch == epoch  # one stretch of training
    measured = managed.job.throughput[2]
    assert abs(measured - rate) / rate < 0.05, managed.job.throughput


def test_a_job_moves_through_one_state_machine(tmp_path: Path, monkeypatch) -> None:
    """Queued, admitted, running, a rendezvous after a crash, suspended by a user, admitted
    again, completed: every move the job makes goes through the one table, the scheduler's and
    the run's alike, and the API shows the job's state as it is."""
    moves: list[tuple[str, JobState, JobState]] = []
    real_move = Job.move

    def recorded(job: Job, to: JobState) -> None:
        before = job.state
        real_move(job, to)  # raises on a move the table does not allow
        if to != before:
            moves.append((job.id, before, to))

    monkeypatch.setattr(Job, "move", recorded)
    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")], cooldown_s=0.0)
    sim.submit("fixed", "q", 3, 3, preemptible=False, checkpoint=False)
    sim.advance(3)
    sim.submit("a", "q", 2, 3)
    sim.advance(2)
    assert sim.job("a")["state"] == "PENDING"
    sim.finish("fixed")
    sim.advance(4)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and job["epoch_open"] and len(job["members"]) == 3
    victim = sim.co.jobs["a"].members[-1]
    sim._exit(sim.co.jobs["a"].workers[victim].node, victim, -9)
    assert sim.job("a")["state"] == "RENDEZVOUS" and not sim.job("a")["epoch_open"]
    sim.advance(4)
    assert sim.job("a")["state"] == "RUNNING" and sim.job("a")["failures"] == 1
    assert sim.co.suspend("a", "by a test") == {"state": "SUSPENDING"}
    for wid in list(sim.co.jobs["a"].members):
        sim.co.worker_done(wid, p.DoneRequest(step=5, suspended=True))
        sim._exit(sim.co.jobs["a"].workers[wid].node, wid, 0)
    sim.advance(2)
    assert sim.job("a")["state"] == "SUSPENDED"
    sim.co.resume("a")
    sim.advance(4)
    assert sim.job("a")["state"] == "RUNNING" and sim.job("a")["incarnation"] == 2
    first_run = sim.co.cluster.managed["a"].history[0]
    assert first_run.state == JobState.SUSPENDED  # an earlier run keeps how it ended
    sim.finish("a")
    sim.advance(1)
    assert sim.job("a")["state"] == "COMPLETED"

    path = [to for jid, _, to in moves if jid == "a"]
    S = JobState
    assert path == [
        S.ADMITTED,
        S.RUNNING,
        S.RENDEZVOUS,
        S.RUNNING,
        *path[4:-5],
        S.SUSPENDING,
        S.SUSPENDED,
        S.ADMITTED,
        S.RUNNING,
        S.COMPLETED,
    ], path
    assert set(path[4:-5]) <= {S.RENDEZVOUS, S.RUNNING}  # the replacement joining
    assert [to for jid, _, to in moves if jid == "fixed"] == [S.ADMITTED, S.RUNNING, S.COMPLETED]


EVERY_FIELD = {
    # A manifest with every field of JobManifest away from its default (a test below checks that
    # none is left out, so a new field must be added here and so to the store's record).
    "name": "every",
    "queue": "team-b",
    "priorityClassName": "high",
    "minReplicas": 2,
    "maxReplicas": 3,
    "nprocPerReplica": 4,
    "mesh": {"dp_shard": 2, "tp": 2},
    "gpusPerReplica": 4,
    "preemptible": False,
    "gracePeriodSeconds": 45.5,
    "topology": {"level": "node", "mode": "required"},
    "command": ["python", "train.py", "--lr", "3e-4"],
    "checkpointDir": "/ck/every",
    "stragglers": {
        "policy": "evict",
        "window": 7,
        "ratio": 1.6,
        "z": 2.5,
        "windows": 4,
        "madFloor": 0.1,
        "drift": 1.2,
        "cooldownSeconds": 120.0,
    },
    "spares": 1,
    "origin": "maitre/every/5f0c6a4e-0000-4000-8000-000000000000",  # (the operator's object)
}
EVERY_RESTART_FIELD = {
    # What a restart-mode job has and EVERY_FIELD cannot (its in-place features are refused).
    "name": "restarter",
    "queue": "team-a",
    "elastic": "restart",
    "command": "torchrun-style.py --epochs 3",
    "successMarker": "training done",
}


def _set_fields(model: Any) -> set[str]:
    """Dotted names of every field of ``model`` (nested models' too) that is not its default."""
    out = set()
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out |= {f"{name}.{sub}" for sub in _set_fields(value)} | {name}
        elif not info.is_required() and value == info.get_default(call_default_factory=True):
            continue
        else:
            out.add(name)
    return out


def _all_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        out.add(prefix + name)
        inner = [a for a in get_args(info.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in inner:
            out |= _all_fields(sub, f"{prefix}{name}.")
    return out


def test_a_restart_round_trips_every_field_of_every_manifest_through_the_store(tmp_path: Path) -> None:
    """Each job comes back from the store as it was submitted: its manifest equal field for
    field (the straggler policy, the priority class, the mesh...), and the coordinator's own
    record of it (incarnation, hold, suspension, service) the same, across two restarts."""
    full = parse_manifest(EVERY_FIELD)
    covered = _set_fields(full) | _set_fields(parse_manifest(EVERY_RESTART_FIELD))
    assert covered >= _all_fields(JobManifest) - {"priority"}, "EVERY_FIELD leaves out a field"
    sim = Sim(tmp_path, {"n0": 8, "n1": 8}, [Queue("team-a"), Queue("team-b")])
    sim.co.submit(EVERY_FIELD)
    sim.co.submit(EVERY_RESTART_FIELD)
    sim.submit("plain", "team-a", 1, 2)  # defaults, and a number for its priority below
    sim.co.submit({"name": "numbered", "queue": "team-a", "priority": 7, "command": "python x.py --a 'b c'"})
    sim.advance(3)
    sim.co.suspend("plain", "by a test")
    for wid in list(sim.co.jobs["plain"].members):
        sim.co.worker_done(wid, p.DoneRequest(step=2, suspended=True))
        sim._exit("n0" if wid in sim.running["n0"] else "n1", wid, 0)
    sim.advance(2)

    def record(co: Coordinator) -> dict[str, tuple]:
        """What a restart must keep exactly: the manifest and the job's lifecycle."""
        return {
            j: (
                m.manifest,
                m.incarnation,
                m.workers_started,
                m.generation,
                m.suspended_run,
                m.held,
                m.admitted_at,
                m.ended_at,
                m.suspend_deadline,
                m.env,
                dataclasses.replace(m.job, attained_slot_s=0.0, throughput={}, restart_s=0.0),  # (measured)
            )
            for j, m in co.cluster.managed.items()
        }

    def progress(co: Coordinator) -> dict[str, tuple[float, float]]:
        """What it keeps as of its last save of progress (every few seconds, not every tick)."""
        return {j: (m.productive_s, m.job.attained_slot_s) for j, m in co.cluster.managed.items()}

    before, served = record(sim.co), progress(sim.co)
    assert before["every"][0] == full and before["plain"][5] is True  # (held: suspended by a user)
    for _ in range(2):
        sim.co.tick()
        sim.restart()
        after = record(sim.co)
        for job, was in before.items():
            assert after[job][0] == was[0], (job, after[job][0], was[0])
            assert after[job] == was, job
        assert all(0 <= kept <= had for j in served for kept, had in zip(progress(sim.co)[j], served[j]))


def test_a_node_that_joins_a_restart_job_hears_its_next_gang_at_once(tmp_path: Path) -> None:
    """A restart-mode gang stopped to make room for a node that joined: the node held no
    worker of it, so no exit woke it, and it got its start order only at its next beat (2 s
    on a cluster), with the new gang's other members waiting for it in their process group.
    The gang's stop wakes every node of the job's placement."""
    sim = Sim(tmp_path, {"a": 1, "b": 1}, [Queue("q")], cooldown_s=0.0)
    sim.down.add("b")
    manifest = {"name": "r", "queue": "q", "minReplicas": 1, "maxReplicas": 2, "command": ["python", "train.py"]}
    sim.co.submit({**manifest, "elastic": "restart"})
    sim.advance(2.0)
    assert sim.members("r") == 1 and sim.job("r")["state"] == "RUNNING"
    sim.down.discard("b")
    sim.version["b"] = sim.co.node_heartbeat("b", p.NodeBeat(slots=1, since=-1)).version  # b is known
    for _ in range(20):  # the job grows onto it: its gang on a stops
        sim.t += 0.25
        sim.co.tick()
        if sim.job("r")["stopping"]:
            break
    assert sim.job("r")["stopping"], sim.job("r")
    orders = sim.co.node_orders("b", sim.version["b"])  # b's watch: nothing yet (the gang stops)
    assert orders.start == []
    sim.version["b"] = orders.version
    [wid] = sim.running["a"]
    beat = p.NodeBeat(slots=1, since=sim.version["a"], workers=[p.WorkerBeat(id=wid, silent_s=0.0)])
    assert sim.co.node_heartbeat("a", beat).terminate == [wid]
    sim._exit("a", wid, -15)  # its SIGTERM ends it, and the gang
    assert not sim.job("r")["stopping"] and [e for e in sim.job("r")["events"] if e["kind"] == "gang_stopped"]
    assert sim.co.node_version("b") > sim.version["b"], "b's watch did not answer: it waits for its next beat"
    assert sim.co.node_orders("b", sim.version["b"]).start, "no start order for b"
