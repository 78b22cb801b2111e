"""Spot capacity in the live cluster: a node's notice drains it (its workers leave at a step
boundary, or their job checkpoints first), the scheduler places nothing there after, the node's
going is a reclaim and no failure, and the cost report charges slot-seconds at each node's
price. First on the control plane alone (test_control_plane's simulated agents and workers, on
an injected clock), then with real agents, workers and a notice file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from maitre import protocol as p
from maitre.control.cluster import DEFAULT_PRICES
from conftest import wait_for
from test_control_plane import Sim
from maitre.scheduling.model import Queue

pytestmark = pytest.mark.timeout(60)


class SpotSim(Sim):
    """Workers that are asked to suspend checkpoint and say so (as the loop does)."""

    def _worker(self, node: str, wid: str) -> None:
        ms = self.co.workers.run(wid)
        view = self.views[wid]
        if view.suspend and wid in ms.members and not view.stop:
            self.co.worker_done(wid, p.DoneRequest(step=self.steps.get(wid, 0), suspended=True))
            self._exit(node, wid, 0)
            return
        super()._worker(node, wid)


def _spot_sim(tmp_path: Path, nodes: dict[str, int], spot: set[str]) -> SpotSim:
    sim = SpotSim(tmp_path, nodes, [Queue("team-a"), Queue("team-b")], cooldown_s=1.0)
    sim.labels = {n: {"capacity_type": "spot" if n in spot else "on-demand"} for n in nodes}
    return sim


def _notice(notice_s: float = 30.0) -> p.SpotNotice:
    return p.SpotNotice(notice_s=notice_s, source="file:/notices/s0.json")


def _events(sim: Sim, kind: str) -> list[dict]:
    return [e for e in sim.db.events() if e["kind"] == kind]


def test_a_noticed_node_is_drained_gracefully_and_reclaimed_without_a_failure(tmp_path: Path) -> None:
    sim = _spot_sim(tmp_path, {"n0": 2, "n1": 2, "s0": 2}, spot={"s0"})
    sim.submit("a", "team-a", 1, 6)
    sim.advance(4)
    assert sim.job("a")["placement"] == {"n0": 2, "n1": 2, "s0": 2}
    registered = {e["node"]: e for e in _events(sim, "node_registered")}
    assert registered["s0"]["labels"] == {"capacity_type": "spot"}
    assert registered["s0"]["price"] == DEFAULT_PRICES["spot"]
    assert registered["n0"]["price"] == DEFAULT_PRICES["on-demand"]
    on_spot = {w for w in sim.running["s0"]}
    assert len(on_spot) == 2

    noticed_at = sim.t
    sim.notices["s0"] = _notice(30.0)
    sim.advance(2)
    job = sim.job("a")
    assert not sim.running["s0"], "the node's workers are gone well within the notice"
    for wid in on_spot:  # they left at a step boundary; none was killed
        w = sim.co.workers.run(wid).workers[wid]
        assert w.state.value == "LEFT" and w.exit_code == 0, (wid, w)
    assert job["state"] == "RUNNING" and len(job["members"]) == 4 and job["failures"] == 0
    assert "s0" not in job["placement"]
    [notice] = _events(sim, "spot_notice")
    assert notice["node"] == "s0" and notice["notice_s"] == 30.0
    assert notice["deadline"] == pytest.approx(noticed_at + 0.25 + 30.0, abs=0.3)
    assert notice["source"] == "file:/notices/s0.json"
    [drained] = _events(sim, "node_drained")
    assert sorted(drained["workers"]) == sorted(on_spot) and 0 <= drained["seconds"] < 2
    shrink = [e for e in _events(sim, "shrink") if e.get("job") == "a"]
    assert shrink and shrink[-1]["reason"] == "spot notice on s0"
    nodes = {n["node"]: n for n in sim.co.nodes_view()}
    assert nodes["s0"]["draining"] and not nodes["s0"]["reclaimed"]

    # Free slots on the spot node, and a job that would take them: nothing goes there.
    sim.submit("b", "team-b", 1, 4)
    sim.advance(4)
    assert not sim.running["s0"] and "s0" not in sim.job("b")["placement"]
    assert sim.members("a") + sim.members("b") == 4

    sim.down.add("s0")  # the machine goes (its agent falls silent)
    sim.advance(8)
    assert [e["node"] for e in _events(sim, "node_reclaimed")] == ["s0"]
    assert not [e for e in _events(sim, "node_dead") if e["node"] == "s0"]
    assert sim.job("a")["failures"] == sim.job("b")["failures"] == 0
    report = sim.co.report()
    assert report["reclaims"] == 1

    # The cost of what was held, each worker's slot-seconds at its node's price.
    expect = {"a": [0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.0]}
    for jid in expect:
        for w in sim.co.jobs[jid].workers.values() if jid in sim.co.jobs else []:
            slot_s = ((w.ended_at if w.ended_at is not None else sim.t) - w.started_at) * w.slots
            price = DEFAULT_PRICES["spot" if w.node == "s0" else "on-demand"]
            expect[jid][0] += slot_s * price / 3600
            expect[jid][1] += slot_s * DEFAULT_PRICES["on-demand"] / 3600
            expect[jid][2] += slot_s if w.node == "s0" else 0.0
    a = report["jobs"]["a"]
    assert a["cost"] == pytest.approx(expect["a"][0], rel=1e-4)
    assert a["on_demand_cost"] == pytest.approx(expect["a"][1], rel=1e-4)
    assert a["spot_slot_s"] == pytest.approx(expect["a"][2], abs=0.02) and a["spot_slot_s"] > 0
    assert a["cost"] < a["on_demand_cost"]
    assert report["jobs"]["b"]["cost"] == pytest.approx(report["jobs"]["b"]["on_demand_cost"])
    assert report["queues"]["team-a"]["cost"] == pytest.approx(a["cost"], rel=1e-4)
    assert report["cost"] == pytest.approx(expect["a"][0] + expect["b"][0], rel=1e-4)
    assert report["prices"] == DEFAULT_PRICES


def test_a_job_whose_only_live_state_is_on_the_node_checkpoints_first_and_runs_elsewhere(tmp_path: Path) -> None:
    sim = _spot_sim(tmp_path, {"s0": 2, "n0": 2}, spot={"s0"})
    sim.down.add("n0")  # not there yet: the job starts on the spot node
    sim.submit("a", "team-a", 2, 2)
    sim.advance(3)
    assert sim.job("a")["placement"] == {"s0": 2} and sim.job("a")["state"] == "RUNNING"
    sim.down.discard("n0")
    sim.advance(2)
    sim.notices["s0"] = _notice(30.0)
    sim.advance(4)
    [suspend] = [e for e in _events(sim, "suspend") if e.get("job") == "a"]
    assert "spot notice on s0" in suspend["reason"] and "checkpoints first" in suspend["reason"]
    assert _events(sim, "job_suspended")
    job = sim.job("a")
    assert job["incarnation"] == 2 and job["state"] == "RUNNING", job
    assert job["placement"] == {"n0": 2} and not sim.running["s0"]
    resumed = [e for e in _events(sim, "admit") if e.get("job") == "a"][-1]
    assert resumed["resumes"] is True
    assert job["failures"] == 0
    [drained] = _events(sim, "node_drained")
    assert len(drained["workers"]) == 2


def test_the_deadline_passing_reclaims_a_node_that_still_beats(tmp_path: Path) -> None:
    sim = _spot_sim(tmp_path, {"n0": 2, "s0": 1}, spot={"s0"})
    sim.advance(1)
    sim.notices["s0"] = _notice(3.0)
    sim.advance(2)
    assert not _events(sim, "node_reclaimed")
    sim.advance(2)
    assert [e["node"] for e in _events(sim, "node_reclaimed")] == ["s0"]
    sim.advance(2)  # its agent still beats its notice: it stays out
    assert {n["node"]: n["reclaimed"] for n in sim.co.nodes_view()}["s0"] is True
    del sim.notices["s0"]  # a new machine of that name, without a notice
    sim.advance(1)
    assert len([e for e in _events(sim, "node_registered") if e["node"] == "s0"]) == 2
    assert sim.co.report()["reclaims"] == 1


def test_an_agent_that_stops_under_its_notice_is_reclaimed_at_the_next_pass(tmp_path: Path) -> None:
    sim = _spot_sim(tmp_path, {"n0": 2, "s0": 1}, spot={"s0"})
    sim.advance(1)
    sim.notices["s0"] = _notice(30.0)
    sim.advance(1)
    sim.notices["s0"] = _notice(0.0)  # its last beat: "going now"
    sim.advance(0.75)
    assert [e["node"] for e in _events(sim, "node_reclaimed")] == ["s0"]
    assert not _events(sim, "node_dead")


def test_no_price_table_means_no_price_and_no_cost(tmp_path: Path) -> None:
    from maitre.control.cluster import ClusterState

    with pytest.raises(ValueError, match="spot price"):
        ClusterState([Queue("q")], run_dir=tmp_path, prices={"spot": -1.0})
    cluster = ClusterState([Queue("q")], run_dir=tmp_path, prices={})
    assert cluster.node_price("anything") is None


@pytest.mark.parametrize(
    "args,words",
    [
        (("up", "--price", "spot=cheap"), "'cheap' is not a number"),
        (("up", "--price", "spot=-1"), "a price is a number >= 0"),
        (("up", "--price", "spot=inf"), "a price is a number >= 0"),
        (("up", "--price", "gpu=1"), "expected on-demand=PRICE or spot=PRICE"),
        (("up", "--price", "spot=1", "--price", "spot=2"), "spot is given twice"),
        (("up", "--nodes", "2", "--spot-nodes", "3"), "--spot-nodes must be between 0 and --nodes 2"),
        (
            ("agent", "--coordinator", "127.0.0.1:1", "--spot-notice", "/tmp/n.json"),
            "expected file:PATH or an http(s):// URL",
        ),
        (("agent", "--coordinator", "127.0.0.1:1", "--spot-notice", "http://"), "has no host"),
        (
            ("agent", "--coordinator", "127.0.0.1:1", "--spot-notice", "file:/tmp/n", "--spot-notice-interval", "0"),
            "--spot-notice-interval must be a positive number",
        ),
        (
            ("agent", "--coordinator", "127.0.0.1:1", "--spot-notice-interval", "5"),
            "--spot-notice-interval needs --spot-notice",
        ),
    ],
)
def test_bad_spot_flags_are_one_line_and_exit_2(args, words, capsys, tmp_path: Path) -> None:
    from maitre.cli import main

    assert main([*args] + (["--state-dir", str(tmp_path / "s")] if args[0] == "up" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maitre: error:") and words in err and "\n" not in err, err
    assert not (tmp_path / "s").exists()  # nothing was started or written


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spot_notice_with_30s_warning_drains_real_workers_and_loses_no_sample(tmp_path: Path, reference) -> None:
    """Real agents and workers: ``b`` (a fixed gang of 1) runs on the spot node alone and
    ``a`` (1..3) across it and an on-demand node. A notice file with 30 s of warning: the spot
    node's workers are gone well within it, ``a`` trains on the others, ``b`` checkpoints first
    and resumes on the on-demand node; the node is reclaimed when its agent stops. Both end with
    every sample exactly once and the parameters of a fixed-size run, and no failure."""
    import torch

    from conftest import example_command, relative_error
    from maitre.local import LocalCluster, UpConfig
    from maitre.runtime.ledger import audit
    from maitre.scheduling.policy import PolicyConfig

    steps = {"a": 500, "b": 240}
    out = {j: tmp_path / f"{j}.pt" for j in steps}
    lines: list[str] = []
    cluster = LocalCluster(
        UpConfig(
            state_dir=tmp_path / "state",
            queues=[Queue("q")],
            policy=PolicyConfig(resize_cooldown_s=1.0),
            notice_interval_s=0.2,
        ),
        out=lines.append,
    ).start()
    co = cluster.coordinator

    def manifest(name: str, lo: int, hi: int) -> dict:
        return {
            "name": name,
            "queue": "q",
            "minReplicas": lo,
            "maxReplicas": hi,
            "checkpointDir": str(tmp_path / "ck" / name),
            "command": example_command(steps[name], out[name]) + ["--device-ms-per-sample", "8"],
        }

    def on_spot() -> set[str]:
        return {w["id"] for j in ("a", "b") for w in co.job_status(j)["workers"] if w["node"] == "node-0"}

    try:
        cluster.add_node(slots=2, spot=True)  # node-0
        wait_for(lambda: co.nodes_view(), 20, "the spot node", lines)
        co.submit(manifest("b", 1, 1))
        wait_for(lambda: co.job_status("b")["step"] >= 5, 90, "b to train on the spot node", lines)
        co.submit(manifest("a", 1, 3))
        wait_for(lambda: co.job_status("a")["step"] >= 5, 90, "a to train on the spot node", lines)
        cluster.add_node(slots=3)  # node-1, on-demand: a grows onto it
        wait_for(
            lambda: (
                lambda a: (
                    len(a["members"]) == 3
                    and a["state"] == "RUNNING"
                    and min(w["step"] for w in a["workers"] if w["id"] in a["members"]) > 0
                )
            )(co.job_status("a")),
            90,
            "a to grow to 3 workers",
            lines,
        )
        assert co.job_status("a")["placement"] == {"node-0": 1, "node-1": 2}
        assert co.job_status("b")["placement"] == {"node-0": 1}
        before = on_spot()
        path = cluster.notice_file("node-0")
        path.with_suffix(".tmp").write_text(json.dumps({"notice_s": 30}))
        os.replace(path.with_suffix(".tmp"), path)
        noticed = time.monotonic()
        drained = wait_for(
            lambda: [e for e in cluster.db.events() if e["kind"] == "node_drained"], 30, "node-0 to drain", lines
        )[0]
        gone_after = time.monotonic() - noticed
        assert drained["seconds"] < 15 and gone_after < 20, (drained, gone_after)
        assert not any(cluster.agents[0].running()), "the spot node's processes are gone"
        cluster.remove_node("node-0")  # the machine goes
        wait_for(
            lambda: [e for e in cluster.db.events() if e["kind"] == "node_reclaimed"],
            30,
            "node-0 to be reclaimed",
            lines,
        )
        wait_for(
            lambda: all(co.job_status(j)["state"] == "COMPLETED" for j in steps), 200, "both jobs to finish", lines
        )
        statuses = {j: co.job_status(j) for j in steps}
        events = list(cluster.db.events())
        after = on_spot()
    finally:
        cluster.stop(drain_s=10)
    log = "\n".join(lines)
    assert after <= before, "nothing was placed on the spot node after its notice"
    assert sorted(drained["workers"]) == sorted(before), (drained, before)
    kinds = [(e["kind"], e.get("job")) for e in events]
    assert ("spot_notice", None) in kinds and ("node_reclaimed", None) in kinds, log
    assert not [e for e in events if e["kind"] == "node_dead"], log
    notice = next(e for e in events if e["kind"] == "spot_notice")
    assert notice["notice_s"] <= 30 and notice["source"].startswith("file:")
    assert any(k == ("suspend", "b") for k in kinds) and any(k == ("job_suspended", "b") for k in kinds), log
    assert statuses["b"]["incarnation"] == 2 and statuses["a"]["incarnation"] == 1
    assert any(e["kind"] == "shrink" and e.get("job") == "a" and "spot notice" in e["reason"] for e in events), log
    for j, status in statuses.items():
        assert status["failures"] == 0, (j, status)
        result = audit(tmp_path / "state" / "ledger" / j)
        assert result.ok, (j, result.describe())
        assert relative_error(torch.load(out[j], weights_only=True), reference(steps[j])) < 1e-9, j
