"""The simulator: the job model, each policy on hand-checked scenarios, spot and failures,
determinism, fidelity against Pollux's published simulator results, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from maitre.cli import main
from maitre.sim import run as sim_run
from maitre.sim.jobs import Recovery, TraceJob, young_daly_interval
from maitre.sim.perfmodel import PerfParams, fit
from maitre.sim.policies import make_policy
from maitre.sim.scenarios import cluster, daytime_inference, pollux_jobs, spot_reclaims
from maitre.sim.simulator import NodeEvent, SimConfig, SimNode, Simulation
from maitre.sim.workload import DATA, load_workload, pollux_workload

pytestmark = pytest.mark.timeout(120)
FREE = Recovery(resize_s=0.0, failure_pause_s=0.0)


def trace(
    name: str, at: float, seconds: float, gpus: int, lo: int | None = None, hi: int | None = None, **kw
) -> TraceJob:
    return TraceJob(
        name,
        at,
        seconds,
        replicas=gpus,
        min_replicas=lo or gpus,
        max_replicas=hi or gpus,
        recovery=kw.pop("recovery", FREE),
        **kw,
    )


def run(jobs, policy: str, nodes: int = 1, gpus: int = 4, **kw):
    return Simulation(
        jobs,
        [SimNode(index=i, gpus=gpus) for i in range(nodes)],
        make_policy(policy),
        SimConfig(**kw.pop("cfg", {})),
        **kw,
    ).run()


# -- the job model --------------------------------------------------------------------------------


def test_a_trace_job_finishes_after_its_work_plus_each_resize() -> None:
    # seen at the first round (60 s), 600 s of work, one 30 s pause to start: done at 690 s
    r = run([trace("a", 0, 600, 2, recovery=Recovery(resize_s=30))], "fifo")
    assert r.jcts == {"a": pytest.approx(690.0)}
    assert r.utilization == pytest.approx(600 * 2 / (r.timeline.time[-1] - 60) / 2, rel=0.1)


def test_young_daly_interval() -> None:
    assert young_daly_interval(10, 3600 * 5) == pytest.approx(math.sqrt(2 * 10 * 18000) - 10)
    assert young_daly_interval(0, 100) == math.inf and young_daly_interval(5, math.inf) == math.inf


# -- policies on hand-checked scenarios -----------------------------------------------------------


def test_fifo_blocks_behind_the_head_of_the_queue() -> None:
    jobs = [trace("big", 0, 600, 3), trace("wide", 1, 600, 2), trace("small", 2, 600, 1)]
    r = run(jobs, "fifo")
    # big runs 60-660; wide cannot fit beside it and small may not pass it: both start at 660
    assert r.jcts["big"] == pytest.approx(600 + 60)
    assert r.jcts["wide"] == pytest.approx(660 + 600 - 1)
    assert r.jcts["small"] == pytest.approx(660 + 600 - 2)


def test_tiresias_demotes_a_long_job_and_runs_the_newcomer_first() -> None:
    long = trace("long", 0, 100 * 3600, 4)
    new = trace("new", 20 * 3600, 600, 4)
    r = run([long, new], "tiresias")
    # 4 GPUs x 4 h = 16 GPU-h: long is demoted to the second queue well before new arrives, so
    # new preempts it at the first round after its arrival and finishes 600 s later
    assert r.jcts["new"] == pytest.approx(60 * math.ceil(20 * 60) - 20 * 3600 + 60 + 600, abs=60)
    assert r.jcts["long"] > 100 * 3600 + 600 - 1


def test_optimus_gives_the_spare_gpus_to_the_job_whose_time_drops_most() -> None:
    short = trace("short", 0, 600, 1, 1, 4, comm_cost=0.0)
    long = trace("long", 0, 60000, 1, 1, 4, comm_cost=0.0)
    r = run([short, long], "optimus")
    placements = {}
    for _, job, g in r.timeline.changes:
        placements.setdefault(job, g)
    assert placements == {"short": 1, "long": 3}  # the long job's remaining time drops more


def test_maitre_grows_into_free_gpus_and_gives_them_back_to_a_newcomer() -> None:
    elastic = trace("elastic", 0, 4 * 3600, 1, 1, 4)
    newcomer = trace("newcomer", 3600, 600, 2)
    r = run([elastic, newcomer], "maitre")
    sizes = [(t, g) for t, job, g in r.timeline.changes if job == "elastic"]
    assert sizes[0] == (60.0, 4)  # admitted at its minimum, filled to its maximum at once
    shrunk = [t for t, g in sizes if g == 2]
    assert shrunk and 3600 <= shrunk[0] <= 3660  # shrunk the round the newcomer was seen
    assert r.jcts["newcomer"] <= 60 + 600


def test_pollux_like_policy_splits_the_cluster_between_jobs() -> None:
    jobs = [trace(f"j{i}", 0, 3600, 1, 1, 8) for i in range(4)]
    r = run(jobs, "pollux", nodes=2)
    firsts = {}
    for _, job, g in r.timeline.changes:
        firsts.setdefault(job, g)
    assert sorted(firsts.values()) == [2, 2, 2, 2]


# -- spot, failures, capacity events -------------------------------------------------------------


def test_a_spot_notice_is_a_graceful_leave_and_a_reclaim_without_one_is_a_failure() -> None:
    rec = Recovery(resize_s=0.0, failure_pause_s=30.0, peer_recovery=True)
    jobs = [trace("j", 0, 4 * 3600, 4, 1, 8, recovery=rec)]
    notice = [NodeEvent(3600, 1, "notice", 120)]
    r = run(jobs, "maitre", nodes=2, node_events=notice)
    assert r.failures == 0
    crash = [NodeEvent(3600, 1, "down")]
    r2 = run([trace("j", 0, 4 * 3600, 4, 1, 8, recovery=rec)], "maitre", nodes=2, node_events=crash)
    assert r2.failures == 1 and r2.jcts["j"] > r.jcts["j"]


def test_peer_recovery_loses_less_than_restarting_from_a_checkpoint() -> None:
    def jct(peer: bool) -> float:
        rec = Recovery(resize_s=0.0, failure_pause_s=30.0, peer_recovery=peer, checkpoint_s=20)
        jobs = [trace("j", 0, 48 * 3600, 8, 2, 8, recovery=rec)]
        r = run(jobs, "maitre", nodes=4, gpus=2, cfg=dict(node_mtbf_s=12 * 3600, seed=3))
        assert r.failures > 0
        return r.jcts["j"]

    assert jct(True) < jct(False)


def test_spot_cluster_costs_less() -> None:
    nodes = cluster(4, 4, spot_nodes=4)
    events = spot_reclaims(nodes, mean_life_s=3600, notice_s=120, back_after_s=600, horizon_s=86400, seed=1)
    assert events and all(e.kind in ("notice", "up") for e in events)
    jobs = lambda: [trace(f"j{i}", 0, 6 * 3600, 4, 1, 8) for i in range(2)]  # noqa: E731
    spot = Simulation(jobs(), nodes, make_policy("maitre"), node_events=events).run()
    ondemand = Simulation(jobs(), cluster(4, 4), make_policy("maitre")).run()
    assert spot.cost < 0.5 * ondemand.cost
    assert spot.makespan_s >= ondemand.makespan_s


def test_daytime_inference_elastic_uses_what_static_leaves_idle() -> None:
    events = daytime_inference(days=8)

    def job(hi: int) -> list[TraceJob]:
        return [trace("train", 0, 4 * 86400, 8, 8, hi, recovery=Recovery(resize_s=30))]

    elastic = run(job(32), "maitre", nodes=8, node_events=events)
    static = run(job(8), "fifo", nodes=8, node_events=events)
    assert elastic.allocation >= 0.85 > static.allocation
    assert elastic.makespan_s < static.makespan_s


def test_the_same_inputs_give_the_same_outputs() -> None:
    def once():  # 12 jobs through spot reclaims and seeded node failures (an hour's MTBF)
        arrivals = load_workload(pollux_workload(6, 0.5))[:12]
        nodes = cluster(8, 4, spot_nodes=4)
        events = spot_reclaims(nodes, seed=7, horizon_s=5 * 86400)
        jobs = pollux_jobs(
            arrivals, "maitre", adaptive_batch=True, recovery=Recovery(peer_recovery=True, checkpoint_s=10)
        )
        r = Simulation(
            jobs, nodes, make_policy("maitre"), SimConfig(node_mtbf_s=3600, seed=5), node_events=events
        ).run()
        return r.jcts, r.summary(), r.timeline.changes

    first = once()
    assert first[1]["failures"] > 0 and first[1]["restarts"] > first[1]["failures"], first[1]
    assert once() == first


# -- a goodput-following job's model of itself ---------------------------------------------------


def test_the_step_time_model_recovers_known_constants() -> None:
    true = PerfParams(
        alpha_c=0.05, beta_c=0.004, alpha_node=0.08, beta_node=0.01, alpha_local=0.02, beta_local=0.002, gamma=1.5
    )
    shapes = [(1, 1), (1, 2), (1, 4), (2, 8), (3, 12), (4, 16)]
    obs = [(n, r, m) for n, r in shapes for m in (16, 32, 64)]
    step = [float(true.step_time(n, r, m)) for n, r, m in obs]
    compute = [true.alpha_c + true.beta_c * m for _, _, m in obs]
    got = fit(*zip(*obs), step, compute)
    for n, r, m in [(1, 3, 48), (2, 6, 24), (8, 32, 32)]:  # shapes it never saw
        assert float(got.step_time(n, r, m)) == pytest.approx(float(true.step_time(n, r, m)), rel=0.05)


def test_a_job_that_never_crossed_a_node_assumes_crossing_costs_a_little_more() -> None:
    obs = [(1, 1, 32), (1, 2, 32), (1, 4, 32)]
    got = fit(*zip(*obs), [0.30, 0.34, 0.36], [0.28, 0.28, 0.28])
    assert got.alpha_node >= 1.1 * got.alpha_local and got.beta_node >= 1.1 * got.beta_local
    assert float(got.step_time(2, 8, 32)) > float(got.step_time(1, 4, 32))


def test_a_goodput_job_reports_predictions_up_to_explore_times_its_largest_size() -> None:
    arrivals = [a for a in load_workload(pollux_workload(1, 1.0)) if a.application == "cifar10"]
    j, plain = (pollux_jobs(arrivals[:1], "maitre", adaptive_batch=True, explore=x)[0] for x in (4.0, 0.0))
    for job in (j, plain):
        job.reallocate([0, 0], job.submitted)
        job.advance(job.submitted + 600)
    assert set(plain.throughput) == {2}  # what it measured
    assert set(j.throughput) == {1, 2, 4, 8}  # and what its model predicts, up to 4 x 2
    assert j.throughput[2] == plain.throughput[2]  # a measurement is never replaced
    assert all(v > 0 for v in j.throughput.values())


# -- fidelity against Pollux's published simulator ------------------------------------------------


def _pollux_avg(policy: str, number: int, load: float) -> tuple[float, float]:
    arrivals = load_workload(pollux_workload(number, load))
    r = Simulation(pollux_jobs(arrivals, policy), cluster(16, 4), make_policy(policy)).run()
    ref = json.loads((DATA / "pollux_reference_results" / f"{policy}-{load}.summary.json").read_text())
    return r.avg_jct_s, ref["avgs"][f"workload-{number}"]


@pytest.mark.parametrize("policy, published", [("tiresias", 3469.7), ("optimus", 5301.9)])
def test_workload6_matches_pollux_simulator(policy: str, published: float) -> None:
    ours, ref = _pollux_avg(policy, 6, 1.0)
    assert ref == pytest.approx(published, abs=0.1)
    assert ours == pytest.approx(ref, rel=0.03)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["tiresias", "optimus"])
@pytest.mark.parametrize("load", [0.5, 1.0, 1.5, 2.0])
def test_every_workload_and_load_matches_pollux_simulator(policy: str, load: float) -> None:
    ours = [_pollux_avg(policy, n, load) for n in range(1, 9)]
    for mine, ref in ours:
        assert mine == pytest.approx(ref, rel=0.03)
    assert sum(m for m, _ in ours) / 8 == pytest.approx(sum(r for _, r in ours) / 8, rel=0.03)


def test_measured_costs_are_the_recovery_benchmarks() -> None:
    data = json.loads(sim_run._RECOVERY_JSON.read_text())["maitre"]
    assert sim_run.measured_costs() == (data["join_pause_s"], data["crash_to_step_s"])
    assert sim_run.MEASURED_RESIZE_S == pytest.approx(data["join_pause_s"], abs=0.005)
    assert sim_run.MEASURED_FAILURE_S == pytest.approx(data["crash_to_step_s"], abs=0.005)


# -- the command line -----------------------------------------------------------------------------


def test_simulate_writes_summary_csv_and_plots(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "simulate",
            "--workload",
            "pollux-6@0.5",
            "--policy",
            "tiresias",
            "--compare",
            "maitre",
            "--limit",
            "20",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("tiresias", "maitre"):
        assert {"avg_jct_s", "p99_jct_s", "makespan_s", "utilization", "gpu_hours", "cost"} <= set(summary[policy])
        assert summary[policy]["jobs"] == 20
    for name in ("timeline.csv", "allocations.csv", "utilization.png", "jct_cdf.png", "allocations.png", "cost.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "utilization.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "avg JCT s" in printed and "maitre" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "nope"], "unknown policy"),
        (["--cluster", "16by4"], "NODESxGPUS"),
        (["--cluster", "0x4"], "1-100000 nodes"),
        (["--spot", "1.5"], "--spot"),
        (["--resize", "fast"], "--resize"),
        (["--compare", "tiresias,tiresias"], "named twice"),
    ],
)
def test_simulate_refuses_bad_flags(tmp_path, capsys, args, message) -> None:
    base = {"--workload": "pollux-1@0.5", "--policy": "tiresias", "--out": str(tmp_path / "o")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    rc = main(["simulate", *[x for kv in base.items() for x in kv]])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_simulate_refuses_bad_workloads(tmp_path, capsys) -> None:
    out = str(tmp_path / "o")
    assert main(["simulate", "--workload", str(tmp_path / "missing.csv"), "--policy", "fifo", "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\na,-1,resnet,0,8\n")
    assert main(["simulate", "--workload", str(bad), "--policy", "fifo", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "resnet" in err
    assert not (tmp_path / "o").exists()
    afile = tmp_path / "file"
    afile.write_text("x")
    assert (
        main(["simulate", "--workload", "pollux-1@0.5", "--policy", "fifo", "--limit", "3", "--out", str(afile)]) == 2
    )
    assert "not a directory" in capsys.readouterr().err
