"""The coordinator's SQLite store: round trips, restarts, bad files, and kill -9 mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from maitre.control.store import Store, StoreError
from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Job, Node, Queue, Topology

pytestmark = pytest.mark.timeout(60)


def test_round_trip_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    store = Store(path)
    store.put_node(Node("n1", 8, rack="r1", block="b0", capacity_type="spot", accelerator="h200"), 1.0)
    store.put_node(Node("n0", 4), 2.0)
    store.node_heartbeat("n0", 5.0)
    store.put_queue(Queue("team-a", guaranteed=8, borrowing_limit=None, weight=2.0))
    store.put_queue(Queue("team-b", guaranteed=0, borrowing_limit=4))
    job = Job(
        id="bert",
        queue="team-a",
        priority=1000,
        min_replicas=2,
        max_replicas=8,
        slots_per_replica=2,
        preemptible=False,
        grace_period_s=90,
        topology=Topology(level="rack", mode="required"),
        submitted_at=3.0,
        state=JobState.RUNNING,
        placement={"n1": 3},
        last_resize_at=4.0,
        throughput={2: 100.0, 3: 140.5},
    )
    store.put_job(job, {"command": ["python", "train.py"], "checkpoint_dir": "/ck"})
    store.put_job(Job(id="pending", queue="team-b", submitted_at=6.0))
    first = store.add_event(7.0, "admit", job="bert", placement={"n1": 3})
    store.add_event(8.0, "node_dead", node="n0")
    store.close()

    again = Store(path)
    cluster = again.cluster()
    assert cluster.nodes["n1"] == Node("n1", 8, rack="r1", block="b0", capacity_type="spot", accelerator="h200")
    assert cluster.queues["team-a"] == Queue("team-a", 8, None, 2.0)
    assert again.node_heartbeats() == {"n0": 5.0, "n1": 1.0}
    (loaded, extra), (pending, _) = again.jobs()
    assert loaded == job and extra == {"command": ["python", "train.py"], "checkpoint_dir": "/ck"}
    assert pending.state == JobState.PENDING and pending.last_resize_at == float("-inf")
    loaded.state, loaded.placement = JobState.SUSPENDED, {}
    again.put_job(loaded)  # an update keeps the extra it had
    assert again.jobs()[0][1]["checkpoint_dir"] == "/ck"
    events = list(again.events())
    assert [e["kind"] for e in events] == ["admit", "node_dead"]
    assert list(again.events(since=first)) == events[1:]
    assert list(again.events(job="bert")) == events[:1]
    again.remove_job("pending")
    again.remove_node("n0")
    assert [j.id for j, _ in again.jobs()] == ["bert"] and list(again.cluster().nodes) == ["n1"]
    again.close()


def test_not_a_store(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a maitre coordinator store"):
        Store(junk)
    other = tmp_path / "other.db"
    Store(other).close()
    with sqlite3.connect(other) as db:
        db.execute("UPDATE meta SET value='99' WHERE key='schema'")
    with pytest.raises(StoreError, match="schema version 99"):
        Store(other)


WRITER = textwrap.dedent("""
    import sys
    from maitre.control.store import Store
    from maitre.scheduling.model import Job, JobState
    store = Store(sys.argv[1])
    i = 0
    while True:
        i += 1
        store.put_job(Job(id=f"j{i}", queue="q", min_replicas=1, max_replicas=4,
                          state=JobState.RUNNING, placement={"n0": 1 + i % 4}, submitted_at=i))
        store.add_event(float(i), "admit", job=f"j{i}", n=i)
        if i == 20:
            print("ready", flush=True)
""")


def test_kill9_mid_write_leaves_a_consistent_store(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = Store(path)
    jobs = [j for j, _ in store.jobs()]
    events = list(store.events())
    assert len(jobs) >= 20
    assert [j.id for j in jobs] == [f"j{i}" for i in range(1, len(jobs) + 1)]  # no gap
    assert [e["n"] for e in events] == list(range(1, len(events) + 1))
    assert len(events) in (len(jobs) - 1, len(jobs))  # the kill fell between the two writes
    store.close()


@pytest.mark.timeout(30)
def test_the_database_is_its_owner_s_only(tmp_path: Path) -> None:
    """It holds every run's token: created 0600, and an older, looser one is made so."""
    store = Store(tmp_path / "state.db")
    store.close()
    assert stat.S_IMODE(os.stat(tmp_path / "state.db").st_mode) == 0o600
    loose = tmp_path / "old.db"
    Store(loose).close()
    os.chmod(loose, 0o644)
    Store(loose).close()
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o600
