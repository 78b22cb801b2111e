"""Whole-job checkpoints under ``maitre run``, with real worker processes over gloo.

* Suspend and resume: the run is asked to stop (as SIGTERM does), every member checkpoints and
  exits, the job is SUSPENDED; ``--resume`` on a different number of workers continues it.
* The whole job lost: every worker is killed at once; the replacements have no live state to take
  from a peer, so they load the newest complete checkpoint and train the lost steps again.

Both must end with every sample consumed exactly once (rolled-back steps count once) and the
parameters of a fixed-size run (relative error <= 1e-5).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import SLOWDOWN, example_command, relative_error
from maitre.checkpoint import format as fmt
from maitre.checkpoint.loader import newest_complete
from maitre.launch import Run, RunConfig
from maitre.runtime.ledger import audit

STEPS = 600


def start_run(tmp_path: Path, *, nodes: int, resume: bool = False, every: int | None = None) -> tuple[Run, list[str]]:
    lines: list[str] = []
    run = Run(
        RunConfig(
            command=example_command(STEPS, tmp_path / "final.pt"),
            min_nodes=1,
            max_nodes=4,
            local_nodes=nodes,
            max_restarts=3,
            run_dir=tmp_path / "run",
            quiet_workers=True,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=every,
            resume=resume,
            grace_period_s=60,
        ),
        out=lines.append,
    )
    return run.start(), lines


def when(run: Run, predicate: Callable[[dict], bool], action: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 120 * SLOWDOWN
        while time.monotonic() < deadline:
            if predicate(run.job()):
                action()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def resume_points(tmp_path: Path) -> list[int]:
    """The steps that workers resumed from, as their ledgers recorded."""
    points = []
    for path in (tmp_path / "run" / "ledger").glob("*.jsonl"):
        points += [json.loads(line)["s"] for line in path.read_text().splitlines() if json.loads(line)["k"] == "r"]
    return points


def check_end(tmp_path: Path, code: int, lines: list[str], reference: dict[str, torch.Tensor]) -> None:
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == STEPS, result.describe()
    err = relative_error(torch.load(tmp_path / "final.pt", weights_only=True), reference)
    assert err <= 1e-5, f"relative error {err:.3g}"


@pytest.mark.slow  # (suspend and resume: test_cluster_e2e.py's preemption, and resharded in
@pytest.mark.timeout(300)  # test_replica_checkpoints.py; 33 s)
def test_suspend_then_resume_on_more_workers(tmp_path: Path, reference) -> None:
    run, lines = start_run(tmp_path, nodes=2)
    when(run, lambda job: job["step"] >= 100, lambda: run.request_stop("SIGTERM"))
    code = run.wait()
    job = run.job()
    assert code == 0 and job["state"] == "SUSPENDED", "\n".join(lines)
    assert any("suspended; continue" in line for line in lines)
    newest = newest_complete(tmp_path / "ckpt")
    assert newest is not None and newest.name == fmt.step_dir_name(job["step"])
    assert 100 <= job["step"] < STEPS
    assert fmt.read_manifest(newest)["world_size"] == 2

    resumed, lines = start_run(tmp_path, nodes=3, resume=True)
    code = resumed.wait()
    assert len(resumed.job()["members"]) == 3
    assert resume_points(tmp_path) == [job["step"]] * 3  # each of the 3 read the checkpoint
    check_end(tmp_path, code, lines, reference(STEPS))


@pytest.mark.timeout(300)
def test_whole_job_lost_resumes_from_the_newest_checkpoint(tmp_path: Path, reference) -> None:
    run, lines = start_run(tmp_path, nodes=2, every=25)

    def kill_everyone() -> None:
        for agent in run.agents:
            for wid in list(agent.workers):
                os.kill(agent.pid(wid), signal.SIGKILL)

    when(run, lambda job: job["step"] >= 140, kill_everyone)
    code = run.wait()
    job = run.job()
    assert job["failures"] >= 1, "\n".join(lines)
    points = resume_points(tmp_path)
    assert points and all(p % 25 == 0 and 125 <= p for p in points), points
    # What the coordinator heard: rank 0's restore from disk, and members that say so.
    restores = [r for r in job["reports"] if r["kind"] == "restore"]
    assert restores and all(r["source"] == "disk" and r["step"] in points and r["seconds"] > 0 for r in restores), job[
        "reports"
    ]
    assert any(r["kind"] == "recovery" and r["epoch"] > 1 and r["state_source"] == "disk" for r in job["reports"]), job[
        "reports"
    ]
    check_end(tmp_path, code, lines, reference(STEPS))
