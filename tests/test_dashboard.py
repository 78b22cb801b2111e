"""The dashboard's server side: the event log and its routes, the token at the page's door, and
replays (a simulation's events, a coordinator's state.db) with their refusals of bad files.

The page itself, in a real browser, is tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.control.eventlog import EventLog
from maitre.control.store import Store
from maitre.dashboard.replay import ReplayError, ReplayLog, find, load
from maitre.dashboard.server import ReplayServer
from maitre.sim import run as sim_run

TOKEN = "dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    db = Store(tmp_path / "state.db")
    srv = CoordinatorServer(ClusterState([], run_dir=tmp_path), token=TOKEN, db=db).start()
    try:
        yield srv
    finally:
        srv.stop()
        db.close()


def _beat(srv: CoordinatorServer, node: str, **labels: str) -> None:
    r = httpx.post(
        f"http://{srv.address}/v1/nodes/{node}/heartbeat", headers=AUTH, json={"slots": 2, "labels": labels}, timeout=10
    )
    assert r.status_code == 200, r.text


def small_simulation(out: Path) -> Path:
    """A simulation of 20 jobs on 4 x 4 GPUs, half of them spot (a few seconds)."""
    opts = sim_run.SimOptions(
        workload="pollux-6", policies=["maitre"], cluster=(4, 4), spot=0.5, spot_life_h=0.5, limit=20, plots=False
    )
    sim_run.main(opts, out, progress=False)
    return out / "events-maitre.jsonl"


# -- the live log --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_events_come_in_pages_after_a_seq_and_name_their_node(server: CoordinatorServer) -> None:
    _beat(server, "n0", rack="r0")
    _beat(server, "n1", rack="r1")
    base = f"http://{server.address}/v1/events"
    page = httpx.get(base, headers=AUTH, timeout=10).json()
    registered = [e for e in page["events"] if e["kind"] == "node_registered"]
    assert [e["node"] for e in registered] == ["n0", "n1"]
    assert [e["seq"] for e in page["events"]] == sorted(e["seq"] for e in page["events"])
    assert page["last"] == page["events"][-1]["seq"]
    first = page["events"][0]["seq"]
    assert (
        httpx.get(base, params={"since": first, "limit": 1}, headers=AUTH, timeout=10).json()["events"]
        == page["events"][1:2]
    )
    assert httpx.get(base, params={"since": page["last"]}, headers=AUTH, timeout=10).json()["events"] == []
    for bad in ({"since": -1}, {"limit": 0}, {"limit": 10**6}, {"job": "no/such"}):
        r = httpx.get(base, params=bad, headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["problems"], (bad, r.text)


@pytest.mark.timeout(60)
def test_the_stream_brings_a_new_event_as_it_happens(server: CoordinatorServer) -> None:
    _beat(server, "n0")
    last = httpx.get(f"http://{server.address}/v1/events", headers=AUTH, timeout=10).json()["last"]
    got: list[dict[str, Any]] = []
    opened = threading.Event()

    def listen() -> None:
        with httpx.stream(
            "GET", f"http://{server.address}/v1/events/stream", params={"since": last}, headers=AUTH, timeout=20
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            opened.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    return

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    assert opened.wait(10)
    time.sleep(0.2)
    _beat(server, "n-late")
    reader.join(10)
    assert got and got[0]["kind"] == "node_registered" and got[0]["node"] == "n-late"
    assert got[0]["seq"] == last + 1


@pytest.mark.timeout(60)
def test_the_log_keeps_its_numbering_across_a_restart_and_reads_old_events_from_disk(tmp_path: Path) -> None:
    db = Store(tmp_path / "state.db")
    log = EventLog(db, keep=3)
    for k in range(5):
        log.append(float(k), "tick", None, {"k": k})
    assert [e["k"] for e in log.since(0)] == [0, 1, 2, 3, 4]  # two of them from disk
    assert [e["k"] for e in log.since(3)] == [3, 4]
    db.close()
    db = Store(tmp_path / "state.db")
    again = EventLog(db)
    assert again.last == 5 and again.append(9.0, "tick", "job-a", {"k": 5}) == 6
    assert again.since(5, job="job-a")[0]["k"] == 5
    db.close()


# -- the token at the door -------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_the_page_needs_the_token_and_the_cookie_opens_reads_only(server: CoordinatorServer) -> None:
    base = f"http://{server.address}"
    with httpx.Client(base_url=base, timeout=10) as c:
        r = c.get("/dashboard/")
        assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login")
        assert c.get("/dashboard/login").status_code == 200
        assert c.get("/v1/events").status_code == 401
        wrong = c.get("/dashboard/", params={"token": "nope"})
        assert wrong.status_code == 401 and "not this coordinator" in wrong.text
        assert (
            c.post(
                "/dashboard/login", content="token=nope", headers={"Content-Type": "application/x-www-form-urlencoded"}
            ).status_code
            == 401
        )
        assert not c.cookies
        r = c.get("/dashboard/", params={"token": TOKEN})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/"
        assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=strict" in r.headers["set-cookie"]
        page = c.get("/dashboard/")
        assert page.status_code == 200 and "app.js" in page.text and TOKEN not in page.text
        assert c.get("/v1/events").status_code == 200
        assert c.get("/v1/jobs").status_code == 200
        # The cookie is no credential for an action: a page elsewhere cannot act through it.
        acted = c.post("/v1/jobs", json={"manifest": "name: x"})
        assert acted.status_code == 401
        assert c.get("/dashboard/logout").status_code == 303
        assert c.get("/dashboard/").status_code == 303
    with httpx.Client(base_url=base, timeout=10) as c:
        r = c.post(
            "/dashboard/login",
            content=f"token={TOKEN}&next=/dashboard/%23/spot",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 303 and "maitre_token" in r.headers["set-cookie"]
        assert c.get("/dashboard/").status_code == 200
        evil = c.post(
            "/dashboard/login",
            content=f"token={TOKEN}&next=https://elsewhere/",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert evil.headers["location"] == "/dashboard/"


@pytest.mark.timeout(60)
def test_what_does_not_exist_is_a_404(server: CoordinatorServer) -> None:
    base = f"http://{server.address}"
    with httpx.Client(base_url=base, timeout=10, headers=AUTH) as c:
        assert c.get("/dashboard/assets/app.js").status_code == 200
        assert c.get("/dashboard/assets/app.css").status_code == 200
        for path in (
            "/dashboard/assets/nope.js",
            "/dashboard/assets/sub/app.js",
            "/dashboard/jobs/x",
            "/dashboard/nope.html",
        ):
            assert c.get(path).status_code == 404, path
        assert c.get("/nope").status_code == 404
        assert c.get("/", follow_redirects=False).headers["location"] == "/dashboard/"


# -- replays -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_simulation_replays_with_the_live_logs_shapes(tmp_path: Path) -> None:
    path = small_simulation(tmp_path / "sim")
    assert find(tmp_path / "sim") == path
    events = load(path)
    kinds = {e["kind"] for e in events}
    assert {
        "prices",
        "node_registered",
        "submitted",
        "admit",
        "epoch",
        "job_completed",
        "spot_notice",
        "node_drained",
        "node_reclaimed",
    } <= kinds
    jobs = {e["job"] for e in events if e["kind"] == "submitted"}
    assert jobs == {e["job"] for e in events if e["kind"] == "job_completed"} and len(jobs) == 20
    slots = {e["node"]: e["slots"] for e in events if e["kind"] == "node_registered"}
    held: dict[str, dict[str, int]] = {}
    for e in events:  # no node is ever held past its slots
        if "placement" in e:
            held[e["job"]] = e["placement"]
            for node in slots:
                assert sum(p.get(node, 0) for p in held.values()) <= slots[node], e
    with ReplayServer(path, TOKEN) as srv:
        with httpx.Client(timeout=10, headers=AUTH) as c:
            page = c.get(srv.url.replace("/dashboard/", "/v1/events"), params={"limit": 10000})
            assert page.json()["events"] == events
            meta = c.get(srv.url + "meta.json").json()
            assert meta["live"] is False and meta["source"] == str(path)
            with c.stream(
                "GET", srv.url.replace("/dashboard/", "/v1/events/stream"), params={"since": events[-3]["seq"]}
            ) as r:
                lines = [line for line in r.iter_lines() if line]
            assert [json.loads(line[6:])["seq"] for line in lines if line.startswith('data: {"')] == [
                e["seq"] for e in events[-2:]
            ]
            assert "event: end" in lines
            assert c.get(srv.url, headers={"Authorization": ""}).status_code == 303
            # The file goes bad under the running replay: a 422 that says why, not a blank page.
            path.write_text(path.read_text() + '{"seq": 1, "t"\n')
            bad = c.get(srv.url.replace("/dashboard/", "/v1/events"))
            assert bad.status_code == 422 and "not JSON" in bad.json()["error"]
            assert "line" in c.get(srv.url + "meta.json").json()["error"]


@pytest.mark.timeout(60)
def test_a_coordinators_state_db_replays_its_events(server: CoordinatorServer, tmp_path: Path) -> None:
    _beat(server, "n0", capacity_type="spot")
    server.coordinator.db.flush()
    log = ReplayLog(find(tmp_path))
    assert log.path.name == "state.db"
    assert log.since(0) == server.coordinator.events.since(0)


BAD = {
    "not-json.jsonl": ('{"seq": 1, "t": 0, "job": null, "kind": "a"}\n{nope\n', "line 2: not JSON"),
    "cut.jsonl": ('{"seq": 1, "t": 0, "job": null, "kind": "a"}\n{"seq": 2, "t"', "cut short"),
    "seq.jsonl": (
        '{"seq": 2, "t": 0, "kind": "a"}\n{"seq": 2, "t": 1, "kind": "b"}\n',
        "line 2: 'seq' must be an integer above",
    ),
    "kind.jsonl": ('{"seq": 1, "t": 0}\n', "'kind' must be"),
    "time.jsonl": ('{"seq": 1, "t": "soon", "kind": "a"}\n', "'t' must be a finite number"),
    "array.jsonl": ("[1, 2]\n", "an event is a JSON object"),
    "empty.jsonl": ("", "no events"),
    "state.db": ("SQLite format 3\x00 but nothing else", "not a coordinator's state database"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_log_is_refused_with_the_line_and_why(tmp_path: Path, name: str) -> None:
    text, why = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ReplayError, match=why.replace("(", r"\(").replace("[", r"\[")):
        ReplayLog(path)


@pytest.mark.timeout(60)
def test_maitre_dashboard_refuses_what_it_cannot_replay(tmp_path: Path) -> None:
    (tmp_path / "cut.jsonl").write_text('{"seq": 1, "t": 0, "kind": "a"}\n{"seq"')
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "events-fifo.jsonl").write_text('{"seq": 1, "t": 0, "kind": "a"}\n')
    cases = [
        ([str(tmp_path / "cut.jsonl")], "line 2 is cut short"),
        ([str(tmp_path / "nowhere")], "no such file"),
        ([str(tmp_path)], "no event log in it"),
        ([str(tmp_path / "sim"), "--policy", "maitre"], "the policies there: fifo"),
        ([str(tmp_path / "sim"), "--port", "70000"], "--port must be in"),
    ]
    for args, why in cases:
        run = subprocess.run(
            [sys.executable, "-m", "maitre.cli", "dashboard", *args], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and why in run.stderr, (args, run.stderr)
        assert "dashboard at" not in run.stdout
