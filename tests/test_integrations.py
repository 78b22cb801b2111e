"""Hugging Face and Lightning, installed from PyPI and unmodified, under restart mode.

``examples/hf_trainer.py`` (a ``transformers`` ``Trainer`` on a small GPT-2 built from a config,
its tokenizer trained here) and ``examples/lightning_restart.py`` (a ``LightningModule`` under
DDP) run under ``maitre run --elastic restart`` through a scale-up (a node joins), a shrink (a
replica taken back, as a preemption does) and a SIGKILL: each change stops the gang and starts
the next one at its size, the framework resumes from its own newest checkpoint, and the job
ends COMPLETED at its last step with no failure but the kill, every restart timed in the run's
summary. Marker ``integrations`` (minutes: each start imports the framework); ``.ci/run`` runs it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import ROOT, wait_for

pytestmark = [pytest.mark.integrations, pytest.mark.timeout(420)]

STEPS = 80


def _story(tmp_path: Path, command: list[str], progress: Callable[[], int]) -> tuple[dict, list[str]]:
    """Run ``command`` in restart mode on 1..2 local nodes: a node joins once it checkpointed,
    the job is shrunk to 1 once it checkpointed again, a worker is SIGKILLed once it checkpointed
    once more; returns the job as it ended and the run's lines. ``progress()``: the step of the
    script's newest checkpoint."""
    from maitre.launch import Run, RunConfig

    lines: list[str] = []
    run = Run(
        RunConfig(
            command=command,
            min_nodes=1,
            max_nodes=2,
            elastic="restart",
            run_dir=tmp_path / "run",
            ledger=False,
            grace_period_s=10.0,
            success_marker="training done",
        ),
        out=lines.append,
    )
    code: list[int] = []
    run.start()
    waiter = threading.Thread(target=lambda: code.append(run.wait()), daemon=True)
    waiter.start()

    def job() -> dict:
        return run.job()

    def said() -> str:
        return "\n".join(lines[-80:]) + f"\njob: {job()}"

    def gang(epoch: int, size: int) -> Callable[[], dict | bool]:
        return lambda: (j := job())["state"] == "RUNNING" and j["epoch"] == epoch and len(j["members"]) == size and j

    def checkpointed_after(step: int) -> Callable[[], bool]:
        return lambda: progress() > step

    try:
        wait_for(gang(1, 1), 60, "the first gang", said)
        wait_for(checkpointed_after(0), 120, "a first checkpoint", said)
        run.add_node()  # scale-up: the gang restarts at 2
        wait_for(gang(2, 2), 60, "the gang at 2", said)
        at = progress()
        wait_for(checkpointed_after(at), 120, "a checkpoint of the gang at 2", said)
        run.coordinator.scale(run.cfg.job_id, 1)  # a replica taken back: the gang restarts at 1
        wait_for(gang(3, 1), 60, "the gang back at 1", said)
        at = progress()
        wait_for(checkpointed_after(at), 120, "a checkpoint of the gang at 1", said)
        [victim] = job()["members"]
        os.kill(run.pid_of(victim), signal.SIGKILL)
        wait_for(lambda: job()["epoch"] >= 4, 60, "the gang after the kill", said)
        waiter.join(timeout=240)
        assert not waiter.is_alive(), "the job did not end:\n" + said()
    finally:
        if waiter.is_alive():
            run.shutdown()
    for agent in run.agents:  # every process of every worker is gone
        for worker in agent.workers.values():
            assert not worker.alive(), f"{worker.worker_id} still running"
    assert code == [0], said()
    return job(), lines


def _check(final: dict, lines: list[str]) -> None:
    assert final["state"] == "COMPLETED" and final["failures"] == 1, final
    causes = [r["cause"] for r in final["restarts"]]
    assert causes[0].startswith("resize to 2") and causes[1].startswith("resize to 1"), causes
    assert "killed by signal 9" in causes[2], causes
    assert all(r["joined_s"] is not None for r in final["restarts"]), final["restarts"]
    said = "\n".join(lines).splitlines()
    table = [line for line in said if re.match(r"\s+\d+\s+\d+\s+(resize|worker)", line)]
    assert len(table) == 3, "\n".join(said[-30:]) + f"\n{final['restarts']}"  # the restarts in the summary
    assert any(f"training done at step {STEPS}" in line for line in lines), "\n".join(lines[-30:])


def test_a_hugging_face_trainer_is_restarted_whole_and_resumes_from_its_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2"
    command = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--output-dir", str(out)]
    command += ["--max-steps", str(STEPS), "--save-steps", "10", "--step-ms", "100"]

    def progress() -> int:
        steps = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
        return max(steps, default=0)

    final, lines = _story(tmp_path, command, progress)
    _check(final, lines)
    resumed = [line for line in lines if "resumed from" in line]
    assert any("checkpoint-" in line for line in resumed), resumed


def test_a_lightning_script_is_restarted_whole_and_resumes_from_its_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, str(ROOT / "examples" / "lightning_restart.py"), "--checkpoint-dir", str(ckpt)]
    command += ["--max-steps", str(STEPS), "--save-every", "10", "--step-ms", "100"]
    seen: dict[float, int] = {}

    def progress() -> int:
        last = ckpt / "last.ckpt"
        if not last.exists():
            return 0
        stamp = last.stat().st_mtime
        if stamp not in seen:  # (read once per write: torch.load of a file being replaced may fail)
            time.sleep(0.2)
            import torch

            try:
                seen[stamp] = int(torch.load(last, map_location="cpu", weights_only=False)["global_step"])
            except Exception:  # noqa: BLE001 -- caught mid-write: the next poll reads it
                return max(seen.values(), default=0)
        return seen[stamp]

    final, lines = _story(tmp_path, command, progress)
    _check(final, lines)
