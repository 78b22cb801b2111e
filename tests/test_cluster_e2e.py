"""The scheduled cluster end to end: a coordinator killed with SIGKILL and restarted while its
jobs train, and a preempted job suspended and resumed. (The demo's story, with real agents and
workers, runs in tests/test_dashboard_browser.py, watched in the browser as it happens.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from conftest import Procs, wait_for
from maitre.runtime.ledger import audit
from maitre.wire import Client, CoordinatorUnreachable


@pytest.mark.chaos  # (about half a minute: in .ci/run's chaos stage, not the default suite)
@pytest.mark.timeout(300)
def test_a_coordinator_killed_with_sigkill_restarts_and_its_job_trains_on(tmp_path: Path, reference) -> None:
    from conftest import example_command

    state = tmp_path / "state"
    procs = Procs(tmp_path)
    steps = 300
    out = tmp_path / "final.pt"
    try:
        procs.start("coordinator", "up", "--nodes", "0", "--state-dir", str(state), "--queue", "q")
        log = tmp_path / "coordinator.log"
        address = wait_for(
            lambda: (
                next(
                    (
                        line.split("coordinator at ")[1].split()[0]
                        for line in log.read_text().splitlines()
                        if "coordinator at " in line
                    ),
                    None,
                )
                if log.exists()
                else None
            ),
            60,
            "the coordinator",
            log,
        )
        token = (state / "token").read_text().strip()
        client = Client(address, timeout_s=5.0, token=token)
        for node in ("n0", "n1"):
            procs.start(
                f"agent-{node}",
                "agent",
                "--coordinator",
                address,
                "--token-file",
                str(state / "token"),
                "--nproc-per-node",
                "1",
                "--node-id",
                node,
            )
        command = example_command(steps, out) + ["--device-ms-per-sample", "8"]
        client.post(
            "/jobs",
            {"manifest": {"name": "fixed", "queue": "q", "minReplicas": 2, "maxReplicas": 2, "command": command}},
        )

        def job() -> dict:
            return client.get("/jobs/fixed")

        before = wait_for(
            lambda: (j := job())["state"] == "RUNNING" and j["step"] >= 30 and j, 120, "the job to train", log
        )
        procs.procs[0].send_signal(signal.SIGKILL)  # the coordinator, without a word
        procs.procs[0].wait(timeout=10)
        with pytest.raises(CoordinatorUnreachable):
            client.get("/health")
        time.sleep(4.0)  # its workers train on meanwhile

        procs.start("coordinator", "up", "--nodes", "0", "--state-dir", str(state))
        after = wait_for(lambda: _try(job), 60, "the restarted coordinator", log)
        assert after["state"] == "RUNNING", after
        assert after["epoch"] == before["epoch"] and after["members"] == before["members"]
        progressed = wait_for(
            lambda: (j := _try(job)) and j["step"] > before["step"] + 10 and j,
            10,
            "the job's steps after the restart",
            log,
        )
        final = wait_for(
            lambda: (j := _try(job)) and j["state"] in ("COMPLETED", "FAILED") and j, 150, "the job to finish", log
        )
    finally:
        procs.cleanup()
    assert final["state"] == "COMPLETED", final
    assert final["failures"] == 0 and final["epoch"] == before["epoch"], final
    assert progressed["step"] > before["step"]
    result = audit(state / "ledger" / "fixed")
    assert result.ok, result.describe()
    import torch

    from conftest import relative_error

    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-9


def _try(fn):
    try:
        return fn()
    except CoordinatorUnreachable:
        return None


@pytest.mark.timeout(300)
def test_a_preempted_job_is_suspended_with_a_checkpoint_and_resumes_where_it_stopped(tmp_path: Path, reference) -> None:
    """A fixed gang cannot shrink, so a higher-priority gang suspends it: its workers checkpoint
    and stop, the newcomer runs, and the suspended job resumes from its checkpoint (a new
    incarnation) and ends with the parameters of a run that was never interrupted."""
    from conftest import example_command, relative_error
    from maitre.local import LocalCluster, UpConfig
    from maitre.scheduling.model import Queue

    import torch

    steps, out = 240, tmp_path / "low.pt"
    lines: list[str] = []
    cluster = LocalCluster(
        UpConfig(state_dir=tmp_path / "state", nodes=1, slots_per_node=2, queues=[Queue("q")]), out=lines.append
    ).start()
    co = cluster.coordinator
    try:
        co.submit(
            {
                "name": "low",
                "queue": "q",
                "priorityClassName": "low",
                "minReplicas": 2,
                "maxReplicas": 2,
                "checkpointDir": str(tmp_path / "ck"),
                "command": example_command(steps, out) + ["--device-ms-per-sample", "8"],
            }
        )
        wait_for(lambda: co.job_status("low")["step"] >= 40, 120, "low to train", lines)
        co.submit(
            {
                "name": "high",
                "queue": "q",
                "priorityClassName": "high",
                "minReplicas": 2,
                "maxReplicas": 2,
                "preemptible": False,
                "command": example_command(60) + ["--device-ms-per-sample", "8"],
            }
        )
        wait_for(lambda: co.job_status("low")["state"] == "COMPLETED", 240, "low to finish", lines)
        high = co.job_status("high")
        low = co.job_status("low")
        events = [e for e in cluster.db.events()]
    finally:
        cluster.stop(drain_s=10)
    log = "\n".join(lines)
    assert high["state"] == "COMPLETED", log
    assert low["incarnation"] == 2, log
    kinds = [(e["kind"], e.get("job")) for e in events]
    order = [
        k
        for k in kinds
        if k in {("suspend", "low"), ("job_suspended", "low"), ("admit", "high"), ("job_completed", "high")}
    ]
    assert order == [("suspend", "low"), ("job_suspended", "low"), ("admit", "high"), ("job_completed", "high")], order
    resumed = next(e for e in events if e["kind"] == "admit" and e.get("job") == "low" and e["incarnation"] == 2)
    assert resumed["resumes"] is True
    # The second run's groups never met the first run's store keys (it counts epochs from 1).
    assert not [e for e in events if e["kind"] == "epoch_closed" and e.get("job") == "low"], log
    result = audit(tmp_path / "state" / "ledger" / "low")
    assert result.ok, result.describe()
    assert relative_error(torch.load(out, weights_only=True), reference(steps)) < 1e-9
