"""Spot notice sources (maitre.agent.notices): AWS's instance-action, GCE's preempted and a
file, served for real (an HTTP server of the test's own on port 0, a file in tmp_path); a source
that is unreachable or says garbage is logged once per change and the node keeps running; the
agent carries a notice it saw in its beats."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from maitre.agent.notices import (
    FileSource,
    HttpSource,
    NoticeError,
    NoticeWatcher,
    parse_aws,
    parse_file,
    parse_time,
    source,
)

pytestmark = pytest.mark.timeout(30)


class _Metadata(BaseHTTPRequestHandler):
    """Answers every GET with ``self.server.answer``: (status, body)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.headers_seen.append(dict(self.headers))  # type: ignore[attr-defined]
        status, body = self.server.answer  # type: ignore[attr-defined]
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    server.answer = (404, "Not Found")  # type: ignore[attr-defined]
    server.headers_seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _watcher(src, now: list[float], **kw) -> NoticeWatcher:
    return NoticeWatcher(src, interval_s=0.05, clock=lambda: now[0], **kw)


def test_aws_instance_action_404_is_no_notice_and_200_gives_its_time(metadata) -> None:
    url = f"http://127.0.0.1:{metadata.server_port}/latest/meta-data/spot/instance-action"
    now = [parse_time("2026-12-01T20:59:30Z")]
    seen = []
    w = _watcher(HttpSource(url), now, on_notice=seen.append)
    assert w.poll() is None and w.status.endswith("no notice")
    metadata.answer = (200, json.dumps({"action": "terminate", "time": "2026-12-01T21:00:00Z"}))
    notice = w.poll()
    assert notice is not None and notice.action == "terminate" and notice.source == url
    assert notice.remaining_s(now[0]) == pytest.approx(30.0)
    assert seen == [notice]
    metadata.answer = (404, "")  # a notice stands once given
    assert w.poll() is notice and seen == [notice]


class _MetadataV2(_Metadata):
    """IMDSv2 only: a GET without a live session token is 401; ``PUT /latest/api/token`` gives
    one (``self.server.tokens``: those given; ``revoked``: those that no longer work)."""

    def do_PUT(self) -> None:  # noqa: N802
        server = self.server
        assert self.path == "/latest/api/token", self.path
        assert int(self.headers["X-aws-ec2-metadata-token-ttl-seconds"]) <= 21600
        token = f"t{len(server.tokens)}"  # type: ignore[attr-defined]
        server.tokens.append(token)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(token)))
        self.end_headers()
        self.wfile.write(token.encode())

    def do_GET(self) -> None:  # noqa: N802
        token = self.headers.get("X-aws-ec2-metadata-token")
        if token not in self.server.tokens or token in self.server.revoked:  # type: ignore
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


def test_aws_imdsv2_gets_a_session_token_and_a_new_one_when_it_stops_working() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MetadataV2)
    server.answer = (404, "")  # type: ignore[attr-defined]
    server.headers_seen, server.tokens, server.revoked = [], [], set()  # type: ignore
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"
        now = [parse_time("2026-12-01T20:59:00Z")]
        w = _watcher(HttpSource(url), now)
        assert w.poll() is None and w.status.endswith("no notice"), w.status
        assert w.poll() is None and server.tokens == ["t0"], "one token, kept"
        server.revoked.add("t0")  # type: ignore[attr-defined]
        server.answer = (200, json.dumps({"action": "stop", "time": "2026-12-01T21:00:00Z"}))  # type: ignore[attr-defined]
        notice = w.poll()
        assert notice is not None and notice.action == "stop" and server.tokens == ["t0", "t1"]
        assert notice.remaining_s(now[0]) == pytest.approx(60.0)
    finally:
        server.shutdown()
        server.server_close()


def test_aws_imdsv1_answers_without_a_token(metadata) -> None:
    """A metadata service with no tokens (the PUT is not served: 501): asked without one."""
    url = f"http://127.0.0.1:{metadata.server_port}/latest/meta-data/spot/instance-action"
    w = _watcher(HttpSource(url), [parse_time("2026-12-01T20:59:30Z")])
    assert w.poll() is None and w.status.endswith("no notice"), w.status
    assert all("X-aws-ec2-metadata-token" not in h for h in metadata.headers_seen)


def test_gce_preempted_true_gives_the_default_notice_from_when_it_was_first_seen(metadata) -> None:
    url = f"http://127.0.0.1:{metadata.server_port}/computeMetadata/v1/instance/preempted"
    now = [1000.0]
    w = _watcher(HttpSource(url), now, default_notice_s=30.0)
    metadata.answer = (200, "FALSE")
    assert w.poll() is None
    metadata.answer = (200, "TRUE\n")
    now[0] = 1010.0
    notice = w.poll()
    assert notice is not None and notice.action == "preempt" and notice.deadline == 1040.0
    assert metadata.headers_seen[-1].get("Metadata-Flavor") == "Google"


def test_garbage_and_unreachable_sources_are_logged_once_per_change_and_give_no_notice(
    metadata, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://127.0.0.1:{metadata.server_port}/x"
    now = [0.0]
    w = _watcher(HttpSource(url, timeout_s=1.0), now)
    caplog.set_level(logging.INFO, logger="maitre.agent.notices")
    for answer in (
        [(200, "<html>oops</html>")] * 3
        + [(500, "boom")] * 2
        + [(200, json.dumps({"action": "reboot", "time": "2026-12-01T21:00:00Z"}))]
    ):
        metadata.answer = answer
        assert w.poll() is None
    garbage = [r.getMessage() for r in caplog.records]
    assert len(garbage) == 3, garbage  # not JSON (once for three polls), HTTP 500, bad action
    assert all("garbage" in m and "keeps running" in m for m in garbage), garbage
    assert "HTTP 500" in garbage[1] and "reboot" in garbage[2]
    metadata.shutdown()
    metadata.server_close()  # nobody listens there any more
    caplog.clear()
    for _ in range(3):
        assert w.poll() is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "unreachable" in messages[0], messages
    assert w.current is None


def test_a_notice_file_absent_then_notice_s_counts_from_its_mtime(tmp_path: Path) -> None:
    path = tmp_path / "notice.json"
    now = [5000.0]
    w = _watcher(source(f"file:{path}"), now)
    assert w.poll() is None
    path.write_text("not json")
    assert w.poll() is None and "garbage" in w.status
    path.write_text(json.dumps({"notice_s": 30}))
    os.utime(path, (4990.0, 4990.0))
    notice = w.poll()
    assert notice is not None and notice.deadline == 5020.0 and notice.source == f"file:{path}"


def test_file_shapes() -> None:
    assert parse_file('{"deadline": 1234.5}', 0.0) == ("terminate", 1234.5)
    assert parse_file('{"notice_s": 30, "action": "stop"}', 100.0) == ("stop", 130.0)
    aws = '{"action": "stop", "time": "2026-12-01T21:00:00Z"}'
    assert parse_file(aws, 0.0) == parse_aws(aws) == ("stop", parse_time("2026-12-01T21:00:00Z"))
    for bad in (
        '{"notice_s": -1}',
        '{"notice_s": "30"}',
        '{"deadline": 1, "notice_s": 2}',
        "[]",
        '{"notice_s": true}',
        '{"time": "2026-12-01T21:00:00"}',
    ):
        with pytest.raises(NoticeError):
            parse_file(bad, 0.0)
    with pytest.raises(NoticeError, match="time zone"):
        parse_aws('{"action": "stop", "time": "2026-12-01T21:00:00"}')


def test_source_specs_are_checked() -> None:
    assert isinstance(source("file:/tmp/x"), FileSource)
    assert isinstance(source("https://169.254.169.254/latest"), HttpSource)
    for bad in ("/tmp/x", "file:", "ftp://x", "http://", "http:///path"):
        with pytest.raises(ValueError, match="--spot-notice"):
            source(bad)
    with pytest.raises(ValueError, match="interval"):
        NoticeWatcher(source("file:/tmp/x"), interval_s=0)


def test_the_watcher_thread_polls_and_the_agent_beats_the_notice_at_once(tmp_path: Path, monkeypatch) -> None:
    """The agent, against a stand-in coordinator: no notice in its beats until the file shows
    one, then a beat at once (not a heartbeat interval later) with the seconds left."""
    from test_agent_beats import _Coordinator

    from maitre import protocol
    from maitre.agent.agent import Agent

    monkeypatch.setenv(protocol.WARM_START, "0")  # (no worker: its first beat waits for no imports)

    beats: list[tuple[float, dict]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Recorder", (_Coordinator,), {"beats": beats}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "notice.json"
    watcher = NoticeWatcher(source(f"file:{path}"), interval_s=0.05)
    agent = Agent(
        f"127.0.0.1:{server.server_port}",
        "spot-0",
        1,
        heartbeat_s=5.0,
        labels={"capacity_type": "spot"},
        notices=watcher,
    )
    try:
        agent.start()
        deadline = time.monotonic() + 10
        while not beats and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beats and "notice" not in beats[0][1]
        path.write_text(json.dumps({"deadline": time.time() + 30}))
        written = time.monotonic()
        while not any("notice" in b for _, b in beats) and time.monotonic() < deadline:
            time.sleep(0.01)
        t, beat = next((t, b) for t, b in beats if "notice" in b)
        assert t - written < 1.0  # not the 5 s heartbeat interval
        assert 28 < beat["notice"]["notice_s"] <= 30
        assert beat["notice"]["source"] == f"file:{path}"
        assert beat["labels"] == {"capacity_type": "spot"}
        agent.stop()
        last = beats[-1][1]  # stopping with a notice standing: the node goes now
        assert last["notice"]["notice_s"] == 0 and last["workers"] == []
    finally:
        agent.stop()
        server.shutdown()
        server.server_close()


def test_an_agent_whose_source_is_unreachable_keeps_beating_without_a_notice(
    caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    from test_agent_beats import _Coordinator

    import socket

    from maitre import protocol
    from maitre.agent.agent import Agent

    monkeypatch.setenv(protocol.WARM_START, "0")  # (no worker: its first beat waits for no imports)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    beats: list[tuple[float, dict]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Recorder", (_Coordinator,), {"beats": beats}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    watcher = NoticeWatcher(source(f"http://127.0.0.1:{dead}/latest/meta-data/spot/instance-action"), interval_s=0.05)
    agent = Agent(f"127.0.0.1:{server.server_port}", "spot-1", 1, heartbeat_s=0.1, notices=watcher)
    caplog.set_level(logging.WARNING, logger="maitre.agent.notices")
    try:
        agent.start()
        deadline = time.monotonic() + 10
        while len(beats) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        agent.stop()
        server.shutdown()
        server.server_close()
    assert len(beats) >= 5 and not any("notice" in b for _, b in beats)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "unreachable" in warned[0], warned  # once, not once a poll


@pytest.mark.timeout(10)
def test_sigterm_is_a_notice_of_the_given_seconds_once_fired() -> None:
    from maitre.agent.notices import SigtermSource

    src = SigtermSource(15, clock=lambda: 1000.0)
    assert src.read(1000.0, 30) is None
    src.fire()
    src.fire()  # a second SIGTERM does not move the deadline
    assert src.read(1003.0, 30) == ("terminate", 1015.0)
    with pytest.raises(ValueError, match="--sigterm-notice"):
        SigtermSource(0)


@pytest.mark.timeout(60)
def test_an_agent_with_sigterm_notice_drains_and_leaves_as_a_reclaim(tmp_path: Path) -> None:
    """``maitre agent --sigterm-notice S``: SIGTERM (Slurm's preemption, scancel) makes the
    node a noticed one; the agent exits once the coordinator heard it, and the node's going is
    a reclaim, not a dead node. Bad flags are refused."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT, wait_for
    from maitre.local import LocalCluster, UpConfig
    from maitre.wire import Client

    up = LocalCluster(UpConfig(state_dir=tmp_path / "state", nodes=0), out=lambda line: None)
    up.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAITRE_")}
    base = [
        sys.executable,
        "-m",
        "maitre.cli",
        "agent",
        "--coordinator",
        up.address,
        "--token-file",
        str(up.token_file),
        "--node-id",
        "held",
        "--health-interval",
        "0",
    ]
    try:
        for bad, says in (
            (["--sigterm-notice", "0"], "--sigterm-notice must be a positive"),
            (["--sigterm-notice", "5", "--spot-notice", "file:/x"], "one notice"),
        ):
            done = subprocess.run(base + bad, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
            assert done.returncode != 0 and says in done.stderr, done.stderr
        client = Client(up.address, token=up.token)
        proc = subprocess.Popen(
            base + ["--sigterm-notice", "20"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for(
                lambda: any(n["node"] == "held" and n["alive"] for n in client.get("/nodes")["nodes"]), 30, "the agent"
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0, proc.stdout.read() if proc.stdout else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        node = wait_for(
            lambda: next((n for n in client.get("/nodes")["nodes"] if n["node"] == "held" and n["reclaimed"]), None),
            10,
            "the reclaim",
        )
        assert not node["alive"]
        kinds = [e["kind"] for e in client.get("/events")["events"]]
        assert "spot_notice" in kinds and "node_reclaimed" in kinds and "node_dead" not in kinds
    finally:
        up.stop()
