"""The API over HTTPS with the user's certificate: clients check it, workers too, and bad
certificate files are refused before anything starts."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Procs, example_command, wait_for
from maitre.control.api import CoordinatorServer
from maitre.control.cluster import ClusterState
from maitre.scheduling import Queue
from maitre.wire import Client, CoordinatorUnreachable

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl makes the test certificates (.ci/run installs it)"
)


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made here (no key is committed)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    directory = tmp_path_factory.mktemp("certs")
    return {name: _certificate(directory, name) for name in ("coordinator", "stranger")}


@pytest.mark.timeout(60)
def test_clients_speak_https_and_check_the_certificate(certs, tmp_path: Path) -> None:
    cert, key = certs["coordinator"]
    with CoordinatorServer(
        ClusterState([Queue("q")], run_dir=tmp_path), "127.0.0.1", 0, token="t", tls_cert=str(cert), tls_key=str(key)
    ) as server:
        assert Client(server.address, token="t", tls_ca=str(cert)).get("/jobs") == {"jobs": []}
        with pytest.raises(CoordinatorUnreachable):  # plain HTTP to an HTTPS port
            Client(server.address, token="t").get("/jobs")
        with pytest.raises(CoordinatorUnreachable, match="(?i)certificate verify failed"):
            Client(server.address, token="t", tls_ca=str(certs["stranger"][0])).get("/jobs")


@pytest.mark.timeout(60)
def test_bad_certificate_flags_are_refused_before_anything_starts(certs, tmp_path: Path) -> None:
    cert, key = certs["coordinator"]
    other_key = certs["stranger"][1]
    state = tmp_path / "state"
    cases = [
        (["up", "--tls-cert", str(cert), "--tls-key", str(other_key)], "certificate and its key"),
        (["up", "--tls-cert", str(cert)], "go together"),
        (["up", "--tls-ca", str(cert)], "--tls-cert and --tls-key too"),
        (["up", "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(key)], "certificate and its key"),
        (
            ["status", "--coordinator", "127.0.0.1:1", "--tls-ca", str(tmp_path / "none.pem")],
            "not a PEM certificate bundle",
        ),
    ]
    for args, message in cases:
        extra = ["--state-dir", str(state), "--nodes", "0"] if args[0] == "up" else []
        out = subprocess.run(
            [sys.executable, "-m", "maitre.cli", *args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert not state.exists()  # nothing written


@pytest.mark.timeout(180)
def test_a_job_trains_with_the_api_over_https(certs, tmp_path: Path) -> None:
    """``maitre up`` with the user's certificate: its nodes, ``maitre submit`` and every worker
    speak HTTPS to it (the workers get the CA from their agent)."""
    cert, key = certs["coordinator"]
    procs = Procs(tmp_path)
    log = tmp_path / "coordinator.log"
    try:
        procs.start(
            "coordinator",
            "up",
            "--nodes",
            "2",
            "--slots-per-node",
            "1",
            "--state-dir",
            str(tmp_path / "state"),
            "--queue",
            "q",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        )
        export = wait_for(
            lambda: (
                log.exists()
                and re.search(
                    r"export MAITRE_COORDINATOR=(\S+) MAITRE_TOKEN_FILE=(\S+) MAITRE_TLS_CA=(\S+)", log.read_text()
                )
            ),
            60,
            "the export line",
            log,
        )
        address, token_file, ca = export.groups()
        assert Path(ca) == cert.resolve()
        client = Client(address, token=Path(token_file).read_text().strip(), tls_ca=ca)
        manifest = tmp_path / "job.yaml"
        manifest.write_text(
            "name: secure\nqueue: q\nminReplicas: 2\nmaxReplicas: 2\ncommand: "
            + repr(example_command(40)).replace("'", '"')
            + "\n"
        )
        env_args = ["--coordinator", address, "--token-file", token_file, "--tls-ca", ca]
        submitted = subprocess.run(
            [sys.executable, "-m", "maitre.cli", "submit", str(manifest), *env_args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert submitted.returncode == 0, submitted.stderr
        final = wait_for(
            lambda: (j := client.get("/jobs/secure"))["state"] in ("COMPLETED", "FAILED") and j,
            150,
            "the job to finish",
            log,
        )
    finally:
        procs.cleanup()
    assert final["state"] == "COMPLETED" and final["step"] == 40, final
    # The run's token went to its workers only: in no log, no event, no status
    with sqlite3.connect(tmp_path / "state" / "state.db") as db:
        stored = " ".join(str(row) for row in db.execute("SELECT * FROM jobs"))
        events = " ".join(str(row) for row in db.execute("SELECT body FROM events"))
    tokens = set(re.findall(r'"token": "([0-9a-f]{64})"', stored))
    assert tokens, "the run's token is kept with its job (for a restart)"
    shown = log.read_text() + events + json.dumps(final)
    assert not any(t in shown for t in tokens)
