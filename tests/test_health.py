"""Sick nodes (issue 15): the agent's health probes (real child processes: a failing check, a
hung one killed at its timeout), a failing probe draining its node until one passes, and the
``evict`` policy: a straggler's replica leaves, its node is suspect, the job takes a free slot
elsewhere at once. First on the control plane alone (test_control_plane's simulated agents and
workers, on an injected clock), then with a real agent."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from maitre import protocol as p
from maitre.agent.health import HealthConfig, HealthMonitor, Prober, judge, run_child
from maitre.scheduling.model import Queue
from conftest import wait_for
from test_control_plane import Sim
from test_metrics import sample
from test_spot import SpotSim

pytestmark = pytest.mark.timeout(60)


def _events(sim: Sim, kind: str) -> list[dict]:
    return [e for e in sim.db.events() if e["kind"] == kind]


def _health(i: int, ok: bool, detail: str = "") -> p.NodeHealth:
    return p.NodeHealth(id=i, ok=ok, detail=detail or ("ok" if ok else "ECC error"), seconds=0.4, probe="command")


# -- the control plane ------------------------------------------------------------------------------
def test_a_failing_probe_drains_its_node_and_no_work_goes_there_until_one_passes(tmp_path: Path) -> None:
    sim = SpotSim(tmp_path, {"n0": 2, "n1": 2, "n2": 2}, [Queue("q")], cooldown_s=1.0)
    for n in sim.slots:
        sim.health[n] = _health(1, True)
    sim.submit("a", "q", 1, 6)
    sim.advance(4)
    assert sim.job("a")["placement"] == {"n0": 2, "n1": 2, "n2": 2}
    on_n2 = set(sim.running["n2"])
    assert len(on_n2) == 2 and len(_events(sim, "node_health")) == 3

    sim.health["n2"] = _health(2, False, "gpu 3: ECC error")
    sim.advance(2)
    assert not sim.running["n2"], "the node's workers are gone"
    for wid in on_n2:  # they left at a step boundary; none was killed
        w = sim.co.workers.run(wid).workers[wid]
        assert w.state.value == "LEFT" and w.exit_code == 0, (wid, w)
    job = sim.job("a")
    assert job["state"] == "RUNNING" and len(job["members"]) == 4 and job["failures"] == 0
    assert "n2" not in job["placement"]
    bad = [e for e in _events(sim, "node_health") if not e["ok"]]
    assert [(e["node"], e["detail"], e["probe"], e["seconds"]) for e in bad] == [
        ("n2", "gpu 3: ECC error", "command", 0.4)
    ]
    shrink = [e for e in _events(sim, "shrink") if e.get("job") == "a"]
    assert shrink and shrink[-1]["reason"] == "health probe failed on n2 (command)"
    view = {n["node"]: n for n in sim.co.nodes_view()}["n2"]
    assert view["unhealthy"] and view["health"]["ok"] is False
    assert view["health"]["detail"] == "gpu 3: ECC error"
    p.NodeList(nodes=sim.co.nodes_view())  # as `maitre status` gets it
    assert sample(sim.co.metrics.render().decode(), "maitre_health_probe_failures_total") == 1

    # Free slots there, and a job that wants them: none goes there while its probe fails.
    sim.submit("b", "q", 1, 4)
    sim.advance(4)
    assert not sim.running["n2"] and "n2" not in sim.job("b")["placement"]
    assert sim.members("a") + sim.members("b") == 4
    sim.advance(2)  # the same result again is no news
    assert len([e for e in _events(sim, "node_health") if not e["ok"]]) == 1

    sim.health["n2"] = _health(3, True)
    sim.advance(4)
    assert sim.running["n2"], "work goes there again once a probe passes"
    assert not {n["node"]: n for n in sim.co.nodes_view()}["n2"]["unhealthy"]


def test_a_job_whose_only_live_state_is_on_the_failing_node_checkpoints_first(tmp_path: Path) -> None:
    sim = SpotSim(tmp_path, {"s0": 2, "n0": 2}, [Queue("q")], cooldown_s=1.0)
    sim.down.add("n0")  # not there yet: the job starts on s0
    sim.submit("a", "q", 2, 2)
    sim.advance(3)
    assert sim.job("a")["placement"] == {"s0": 2}
    sim.down.discard("n0")
    sim.advance(1)
    sim.health["s0"] = _health(1, False)
    sim.advance(4)
    [suspend] = [e for e in _events(sim, "suspend") if e.get("job") == "a"]
    assert suspend["reason"].startswith("health probe failed on s0") and "checkpoints first" in suspend["reason"]
    job = sim.job("a")
    assert job["incarnation"] == 2 and job["state"] == "RUNNING" and job["failures"] == 0
    assert job["placement"] == {"n0": 2} and not sim.running["s0"]


def test_a_node_that_fails_its_first_probe_never_gets_work(tmp_path: Path) -> None:
    sim = Sim(tmp_path, {"n0": 1, "n1": 1}, [Queue("q")], cooldown_s=1.0)
    sim.health = {"n0": _health(1, True), "n1": _health(1, False, "timed out after 60s")}
    sim.submit("a", "q", 1, 2)
    sim.advance(4)
    assert sim.job("a")["placement"] == {"n0": 1} and not sim.running["n1"]


def _evict_sim(tmp_path: Path, cooldown_s: float = 30.0, resize_cooldown_s: float = 60.0, spares: int = 0) -> Sim:
    sim = Sim(tmp_path, {f"n{i}": 1 for i in range(4)}, [Queue("q")], cooldown_s=resize_cooldown_s)
    for n in sim.slots:
        sim.health[n] = _health(1, True)
    sim.co.submit(
        {
            "name": "a",
            "queue": "q",
            "minReplicas": 2,
            "maxReplicas": 3,
            "command": ["python", "train.py"],
            "stragglers": {"policy": "evict", "cooldownSeconds": cooldown_s},
            "spares": spares,
        }
    )
    sim.advance(3)
    assert len(sim.job("a")["members"]) == 3 and len(sim.job("a")["spares"]) == spares
    return sim


def _straggle(sim: Sim, slow: str, policy: str = "evict") -> None:
    ms = sim.co.jobs["a"]
    rank0 = ms.members[0]
    sim.co.worker_report(
        rank0,
        {
            "kind": "straggler",
            "straggler": slow,
            "rank": 2,
            "epoch": ms.epoch,
            "world_size": 3,
            "ratio": 2.0,
            "since_step": 1,
            "step": 10,
            "windows": 2,
            "evidence": [],
            "policy": policy,
            "thresholds": {},
        },
    )


def test_evict_moves_the_stragglers_replica_to_a_free_node_at_once_and_suspects_its_node(tmp_path: Path) -> None:
    sim = _evict_sim(tmp_path)
    job = sim.job("a")
    [free] = [n for n in sim.slots if n not in job["placement"]]
    ms = sim.co.jobs["a"]
    slow = ms.members[-1]
    node = ms.workers[slow].node
    _straggle(sim, slow)
    [suspect] = _events(sim, "node_suspect")
    assert suspect["node"] == node and suspect["worker"] == slow and "2.00x" in suspect["reason"]
    assert suspect["until"] == pytest.approx(sim.t + 30.0, abs=0.01)
    [repair] = [e for e in _events(sim, "repair") if e.get("job") == "a"]
    assert free in repair["placement"] and node not in repair["placement"]
    sim.advance(0.5)  # a beat, then the step boundary: no resize cooldown (60 s here)
    assert sim.probe_asked[node], "the suspect node is asked for a probe"
    sim.advance(2)
    w = ms.workers[slow]
    assert w.state.value == "LEFT" and w.exit_code == 0
    job = sim.job("a")
    assert len(job["members"]) == 3 and job["failures"] == 0 and node not in job["placement"]
    assert sim.running[free] and not sim.running[node]
    view = {n["node"]: n for n in sim.co.nodes_view()}[node]
    assert view["suspect"]["reason"] == suspect["reason"]
    assert sample(sim.co.metrics.render().decode(), "maitre_evictions_total", job="a") == 1
    _straggle(sim, slow)  # a second verdict about the one gone changes nothing
    assert len(_events(sim, "node_suspect")) == 1

    sim.health[node] = _health(2, True)  # the probe it was asked for passes
    sim.advance(1)
    assert [(e["node"], e["reason"]) for e in _events(sim, "node_cleared")] == [(node, "health probe passed")]
    assert not sim.probe_asked[node] and {n["node"]: n for n in sim.co.nodes_view()}[node]["suspect"] is None


def test_an_evicted_replica_is_replaced_by_the_warm_spare_not_a_cold_start(tmp_path: Path) -> None:
    """With ``spares: 1`` on the fourth node, the straggler's place goes to the spare at the
    step boundary it leaves at: no repair (no cold start), the allocation follows the spare."""
    sim = _evict_sim(tmp_path, spares=1)
    ms = sim.co.jobs["a"]
    [spare] = sim.job("a")["spares"]
    slow = ms.members[-1]
    node = ms.workers[slow].node
    started = set(ms.workers)
    _straggle(sim, slow)
    assert not [e for e in _events(sim, "repair") if e.get("job") == "a"], "no cold start"
    [assigned] = _events(sim, "spare_assigned")
    assert (assigned["worker"], assigned["replacing"]) == (spare, slow)
    sim.advance(3)
    job = sim.job("a")
    assert spare in job["members"] and slow not in job["members"] and len(job["members"]) == 3
    assert node not in job["placement"] and ms.workers[spare].node in job["placement"]
    assert job["failures"] == 0 and ms.workers[slow].state.value == "LEFT"
    # No worker started for the evicted one's place; a new spare, and not on the suspect node.
    new = [ms.workers[w] for w in set(ms.workers) - started]
    assert all(w.spare and w.node != node for w in new), [(w.id, w.spare, w.node) for w in new]


def test_a_node_that_fails_its_probe_lets_its_spare_go_and_gets_no_new_one(tmp_path: Path) -> None:
    sim = _evict_sim(tmp_path, spares=1)
    ms = sim.co.jobs["a"]
    [spare] = sim.job("a")["spares"]
    node = ms.workers[spare].node
    sim.health[node] = _health(2, False, "memory pattern read back wrong")
    sim.advance(2)
    [released] = _events(sim, "spare_released")
    assert released["worker"] == spare and "failed its health probe" in released["reason"]
    assert ms.workers[spare].state.value == "DEAD" and ms.failures == 0
    assert not sim.job("a")["spares"] and not sim.running[node], "no new spare there"


def test_a_suspect_node_stays_suspect_across_a_coordinator_restart(tmp_path: Path) -> None:
    sim = _evict_sim(tmp_path, cooldown_s=30.0)
    ms = sim.co.jobs["a"]
    slow = ms.members[-1]
    node = ms.workers[slow].node
    _straggle(sim, slow)
    sim.advance(2)
    sim.restart()  # a new coordinator on the same store
    sim.advance(2)
    view = {n["node"]: n for n in sim.co.nodes_view()}[node]
    assert view["suspect"] is not None and "straggler" in view["suspect"]["reason"]
    assert sim.probe_asked[node], "the new coordinator asks for the probe that may clear it"
    sim.submit("b", "q", 1, 1)
    sim.advance(2)
    assert node not in sim.job("b")["placement"] and not sim.running[node]
    sim.health[node] = _health(2, True)  # a probe after the suspicion passes: cleared
    sim.advance(1)
    assert {n["node"]: n for n in sim.co.nodes_view()}[node]["suspect"] is None


def test_a_suspect_node_is_avoided_until_its_cooldown_ends(tmp_path: Path) -> None:
    sim = _evict_sim(tmp_path, cooldown_s=5.0, resize_cooldown_s=1.0)
    ms = sim.co.jobs["a"]
    slow = ms.members[-1]
    node = ms.workers[slow].node
    _straggle(sim, slow)
    sim.advance(2)
    # A job that wants a slot: it gets one elsewhere (the policy shares), never the node's.
    sim.submit("b", "q", 1, 1)
    sim.advance(2)
    assert node not in sim.job("b")["placement"] and node not in sim.job("a")["placement"]
    assert not sim.running[node]
    sim.advance(2)
    assert [(e["node"], e["reason"]) for e in _events(sim, "node_cleared")] == [(node, "cool-down ended")]
    sim.advance(3)
    assert sim.running[node], "work goes there again after the cool-down"


def test_report_policy_and_no_free_slot(tmp_path: Path) -> None:
    """Policy ``report`` moves nothing; ``evict`` with no free slot runs one smaller, and at
    its minimum does not evict."""
    sim = _evict_sim(tmp_path)
    ms = sim.co.jobs["a"]
    _straggle(sim, ms.members[-1], policy="report")
    assert not _events(sim, "node_suspect") and ms.workers[ms.members[-1]].state.value == "ACTIVE"
    sim.submit("b", "q", 1, 1)  # takes the free node
    sim.advance(3)
    assert sim.job("b")["placement"]
    slow = ms.members[-1]
    _straggle(sim, slow)
    assert _events(sim, "replace_waiting") and ms.target == 2
    sim.advance(3)
    assert len(sim.job("a")["members"]) == 2 and sim.job("a")["failures"] == 0
    # At its minimum with no free slot: it keeps its straggler (a gang that waits is worse).
    other = ms.members[-1]
    _straggle(sim, other)
    [skipped] = _events(sim, "evict_skipped")
    assert skipped["worker"] == other and "below its minimum of 2" in skipped["reason"]
    sim.advance(2)
    assert ms.workers[other].state.value == "ACTIVE" and len(sim.job("a")["members"]) == 2


# -- the agent's probes, in real child processes ---------------------------------------------------
def test_a_failing_check_command_fails_with_its_last_lines() -> None:
    prober = Prober(
        HealthConfig(
            builtin=False,
            timeout_s=10,
            command=[
                sys.executable,
                "-c",
                "import sys; print('\\n'.join(f'l{i}' for i in range(9)));"
                "print('disk /data: read-only', file=sys.stderr); sys.exit(3)",
            ],
        )
    )
    r = prober.probe()
    assert not r.ok and r.probe == "command"
    assert r.detail.splitlines() == ["l6", "l7", "l8", "disk /data: read-only", "exit code 3"]


def test_a_hung_check_is_killed_at_its_timeout_and_counts_as_a_failure(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    prober = Prober(
        HealthConfig(
            builtin=False, timeout_s=0.5, command=["sh", "-c", f"echo checking; sleep 30 & echo $! > {pid_file}; wait"]
        )
    )
    began = time.monotonic()
    r = prober.probe()
    assert time.monotonic() - began < 5
    assert not r.ok and "timed out after 0.5s" in r.detail and "checking" in r.detail
    pid = int(pid_file.read_text())
    wait_for(lambda: not _alive(pid), 5, "the hung check's child to be killed", [])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is gone too
        return f.read().split()[2] != "Z"


def test_the_builtin_probe_checks_compute_and_memory_and_judges_speed_by_the_first() -> None:
    prober = Prober(HealthConfig(timeout_s=30, memory_mib=8))
    r = prober.probe()
    assert r.ok and r.probe == "builtin" and r.detail.startswith("ok: cpu "), r
    assert set(prober.baseline) >= {"cpu"} and prober.baseline["cpu"] > 0
    base = {"cpu": 0.1}
    assert judge([{"name": "cpu", "ok": True, "compute_s": 0.25}], base, 3.0)[0]
    ok, detail = judge([{"name": "cpu", "ok": True, "compute_s": 0.45}, {"name": "memory", "ok": True}], base, 3.0)
    assert not ok and "4.5x the node's first measurement" in detail
    ok, detail = judge([{"name": "memory", "ok": False, "detail": "pattern read back wrong"}], base, 3.0)
    assert not ok and detail == "memory: pattern read back wrong"
    code, out = run_child([sys.executable, "-m", "maitre.agent.health", "--memory-mib", "2"], 30)
    assert code == 0 and '"name": "memory", "ok": true' in out


def test_the_monitor_probes_at_start_then_when_asked_and_says_so_in_the_beat() -> None:
    monitor = HealthMonitor(HealthConfig(builtin=False, interval_s=0, timeout_s=5, command=["sh", "-c", "echo fine"]))
    results = []
    monitor.on_result = results.append
    assert monitor.beat() is None
    monitor.first()
    assert monitor.beat() == p.NodeHealth(id=1, ok=True, detail="fine", seconds=results[0].seconds, probe="command")
    monitor.start()
    try:
        time.sleep(0.2)
        assert monitor.count == 1, "interval 0: no periodic probe"
        monitor.request()  # as orders with ``probe`` ask
        wait_for(lambda: monitor.count == 2, 10, "the asked-for probe", [])
    finally:
        monitor.stop()


def test_health_config_refuses_bad_values() -> None:
    for bad in ({"interval_s": 0.5}, {"timeout_s": 0}, {"slowdown": 1.0}, {"command": []}, {"builtin": False}):
        with pytest.raises(ValueError):
            HealthConfig(**bad)


@pytest.mark.timeout(120)
def test_a_real_agent_whose_check_fails_is_drained_and_gets_work_once_it_passes(tmp_path: Path, capsys) -> None:
    """Real agents and training workers; node-1's check fails while a file exists: its worker
    leaves at a step boundary, the job trains on, nothing starts there; the file gone, its next
    probe passes and the job grows back onto it."""
    from conftest import example_command
    from maitre.local import LocalCluster, UpConfig
    from maitre.scheduling.policy import PolicyConfig

    flag = tmp_path / "sick"
    lines: list[str] = []
    cluster = LocalCluster(
        UpConfig(state_dir=tmp_path / "state", queues=[Queue("q")], policy=PolicyConfig(resize_cooldown_s=0.5)),
        out=lines.append,
    ).start()
    co = cluster.coordinator
    check = HealthConfig(
        builtin=False,
        interval_s=1.0,
        timeout_s=5,
        command=["sh", "-c", f"if [ -e {flag} ]; then echo sick; exit 1; fi"],
    )

    def members_on(node: str) -> list[str]:
        job = co.job_status("a")
        return [w["id"] for w in job["workers"] if w["node"] == node and w["id"] in job["members"]]

    try:
        cluster.add_node(slots=1)  # node-0: no probes
        cluster.add_node(slots=1, health=check)  # node-1
        wait_for(lambda: len(co.nodes_view()) == 2, 20, "two nodes", lines)
        co.submit(
            {
                "name": "a",
                "queue": "q",
                "minReplicas": 1,
                "maxReplicas": 2,
                "command": example_command(100_000, extra=("--device-ms-per-sample", "2")),
            }
        )
        wait_for(
            lambda: members_on("node-1") and co.job_status("a")["step"] >= 3, 60, "a to train on both nodes", lines
        )
        [first] = members_on("node-1")
        flag.touch()
        wait_for(
            lambda: {n["node"]: n for n in co.nodes_view()}["node-1"]["unhealthy"],
            10,
            "node-1 to fail its probe",
            lines,
        )
        wait_for(lambda: not cluster.agents[1].running(), 30, "node-1's worker to leave", lines)
        w = next(w for w in co.job_status("a")["workers"] if w["id"] == first)
        assert w["state"] == "LEFT", w
        step = co.job_status("a")["step"]
        from maitre.cli import main

        assert main(["status", "--coordinator", cluster.address, "--token-file", str(cluster.token_file)]) == 0
        shown = capsys.readouterr().out
        time.sleep(1.0)
        assert not cluster.agents[1].running(), "no work on an unhealthy node"
        assert co.job_status("a")["step"] > step, "the job trains on"
        flag.unlink()
        wait_for(lambda: members_on("node-1"), 60, "a back on node-1", lines)
        status = co.job_status("a")
        events = list(cluster.db.events())
    finally:
        cluster.stop()
    assert status["failures"] == 0, status
    row = next(line for line in shown.splitlines() if line.startswith("node-1 "))
    assert "UNHEALTHY" in row and "FAILED" in row, shown
    assert "node-1: health probe failed (command" in shown and "sick | exit code 1" in shown
    bad = [e for e in events if e["kind"] == "node_health" and not e["ok"]]
    assert [(e["node"], e["detail"], e["probe"]) for e in bad][:1] == [("node-1", "sick\nexit code 1", "command")]
    assert any(e["kind"] == "shrink" and "health probe failed on node-1" in e["reason"] for e in events)


@pytest.mark.parametrize(
    "args,words",
    [
        (("--health-timeout", "0"), "health timeout must be 0.1..3600 s"),
        (("--health-interval", "0.5"), "health interval must be 0 (at start only)"),
        (("--health-interval", "inf"), "--health-interval must be a number of seconds"),
        (("--no-health-builtin",), "no probe: the built-in one is off"),
        (("--health-check", "'unclosed"), '--health-check "\'unclosed": No closing quotation'),
        (("--health-check", "  "), "--health-check is empty"),
    ],
)
def test_bad_health_flags_are_one_line_and_exit_2(args, words, capsys) -> None:
    from maitre.cli import main

    assert main(["agent", "--coordinator", "127.0.0.1:1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maitre: error:") and words in err and "\n" not in err, err


@pytest.mark.slow  # a real run of 3 workers and a replacement: ~30 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_a_slow_node_is_found_evicted_and_the_job_trains_on_at_full_speed_exactly(tmp_path: Path, reference) -> None:
    """4 single-slot nodes, a job of 3 (min 2) with ``stragglers: {policy: evict}``, node-0's
    workers 3x slower (MAITRE_SLOW_FACTOR in its agent's environment): the straggler is found
    within a bounded number of steps, its replica leaves, node-0 is suspect, the job grows onto
    the free node at once, node-0's agent is asked for a probe whose pass clears it, every
    sample is trained once, the parameters are a fixed-size run's, and its steps come at least
    1.4x as fast as before."""
    import torch

    from conftest import relative_error
    from maitre.runtime.ledger import audit

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import eviction  # the benchmark's scenario, one run of it

    steps = 300
    # A 3x node against a ratio of 2: a loaded machine's noise (a rank 1.3x slow for a while,
    # seen here once) is the detector's false positive to fix, not this test's subject.
    slow = eviction.run(
        tmp_path, slow=True, steps=steps, factor=2.0, ms_per_sample=4.0, stragglers={"ratio": 2.0}, probes=True
    )
    log = "\n".join(slow["lines"])
    status, events = slow["status"], slow["events"]
    assert status["state"] == "COMPLETED" and status["failures"] == 0, log
    found = [e for e in events if e["kind"] == "straggler"]
    verdict = found[0]
    assert verdict["node"] == "node-0" and verdict["policy"] == "evict", verdict
    assert len(found) == 1, [(e["worker"], e["node"], e["step"], e["ratio"]) for e in found]
    assert verdict["step"] <= 40, verdict  # slow from its first step: found within 40
    [suspect] = [e for e in events if e["kind"] == "node_suspect"]
    assert suspect["node"] == "node-0" and suspect["worker"] == verdict["worker"]
    [repair] = [e for e in events if e["kind"] == "repair" and e.get("job") == "a"]
    assert "node-3" in repair["placement"] and "node-0" not in repair["placement"], repair
    gone = next(w for w in status["workers"] if w["id"] == verdict["worker"])
    assert gone["state"] == "LEFT", gone
    assert any(w["node"] == "node-3" and w["id"] in status["members"] for w in status["workers"]), status
    # Its agent was asked for a probe, which passed: node-0 is no longer suspect.
    cleared = [e for e in events if e["kind"] == "node_cleared"]
    assert [(e["node"], e["reason"]) for e in cleared] == [("node-0", "health probe passed")]
    assert cleared[0]["t"] > suspect["t"]
    node0 = {n["node"]: n for n in slow["nodes"]}["node-0"]
    assert node0["suspect"] is None and node0["health"]["ok"]

    result = audit(slow["ledger"])
    assert result.ok and result.steps == steps, result.describe()
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert relative_error(final, reference(steps)) <= 1e-9

    p = eviction.phases(slow)
    assert p["throughput_before"] and p["throughput_after"], p
    assert p["throughput_after"] >= 1.4 * p["throughput_before"], p
    assert p["evict_to_join_s"] is not None and p["evict_to_join_s"] < 15, p
