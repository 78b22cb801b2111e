"""SIGTERM to ``maitre agent --sigterm-notice S`` is a graceful leave: what the kubelet sends
when a pod is deleted, drained, rolled or preempted (``terminationGracePeriodSeconds`` later,
SIGKILL), and Slurm when it preempts a job (``GraceTime`` later). The node drains as under a spot
notice of S seconds: its workers leave at a step boundary (or their job checkpoints first), the
agent exits 0 once they are gone, and the node's going is a reclaim, never a failure.

Real processes: a coordinator with one in-process node (``LocalCluster``) and the pod's agent as
a ``maitre agent`` process of its own, sent SIGTERM as the kubelet would, while a job's worker
trains on it (``tests/test_notices.py`` sends SIGTERM to an idle one, and checks the flag).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, TAG_VAR, _tagged_pids, example_command, kill_tagged, relative_error, wait_for
from maitre.scheduling.model import Queue

pytestmark = pytest.mark.timeout(120)


def _agent(address: str, token_file: Path, node: str, tag: str, notice: bool = True) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1"})
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maitre.cli",
            "agent",
            "--coordinator",
            address,
            "--token-file",
            str(token_file),
            "--node-id",
            node,
            "--nproc-per-node",
            "1",
            *(("--sigterm-notice", "30") if notice else ()),
            "--no-health-builtin",
            "--health-check",
            "true",
            "--health-interval",
            "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _events(cluster, kind: str, node: str | None = None) -> list[dict]:
    return [e for e in cluster.db.events() if e["kind"] == kind and (node is None or e.get("node") == node)]


def _cluster(tmp_path: Path, lines: list[str], **kw):
    from maitre.local import LocalCluster, UpConfig
    from maitre.scheduling.policy import PolicyConfig

    return LocalCluster(
        UpConfig(state_dir=tmp_path / "state", queues=[Queue("q")], policy=PolicyConfig(resize_cooldown_s=1.0), **kw),
        out=lines.append,
    ).start()


def test_a_sigterm_that_reaches_the_workers_too_is_their_agents_notice(tmp_path: Path, reference) -> None:
    """Slurm's ``proctrack/cgroup`` signals every process of a job step, so the workers hear
    the SIGTERM their agent takes as a notice. An agent with ``--sigterm-notice`` tells its
    workers so (``MAITRE_SIGTERM_DRAINS``): a worker sent SIGTERM says it heard it and trains
    on (its agent drains it when the notice is the agent's): no exit, no failure counted, every
    sample once, the parameters of a fixed-size run."""
    import torch

    from maitre import protocol
    from maitre.runtime.ledger import audit

    steps, out = 120, tmp_path / "a.pt"
    lines: list[str] = []
    cluster = _cluster(tmp_path, lines, nodes=0, quiet_workers=False)
    co = cluster.coordinator
    try:
        agent = cluster.add_node(slots=1, env={protocol.SIGTERM_DRAINS: "1"})
        co.submit(
            {
                "name": "a",
                "queue": "q",
                "minReplicas": 1,
                "maxReplicas": 1,
                "command": example_command(steps, out) + ["--device-ms-per-sample", "4"],
            }
        )
        wait_for(lambda: (a := co.job_status("a"))["state"] == "RUNNING" and a["step"] > 5, 60, "a to train", lines)
        [wid] = co.job_status("a")["members"]
        os.kill(agent.pid(wid), signal.SIGTERM)
        wait_for(lambda: co.job_status("a")["state"] in ("COMPLETED", "FAILED"), 60, "a to finish", lines)
        status = co.job_status("a")
        events = list(cluster.db.events())
    finally:
        cluster.stop()
    log = "\n".join(lines)
    assert status["state"] == "COMPLETED" and status["failures"] == 0, (status, log)
    assert f"{wid} heard SIGTERM" in log, log
    assert not [e for e in events if e["kind"] in ("worker_dead", "epoch_closed")], log
    result = audit(tmp_path / "state" / "ledger" / "a")
    assert result.ok and result.steps == steps, result.describe()
    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-9


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_drains_a_pods_worker_at_a_step_boundary_and_loses_no_sample(tmp_path: Path, reference) -> None:
    """Job ``a`` (1..2 replicas) trains on the in-process node and the pod's agent. SIGTERM to
    the pod's agent: its worker leaves at a step boundary well within the notice, the agent
    exits 0, the job trains on at one replica with no failure counted and ends with every
    sample exactly once and the parameters of a fixed-size run."""
    import torch

    from maitre.runtime.ledger import audit

    steps, out = 200, tmp_path / "a.pt"
    lines: list[str] = []
    cluster = _cluster(tmp_path, lines)
    co = cluster.coordinator
    tag = uuid.uuid4().hex
    proc = _agent(cluster.address, cluster.token_file, "pod-0", tag)
    try:
        cluster.add_node(slots=1)  # node-0
        wait_for(lambda: len([n for n in co.nodes_view() if n["alive"]]) == 2, 60, "both nodes", lines)
        co.submit(
            {
                "name": "a",
                "queue": "q",
                "minReplicas": 1,
                "maxReplicas": 2,
                "command": example_command(steps, out) + ["--device-ms-per-sample", "4"],
            }
        )

        def on_both() -> bool:
            a = co.job_status("a")
            nodes = {w["node"] for w in a["workers"] if w["id"] in a["members"]}
            return (
                nodes == {"node-0", "pod-0"}
                and a["state"] == "RUNNING"
                and min(w["step"] for w in a["workers"] if w["id"] in a["members"]) > 0
            )

        wait_for(on_both, 120, "a to train on both nodes", lines)
        on_pod = {w["id"] for w in co.job_status("a")["workers"] if w["node"] == "pod-0"}
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        agent_out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        wait_for(lambda: co.job_status("a")["state"] == "COMPLETED", 200, "a to finish", lines)
        status = co.job_status("a")
        events = list(cluster.db.events())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = kill_tagged(tag)
        cluster.stop(drain_s=10)
    log = "\n".join(lines)
    assert proc.returncode == 0 and took < 20, (took, agent_out)
    drained = next(e for e in events if e["kind"] == "node_drained" and e["node"] == "pod-0")
    assert sorted(drained["workers"]) == sorted(on_pod), (drained, on_pod)  # left gracefully
    print(f"SIGTERM to the agent's exit {took:.2f} s; the node drained in {drained['seconds']:.2f} s")
    assert any(e["kind"] == "node_reclaimed" and e["node"] == "pod-0" for e in events), log
    assert any(e["kind"] == "shrink" and e.get("job") == "a" for e in events), log
    assert not [e for e in events if e["kind"] == "node_dead"], log
    assert status["failures"] == 0, status
    result = audit(tmp_path / "state" / "ledger" / "a")
    assert result.ok, result.describe()
    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-9
    assert left == [], "the agent left processes behind"


def test_sigterm_without_a_notice_stops_the_agent_and_its_workers(tmp_path: Path) -> None:
    """Without ``--sigterm-notice``, SIGTERM (``kill``, systemd's stop) stops the agent as
    SIGINT does: its workers are ended and it exits 0, leaving no process behind (python's
    default ended it at once, and the workers, in sessions of their own, trained on)."""
    lines: list[str] = []
    cluster = _cluster(tmp_path, lines)
    co = cluster.coordinator
    tag = uuid.uuid4().hex
    proc = _agent(cluster.address, cluster.token_file, "box-0", tag, notice=False)
    try:
        wait_for(lambda: [n for n in co.nodes_view() if n["alive"]], 60, "the node", lines)
        command = example_command(100_000, tmp_path / "a.pt") + ["--device-ms-per-sample", "4"]
        co.submit({"name": "a", "queue": "q", "minReplicas": 1, "maxReplicas": 1, "command": command})
        wait_for(lambda: (a := co.job_status("a"))["state"] == "RUNNING" and a["step"] > 0, 120, "a to train", lines)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)  # (not its output: a worker left behind holds the pipe)
        deadline = time.monotonic() + 5
        while (left := _tagged_pids(tag)) and time.monotonic() < deadline:  # (workers after it)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_tagged(tag)
        agent_out, _ = proc.communicate()
        cluster.stop()
    assert code == 0, agent_out
    assert left == [], "the agent left its workers behind"
