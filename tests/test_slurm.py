"""maitre on a real Slurm (tests/slurm_cluster.py: munged, slurmctld, four slurmd on this host).

The fast tests read the inventory, plan replica jobs, and check the bad input (a Slurm that
does not answer, a partition that does not exist, sbatch refusing a replica job). The story,
marked ``slurm`` (``pytest -m slurm``, a separate command in .ci/run), trains a job that grows
into idle nodes, is partly preempted by a Slurm job that is not maitre's, and grows back; and
a job whose last replica job is cancelled resumes from its checkpoint.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import ROOT, wait_for
from maitre.engines.slurm import inventory
from maitre.engines.slurm.commands import Slurm, SlurmError
from maitre.engines.slurm.engine import Plan, SlurmConfig, SlurmEngine, Submit, plan
from maitre.engines.slurm.replicas import ReplicaJob, parse_name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with slurm_cluster.running(tmp_path_factory.mktemp("slurm")) as c:
        yield c


# -- Slurm's text, parsed (no Slurm needed) ----------------------------------------------------
NODE_LINE = (
    "NodeName=gpu07 Arch=x86_64 CoresPerSocket=16 CPUAlloc=0 CPUTot=64 "
    "AvailableFeatures=ib,rack-b2 ActiveFeatures=ib,rack-b2 Gres=gpu:a100:8(S:0-1) "
    "NodeAddr=10.0.0.7 State=MIXED+DRAIN Partitions=gpu,scavenger BootTime=None"
)


@pytest.mark.timeout(10)
def test_slurm_text_parses_into_nodes_gpus_labels_and_partitions() -> None:
    assert inventory.expand("gpu[01-03,7],login") == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]
    assert inventory.gpus("gpu:a100:4(S:0-1),gpu:v100:2,shard:8") == 6
    assert inventory.gpus("(null)") == 0
    [node] = inventory.parse_nodes(NODE_LINE)
    assert (node.name, node.cpus, node.gpus, node.state) == ("gpu07", 64, 8, "mixed+drain")
    assert node.partitions == ("gpu", "scavenger")
    assert node.labels == {"rack": "rack-b2", "accelerator": "a100"}  # no switches: features
    topo = inventory.parse_topology(
        "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu[06-07]\n"
        "SwitchName=spine Level=1 LinkSpeed=1 Nodes=gpu[06-07] Switches=leaf[1-2]\n"
    )
    [node] = inventory.parse_nodes(NODE_LINE, topo)
    assert node.labels == {"rack": "leaf1", "block": "spine", "accelerator": "a100"}
    parts = inventory.parse_partitions(
        "PartitionName=scav AllowGroups=ALL PriorityTier=1 GraceTime=00:01:30 "
        "PreemptMode=REQUEUE State=UP Nodes=gpu[06-07]\n"
    )
    assert parts["scav"].grace_s == 90 and parts["scav"].nodes == ("gpu06", "gpu07")
    assert inventory.parse_kill_wait("KillWait                = 30 sec\nX = 1\n") == 30
    assert parse_name("maitre-bert-large-3") == ("bert-large", 3)
    assert parse_name("someone-elses-job") is None


def _job(name: str, lo: int, hi: int, state: str = "RUNNING", workers=()) -> dict:
    return {
        "job_id": name,
        "state": state,
        "min_workers": lo,
        "max_workers": hi,
        "workers": [{"id": w} for w in workers],
    }


def _rep(sid: str, job: str, index: int, state: str = "RUNNING", node: str = "") -> ReplicaJob:
    return ReplicaJob(sid, job, index, "x", state, node, "")


@pytest.mark.timeout(10)
def test_plan_puts_the_minimum_in_the_partition_and_grows_only_into_idle_nodes() -> None:
    assert plan([_job("a", 2, 4, "PENDING")], {}, [], idle_scavenger=1) == Plan(
        submit=[Submit("a", 0, False), Submit("a", 1, False), Submit("a", 2, True)]
    )
    have = [_rep("1", "a", 0), _rep("2", "a", 1), _rep("3", "a", 2, "PENDING")]
    assert plan([_job("a", 2, 4)], {}, have, idle_scavenger=3) == Plan()  # Slurm has no room
    assert plan([_job("a", 2, 4)], {}, have[:2], idle_scavenger=0) == Plan()
    assert plan([_job("a", 2, 4)], {}, have[:2], idle_scavenger=9, scavenger=False) == Plan()
    requeued = [*have[:2], ReplicaJob("4", "a", 3, "x", "PENDING", "", "BeginTime")]
    assert plan([_job("a", 2, 4)], {}, requeued, idle_scavenger=1) == Plan(release=["4"])


@pytest.mark.timeout(10)
def test_plan_cancels_a_replica_job_only_once_the_coordinator_has_left_its_node() -> None:
    have = [_rep("1", "a", 0, node="n1"), _rep("2", "a", 1, node="n2"), _rep("3", "a", 2, node="n3")]
    nodes = {"n1": ["w1"], "n2": ["w2"], "n3": ["w3"]}
    job = _job("a", 1, 2, workers=["w1", "w2", "w3"])  # scaled to 2, not shrunk yet
    assert plan([job], nodes, have, idle_scavenger=1) == Plan()
    nodes["n2"] = []  # the coordinator shrank away from n2
    assert plan([_job("a", 1, 2, workers=["w1", "w3"])], nodes, have, 1) == Plan(cancel=["2"])
    # a finished job's, and a job the coordinator does not know (cancelled while we were away)
    assert plan([_job("a", 1, 2, "COMPLETED")], nodes, have, 1) == Plan(cancel=["1", "2", "3"])
    assert plan([], nodes, have[:1], 1) == Plan(cancel=["1"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args,words",
    [
        (("up", "--slurm-scavenger", "scav"), "--slurm-scavenger needs --slurm"),
        (("up", "--slurm", "--nodes", "2"), "--nodes and --slurm"),
        (("agent", "--coordinator", "127.0.0.1:1", "--slurm"), "not inside a Slurm job"),
    ],
)
def test_bad_slurm_flags_are_one_line_and_exit_2(args, words, capsys, monkeypatch, tmp_path: Path) -> None:
    from maitre.cli import main

    for var in ("SLURMD_NODENAME", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    assert main([*args] + (["--state-dir", str(tmp_path / "s")] if args[0] == "up" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "s").exists()


# -- against the test Slurm ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_the_inventory_is_read_from_slurm(cluster) -> None:
    inv = inventory.read(Slurm(env=cluster.env))
    assert [n.name for n in inv.nodes] == list(slurm_cluster.NODES)
    assert all(n.gpus == 1 and n.cpus == 1 and n.state == "idle" for n in inv.nodes)
    assert {n.name: n.labels["rack"] for n in inv.nodes} == {
        "node1": "sw1",
        "node2": "sw1",
        "node3": "sw2",
        "node4": "sw2",
    }
    assert {n.labels["block"] for n in inv.nodes} == {"top"}
    assert inv.partition("scavenger").grace_s == slurm_cluster.GRACE_S
    assert inv.partition("scavenger").preempt_mode == "REQUEUE"
    assert inv.partition("normal").priority_tier > inv.partition("scavenger").priority_tier
    assert inv.kill_wait_s == 5


def _up(tmp: Path, env: dict[str, str], *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if not k.startswith("MAITRE_")}
    return subprocess.run(
        [sys.executable, "-m", "maitre.cli", "up", "--slurm", "--state-dir", str(tmp / "state"), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(90)
def test_a_slurm_that_does_not_answer_is_one_line_naming_the_command(cluster, tmp_path) -> None:
    conf = tmp_path / "slurm.conf"  # the same cluster, but its controller on a dead port
    [dead] = slurm_cluster.free_ports(1)
    text = cluster.conf.read_text()
    text = (
        "\n".join(f"SlurmctldPort={dead}" if ln.startswith("SlurmctldPort=") else ln for ln in text.splitlines())
        + "\nMessageTimeout=2\n"
    )
    conf.write_text(text)
    for name in ("gres.conf", "topology.conf"):
        (tmp_path / name).write_text((cluster.conf.parent / name).read_text())
    started = time.monotonic()
    done = _up(tmp_path, {**cluster.env, "SLURM_CONF": str(conf)}, "--slurm-scavenger", "scavenger")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("maitre: error: Slurm: scontrol show "), done.stderr
    assert "Unable to contact slurm controller" in lines[0], lines[0]
    assert not (tmp_path / "state" / "state.db").exists()  # nothing started, nothing stored
    assert time.monotonic() - started < 60


@pytest.mark.timeout(60)
def test_a_partition_that_does_not_exist_is_refused_before_anything_starts(cluster, tmp_path) -> None:
    done = _up(tmp_path, cluster.env, "--slurm-scavenger", "nosuch")
    assert done.returncode != 0
    assert done.stderr.strip() == (
        "maitre: error: Slurm: scontrol show partition nosuch: "
        "Partition "
        "'nosuch' does not exist (Slurm has: normal, scavenger)"
    )
    assert not (tmp_path / "state" / "state.db").exists()
    done = _up(tmp_path, cluster.env, "--slurm-partition", "normal", "--slurm-scavenger", "normal")
    assert done.returncode != 0 and "is the job partition itself" in done.stderr
    assert not (tmp_path / "state" / "state.db").exists()


@pytest.mark.timeout(90)
def test_sbatch_refusing_a_replica_job_leaves_the_job_pending_and_nothing_lost(cluster, tmp_path) -> None:
    """Three GPUs per replica on nodes of one: sbatch says no; that line is the engine's error,
    the job stays PENDING in maitre, and no replica job is left in Slurm."""
    from maitre.engines.slurm.replicas import AgentCommand
    from maitre.local import LocalCluster, UpConfig
    from maitre.scheduling.model import Queue
    from maitre.wire import Client

    up = LocalCluster(
        UpConfig(state_dir=tmp_path / "state", nodes=0, queues=[Queue("q")]), out=lambda line: None
    ).start()
    try:
        client = Client(up.address, token=up.token)
        client.post(
            "/jobs",
            {"manifest": {"name": "big", "queue": "q", "minReplicas": 1, "maxReplicas": 2, "command": ["true"]}},
        )
        cfg = SlurmConfig(partition="normal", scavenger="scavenger", gpus_per_replica=3, log_dir=str(tmp_path))
        engine = SlurmEngine(client, cfg, AgentCommand(up.address, str(up.token_file)), Slurm(env=cluster.env))
        with pytest.raises(SlurmError) as caught:
            engine.once()
        assert str(caught.value).startswith("sbatch --parsable --requeue")
        assert caught.value.message.startswith("sbatch: error: ")
        assert "Requested node configuration is not available" in caught.value.message
        assert client.get("/jobs/big")["state"] == "PENDING"
        assert [j for j in cluster.jobs() if j["name"].startswith("maitre-")] == []
        engine.start()  # the loop logs it once and keeps trying; the job stays pending
        wait_for(lambda: len(engine.errors) >= 2, 20, "the engine's second try")
        engine.stop()
        assert len(set(engine.errors)) == 1
        assert client.get("/jobs/big")["state"] == "PENDING"
    finally:
        up.stop()


@pytest.mark.timeout(90)
def test_a_replica_job_joins_as_its_slurm_node_and_leaves_gracefully_on_scancel(cluster, tmp_path) -> None:
    """A replica job's agent is the Slurm node it got (name, switch labels, spot in the
    scavenger partition), reserved for its job; scancel's SIGTERM is a notice: the node is
    reclaimed, not dead."""
    from maitre.engines.slurm import replicas
    from maitre.engines.slurm.replicas import AgentCommand
    from maitre.local import LocalCluster, UpConfig
    from maitre.scheduling.model import Queue
    from maitre.wire import Client

    up = LocalCluster(
        UpConfig(state_dir=tmp_path / "state", nodes=0, queues=[Queue("q")]), out=lambda line: None
    ).start()
    slurm = Slurm(env={**cluster.env, "PYTHONPATH": str(ROOT / "src")})
    try:
        client = Client(up.address, token=up.token)
        agent = AgentCommand(up.address, str(up.token_file.resolve()))
        sid = replicas.submit(
            slurm, "lone", 2, partition="scavenger", agent=agent, grace_s=10, scavenger=True, log_dir=str(tmp_path)
        )
        [rep] = replicas.listed(slurm)
        assert (rep.slurm_id, rep.job, rep.index, rep.partition) == (sid, "lone", 2, "scavenger")
        node = wait_for(
            lambda: next((n for n in client.get("/nodes")["nodes"] if n["alive"]), None),
            60,
            "the replica job's agent to join",
            tmp_path / f"maitre-lone-2-{sid}.log",
        )
        running = next(j for j in cluster.jobs() if j["id"] == sid)
        assert node["node"] == running["nodes"]
        rack = "sw1" if node["node"] in ("node1", "node2") else "sw2"
        assert node["labels"] == {
            "rack": rack,
            "block": "top",
            "capacity_type": "spot",
            "reserved_for": "lone",
        }  # that job's workers only
        replicas.cancel(slurm, sid)
        gone = wait_for(
            lambda: (
                (n := next(x for x in client.get("/nodes")["nodes"] if x["node"] == node["node"]))["reclaimed"] and n
            ),
            30,
            "the node to be reclaimed",
            tmp_path / f"maitre-lone-2-{sid}.log",
        )
        assert not gone["alive"]
        wait_for(lambda: not cluster.jobs(), 30, "the replica job to end")
        kinds = [e["kind"] for e in client.get("/events")["events"]]
        assert "spot_notice" in kinds and "node_reclaimed" in kinds and "node_dead" not in kinds
    finally:
        up.stop()


# -- the story ------------------------------------------------------------------------------------
@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_a_job_grows_into_idle_nodes_is_preempted_by_slurm_in_place_and_grows_back(
    cluster, tmp_path, reference
) -> None:
    """``maitre up --slurm``: a job of 2..4 replicas takes its minimum in ``normal`` and grows
    into the idle nodes through the scavenger partition; a high-priority Slurm job that is not
    maitre's takes two nodes: Slurm preempts two replica jobs (SIGTERM, GraceTime), the job
    shrinks in place at a step boundary with no failure counted; the replica jobs are requeued
    and, when the intruder is done, join again and the job grows back to 4. Every sample once;
    the final parameters are a fixed-size run's."""
    import torch

    from conftest import example_command, relative_error

    steps, out = 1200, tmp_path / "final.pt"
    with (
        slurm_cluster.maitre_up(
            cluster, tmp_path, "--resize-cooldown", "0", "--slurm-partition", "normal", "--slurm-scavenger", "scavenger"
        ) as (client, state, log),
        contextlib.ExitStack() as cleanup,
    ):
        command = example_command(steps, out) + ["--device-ms-per-sample", "20"]
        client.post(
            "/jobs",
            {
                "manifest": {
                    "name": "story",
                    "queue": "q",
                    "minReplicas": 2,
                    "maxReplicas": 4,
                    "command": command,
                    "checkpointDir": str(tmp_path / "ckpt"),
                }
            },
        )

        def job() -> dict:
            return client.get("/jobs/story")

        def members(n: int):
            return lambda: (j := job())["state"] == "RUNNING" and len(j["members"]) == n and j

        def said() -> str:  # (a timeout's detail: the job as the API shows it, and every log)
            return f"the job: {job()}\n" + slurm_cluster.told(log, state)

        t0 = time.monotonic()
        grown = wait_for(members(4), 150, "the job to grow into the four nodes", said)
        t_grown = time.monotonic()
        reps = {j["name"]: j for j in cluster.jobs() if j["name"].startswith("maitre-story-")}
        assert {r["partition"] for n, r in reps.items() if n[-1] in "01"} == {"normal"}
        assert {r["partition"] for n, r in reps.items() if n[-1] in "23"} == {"scavenger"}
        intruder = cluster.run(
            "sbatch", "--parsable", "-p", "normal", "-N", "2", "-J", "not-maitre", "--wrap", "sleep 25"
        ).strip()
        cleanup.callback(cluster.run, "scancel", intruder, check=False)  # (before maitre stops)
        t_intruder = time.monotonic()
        shrunk = wait_for(members(2), 60, "the job to shrink in place to 2", said)
        t_shrunk = time.monotonic()
        assert shrunk["failures"] == 0 and shrunk["step"] > grown["step"]
        wait_for(
            lambda: any(j["id"] == intruder and j["state"] == "RUNNING" for j in cluster.jobs()),
            60,
            "the intruder to run",
            said,
        )
        requeued = [
            j for j in cluster.jobs() if j["name"].startswith("maitre-story-") and j["partition"] == "scavenger"
        ]
        assert len(requeued) == 2 and all(j["state"] == "PENDING" for j in requeued), requeued
        t_running = time.monotonic()
        back = wait_for(members(4), 150, "the job to grow back to 4", said)
        t_back = time.monotonic()
        assert back["step"] > shrunk["step"]
        final = wait_for(lambda: (j := job())["state"] in ("COMPLETED", "FAILED") and j, 240, "the job to finish", said)
        wait_for(
            lambda: not [j for j in cluster.jobs() if j["name"].startswith("maitre-")],
            60,
            "the replica jobs to be cancelled",
            said,
        )
        events, since = [], 0
        while page := client.get(f"/events?since={since}")["events"]:
            events += page
            since = page[-1]["seq"]
    assert final["state"] == "COMPLETED" and final["failures"] == 0, final
    kinds = [e["kind"] for e in events]
    assert kinds.count("node_reclaimed") >= 2 and "node_dead" not in kinds, kinds
    from maitre.runtime.ledger import audit

    result = audit(state / "ledger" / "story")
    assert result.ok, result.describe()
    err = relative_error(torch.load(out, weights_only=True), reference(steps))
    print(
        f"\nslurm story: grown to 4 in {t_grown - t0:.1f} s; shrunk to 2 "
        f"{t_shrunk - t_intruder:.1f} s after the intruder's sbatch (steps {grown['step']} -> "
        f"{shrunk['step']}); back to 4 {t_back - t_running:.1f} s after the intruder ran "
        f"(step {back['step']}); {final['epoch']} epochs; relative error {err:.2e}"
    )
    assert err < 1e-5


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_an_unmodified_ddp_script_is_restarted_whole_when_slurm_preempts_a_replica(cluster, tmp_path) -> None:
    """``elastic: restart`` under ``maitre up --slurm``: plain DDP (examples/torchrun_ddp.py,
    nothing of maitre's) on 2 replica jobs, one in the scavenger partition; a Slurm job that is
    not maitre's takes 3 nodes, Slurm preempts the scavenger replica (its SIGTERM reaches the
    script too): the gang is restarted at 1 with no failure counted, grows back to 2 when the
    intruder is done, and the script ends with a fixed-size run's parameters."""
    import torch

    from conftest import relative_error
    from test_restart_mode import DDP, _reference

    steps, out, ckpt = 1500, tmp_path / "final.pt", tmp_path / "ckpt"
    with (
        slurm_cluster.maitre_up(
            cluster, tmp_path, "--resize-cooldown", "0", "--slurm-partition", "normal", "--slurm-scavenger", "scavenger"
        ) as (client, state, log),
        contextlib.ExitStack() as cleanup,
    ):
        command = [sys.executable, str(DDP), "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--out", str(out)]
        client.post(
            "/jobs",
            {
                "manifest": {
                    "name": "plain",
                    "queue": "q",
                    "elastic": "restart",
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "gracePeriodSeconds": 10,
                    "successMarker": "training done",
                    "command": command + ["--step-ms", "50"],
                }
            },
        )

        def job() -> dict:
            return client.get("/jobs/plain")

        def said() -> str:
            return f"the job: {job()}\n" + slurm_cluster.told(log, state)

        def gang(n: int, after: int = 0):
            return lambda: (j := job())["state"] == "RUNNING" and len(j["members"]) == n and j["epoch"] > after and j

        two = wait_for(gang(2), 150, "a gang of 2", said)
        wait_for(lambda: (ckpt / "latest.pt").exists(), 90, "the script's first checkpoint", said)
        intruder = cluster.run("sbatch", "--parsable", "-p", "normal", "-N", "3", "-J", "other", "--wrap", "sleep 20")
        cleanup.callback(cluster.run, "scancel", intruder.strip(), check=False)
        one = wait_for(gang(1, two["epoch"]), 90, "the gang restarted at 1", said)
        assert one["failures"] == 0, one
        back = wait_for(gang(2, one["epoch"]), 180, "the gang back at 2", said)
        final = wait_for(lambda: (j := job())["state"] in ("COMPLETED", "FAILED") and j, 240, "the job to end", said)
        wait_for(
            lambda: not [j for j in cluster.jobs() if j["name"].startswith("maitre-")],
            60,
            "the replica jobs to be cancelled",
            said,
        )
    assert final["state"] == "COMPLETED" and final["failures"] == 0, final
    assert back["epoch"] >= 3 and len(final["restarts"]) >= 2, final["restarts"]
    assert relative_error(torch.load(out, weights_only=True), _reference(steps)) <= 1e-9


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_job_whose_last_replica_job_is_cancelled_resumes_from_its_checkpoint(cluster, tmp_path, reference) -> None:
    """Its only replica job ``scancel``led (by the site): SIGTERM is a notice of ``KillWait``;
    the job checkpoints within it and is suspended, the engine submits the replica job again,
    and the job resumes from its checkpoint on the new node, ending as a fixed-size run."""
    import torch

    from conftest import example_command, relative_error

    steps, out = 400, tmp_path / "final.pt"
    with slurm_cluster.maitre_up(cluster, tmp_path) as (client, state, log):
        command = example_command(steps, out) + ["--device-ms-per-sample", "5"]
        client.post(
            "/jobs",
            {
                "manifest": {
                    "name": "alone",
                    "queue": "q",
                    "minReplicas": 1,
                    "maxReplicas": 1,
                    "command": command,
                    "checkpointDir": str(tmp_path / "ckpt"),
                }
            },
        )

        def job() -> dict:
            return client.get("/jobs/alone")

        before = wait_for(
            lambda: (j := job())["state"] == "RUNNING" and j["step"] >= 40 and j, 120, "the job to train", log
        )
        [rep] = [j for j in cluster.jobs() if j["name"] == "maitre-alone-0"]
        cluster.run("scancel", rep["id"])
        wait_for(lambda: job()["state"] in ("SUSPENDING", "SUSPENDED"), 30, "the job to be suspended", log)
        again = wait_for(
            lambda: (
                (j := job())["state"] == "RUNNING" and j["step"] > 0 and j["incarnation"] > before["incarnation"] and j
            ),
            90,
            "the job to resume on a new replica job",
            log,
        )
        assert any(j["name"] == "maitre-alone-0" and j["id"] != rep["id"] for j in cluster.jobs())
        final = wait_for(lambda: (j := job())["state"] in ("COMPLETED", "FAILED") and j, 150, "the job to finish", log)
        wait_for(
            lambda: not [j for j in cluster.jobs() if j["name"].startswith("maitre-")],
            60,
            "the replica job to be cancelled",
            log,
        )
    assert final["state"] == "COMPLETED" and final["failures"] == 0, final
    assert again["step"] >= before["step"] - 1  # resumed from the checkpoint, not from zero
    from maitre.runtime.ledger import audit

    result = audit(state / "ledger" / "alone")
    assert result.ok, result.describe()
    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-5
