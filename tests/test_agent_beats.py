"""The agent's promise to the hang detector (protocol.SILENT_S): a node beat is due every
``heartbeat_s``, but a worker that falls silent makes the agent beat within ``urgent_s`` of it
passing SILENT_S, whenever in the interval that happens. Against a stand-in coordinator that
records the beats (the agent's side only; the coordinator's is in test_membership.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from maitre import protocol
from maitre.agent.agent import Agent, WorkerBeats, _Worker
from maitre.errors import ApiError
from maitre.scheduling.lifecycle import JobState
from maitre.wire import UnixClient

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


def orders(**fields: object) -> protocol.NodeOrders:
    """A node's orders as the coordinator's answer brings them."""
    return protocol.NodeOrders.model_validate(fields)


def test_a_worker_falling_silent_mid_interval_makes_its_agent_beat_at_once(monkeypatch) -> None:
    monkeypatch.setenv(protocol.WARM_START, "0")  # (no warm worker: its first beat waits for no imports)
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
    monkeypatch.setattr(agent, "_spawn", lambda order: spawned.append(order.worker_id))
    try:
        order = protocol.StartOrder(
            worker_id="j-w1", job_id="j", command=["true"], env={}, local_rank=0, slots=1, store="x:1", token="t"
        )
        for _ in range(3):  # a beat's answer and a watch's may both carry it
            agent._apply(orders(version=0, start=[order]), time.monotonic())
        agent._apply(orders(version=1, start=[order.model_copy(update={"worker_id": "j-w2"})]), time.monotonic())
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
        view = protocol.WorkerView(member_epoch=7)
        agent._apply(orders(version=800, boot="old", views={"j-w1": view}), time.monotonic())
        assert agent.version == 800 and agent.views["j-w1"].member_epoch == 7
        agent._poke.clear()
        agent._apply(orders(version=3, boot="new"), time.monotonic())  # "nothing changed since 800", in the new count
        assert agent.version == -1 and agent._poke.is_set()  # the next request: since -1
        closed = view.model_copy(update={"closed": True})
        agent._apply(orders(version=4, boot="new", views={"j-w1": closed}), time.monotonic())
        assert agent.version == 4 and agent.views["j-w1"].closed is True
        agent._apply(
            orders(version=2, boot="new", views={"j-w1": view}), time.monotonic()
        )  # older, of the new: dropped
        assert agent.version == 4 and agent.views["j-w1"].closed is True
    finally:
        agent.stop(grace_s=0.5)


def test_a_workers_beat_on_the_socket_gets_its_view_and_a_malformed_one_a_400() -> None:
    """The node's socket speaks :class:`protocol.LocalBeat` in and :class:`protocol.AgentView`
    out: a worker the coordinator said nothing of yet gets the empty view, then the one the
    orders brought; a beat that is no LocalBeat is refused and changes nothing."""
    agent = Agent("127.0.0.1:1", "n0", 1)
    server = threading.Thread(target=agent._local.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    server.start()
    client = UnixClient(agent.socket_path)
    route = protocol.WORKER_HEARTBEAT.format(worker="j-w1")
    try:
        first = protocol.AgentView.model_validate(client.post(route, protocol.LocalBeat(step=3).model_dump()))
        assert first == protocol.AgentView()  # no view yet, and nothing heard
        view = protocol.WorkerView(job_state=JobState.RUNNING, epoch=2, member_epoch=2, change=True)
        agent._apply(orders(version=1, views={"j-w1": view}), time.monotonic())
        reply = protocol.AgentView.model_validate(client.post(route, {"step": 4, "trained_s": 1.5}))
        assert reply.model_dump(exclude={"heard_s"}) == view.model_dump() and reply.heard_s is not None
        assert agent.beats["j-w1"][0].step == 4
        for bad in ({"step": -1}, {"step": "5"}, {"stalled": 1}, {"steps": 5}, {"proc": 5000}):
            with pytest.raises(ApiError) as refused:
                client.post(route, bad)
            assert refused.value.status == 400 and "bad heartbeat" in refused.value.message, bad
        assert agent.beats["j-w1"][0].step == 4 and list(agent.beats["j-w1"]) == [0]
    finally:
        agent._local.shutdown()
        agent.stop(grace_s=0.5)


def test_a_worker_whose_start_ends_after_the_agent_stopped_is_ended_not_left_behind(monkeypatch) -> None:
    """Starts run on threads of their own: one that finishes after :meth:`Agent.stop` took its
    list of workers is the start's to end. (Left running, a warm worker, which python waits for
    at exit, kept its agent's process alive after SIGINT: found by the chaos run.)"""
    agent = Agent("127.0.0.1:1", "n0", 1)
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen:
        started.append(real(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    monkeypatch.setattr("maitre.agent.agent.subprocess.Popen", popen)
    order = protocol.StartOrder(
        worker_id="j-w1",
        job_id="j",
        command=[sys.executable, "-c", "import time; time.sleep(60)"],  # (-c: a cold start)
        env={},
        local_rank=0,
        slots=1,
        store="x:1",
        token="t",
    )
    agent.stop(grace_s=0.5)
    agent._spawn(order)
    assert len(started) == 1 and started[0].poll() is not None  # ended, and waited for
    assert agent.workers == {} and agent.running() == []


SLOW_IMPORTS = """
import os, time
if os.environ.get("SLOW_FAILS"):
    os._exit(3)  # (as an import that crashes the interpreter would)
time.sleep(float(os.environ["SLOW_S"]))
open(os.environ["WARM_MARK"], "w").write(repr(time.time()))
"""

A_NODE = """
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from maitre.agent import warmstart
from maitre.agent.agent import Agent

BEATS = []


class Coordinator(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.endswith("/watch"):
            time.sleep(0.5)
        else:
            BEATS.append(time.time())
        reply = b'{"version": 0, "views": null, "start": [], "kill": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    warmstart.PRELOAD[:] = ["slow_imports"]  # (torch's, slower and as slow as the machine is busy)
    warmstart.WARM_TIMEOUT_S = float(sys.argv[1])
    server = ThreadingHTTPServer(("127.0.0.1", 0), Coordinator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    agent = Agent(f"127.0.0.1:{server.server_port}", "n0", 1, heartbeat_s=0.2)
    started = time.time()
    agent.start()
    deadline = time.time() + 30
    while not BEATS and time.time() < deadline:
        time.sleep(0.01)
    mark = os.environ["WARM_MARK"]
    while not os.environ.get("SLOW_FAILS") and not os.path.exists(mark) and time.time() < deadline:
        time.sleep(0.01)  # (the fork server ends with its agent once its imports are done)
    agent.stop(grace_s=0.5)
    warmstart.reap()
    warm = float(open(mark).read()) if os.path.exists(mark) else None
    seen = {"started": started, "beat": BEATS[0] if BEATS else None, "warm": warm, "enabled": warmstart.enabled()}
    print(json.dumps(seen))
"""


@pytest.mark.parametrize("case", ["warm", "timeout", "fails"])
def test_a_node_is_known_only_once_its_fork_server_has_done_its_imports(tmp_path, case: str) -> None:
    """The first beat makes the node known, and the coordinator gives it work at once (a
    restart-mode job stops its whole gang to make room for it): it comes once the node's fork
    server has done its imports, so that its workers start in milliseconds, not after seconds
    of torch's imports with the other nodes' waiting for them in their process group. Bounded
    (a warning, and the node joins) and a fork server that failed starts workers cold. A real
    agent process: the fork server is one per process, and its imports are a process's."""
    from conftest import ROOT, run_tagged

    (tmp_path / "slow_imports.py").write_text(SLOW_IMPORTS)
    (tmp_path / "node.py").write_text(A_NODE)
    mark = tmp_path / "warm"
    timeout_s = {"warm": "60", "timeout": "0.5", "fails": "60"}[case]
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}", "WARM_MARK": str(mark), "SLOW_S": "2"}
    if case == "fails":
        env["SLOW_FAILS"] = "1"
    done = run_tagged([sys.executable, str(tmp_path / "node.py"), timeout_s], 60, **env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["beat"] is not None, done.stderr
    if case == "warm":  # not before its imports were done (it used to beat at once)
        assert seen["warm"] is not None and seen["beat"] >= seen["warm"], (seen, done.stderr)
        assert "joins now" not in done.stderr and seen["enabled"], done.stderr
    elif case == "timeout":  # it waited its 0.5 s, said so, and joined before the imports' end
        assert seen["beat"] - seen["started"] >= 0.5 and seen["beat"] < seen["warm"], seen
        assert "were not done after 0.5s; it joins now" in done.stderr, done.stderr
        assert seen["enabled"], "a slow fork server still starts the workers, once it is ready"
    else:  # known without waiting for ever; its workers start with exec
        assert "the fork server failed" in done.stderr and "workers start cold" in done.stderr, done.stderr
        assert not seen["enabled"] and seen["warm"] is None, seen


def test_a_worker_that_leads_no_group_yet_is_still_signalled_by_its_group() -> None:
    """A warm worker's ``setsid`` is its first act: SIGKILLed to its group a moment after its
    fork (a start that ended after its agent stopped), it leads none yet, and the signal must
    reach it all the same (it trained on, and the process of the agents, which waits for its
    children at exit, with it)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # (our group)
    try:
        _Worker("w1", proc).signal_groups(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_a_coordinator_gone_at_the_first_beat_is_waited_for_not_fatal(tmp_path: Path, monkeypatch) -> None:
    """The coordinator answered the agent's start, then went (killed, restarting) before its
    first beat, which comes seconds later, after the fork server's imports: the agent waits for
    it as later beats do, and joins it once it is back. (A chaos run lost three agents so: each
    exited on that beat, and their nodes were declared dead.)"""
    from conftest import free_ports

    from maitre.local import LocalCluster, UpConfig

    monkeypatch.setenv(protocol.WARM_START, "0")
    (port,) = free_ports(1)
    token = "t" * 43
    agent = Agent(f"127.0.0.1:{port}", "late", 1, token=token, heartbeat_s=0.5)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            agent.serve()
        except BaseException as exc:  # noqa: BLE001 -- the test says what it was
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    up = None
    try:
        time.sleep(1.5)
        assert not errors, errors
        up = LocalCluster(UpConfig(state_dir=tmp_path / "state", port=port, nodes=0, token=token), out=lambda _: None)
        up.start()
        deadline = time.monotonic() + 20
        while not any(n["node"] == "late" for n in up.coordinator.nodes_view()):
            assert time.monotonic() < deadline and not errors, errors or "the agent never joined"
            time.sleep(0.1)
    finally:
        agent.stop()
        thread.join(10)
        if up is not None:
            up.stop()
