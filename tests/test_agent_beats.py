"""The agent's promise to the hang detector (protocol.SILENT_S): a node beat is due every
``heartbeat_s``, but a worker that falls silent makes the agent beat within ``urgent_s`` of it
passing SILENT_S, whenever in the interval that happens. Against a stand-in coordinator that
records the beats (the agent's side only; the coordinator's is in test_membership.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from maitre import protocol
from maitre.agent.agent import Agent, WorkerBeats, _Worker

pytestmark = pytest.mark.timeout(60)


class _Coordinator(BaseHTTPRequestHandler):
    beats: list[tuple[float, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path.endswith("/watch"):
            time.sleep(min(1.0, body.get("wait_s", 0)))
        else:
            self.beats.append((time.monotonic(), body))
        reply = json.dumps({"version": 0, "views": None, "start": [], "kill": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


def test_a_worker_falling_silent_mid_interval_makes_its_agent_beat_at_once() -> None:
    beats: list[tuple[float, dict]] = []
    handler = type("Recorder", (_Coordinator,), {"beats": beats})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent = Agent(f"127.0.0.1:{server.server_port}", "n0", 1, heartbeat_s=5.0, urgent_s=0.1)
    try:
        agent.start()
        deadline = time.monotonic() + 10
        while not beats and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beats, "the agent never beat"
        assert beats[0][1]["interval_s"] == 5.0  # the promise, in every beat
        with agent._lock:  # a worker of this node beats once, then falls silent
            agent.workers["w1"] = _Worker("w1", proc)
            agent.beats["w1"] = {0: WorkerBeats()}  # its one process
            heard = time.monotonic()
            agent.beats["w1"][0].beat(heard, 3, False, 0.0)
        deadline = heard + 4.0  # well before the 5 s beat would be due
        while time.monotonic() < deadline and not any(
            w.get("silent_s", 0) >= protocol.SILENT_S for t, body in beats for w in body["workers"]
        ):
            time.sleep(0.01)
        late = [
            (t, w["silent_s"])
            for t, body in beats
            for w in body["workers"]
            if w.get("silent_s", 0) >= protocol.SILENT_S
        ]
        assert late, f"no beat reported the silence within 4 s: {beats}"
        at, silent = late[0]
        # Within urgent_s of crossing SILENT_S (a second of margin for a busy machine).
        assert protocol.SILENT_S <= at - heard < protocol.SILENT_S + 1.0, (at - heard, silent)
    finally:
        proc.kill()
        proc.wait()
        agent.stop(grace_s=0.5)
        server.shutdown()
        server.server_close()


def test_a_start_order_that_comes_again_is_carried_out_once(monkeypatch) -> None:
    """The coordinator repeats a start order until a beat lists the worker (an answer can be
    lost on its way); the agent starts the worker once however often the order comes."""
    agent = Agent("127.0.0.1:1", "n0", 1)
    spawned: list[str] = []
    monkeypatch.setattr(agent, "_spawn", lambda order: spawned.append(order["worker_id"]))
    try:
        order = {"worker_id": "j-w1", "job_id": "j"}
        for _ in range(3):  # a beat's answer and a watch's may both carry it
            agent._apply({"version": 0, "views": None, "start": [order], "kill": []}, time.monotonic())
        agent._apply(
            {"version": 1, "views": None, "start": [{**order, "worker_id": "j-w2"}], "kill": []}, time.monotonic()
        )
        deadline = time.monotonic() + 5
        while len(spawned) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert sorted(spawned) == ["j-w1", "j-w2"], spawned
    finally:
        agent.stop(grace_s=0.5)


def test_a_restarted_coordinators_views_are_taken_though_its_count_starts_again() -> None:
    """A coordinator restarted from its store counts its orders' versions from 0 again: the
    agent, at version 800 of the old one, sees another ``boot``, asks again since -1 and takes
    the new one's views (it used to drop them as older, and its workers never heard the
    epoch close: a job stuck in rendezvous after a coordinator kill, found by the chaos run)."""
    agent = Agent("127.0.0.1:1", "n0", 1)
    try:
        view = {"member_epoch": 7, "closed": False, "stop": False}
        agent._apply(
            {"version": 800, "boot": "old", "views": {"j-w1": view}, "start": [], "kill": []}, time.monotonic()
        )
        assert agent.version == 800 and agent.views["j-w1"]["member_epoch"] == 7
        agent._poke.clear()
        agent._apply(
            {"version": 3, "boot": "new", "views": None, "start": [], "kill": []}, time.monotonic()
        )  # "nothing changed since 800", in the new count
        assert agent.version == -1 and agent._poke.is_set()  # the next request: since -1
        agent._apply(
            {"version": 4, "boot": "new", "views": {"j-w1": {**view, "closed": True}}, "start": [], "kill": []},
            time.monotonic(),
        )
        assert agent.version == 4 and agent.views["j-w1"]["closed"] is True
        agent._apply(
            {"version": 2, "boot": "new", "views": {"j-w1": view}, "start": [], "kill": []}, time.monotonic()
        )  # an older answer of the new one: dropped
        assert agent.version == 4 and agent.views["j-w1"]["closed"] is True
    finally:
        agent.stop(grace_s=0.5)
