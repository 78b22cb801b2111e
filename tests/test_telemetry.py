"""Telemetry from real workers: progress, checkpoint and recovery reports under ``maitre run``.

One short run over gloo (two workers, a checkpoint every 25 steps, one worker SIGKILLed) and
what the coordinator made of it: ``progress`` events with a loss, ``checkpoint`` reports with
their timings and interval, recovery reports that say where each member's state came from, and
``/metrics`` counting it all. The exactly-once audit of the run must still hold. And the
worker's side alone: its reports never wait on the coordinator, and progress is dropped, never
queued, while a post is in flight.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from conftest import example_command, play
from maitre.runtime.ledger import audit
from maitre.runtime.telemetry import ProgressMeter, Reporter
from test_metrics import sample

STEPS = 250
"""About 3 s of training here: rank 0 sends a progress report a second."""


def run_story(tmp_path: Path, steps: int, story: str, resume: bool = False):
    # (1 ms of "device" a sample: each epoch trains for more than a progress report's second
    # even on a fast machine)
    return play(
        tmp_path,
        example_command(steps, extra=("--device-ms-per-sample", "1")),
        story,
        min_nodes=1,
        max_nodes=2,
        local_nodes=2,
        max_restarts=3,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=25,
        resume=resume,
    )


@pytest.mark.timeout(180)
def test_progress_checkpoint_and_recovery_reports_reach_the_coordinator(tmp_path: Path) -> None:
    code, lines, run = run_story(tmp_path, STEPS, "kill@100")
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == STEPS, result.describe()
    co, job = run.coordinator, run.job()

    progress = job["progress"]  # the latest (the earlier ones are events, not kept)
    assert progress["kind"] == "progress" and 0 < progress["step"] <= STEPS
    assert isinstance(progress["loss"], float) and 0 < progress["loss"] < 10, progress
    assert progress["steps_per_s"] > 0 and progress["samples_per_s"] == pytest.approx(12 * progress["steps_per_s"]), (
        progress
    )  # TINY's global batch of 12
    assert not any(r["kind"] == "progress" for r in job["reports"])

    saves = [r for r in job["reports"] if r["kind"] == "checkpoint"]
    assert saves and all(r["ok"] and r["error"] is None for r in saves), saves
    assert all(r["interval_steps"] == 25 and r["interval_s"] is None for r in saves), saves
    assert all(r["snapshot_s"] > 0 and r["persist_s"] > 0 and r["bytes"] > 10_000 for r in saves), saves
    # The committer's last save, reported before its "done" (the final step's own save may
    # be vetoed by a writer still busy with one a few steps before).
    assert saves[-1]["step"] > STEPS - 25 - 3, saves
    assert saves[0]["step"] == 25
    assert any("checkpoint at step 25:" in line for line in lines), "\n".join(lines)

    recoveries = [r for r in job["reports"] if r["kind"] == "recovery"]
    first = [r for r in recoveries if r["epoch"] == 1]
    later = [r for r in recoveries if r["epoch"] > 1 and r["reason"] != "join"]
    assert first and all(r["state_source"] == "none" for r in first), first
    assert later and all(r["state_source"] == "peer" for r in later), recoveries
    assert job["failures"] == 1

    text = co.metrics.render().decode()
    assert sample(text, "maitre_events_total", kind="progress") >= 1  # (one a second at most)
    assert sample(text, "maitre_checkpoints_total", result="ok") == len(saves)
    assert sample(text, "maitre_checkpoint_snapshot_duration_seconds_count") == len(saves)
    assert sample(text, "maitre_recoveries_total", cause="crash") >= 1
    assert sample(text, "maitre_recovery_duration_seconds_count", cause="crash") >= 1
    assert sample(text, "maitre_job_checkpoint_interval_steps", job="job") is None  # ended
    assert sample(text, "maitre_jobs", state="COMPLETED") == 1


@pytest.mark.slow  # (a second run: 5 s more of worker start-up)
@pytest.mark.timeout(180)
def test_a_resumed_job_reports_its_restore_from_disk(tmp_path: Path) -> None:
    code, lines, _ = run_story(tmp_path, 50, "")
    assert code == 0, "\n".join(lines)
    code, lines, run = run_story(tmp_path, 80, "", resume=True)
    assert code == 0, "\n".join(lines)
    job = run.job()
    restores = [r for r in job["reports"] if r["kind"] == "restore"]
    assert len(restores) == 1, job["reports"]  # rank 0's
    assert restores[0]["step"] == 50 and restores[0]["source"] == "disk"
    assert restores[0]["seconds"] > 0 and restores[0]["bytes"] > 10_000, restores
    first = [r for r in job["reports"] if r["kind"] == "recovery" and r["epoch"] == 1]
    assert first and all(r["state_source"] == "disk" for r in first), first
    assert any("restored step 50 from disk" in line for line in lines), "\n".join(lines)
    text = run.coordinator.metrics.render().decode()
    assert sample(text, "maitre_restores_total", source="disk") == 1
    assert sample(text, "maitre_restore_duration_seconds_count") == 1


# -- the worker's side, alone ----------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_reports_never_wait_and_progress_is_dropped_while_a_post_is_in_flight() -> None:
    got: list[dict] = []
    release = threading.Event()

    def post(report: dict, timeout_s: float) -> None:  # the first report is held until released
        if not got:
            release.wait(10)
        got.append(report)

    reporter = Reporter(post)
    try:

        def progress(step: int) -> dict:
            return {
                "kind": "progress",
                "step": step,
                "loss": 1.0,
                "world_size": 1,
                "steps_per_s": 1.0,
                "samples_per_s": 1.0,
            }

        began = time.monotonic()
        assert reporter.offer(progress(1))
        deadline = time.monotonic() + 5
        while not reporter._posting and time.monotonic() < deadline:  # in flight, held
            time.sleep(0.01)
        assert not reporter.offer(progress(2))  # dropped: one is in flight
        reporter.send({"kind": "checkpoint", "step": 2})  # queued behind it
        assert not reporter.offer(progress(3))  # dropped: a report is waiting
        assert time.monotonic() - began < 1.0  # none of it waited for the coordinator
        release.set()
        assert reporter.flush(5.0)
        assert [(r["kind"], r["step"]) for r in got] == [("progress", 1), ("checkpoint", 2)]
        assert reporter.dropped == 2 and reporter.sent == 2
    finally:
        release.set()
        reporter.close()


def test_the_progress_meter_reports_rates_over_its_window() -> None:
    meter = ProgressMeter(every_s=1.0)
    assert meter.committed(10.0, 5, 12, 2.0, 2) is None  # the window opens here
    assert meter.committed(10.5, 6, 12, 1.9, 2) is None
    report = meter.committed(11.0, 7, 12, float("nan"), 2, skipped=3)
    assert report == {
        "kind": "progress",
        "step": 7,
        "loss": None,
        "world_size": 2,
        "steps_per_s": 2.0,
        "samples_per_s": 24.0,
        "skipped_samples": 3,
    }
    assert meter.committed(11.5, 8, 12, 1.8, 2) is None  # counted from the last report
    assert meter.committed(12.0, 9, 12, 1.7, 2)["steps_per_s"] == 2.0
