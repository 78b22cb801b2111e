"""Warm spares (issue 15): a job's ``spares: N`` workers are started on slots no allocation holds
and held back from every epoch; a lost member's place goes to one at the next epoch (no cold
start), the allocation follows it and a new spare starts; a job that needs a spare's slot gets
it. First on the control plane alone (test_control_plane's simulated agents and workers, on an
injected clock), then with real agents and workers, a member SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from maitre.control.membership import WorkerState
from maitre.errors import BadRequest
from maitre.scheduling.model import Queue
from test_control_plane import Sim

pytestmark = pytest.mark.timeout(60)


def _submit(sim: Sim, name: str, lo: int, hi: int, spares: int = 0, priority: str = "normal") -> None:
    sim.co.submit(
        {
            "name": name,
            "queue": "q",
            "minReplicas": lo,
            "maxReplicas": hi,
            "priorityClassName": priority,
            "spares": spares,
            "checkpointDir": str(sim.tmp / "ck" / name),
            "command": ["python", "t.py"],
        }
    )


def _kinds(sim: Sim, kind: str) -> list[dict]:
    return [e for e in sim.db.events() if e["kind"] == kind]


def _workers(sim: Sim, job: str) -> dict[str, object]:
    return dict(sim.co.jobs[job].workers)


def test_a_spare_is_started_and_held_back_and_its_slot_counts_as_free(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and len(job["members"]) == 2 and job["epoch"] == 1
    assert sum(job["placement"].values()) == 2, "the spare is no replica of the job"
    assert len(job["spares"]) == 1 and job["spares_wanted"] == 1
    from maitre.cli import _spares
    from maitre.protocol import JobStatus

    JobStatus.model_validate(job)  # (the API's shape: spares, spares_wanted, spare)
    assert _spares(job) == "1/1", "maitre status: SPARES waiting/kept"
    from test_metrics import sample

    text = sim.co.metrics.render().decode()
    assert sample(text, "maitre_job_slots_held", job="a") == 2
    assert sample(text, "maitre_job_spare_slots", job="a") == 1
    spare = sim.co.jobs["a"].workers[job["spares"][0]]
    assert spare.spare and spare.state == WorkerState.READY and spare.id not in job["members"]
    held = {(w.node, w.slot) for w in sim.co.jobs["a"].live_workers()}
    assert (spare.node, spare.slot) not in held, "on a slot no member holds"
    assert [e["worker"] for e in _kinds(sim, "spare_started")] == [spare.id]
    assert [e["worker"] for e in _kinds(sim, "spare_ready")] == [spare.id]
    view, jobs = sim.co.cluster.prepare(sim.t)
    free = view.capacity - sum(j.slots for j in jobs)
    assert free == 1, "the scheduler sees the spare's slot free"
    sim.advance(3)
    assert sim.job("a")["epoch"] == 1, "a waiting spare closes no epoch"


def test_maitre_status_marks_spares_in_the_nodes_lists(tmp_path: Path, monkeypatch, capsys) -> None:
    """The jobs' and nodes' tables of ``maitre status`` as the coordinator's routes give them:
    a spare counts in SPARES, not WORKERS, and is marked where its node lists it."""
    import argparse

    from maitre import cli, protocol

    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    routes = {
        protocol.JOBS: {"jobs": sim.co.job_list()},
        protocol.NODES: {"nodes": sim.co.nodes_view()},
        protocol.QUEUES: {"queues": []},
        protocol.REPORT: sim.co.report(),
    }
    monkeypatch.setattr(
        cli, "_coordinator", lambda args: type("Client", (), {"get": staticmethod(lambda path: routes[path])})()
    )
    assert cli.cmd_status(argparse.Namespace(job=None, json=False)) == 0
    out = capsys.readouterr().out
    [spare] = sim.job("a")["spares"]
    assert re.search(r"a\s+q\s+\d+\s+RUNNING\s+1\s+\d+\s+2/2\s+1/1", out), out
    assert f"{spare}(spare)" in out and out.count("(spare)") == 1, out


def test_a_killed_member_is_replaced_by_the_spare_and_a_new_spare_starts(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    before = sim.job("a")
    spare = before["spares"][0]
    victim = next(
        m for m in before["members"] if sim.co.jobs["a"].workers[m].node != sim.co.jobs["a"].workers[spare].node
    )
    node = sim.co.jobs["a"].workers[victim].node
    started = set(_workers(sim, "a"))
    sim._exit(node, victim, -9)  # SIGKILL
    sim.advance(2)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and job["epoch"] == 2
    assert spare in job["members"] and victim not in job["members"] and len(job["members"]) == 2
    promoted = _kinds(sim, "spare_promoted")
    assert [(e["worker"], e["replacing"]) for e in promoted] == [(spare, victim)]
    assert 0 <= promoted[0]["seconds"] < 2
    spare_node = sim.co.jobs["a"].workers[spare].node
    assert job["placement"].get(spare_node, 0) >= 1 and sum(job["placement"].values()) == 2
    new = set(_workers(sim, "a")) - started
    assert len(new) == 1, "no cold replacement: one new worker, the new spare"
    (fresh,) = new
    assert sim.co.jobs["a"].workers[fresh].spare and job["spares"] == [fresh]
    assert job["failures"] == 1


def test_a_job_that_needs_the_spares_slot_takes_it(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    spare = sim.job("a")["spares"][0]
    _submit(sim, "b", 1, 1, priority="high")
    sim.advance(4)
    b, a = sim.job("b"), sim.job("a")
    assert b["state"] == "RUNNING" and len(b["members"]) == 1
    assert a["state"] == "RUNNING" and a["epoch"] == 1 and a["failures"] == 0, a
    released = _kinds(sim, "spare_released")
    assert [e["worker"] for e in released] == [spare] and "job b" in released[0]["reason"]
    assert a["spares"] == [], "no slot is left for a spare"
    assert not any(e.get("spare") is None and e["worker"] == spare for e in _kinds(sim, "worker_dead"))
    sim.finish("b")
    sim.advance(3)
    assert len(sim.job("a")["spares"]) == 1, "a spare again once the slot is free"


def test_a_spare_that_dies_is_no_failure_and_one_over_the_max_is_refused(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 3}, [Queue("q")])
    with pytest.raises(BadRequest, match="spares 3 is more than maxReplicas 2"):
        _submit(sim, "x", 1, 2, spares=3)
    assert "x" not in sim.co.cluster.managed and not list(sim.db.jobs())
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    spare = sim.job("a")["spares"][0]
    sim._exit("n0", spare, -9)
    sim.advance(2)
    job = sim.job("a")
    assert job["failures"] == 0 and job["epoch"] == 1
    assert len(job["spares"]) == 1 and job["spares"] != [spare]


@pytest.mark.timeout(240)  # (10-20 s, most of it the first workers' start)
def test_a_sigkilled_member_is_replaced_by_its_warm_spare_and_the_job_stays_exact(tmp_path: Path, reference) -> None:
    """Real agents and workers: ``a`` (2 workers, 1 spare) on 3 slots. A member SIGKILLed: the
    spare is in the next epoch and trains, no cold worker is started in its place, a new spare
    starts, and the job ends with every sample exactly once and a fixed-size run's parameters."""
    import torch

    from conftest import example_command, relative_error, wait_for
    from maitre.local import LocalCluster, UpConfig
    from maitre.runtime.ledger import audit

    steps, out = 100, tmp_path / "a.pt"
    lines: list[str] = []
    cluster = LocalCluster(UpConfig(state_dir=tmp_path / "state", queues=[Queue("q")]), out=lines.append).start()
    co = cluster.coordinator
    try:
        cluster.add_node(slots=2)
        cluster.add_node(slots=1)
        co.submit(
            {
                "name": "a",
                "queue": "q",
                "minReplicas": 2,
                "maxReplicas": 2,
                "spares": 1,
                "command": example_command(steps, out) + ["--device-ms-per-sample", "2"],
            }
        )
        status = wait_for(
            lambda: (
                lambda s: (
                    s["step"] >= 5
                    and len(s["spares"]) == 1
                    and co.jobs["a"].workers[s["spares"][0]].state == WorkerState.READY
                    and s
                )
            )(co.job_status("a")),
            120,
            "a to train with a ready spare",
            lines,
        )
        assert status["epoch"] == 1 and len(status["members"]) == 2
        spare = status["spares"][0]
        before = {w["id"] for w in status["workers"]}
        victim = next(m for m in status["members"] if co.jobs["a"].workers[m].node != co.jobs["a"].workers[spare].node)
        os.kill(cluster.pid_of(victim), signal.SIGKILL)
        wait_for(lambda: co.job_status("a")["state"] == "COMPLETED", 120, "a to finish", lines)
        status = co.job_status("a")
        events = list(cluster.db.events())
    finally:
        cluster.stop(drain_s=5)
    log = "\n".join(lines)
    promoted = [e for e in events if e["kind"] == "spare_promoted"]
    assert [(e["worker"], e["replacing"]) for e in promoted] == [(spare, victim)], log
    assert spare in status["members"] and victim not in status["members"], status
    new = {w["id"] for w in status["workers"]} - before
    started = [e["worker"] for e in events if e["kind"] == "spare_started"]
    assert new and set(started) >= new, ("only spares were started after the kill", new, log)
    assert len(started) == 2, log
    ledger = tmp_path / "state" / "ledger" / "a"
    result = audit(ledger)
    assert result.ok, result.describe()
    shares = [
        r for r in map(json.loads, (ledger / f"{spare}.jsonl").read_text().splitlines()) if r["k"] == "a" and r["i"]
    ]
    assert len(shares) > 10, "the spare trained on its shares of the data"
    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-9


@pytest.mark.timeout(120)
def test_the_jobs_page_shows_its_spares_apart_from_its_slots(tmp_path: Path) -> None:
    from browser import replay_page
    from test_dashboard import TOKEN

    events = [
        {"kind": "node_registered", "node": "n0", "slots": 2, "labels": {}, "price": None},
        {"kind": "node_registered", "node": "n1", "slots": 1, "labels": {}, "price": None},
        {"kind": "submitted", "job": "a", "queue": "q", "priority": 0, "replicas": [2, 2]},
        {"kind": "admit", "job": "a", "placement": {"n0": 2}},
        {"kind": "spare_started", "job": "a", "worker": "a-w3", "node": "n1"},
        {"kind": "spare_ready", "job": "a", "worker": "a-w3", "seconds": 1.0},
        {"kind": "epoch", "job": "a", "epoch": 1, "members": ["a-w1", "a-w2"], "reason": "start"},
        {"kind": "worker_dead", "job": "a", "worker": "a-w1", "reason": "killed by signal 9"},
        {
            "kind": "spare_assigned",
            "job": "a",
            "worker": "a-w3",
            "replacing": "a-w1",
            "node": "n1",
            "placement": {"n0": 1, "n1": 1},
        },
        {"kind": "spare_started", "job": "a", "worker": "a-w4", "node": "n0"},
        {
            "kind": "spare_promoted",
            "job": "a",
            "worker": "a-w3",
            "replacing": "a-w1",
            "node": "n1",
            "epoch": 2,
            "seconds": 0.31,
        },
    ]
    with replay_page(tmp_path, events, TOKEN) as page:
        page.view("job/a")
        assert "1 warm spare(s), not in the slots held" in page.page.inner_text("#job")
        rows = [page.page.locator("#job #spares tr").nth(k).inner_text() for k in (1, 2)]
        assert "a-w4" in rows[0] and "starting" in rows[0], rows
        assert "a-w3" in rows[1] and "a-w1" in rows[1] and "0.31 s" in rows[1], rows
        assert page.page_errors() == []


def test_spares_survive_a_coordinator_restart_and_replace_a_dead_nodes_member(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 1, "n1": 1, "n2": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    spare = sim.job("a")["spares"][0]
    sim.restart()  # a new coordinator reads the store: the spare is still one
    sim.advance(2)
    job = sim.job("a")
    assert job["spares"] == [spare] and job["epoch"] == 1 and spare not in job["members"]
    victim = job["members"][0]
    dead = sim.co.jobs["a"].workers[victim].node
    sim.down.add(dead)  # its agent and workers fall silent
    sim.advance(10)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and spare in job["members"] and len(job["members"]) == 2
    assert dead not in job["placement"] and sum(job["placement"].values()) == 2, job
    assert [e["replacing"] for e in _kinds(sim, "spare_promoted")] == [victim]


def test_a_noticed_node_lets_its_spare_go_and_drains(tmp_path: Path) -> None:
    from maitre import protocol as p

    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    spare = sim.co.jobs["a"].workers[sim.job("a")["spares"][0]]
    assert spare.node == "n1"
    sim.notices["n1"] = p.SpotNotice(notice_s=30.0, source="file:/n1.json")
    sim.advance(2)
    assert [e["worker"] for e in _kinds(sim, "spare_released")] == [spare.id]
    assert [e["node"] for e in _kinds(sim, "node_drained")] == ["n1"]
    assert sim.job("a")["epoch"] == 1 and sim.job("a")["failures"] == 0


def test_a_spare_whose_script_fails_is_started_again_only_so_often(tmp_path: Path) -> None:
    from maitre import protocol as p

    sim = Sim(tmp_path, {"n0": 3}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(3)
    failed = []
    for _ in range(6):  # its script raises before its first rendezvous, every time
        spares = sim.job("a")["spares"]
        if not spares:
            break
        failed.append(spares[0])
        sim.running["n0"].discard(spares[0])
        sim.co.worker_exit(spares[0], p.ExitRequest(code=1, error="ImportError: no module x"))
        sim.advance(1)
    ms = sim.co.jobs["a"]
    assert len(failed) == ms.spec.max_restarts + 1 and sim.job("a")["spares"] == []
    assert sim.job("a")["state"] == "RUNNING" and sim.job("a")["failures"] == 0


def test_a_replica_placed_on_its_own_spares_slot_is_that_spare(tmp_path: Path) -> None:
    """A repair that moves a replica of the job onto the node of its spare (as the health
    policy's eviction does, outside the scheduling pass) promotes the spare: it is not stopped
    to start the same worker again cold."""
    sim = Sim(tmp_path, {"n0": 2, "n1": 1}, [Queue("q")])
    _submit(sim, "a", 2, 2, spares=1)
    sim.advance(5)
    ms, m = sim.co.jobs["a"], sim.co.cluster.managed["a"]
    spare = sim.job("a")["spares"][0]
    assert ms.workers[spare].node == "n1"
    victim = sim.job("a")["members"][1]
    with sim.co.lock:  # the member is asked to leave, its replica placed on n1
        ms._set_state(ms.workers[victim], WorkerState.LEAVING)
        m.job.placement = {"n0": 1, "n1": 1}
        sim.co.cluster.index_allocations()
        sim.co._changed("a", persist=True)
    started = set(ms.workers)
    sim.advance(3)
    job = sim.job("a")
    assert spare in job["members"] and victim not in job["members"], job
    assert job["placement"] == {"n0": 1, "n1": 1} and job["failures"] == 0
    assert not _kinds(sim, "spare_released")
    assert all(ms.workers[w].spare for w in set(ms.workers) - started), "no cold start"
