"""Restart mode (``elastic: restart``): unmodified torchrun scripts, their gang restarted whole.

The gang's logic as pure bookkeeping (:class:`maitre.control.restarts.RestartRun`, no processes),
the manifest's refusals, and real runs of ``examples/torchrun_ddp.py`` (plain DDP, checkpoints of
its own, nothing of maitre's) under ``maitre run --elastic restart``: a SIGKILL and a node that
joins each restart the gang at its new size, and the script ends with the parameters of a
fixed-size run; a script that crashes at every start, or never builds its process group, ends
FAILED with what it printed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import ROOT, relative_error, wait_for
from maitre.control.membership import JobSpec, WorkerState
from maitre.control.restarts import RestartRun, run_from_json
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.spec import ManifestError, parse_manifest

DDP = ROOT / "examples" / "torchrun_ddp.py"


def _run(min_workers: int = 1, max_workers: int = 4, target: int = 2, **spec: object) -> RestartRun:
    run = RestartRun(
        JobSpec(
            job_id="j",
            command=["python", "x.py"],
            min_workers=min_workers,
            max_workers=max_workers,
            elastic="restart",
            **spec,  # type: ignore[arg-type]
        ),
        now=0.0,
    )
    run.target = target
    return run


def _start(run: RestartRun, now: float = 1.0) -> list[str]:
    """Start the workers the run wants, one per node."""
    return [run.add_worker(f"n{i}", 0, now).id for i in range(run.wants_workers())]


# -- the gang's bookkeeping ------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_a_gang_opens_once_every_replica_started_and_completes_when_all_exit_zero() -> None:
    run = _run()
    first = run.add_worker("n0", 0, 1.0)
    assert run.state == JobState.ADMITTED and not run.open and run.wants_workers() == 1
    assert run.restart_order(first) == {
        "group_rank": 0,
        "group_world_size": 2,
        "restart_count": 0,
        "max_restarts": 3,
        "grace_s": 30.0,
        "success_marker": None,
    }
    second = run.add_worker("n1", 0, 1.0)
    assert run.state == JobState.RUNNING and run.open and run.members == [first.id, second.id]
    assert second.rank == 1 and run.wants_workers() == 0
    run.exited(first.id, 0, None, 5.0, joined=True)
    assert run.state == JobState.RUNNING  # the other still runs
    run.exited(second.id, 0, None, 5.1, joined=True)
    assert run.state == JobState.COMPLETED and run.failures == 0


@pytest.mark.timeout(10)
def test_a_failure_stops_the_gang_and_the_next_one_counts_a_restart() -> None:
    run = _run()
    a, b = _start(run)
    run.exited(a, -9, None, 3.0, joined=True)
    assert run.failures == 1 and run.state == JobState.RENDEZVOUS
    assert run.workers[b].state == WorkerState.LEAVING  # its SIGTERM goes out with the orders
    assert run.wants_workers() == 0  # no new gang while one of the old one's processes lives
    run.exited(b, -15, None, 3.5, joined=True)  # stopped by us: no second failure
    assert run.failures == 1 and run.workers[b].state == WorkerState.LEFT
    c, d = _start(run, 4.0)
    assert run.state == JobState.RUNNING and run.epoch == 2
    assert [run.restart_order(run.workers[w])["restart_count"] for w in (c, d)] == [1, 1]
    [record] = run.restarts
    assert record["epoch"] == 2 and record["size"] == 2 and record["restart_s"] == pytest.approx(1.0)
    assert "killed by signal 9" in record["cause"]


@pytest.mark.timeout(10)
def test_a_restart_is_timed_to_the_new_gangs_process_group_and_charged_to_the_job() -> None:
    run = _run()
    assert run.restart_cost_s() == 60.0  # (a guess until one was measured)
    a, b = _start(run)
    run.scale(3, 10.0)
    for w in (a, b):
        run.exited(w, -15, None, 11.0)
    new = _start(run, 12.0)
    for i, w in enumerate(new):
        run.joined(w, 20.0 + i, 30.0)
    [record] = run.restarts
    assert record["restart_s"] == pytest.approx(2.0) and record["joined_s"] == pytest.approx(12.0)
    assert run.restart_cost_s() == pytest.approx(12.0)


@pytest.mark.timeout(10)
def test_the_policy_grows_a_restarting_job_only_when_the_growth_pays_for_its_restart() -> None:
    from maitre.scheduling import PolicyConfig, Queue
    from maitre.scheduling.model import Cluster, Job, Node
    from maitre.scheduling.policy import schedule

    def grown(restart_s: float) -> bool:
        nodes = {f"n{i}": Node(f"n{i}", 1) for i in range(4)}
        job = Job(id="j", queue="q", min_replicas=1, max_replicas=4, state=JobState.RUNNING, restart_s=restart_s)
        job.placement = {"n0": 1}
        cluster = Cluster(nodes=nodes, queues={"q": Queue("q")})
        plan = schedule(cluster, [job], 1000.0, PolicyConfig(resize_cooldown_s=0, restart_horizon_s=600))
        return any(a.kind == "grow" for a in plan.actions)

    assert grown(0.0) and grown(30.0)  # in place, or a restart that a 4x speedup repays at once
    assert not grown(500.0)  # 4x for the 100 s left of the horizon does not repay 500 s lost


@pytest.mark.timeout(10)
def test_a_resize_restarts_the_gang_at_the_new_size_without_a_failure() -> None:
    run = _run()
    a, b = _start(run)
    assert run.scale(3, 2.0) == [a, b]
    for w in (a, b):
        run.exited(w, -15, None, 2.5)
    assert len(_start(run, 3.0)) == 3 and run.gang_size == 3 and run.failures == 0
    assert run.scale(3, 4.0) == []  # the same size: nothing to restart
    assert run.epoch == 2


@pytest.mark.timeout(10)
def test_a_crash_at_every_start_fails_the_job_with_its_last_lines_of_stderr() -> None:
    run = _run(target=1, max_restarts=2)
    for attempt in range(3):
        [w] = _start(run, float(attempt))
        run.exited(
            w, 1, "ValueError: no data", attempt + 0.5, joined=False, stderr=["Traceback", "ValueError: no data"]
        )
    assert run.state == JobState.FAILED and run.failures == 3
    assert "exceeded the restart budget" in (run.failure or "") and "ValueError: no data" in (run.failure or "")
    assert run.wants_workers() == 0


@pytest.mark.timeout(10)
def test_a_data_error_fails_the_job_at_once_instead_of_restarting_the_gang() -> None:
    """A corrupt record is the data's fault: a new gang would meet it again, restart after
    restart, so the first worker that reports it fails the job, naming the file and offset."""
    from maitre import protocol

    line = protocol.DATA_ERROR + "/d/shard-001.bin: at byte 200: token id 65000 is not below the vocabulary size 512"
    run = _run(max_restarts=5)
    a, b = _start(run)
    run.exited(a, 1, line, 3.0, joined=True, stderr=["Traceback", line])
    assert run.state == JobState.FAILED and run.failures == 1, run.events[-3:]
    assert run.failure == (
        "the data cannot be read: /d/shard-001.bin: at byte 200: token id 65000 is not below the "
        f"vocabulary size 512 (worker {a})"
    )
    run.exited(b, -15, None, 3.5, joined=True)  # its gang stopped: nothing more
    assert run.state == JobState.FAILED and [e["kind"] for e in run.events].count("failed") == 1
    assert run.wants_workers() == 0


@pytest.mark.timeout(10)
def test_exiting_zero_without_a_process_group_or_the_success_marker_is_a_failure() -> None:
    run = _run(target=1, max_restarts=0)
    [w] = _start(run)
    run.exited(w, 0, None, 2.0, joined=False)
    assert run.state == JobState.FAILED and "never called init_process_group" in (run.failure or "")

    run = _run(target=2, max_restarts=0, success_marker="done")
    a, b = _start(run)
    run.exited(a, 0, None, 2.0, joined=True, marked=False)
    run.exited(b, 0, None, 2.0, joined=True, marked=False)
    assert run.state == JobState.FAILED and "success marker 'done'" in (run.failure or "")

    run = _run(target=2, success_marker="done")
    a, b = _start(run)
    run.exited(a, 0, None, 2.0, joined=True, marked=True)  # rank 0 says it, the others need not
    run.exited(b, 0, None, 2.0, joined=True, marked=False)
    assert run.state == JobState.COMPLETED


@pytest.mark.timeout(10)
def test_a_worker_that_ends_under_its_nodes_notice_is_no_failure() -> None:
    """Slurm's preemption signals the script as well as its agent: its SIGTERM death, on a node
    with a notice, stops the gang without a failure (the drain then resizes the job)."""
    run = _run()
    a, b = _start(run)
    run.exited(a, -15, None, 2.0, joined=True, noticed=True)
    assert run.failures == 0 and run.workers[b].state == WorkerState.LEAVING
    assert "notice" in (run.close_reason or "")


@pytest.mark.timeout(10)
def test_a_suspension_stops_the_gang_and_a_lost_node_restarts_it() -> None:
    run = _run()
    a, b = _start(run)
    run.evict(a, "node n0 is dead", 2.0)
    assert run.failures == 1 and run.workers[b].state == WorkerState.LEAVING
    run.exited(b, -15, None, 2.2)
    _start(run, 3.0)
    run.suspend("preempted", 4.0)
    assert run.state == JobState.SUSPENDING and run.wants_workers() == 0
    for w in run.members:
        run.exited(w, -15, None, 4.5)
    assert run.state == JobState.SUSPENDED and run.failures == 1


@pytest.mark.timeout(10)
def test_a_run_is_saved_and_restored_as_a_restart_run() -> None:
    run = _run(success_marker="done")
    a, _ = _start(run)
    run.exited(a, 0, None, 2.0, joined=True, marked=True)
    again = run_from_json(run.to_json(), None, 10.0)
    assert isinstance(again, RestartRun)
    assert (again.gang_size, again.epoch, again.members, again.marked) == (2, 1, run.members, {a})
    assert again.summary()["elastic"] == "restart"


@pytest.mark.timeout(60)
def test_a_spot_notice_restarts_the_gang_off_the_noticed_node_with_no_failure(tmp_path: Path) -> None:
    """Under the coordinator and its (simulated) agents: a restart-mode job on three nodes, one
    of them spot; its notice stops the gang (SIGTERM by terminate orders), and the next gang
    runs on the two others, no failure counted, the restart on record."""
    from maitre import protocol as p
    from maitre.scheduling.model import Queue
    from test_control_plane import Sim

    sim = Sim(tmp_path, {"n0": 1, "n1": 1, "s0": 1}, [Queue("team-a")], cooldown_s=1.0)
    sim.labels = {"s0": {"capacity_type": "spot"}}
    sim.co.submit(
        {
            "name": "r",
            "queue": "team-a",
            "minReplicas": 1,
            "maxReplicas": 3,
            "elastic": "restart",
            "command": "python x.py",
        }
    )
    sim.advance(3)
    job = sim.job("r")
    assert job["state"] == "RUNNING" and len(job["members"]) == 3 and job["elastic"] == "restart"
    sim.notices["s0"] = p.SpotNotice(notice_s=30.0, source="file:/notices/s0.json")
    sim.advance(3)
    job = sim.job("r")
    assert job["state"] == "RUNNING" and job["epoch"] == 2 and len(job["members"]) == 2, job
    assert job["failures"] == 0 and not sim.running["s0"]
    [restart] = job["restarts"]
    assert restart["size"] == 2 and restart["cause"].startswith("resize to 2"), restart


@pytest.mark.timeout(10)
def test_each_process_gets_torchruns_variables_for_its_replica() -> None:
    """A replica is torchrun's node: LOCAL_RANK counts its processes, and the GPUs it sees are
    its own slots (through the node's CUDA_VISIBLE_DEVICES), whatever else runs on the node."""
    from maitre import protocol as p
    from maitre.agent.torchrun import environ, scrub

    order = p.StartOrder(
        worker_id="j-w5", job_id="j", command=["x"], env={}, local_rank=2, slots=2, store="h:1", token="t", nproc=2
    )
    restart = p.RestartOrder(group_rank=1, group_world_size=3, restart_count=2, max_restarts=3, grace_s=30.0)
    first, second = (environ(order, restart, i, 4242) for i in range(2))
    assert (first["RANK"], second["RANK"], first["WORLD_SIZE"]) == ("2", "3", "6")
    assert (first["LOCAL_RANK"], second["LOCAL_RANK"], first["LOCAL_WORLD_SIZE"]) == ("0", "1", "2")
    assert (first["GROUP_RANK"], first["GROUP_WORLD_SIZE"], first["TORCHELASTIC_RESTART_COUNT"]) == ("1", "3", "2")
    assert (first["MASTER_ADDR"], first["MASTER_PORT"], first["CUDA_VISIBLE_DEVICES"]) == ("127.0.0.1", "4242", "2,3")
    assert environ(order, restart, 0, 4242, visible="4,5,6,7")["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert scrub(
        {"MAITRE_TOKEN": "secret", "MAITRE_COORDINATOR": "h:1", "MAITRE_LEDGER_DIR": "/l", "PATH": "/bin"}
    ) == {
        "MAITRE_LEDGER_DIR": "/l",
        "PATH": "/bin",
    }


# -- the manifest ----------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"spares": 1}, "spares: a warm spare joins a running job in place"),
        ({"stragglers": {"policy": "evict"}}, "stragglers:"),
        ({"nprocPerReplica": 2, "mesh": {"dp_shard": 1, "tp": 2}}, "mesh:"),
    ],
)
def test_a_restart_job_that_asks_for_in_place_features_is_refused_naming_the_field(extra: dict, said: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest({"name": "a", "queue": "q", "command": "python x.py", "elastic": "restart", **extra})
    assert said in str(err.value) and "elastic: restart" in str(err.value)


@pytest.mark.timeout(10)
def test_a_success_marker_needs_restart_mode() -> None:
    with pytest.raises(ManifestError, match="successMarker: only an elastic: restart job"):
        parse_manifest({"name": "a", "queue": "q", "command": "python x.py", "successMarker": "done"})


# -- real processes --------------------------------------------------------------------------------
def _reference(steps: int, global_batch: int = 64) -> dict[str, torch.Tensor]:
    """What the example learns in one process, without DDP (the same seed, data and update)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(global_batch, 32, generator=g, dtype=torch.float64)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = ((model(x) - y) ** 2).sum() / global_batch
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def _restart_run(tmp_path: Path, command: list[str], nodes: str, **cfg: object):
    from maitre.launch import Run, RunConfig

    lo, _, hi = nodes.partition(":")
    lines: list[str] = []
    run = Run(
        RunConfig(
            command=command,
            min_nodes=int(lo),
            max_nodes=int(hi or lo),
            elastic="restart",
            run_dir=tmp_path / "run",
            ledger=False,
            grace_period_s=5.0,
            **cfg,  # type: ignore[arg-type]
        ),
        out=lines.append,
    )
    return run, lines


def _wait(run, lines: list[str]) -> int:
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(run.wait()), daemon=True)
    thread.start()
    thread.join(timeout=150)
    if thread.is_alive():
        run.shutdown()
        pytest.fail("the run did not end:\n" + "\n".join(lines[-60:]))
    for agent in run.agents:  # every process of every worker is gone
        for worker in agent.workers.values():
            assert not worker.alive(), f"{worker.worker_id} still running"
    return code[0]


@pytest.mark.timeout(200)
def test_an_unmodified_ddp_script_survives_a_sigkill_and_a_join_restarted_at_each_new_size(tmp_path: Path) -> None:
    steps, out, ckpt = 120, tmp_path / "final.pt", tmp_path / "ckpt"
    command = [sys.executable, str(DDP), "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--out", str(out)]
    run, lines = _restart_run(tmp_path, command + ["--step-ms", "40"], "2:3", success_marker="training done")
    run.start()

    def job() -> dict:
        return run.job()

    def said() -> str:
        return "\n".join(lines[-80:]) + f"\njob: {job()}"

    wait_for(lambda: (ckpt / "latest.pt").exists() and job()["state"] == "RUNNING", 60, "a first checkpoint", said)
    victim = job()["members"][1]
    os.kill(run.pid_of(victim), signal.SIGKILL)
    wait_for(lambda: job()["epoch"] == 2 and job()["state"] == "RUNNING", 60, "the gang to restart", said)
    assert job()["failures"] == 1
    wait_for(lambda: any("restart 1, resuming at step 1" in line for line in lines), 60, "its checkpoint read", said)
    run.add_node()  # a third node: the job grows, restarted at 3
    grown = wait_for(lambda: (j := job())["epoch"] == 3 and j["state"] == "RUNNING" and j, 60, "the gang at 3", said)
    assert len(grown["members"]) == 3 and grown["failures"] == 1
    assert _wait(run, lines) == 0, "\n".join(lines[-60:])
    final = job()
    assert final["state"] == "COMPLETED" and final["failures"] == 1, final
    causes = [r["cause"] for r in final["restarts"]]
    assert "killed by signal 9" in causes[0] and causes[1].startswith("resize to 3"), causes
    assert all(r["restart_s"] is not None and r["joined_s"] >= r["restart_s"] for r in final["restarts"])
    resumed = [line for line in lines if "resuming at step" in line]
    assert any("rank 2 of 3: restart 2" in line for line in resumed), resumed
    assert relative_error(torch.load(out, weights_only=True), _reference(steps)) <= 1e-9


@pytest.mark.timeout(120)
def test_a_script_that_crashes_at_every_start_fails_with_its_stderr(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('loading shards', file=sys.stderr)\nraise SystemExit('no shard in /data/x')\n")
    run, lines = _restart_run(tmp_path, [sys.executable, str(script)], "1", max_restarts=1)
    run.start()
    assert _wait(run, lines) == 1
    final = run.job()
    assert final["state"] == "FAILED" and final["failures"] == 2, final
    assert "restart budget" in final["failure"] and "no shard in /data/x" in final["failure"], final["failure"]
    assert "loading shards" in final["failure"]


@pytest.mark.timeout(120)
def test_a_script_that_never_builds_its_process_group_fails(tmp_path: Path) -> None:
    script = tmp_path / "alone.py"
    script.write_text("print('training alone, as if no one else were here')\n")
    run, lines = _restart_run(tmp_path, [sys.executable, str(script)], "2", max_restarts=0)
    run.start()
    assert _wait(run, lines) == 1
    final = run.job()
    assert final["state"] == "FAILED" and "never called init_process_group" in final["failure"], final
