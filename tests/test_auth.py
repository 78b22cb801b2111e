"""The coordinator's token: every API call but the health probe needs it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.scheduling import Queue
from maitre.launch import Run, RunConfig
from maitre.wire import ApiError, Client

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path: Path):
    cluster = ClusterState([Queue("q")], run_dir=tmp_path)
    srv = CoordinatorServer(cluster, "127.0.0.1", 0, token="s3cret-token").start()
    yield srv
    srv.stop()


def test_calls_without_the_token_are_refused(server: CoordinatorServer) -> None:
    assert Client(server.address).get("/health") == {"ok": True}  # liveness probes stay open
    for token in (None, "wrong", "s3cret-token-but-longer"):
        with pytest.raises(ApiError) as err:
            Client(server.address, token=token).get("/jobs")
        assert err.value.status == 401 and "token" in err.value.message
    with pytest.raises(ApiError) as err:
        Client(server.address).post("/jobs", {"job_id": "x"})
    assert err.value.status == 401
    assert Client(server.address, token="s3cret-token").get("/jobs") == {"jobs": []}


def test_the_cli_reads_the_token_file(server: CoordinatorServer, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAITRE_")}
    cmd = [sys.executable, "-m", "maitre.cli", "status", "--coordinator", server.address]
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1
    assert refused.stderr.strip().startswith("maitre: error: missing or wrong token")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    ok = subprocess.run(
        cmd + ["--token-file", str(token_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert ok.returncode == 0 and ok.stdout.startswith("JOB"), ok.stderr
    via_env = subprocess.run(
        cmd, cwd=ROOT, env={**env, "MAITRE_TOKEN": "s3cret-token"}, capture_output=True, text=True, timeout=30
    )
    assert via_env.returncode == 0, via_env.stderr
    missing = subprocess.run(
        cmd + ["--token-file", str(tmp_path / "nope"), "--wait", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )  # (--wait 0: a token file not there is not waited for; tests/test_cli.py has the wait)
    assert missing.returncode == 2 and "cannot read --token-file" in missing.stderr


def test_maitre_run_writes_an_owner_only_token_file(tmp_path: Path) -> None:
    lines: list[str] = []
    run = Run(
        RunConfig(
            command=[sys.executable, "-c", "pass"], min_nodes=1, max_nodes=1, local_nodes=0, run_dir=tmp_path / "run"
        ),
        out=lines.append,
    )
    try:
        run.start()
        token_file = tmp_path / "run" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 40 and token == run.token
        assert any(f"--token-file {token_file}" in line for line in lines)
        assert Client(run.server.address, token=token).get("/jobs")["jobs"][0]["job_id"] == "job"
        with pytest.raises(ApiError):
            Client(run.server.address).get("/jobs")
    finally:
        run.shutdown()
