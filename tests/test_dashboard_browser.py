"""The dashboard in a real browser (headless Chromium, see tests/browser.py): a replay renders
every view with no console error; a bad log shows an error, not a blank page; the token's door;
and the demo's story, live.

``MAITRE_SCREENSHOTS=DIR`` saves a screenshot of each view there (the docs' come from
``MAITRE_SCREENSHOTS=docs/img pytest tests/test_dashboard_browser.py``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from browser import Page, browser, browser_if_any, new_page, replay_page
from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.dashboard.server import ReplayServer
from test_dashboard import TOKEN, small_simulation

SHOTS = os.environ.get("MAITRE_SCREENSHOTS")


def shot(page: Page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.page.screenshot(path=str(Path(SHOTS) / f"dashboard-{name}.png"))


@pytest.mark.timeout(180)
def test_a_simulations_replay_renders_every_view_with_no_console_error(tmp_path: Path) -> None:
    path = small_simulation(tmp_path / "sim")
    with ReplayServer(path, TOKEN) as srv, browser() as b:
        page = new_page(b)
        page.open(f"{srv.url}?token={TOKEN}")
        assert page.js("location.search") == ""  # the token left the address bar
        assert "replay of" in page.page.inner_text("#source")
        assert page.page.is_hidden("#error")
        page.view("scaling")
        assert page.page.locator("#scaling-canvas").count() == 1
        assert page.js("window.__maitre.model().nodes.size") == 4
        assert page.page.locator("#stat-allocation").count() == 1
        page.view("rendezvous")
        cards = page.page.locator("#rendezvous .card")
        assert cards.count() == 20
        lit = page.page.locator("#rendezvous .machine .box.on")
        assert lit.count() == 20 and lit.first.get_attribute("data-state") == "COMPLETED"
        assert page.page.locator("#rendezvous table.epochs tr[data-epoch]").count() > 20
        page.view("checkpoints")
        assert "No checkpoint" in page.page.inner_text("#checkpoints")
        page.view("spot")
        assert page.page.locator("#spot svg.chart").count() == 2
        assert page.page.locator("#notices tr").count() > 2
        assert "saved" in page.page.inner_text("#cost-summary")
        job = page.js("[...window.__maitre.model().jobs.keys()][0]")
        page.view(f"job/{job}")
        assert page.page.locator("#job .machine").count() == 1
        page.view("node/n2")
        assert "spot" in page.page.inner_text("#node")
        page.view("job/no-such-job")
        assert "No job named" in page.page.inner_text("main")
        page.view("nowhere")
        assert "no view" in page.page.inner_text("main")
        # Back in time: the slider's middle shows the cluster as it was then.
        page.view("scaling")
        done_at_end = page.js("[...window.__maitre.model().jobs.values()].filter(j => j.state === 'COMPLETED').length")
        page.page.locator("#slider").fill("300")
        page.page.wait_for_function("!document.querySelector('#follow').checked")
        done_then = page.js("[...window.__maitre.model().jobs.values()].filter(j => j.state === 'COMPLETED').length")
        assert done_then < done_at_end == 20
        assert page.page_errors() == []


@pytest.mark.timeout(120)
def test_a_log_that_goes_bad_shows_the_error_not_a_blank_page(tmp_path: Path) -> None:
    path = small_simulation(tmp_path / "sim")
    with ReplayServer(path, TOKEN) as srv, browser() as b:
        path.write_text(path.read_text()[:-40] + "\n")  # the last line cut short
        page = new_page(b)
        page.open(f"{srv.url}?token={TOKEN}")
        error = page.page.locator("#error")
        assert error.is_visible()
        assert "could not load" in error.inner_text() and "not JSON" in error.inner_text()
        assert page.js("window.__maitre.failed")
        missing = page.page.goto(srv.url + "no-such-page")
        assert missing.status == 404 and "There is no page" in page.page.inner_text("main")


@pytest.mark.timeout(120)
def test_the_browser_signs_in_with_the_token_and_the_stream_shows_new_events(tmp_path: Path) -> None:
    import httpx

    with CoordinatorServer(ClusterState([], run_dir=tmp_path), token=TOKEN) as srv, browser() as b:
        page = new_page(b)
        page.page.goto(f"http://{srv.address}/dashboard/")
        assert page.page.locator("input[name=token]").count() == 1  # the login form
        page.page.fill("input[name=token]", "wrong")
        # The browser logs the refused login's 401 as an error, in its own time: waited for,
        # then dropped.
        with page.page.expect_console_message(lambda m: "401" in m.text, timeout=10000):
            page.page.click("button[type=submit]")
        assert "not this coordinator's" in page.page.inner_text("main")
        page.errors.clear()
        page.page.fill("input[name=token]", TOKEN)
        page.page.click("button[type=submit]")
        page.ready()
        assert page.page.inner_text("#source") == "live"
        page.view("scaling")
        assert "No node has registered" in page.page.inner_text("#scaling")
        sent = time.time()
        r = httpx.post(
            f"http://{srv.address}/v1/nodes/n-new/heartbeat",
            timeout=10,
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"slots": 4, "labels": {"capacity_type": "spot"}},
        )
        assert r.status_code == 200
        # The event reaches the model first and the page on the next animation frame: waited
        # for the render that shows it, not just the model.
        page.page.wait_for_function(
            "window.__maitre.model().nodes.has('n-new') && window.__maitre.renderedSeq >= window.__maitre.model().seq",
            timeout=10000,
        )
        seen = page.js("window.__maitre.seen[window.__maitre.model().seq] ?? window.__maitre.renderedAt") / 1000
        print(f"a node's registration showed in the page {seen - sent:.3f} s after its beat")
        assert page.page.locator("#scaling-canvas").count() == 1
        assert page.page_errors() == []


@pytest.mark.timeout(400)
def test_the_demo_story_watched_live(tmp_path: Path) -> None:
    """The demo's story with real agents and workers: the elastic jobs shrink for urgent
    instead of being killed, a SIGKILLed worker and a spot reclaim are survived, no sample is
    lost or repeated. Watched in the browser as it happens: a resize shows in the scaling and
    rendezvous views, the reclaim in the spot view, each change in the page within a second of
    its event (measured and printed). Without chromium (not under CI) the story runs alone."""
    import json

    from maitre.demo import Demo, DemoConfig

    lines: list[str] = []
    url: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        if "watch it live at " in line:
            url.append(line.split("watch it live at ", 1)[1].strip())

    # 300 steps: the story's stages (urgent, the kill, the notice) wait on wall-clock time too,
    # and must all come before the elastic jobs end, on a slow machine as well.
    demo = Demo(
        DemoConfig(
            run_dir=tmp_path,
            nodes=2,
            slots_per_node=2,
            steps=300,
            urgent_at_step=50,
            urgent_steps=60,
            cooldown_s=5.0,
            timeout_s=300,
            device_ms_per_sample=4.0,
            reclaim_after_s=2.0,
        ),
        out=out,
    )
    result: list[int | str] = []

    def play() -> None:
        try:
            result.append(demo.run())
        except BaseException:  # what the story raised, in the test's message
            import traceback

            result.append(traceback.format_exc())
            raise

    runner = threading.Thread(target=play, daemon=True)
    runner.start()
    with browser_if_any() as b:
        if b is not None:
            try:
                watch_the_demo(b, url, lines, runner)
            except Exception as exc:  # say what the story did, not only what the page lacked
                runner.join(300)
                raise AssertionError("\n".join(lines)[-8000:]) from exc
        runner.join(300)
    log = "\n".join(lines)
    assert result == [0], f"{result}\n{log[-6000:]}"  # (the end of the story says what failed)
    report = json.loads((tmp_path / "report.json").read_text())
    assert {j: v["state"] for j, v in report["jobs"].items()} == {
        "a-lm": "COMPLETED",
        "b-lm": "COMPLETED",
        "urgent": "COMPLETED",
    }, log
    assert all("exactly once" in a for a in report["audits"].values()), report["audits"]
    causes = [r["cause"] for r in report["recoveries"]]
    assert any("shrink (preempted by urgent)" in c for c in causes), causes
    assert any(c.startswith("SIGKILL") for c in causes), causes
    # A spot node's reclaim notice: its workers left at a step boundary (or, for a job whose
    # only live state was there, checkpointed and resumed elsewhere), a reclaim, no failure.
    assert any("shrink (spot notice on node-1)" in c or "suspend (spot notice on node-1" in c for c in causes), causes
    assert report["reclaims"] == 1 and "spot: node-1 drained in" in log, log
    assert report["cost"] < report["on_demand_cost"], report
    # No restart but one: a job whose only live state was on the noticed node (where the
    # scheduler happened to leave it) checkpoints within the notice and resumes from it.
    for job in ("a-lm", "b-lm"):
        resumes = [
            c
            for r, c in zip(report["recoveries"], causes)
            if r["job"] == job and r.get("incarnation", 1) > 1 and r["epoch"] == 1
        ]
        assert report["jobs"][job]["incarnations"] == 1 + len(resumes), (job, causes)
        assert all(c.startswith("resume after suspend (spot notice on node-1: ") for c in resumes), (job, causes)
        assert len(resumes) <= 1, (job, causes)
    assert 0 < report["allocation"] <= 1 and 0 < report["utilization"] <= 1
    assert "maitre demo: report" in log
    # No rank of the demo is slow: a straggler there would be the 2 shared cores taken for one.
    assert "straggler" not in log, [line for line in log.splitlines() if "straggler" in line]


@pytest.mark.timeout(30)
def test_the_demo_names_what_a_new_incarnation_resumes_after(tmp_path: Path) -> None:
    """The report's cause of a resumed incarnation's first epoch: the suspension before it (a
    spot notice where the job's only live state was), not a bare "resume"."""
    from maitre.demo import Demo, DemoConfig

    demo = Demo(DemoConfig(run_dir=tmp_path), out=lambda line: None)
    why = "spot notice on node-1: it would be left below its minimum of 1; it checkpoints first"
    demo.decisions = {
        "a-lm": [
            {"t": 10.0, "kind": "shrink", "reason": "preempted by urgent"},
            {"t": 17.7, "kind": "suspend", "reason": why},
            {"t": 18.7, "kind": "admit"},
        ]
    }
    first = {"reason": "join", "epoch": 1, "detected_at": 19.0}
    assert demo._cause("a-lm", {}, {**first, "incarnation": 1}) == ("start", None)
    assert demo._cause("a-lm", {}, {**first, "incarnation": 2}) == (f"resume after suspend ({why})", None)
    assert demo._cause("b-lm", {}, {**first, "incarnation": 2}) == ("resume", None)


def watch_the_demo(b, url: list[str], lines: list[str], runner: threading.Thread) -> None:
    deadline = time.monotonic() + 120
    while not url and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.1)
    assert url, "\n".join(lines)
    page = new_page(b)
    page.open(url[0])
    page.view("scaling")
    # a resize: urgent arrives and the elastic jobs shrink to make room
    page.page.wait_for_function(
        "(() => { const j = window.__maitre.model().jobs.get('b-lm');"
        " return j && j.states.some(s => s.to === 'RESIZING'); })()",
        timeout=240_000,
    )
    assert page.page.locator("#scaling-canvas").count() == 1
    assert "b-lm" in page.page.inner_text(".legend")
    # ... and the epoch it opens (the page may have been faster than the rendezvous)
    page.page.wait_for_function("window.__maitre.model().jobs.get('b-lm').epochs.length >= 2", timeout=60_000)
    page.view("rendezvous")
    card = page.page.locator("#rendezvous .card[data-job='b-lm']")
    assert card.locator("table.epochs tr[data-epoch]").count() >= 2
    assert "resizing" in card.locator("ol.transitions").inner_text()
    shot(page, "rendezvous")
    assert page.page_errors() == []
    # the reclaim: a spot node's notice, its drain, its end
    reclaimed = "window.__maitre.model().notices.some(n => n.reclaimed !== null)"
    deadline = time.monotonic() + 240
    while not page.js(reclaimed) and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not page.js(reclaimed):  # the story ended (or stalled) before the reclaim was in it
        runner.join(5)
        page.page.wait_for_function(reclaimed, timeout=5_000)
    page.view("spot")
    notices = page.page.locator("#notices tr")
    assert notices.count() >= 2 and "node-1" in notices.nth(1).inner_text()
    assert "saved" in page.page.inner_text("#cost-summary")
    shot(page, "spot")
    runner.join(300)
    page.page.wait_for_function("window.__maitre.model().jobs.get('a-lm').state === 'COMPLETED'", timeout=30_000)
    page.view("scaling")
    shot(page, "scaling")
    page.view("checkpoints")
    shot(page, "checkpoints")
    page.view("job/b-lm")
    shot(page, "job")
    page.view("node/node-1")
    shot(page, "node")
    lag = page.js("""(() => { const m = window.__maitre.model(); const seen = window.__maitre.seen;
        const out = []; for (const j of m.jobs.values()) for (const e of j.events)
          if (seen[e.seq]) out.push(seen[e.seq] / 1000 - e.t);
        return out; })()""")
    assert lag, "no event was seen live"
    lag.sort()
    print(
        f"{len(lag)} job events seen live: median {lag[len(lag) // 2]:.3f} s, "
        f"worst {lag[-1]:.3f} s from the coordinator's event to the page"
    )
    # The coordinator has stopped with the demo: the stream's reconnects fail, and only that
    # may be on the console.
    gone = ("ERR_CONNECTION_REFUSED", "ERR_INCOMPLETE_CHUNKED_ENCODING")
    assert [e for e in page.page_errors() if not any(g in e for g in gone)] == []


@pytest.mark.timeout(120)
def test_a_slow_rank_is_marked_on_its_job_and_node(tmp_path: Path) -> None:
    events = [
        {"kind": "node_registered", "node": "n0", "slots": 2, "labels": {}, "price": None},
        {"kind": "node_registered", "node": "n1", "slots": 2, "labels": {}, "price": None},
        {"kind": "submitted", "job": "lm", "queue": "q", "priority": 0, "replicas": [1, 4]},
        {"kind": "admit", "job": "lm", "placement": {"n0": 2, "n1": 2}},
        {"kind": "epoch", "job": "lm", "epoch": 1, "members": ["w1", "w2", "w3", "w4"], "reason": "start"},
        {
            "kind": "straggler",
            "job": "lm",
            "worker": "w3",
            "rank": 2,
            "node": "n1",
            "ratio": 1.62,
            "since_step": 1,
            "step": 10,
            "policy": "report",
        },
    ]
    with replay_page(tmp_path, events, TOKEN) as page:
        assert "1 slow rank" in page.page.inner_text("#stat-stragglers")
        page.view("job/lm")
        row = page.page.locator("#job #stragglers tr").nth(1).inner_text()
        assert "w3" in row and "n1" in row and "1.62x" in row
        page.view("node/n1")
        assert "w3" in page.page.inner_text("#node #stragglers")
        assert page.page_errors() == []


@pytest.mark.timeout(120)
def test_an_unhealthy_and_a_suspect_node_are_marked_with_why(tmp_path: Path) -> None:
    events = [
        {"kind": "node_registered", "node": "n0", "slots": 1, "labels": {}, "price": None},
        {"kind": "node_registered", "node": "n1", "slots": 1, "labels": {}, "price": None},
        {
            "kind": "node_health",
            "node": "n0",
            "ok": True,
            "detail": "ok: cpu 0.050s",
            "seconds": 0.6,
            "probe": "builtin",
        },
        {
            "kind": "node_health",
            "node": "n1",
            "ok": False,
            "detail": "gpu 3: ECC error",
            "seconds": 0.4,
            "probe": "command",
        },
        {
            "kind": "node_suspect",
            "node": "n0",
            "reason": "straggler: w2 at 2.00x the median",
            "until": 600.0,
            "job": "lm",
            "worker": "w2",
        },
    ]
    with replay_page(tmp_path, events, TOKEN) as page:
        page.view("scaling")
        marked = page.page.inner_text("#scaling .marked")
        assert "n1 unhealthy" in marked and "n0 suspect" in marked, marked
        page.view("node/n1")
        text = page.page.inner_text("#node #health")
        assert "FAILED" in text and "gpu 3: ECC error" in text
        assert "unhealthy" in page.page.inner_text("#node h2")
        page.view("node/n0")
        assert "straggler: w2 at 2.00x the median" in page.page.inner_text("#node #health")
        assert page.page_errors() == []
