"""``/metrics``: a real coordinator and its API in process, driven through a job's life by the
messages its agent and workers send (heartbeats, rendezvous, reports, an exit), then scraped.

The text must be what Prometheus reads (``promtool check metrics``: its parser and its naming
lint), need the coordinator's token, and say what happened: slots held and busy, the job's
progress, its checkpoint, the crash it recovered from and how long that took, the scheduling
passes, spot notices and reclaims as the spot engineer's events arrive in the log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from maitre.control.api import build_app
from maitre.control.cluster import ClusterState
from maitre.control.coordinator import Coordinator
from maitre.control.metrics import cause_of
from maitre.control.store import Store
from maitre.scheduling.model import Queue

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

TOKEN = "t"


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in a scrape (None: no such sample)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def promtool_check(text: str) -> None:
    """``promtool check metrics`` on the text: it parses, and its lint finds nothing."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (Debian package prometheus; .ci/run installs it)")
        pytest.skip("promtool is missing (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.returncode,
        done.stdout,
        done.stderr,
    )


def ok(response: Any) -> Any:
    assert response.status_code == 200, (response.status_code, response.text)
    return response.json()


@pytest.fixture
def world(tmp_path: Path):
    t = [1000.0]
    db = Store(tmp_path / "state.db")
    co = Coordinator(
        "127.0.0.1:1", clock=lambda: t[0], cluster=ClusterState([Queue("q")], run_dir=tmp_path), store=db, pass_s=0.5
    )
    with TestClient(build_app(co, token=TOKEN), headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        yield co, client, t
    db.close()


def recovery(epoch: int, reason: str, source: str, to_next_step_s: float) -> dict[str, Any]:
    return {
        "kind": "recovery",
        "epoch": epoch,
        "rank": 0,
        "world_size": 1,
        "step": 10,
        "state_bytes": 0,
        "reason": reason,
        "detected_at": 0.0,
        "rendezvous_s": 0.1,
        "group_s": 0.05,
        "state_s": 0.0,
        "to_next_step_s": to_next_step_s,
        "state_source": source,
    }


@pytest.mark.timeout(60)
def test_a_scrape_says_what_the_coordinator_saw(world) -> None:
    co, client, t = world

    def tick() -> None:
        t[0] += 1.0
        co.tick()

    ok(
        client.post(
            "/v1/jobs",
            json={
                "manifest": {
                    "name": "a",
                    "queue": "q",
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "command": ["python", "train.py"],
                    "checkpointDir": "/nonexistent/a",
                }
            },
        )
    )
    orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2}))
    tick()  # admits it on n0
    orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2, "since": orders["version"]}))
    w1, w2 = sorted(o["worker_id"] for o in orders["start"])
    ok(
        client.post(
            "/v1/nodes/n0/heartbeat",
            json={"slots": 2, "since": orders["version"], "workers": [{"id": w, "silent_s": 0.0} for w in (w1, w2)]},
        )
    )
    for w in (w1, w2):
        client.post(f"/v1/workers/{w}/rendezvous", json={"from_epoch": 0, "wait_s": 0})
    for w in (w1, w2):
        assert ok(client.post(f"/v1/workers/{w}/rendezvous", json={"from_epoch": 0, "wait_s": 0}))["action"] == "train"
    ok(
        client.post(
            "/v1/jobs",
            json={
                "manifest": {  # cannot fit: it waits
                    "name": "b",
                    "queue": "q",
                    "minReplicas": 3,
                    "maxReplicas": 3,
                    "command": ["python", "train.py"],
                }
            },
        )
    )
    tick()

    report = f"/v1/workers/{w1}/report"
    ok(client.post(report, json=recovery(1, "join", "none", 2.0)))  # the start: no recovery
    for step in (10, 20, 30):
        t[0] += 1.0
        ok(
            client.post(
                report,
                json={
                    "kind": "progress",
                    "step": step,
                    "loss": 2.5 - step / 100,
                    "world_size": 2,
                    "steps_per_s": 10.0,
                    "samples_per_s": 120.0,
                },
            )
        )
    t[0] += 0.1  # too soon after the last one: kept as the latest, no event
    ok(
        client.post(
            report,
            json={
                "kind": "progress",
                "step": 31,
                "loss": None,
                "world_size": 2,
                "steps_per_s": 9.0,
                "skipped_samples": 2,
            },
        )
    )
    bad_fields = ('"steps_per_s": -1.0', '"loss": NaN', '"world_size": 0', '"loss": Infinity', '"skipped_samples": -1')
    for bad in bad_fields:
        body = '{"kind": "progress", "step": 32, "world_size": 2, "steps_per_s": 1.0, ' + bad + "}"
        assert (
            client.post(report, content=body.encode(), headers={"content-type": "application/json"}).status_code == 400
        ), bad
    ok(
        client.post(
            report,
            json={
                "kind": "checkpoint",
                "step": 25,
                "world_size": 2,
                "snapshot_s": 0.004,
                "persist_s": 0.2,
                "bytes": 123456,
                "interval_steps": None,
                "interval_s": 30.0,
                "ok": True,
                "error": None,
            },
        )
    )
    assert co.progress["a"]["step"] == 31
    assert [r["kind"] for r in co.reports["a"]] == ["recovery", "checkpoint"]  # no progress

    # w2 is killed: the epoch closes; w1 goes on alone from its own state.
    ok(client.post(f"/v1/workers/{w2}/exit", json={"code": -9}))
    assert (
        ok(
            client.post(
                f"/v1/workers/{w1}/rendezvous",
                json={"from_epoch": 1, "step": 30, "reason": "Connection closed by peer", "wait_s": 0},
            )
        )["action"]
        == "train"
    )
    ok(client.post(report, json=recovery(2, "Connection closed by peer", "peer", 0.3)))
    tick()
    co.cluster.log(
        t[0], "spot_notice", node="n0", notice_s=120.0, deadline=t[0] + 120.0, source="file:/tmp/notice"
    )  # (as the spot handling emits them)
    co.cluster.log(t[0], "node_drained", node="n0", workers=[w1], seconds=4.5)
    co.cluster.log(t[0], "node_reclaimed", node="n0")

    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    worker_token = orders["start"][0]["token"]
    assert client.get("/metrics", headers={"Authorization": f"Bearer {worker_token}"}).status_code == 403
    scraped = client.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = scraped.text
    promtool_check(text)

    assert sample(text, "maitre_job_slots_held", job="a") == 1  # w2's slot is free
    assert sample(text, "maitre_job_slots_busy", job="a") == 1
    assert sample(text, "maitre_job_slots_held", job="b") == 0
    assert sample(text, "maitre_cluster_slots") == 2
    assert sample(text, "maitre_cluster_slots_held") == 1
    assert sample(text, "maitre_nodes", state="alive") == 1
    assert sample(text, "maitre_nodes", state="dead") == 0
    assert sample(text, "maitre_jobs", state="RUNNING") == 1
    assert sample(text, "maitre_jobs", state="PENDING") == 1
    assert sample(text, "maitre_jobs_waiting", queue="q") == 1
    assert sample(text, "maitre_job_step", job="a") == 31
    assert sample(text, "maitre_job_skipped_samples", job="a") == 2
    assert sample(text, "maitre_job_steps_per_second", job="a") == 9.0
    assert sample(text, "maitre_job_loss", job="a") is None  # the latest had none
    assert sample(text, "maitre_job_world_size", job="a") == 2
    assert sample(text, "maitre_events_total", kind="progress") == 3
    assert sample(text, "maitre_checkpoints_total", result="ok") == 1
    assert sample(text, "maitre_checkpoints_total", result="failed") == 0
    assert sample(text, "maitre_checkpoint_written_bytes_total") == 123456
    assert sample(text, "maitre_checkpoint_snapshot_duration_seconds_count") == 1
    assert sample(text, "maitre_checkpoint_snapshot_duration_seconds_bucket", le="0.005") == 1
    assert sample(text, "maitre_checkpoint_persist_duration_seconds_sum") == pytest.approx(0.2)
    assert sample(text, "maitre_job_checkpoint_interval_seconds", job="a") == 30.0
    assert sample(text, "maitre_worker_failures_total") == 1
    assert sample(text, "maitre_recoveries_total", cause="crash") == 1
    assert sample(text, "maitre_recoveries_total", cause="start") is None
    assert sample(text, "maitre_recovery_duration_seconds_count", cause="crash") == 1
    assert sample(text, "maitre_recovery_duration_seconds_sum", cause="crash") == pytest.approx(0.3)
    assert sample(
        text, "maitre_recovery_phase_duration_seconds_sum", cause="crash", phase="rendezvous"
    ) == pytest.approx(0.1)
    assert sample(text, "maitre_resizes_total", kind="grow") == 0
    assert sample(text, "maitre_spot_notices_total") == 1
    assert sample(text, "maitre_spot_reclaims_total") == 1
    assert sample(text, "maitre_spot_drain_duration_seconds_sum") == 4.5
    assert sample(text, "maitre_scheduling_pass_duration_seconds_count") >= 3
    assert 0 < sample(text, "maitre_scheduling_pass_duration_seconds_sum") < 5
    kinds = {e["kind"] for e in co.db.events(job="a")}
    assert {"progress", "checkpoint", "report"} <= kinds


def test_the_causes_of_a_membership_change() -> None:
    assert cause_of("start") == "start"
    assert cause_of("worker a-w2: killed by signal 9") == "crash"
    assert cause_of("worker a-w2 hung: no heartbeat for 3.1s while its peers waited") == "hang"
    assert cause_of("worker a-w2 sent no heartbeat for 15.0s") == "lost"
    assert cause_of("node n1 is dead (no agent heartbeat)") == "node_lost"
    assert cause_of("resize (reported by a-w1)") == "resize"
    assert cause_of("worker a-w2 left") == "leave"
    assert cause_of("Connection closed by peer [127.0.0.1]:4242 (reported by a-w1)") == "crash"
    assert cause_of("something new") == "other"
