"""Slurm's accounting is the site's record of what maitre's jobs used: a test Slurm with
slurmdbd on a MariaDB of its own (``slurm_cluster.start(accounting=True)``; an account, a QOS,
``AccountingStorageEnforce=associations,qos``). Marked ``slurm`` with the stories (``.ci/run``
installs ``slurmdbd`` and ``mariadb-server``).

Two maitre jobs run at once under ``maitre up --slurm --slurm-qos Q --slurm-account A``: ``sacct``
has every replica job under its maitre job's name, with that QOS and account, and each job's
workers ran only on the nodes of its own replica jobs (each replica job's node is reserved for
its job), so what ``sacct`` says a job used is what it used. A QOS Slurm does not have is
``sbatch``'s refusal, one line naming the command and Slurm's message, the job left pending.
"""

from __future__ import annotations

import pytest

import slurm_cluster
from conftest import example_command, wait_for
from slurm_cluster import ACCOUNT, QOS

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with slurm_cluster.running(tmp_path_factory.mktemp("slurm-acct"), accounting=True) as c:
        yield c


def sacct(cluster) -> list[dict[str, str]]:
    """Every job Slurm's accounting has (allocations only, ``-X``)."""
    keys = ("id", "name", "partition", "qos", "account", "state", "nodes")
    out = cluster.run(
        "sacct",
        "-X",
        "-n",
        "-P",
        "-a",
        "--starttime",
        "now-1hour",
        "-o",
        "JobID,JobName,Partition,QOS,Account,State,NodeList",
    )
    return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_sacct_records_each_replica_job_under_its_job_qos_and_account(cluster, tmp_path) -> None:
    from maitre.runtime.ledger import audit

    jobs = {"a": 2, "b": 1}  # a may grow to 4: only onto nodes of its own replica jobs
    with slurm_cluster.maitre_up(
        cluster, tmp_path, "--slurm-qos", QOS, "--slurm-account", ACCOUNT, "--resize-cooldown", "0"
    ) as (client, state, log):
        for name, n in jobs.items():
            client.post(
                "/jobs",
                {
                    "manifest": {
                        "name": name,
                        "queue": "q",
                        "minReplicas": n,
                        "maxReplicas": 2 * n,
                        "command": example_command(300, tmp_path / f"{name}.pt") + ["--device-ms-per-sample", "4"],
                    }
                },
            )
        done = {
            j: wait_for(
                lambda j=j: (s := client.get(f"/jobs/{j}"))["state"] in ("COMPLETED", "FAILED") and s,
                150,
                f"job {j} to finish",
                log,
            )
            for j in jobs
        }
        wait_for(
            lambda: not [j for j in cluster.jobs() if j["name"].startswith("maitre-")],
            60,
            "the replica jobs to be cancelled",
            log,
        )
    records = wait_for(
        lambda: (
            (r := [x for x in sacct(cluster) if x["name"].startswith("maitre-")])
            and all(x["state"] != "RUNNING" for x in r)
            and r
        ),
        30,
        "sacct to record the replica jobs",
    )
    assert sorted(r["name"] for r in records) == ["maitre-a-0", "maitre-a-1", "maitre-b-0"], records
    assert {(r["partition"], r["qos"], r["account"]) for r in records} == {("normal", QOS, ACCOUNT)}, records
    for name, n in jobs.items():
        status = done[name]
        assert status["state"] == "COMPLETED" and status["failures"] == 0, status
        assert audit(state / "ledger" / name).ok
        theirs = {r["nodes"] for r in records if r["name"].startswith(f"maitre-{name}-")}
        ran_on = {w["node"] for w in status["workers"]}
        assert len(theirs) == n and ran_on <= theirs, (name, ran_on, records)


@pytest.mark.timeout(120)
def test_a_qos_slurm_does_not_have_is_sbatchs_refusal_and_the_job_stays_pending(cluster, tmp_path) -> None:
    with slurm_cluster.maitre_up(cluster, tmp_path, "--slurm-qos", "nosuch") as (client, _, log):
        client.post(
            "/jobs",
            {"manifest": {"name": "waits", "queue": "q", "minReplicas": 1, "maxReplicas": 1, "command": ["true"]}},
        )
        line = wait_for(
            lambda: next((ln for ln in log.read_text().splitlines() if "sbatch --parsable" in ln), None),
            30,
            "the engine's error line",
            log,
        )
        assert "--qos nosuch" in line and "sbatch: error:" in line and "qos" in line.lower(), line
        assert "stays pending" in line, line
        assert client.get("/jobs/waits")["state"] == "PENDING"
        assert [j for j in cluster.jobs() if j["name"].startswith("maitre-")] == []
