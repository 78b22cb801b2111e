"""End to end with real worker processes over gloo: crashes, hangs, joins and leaves.

Each run uses the embedded coordinator and local agents of ``maitre run`` and its scripted story
as the fault injector. Each asserts that the job completes, that the data ledger shows every
sample consumed exactly once, and that the final parameters match a fixed-size run with the same
seed and global batch (relative error <= 1e-5).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import example_command, play, relative_error
from maitre.launch import Run
from maitre.runtime.ledger import audit

STEPS = 400


def run_story(
    tmp_path: Path,
    events: str,
    *,
    nodes: int,
    min_nodes: int = 1,
    max_nodes: int = 4,
    max_restarts: int = 5,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
) -> tuple[int, list[str], Run]:
    return play(  # type: ignore[return-value]
        tmp_path,
        example_command(steps, tmp_path / "final.pt", extra),
        events,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_nodes=nodes,
        max_restarts=max_restarts,
    )


def check(tmp_path: Path, code: int, lines: list[str], reference: dict[str, torch.Tensor], steps: int = STEPS) -> float:
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok, result.describe()
    assert result.steps == steps
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    error = relative_error(final, reference)
    assert error <= 1e-5, error
    return error


@pytest.mark.timeout(180)
def test_kill9_worker_mid_run(tmp_path: Path, reference) -> None:
    code, lines, run = run_story(tmp_path, "kill@40", nodes=3)
    check(tmp_path, code, lines, reference(STEPS))
    job = run.job()
    assert job["failures"] == 1
    assert any("killed by signal 9" in e.get("reason", "") for e in job["events"])


@pytest.mark.timeout(180)
def test_sigstop_worker_is_detected_and_removed(tmp_path: Path, reference) -> None:
    code, lines, run = run_story(tmp_path, "hang@40", nodes=3)
    check(tmp_path, code, lines, reference(STEPS))
    assert any("hung" in e.get("reason", "") for e in run.job()["events"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["stream", pytest.param("pause", marks=pytest.mark.slow)])
def test_worker_joins(tmp_path: Path, reference, monkeypatch, mode: str) -> None:
    """Streamed (the joiner listens while the job trains on) or broadcast while the job waits."""
    monkeypatch.setenv("MAITRE_JOIN", mode)
    code, lines, run = run_story(tmp_path, "join@20", nodes=2, max_nodes=3)
    check(tmp_path, code, lines, reference(STEPS))
    job = run.job()
    assert max(len(e["members"]) for e in job["events"] if e["kind"] == "epoch") == 3
    caught_up = [r for r in job["reports"] if r["kind"] == "caught_up"]
    assert len(caught_up) == (1 if mode == "stream" else 0), "\n".join(lines)
    assert job["epoch"] == 2, "\n".join(lines)  # (streamed: no rebuild once caught up)


@pytest.mark.timeout(180)
def test_worker_leaves_gracefully(tmp_path: Path, reference) -> None:
    code, lines, run = run_story(tmp_path, "leave@40", nodes=3)
    check(tmp_path, code, lines, reference(STEPS))
    job = run.job()
    assert job["failures"] == 0
    assert any(e["kind"] == "worker_left" for e in job["events"])


@pytest.mark.slow  # (40 s: a chaos run; each of its events has its own test above)
@pytest.mark.timeout(300)
def test_several_events_in_one_run(tmp_path: Path, reference) -> None:
    # Long enough that a joiner started under load (6-9 s on 2 busy cores) arrives before the
    # job ends: at 900 steps the story lost that race in 1 of 5 runs.
    steps = 1500
    code, lines, run = run_story(tmp_path, "kill@25,join@50,hang@150,leave@250", nodes=3, steps=steps)
    check(tmp_path, code, lines, reference(steps), steps)
    assert run.job()["failures"] == 2


@pytest.mark.timeout(300)
def test_no_false_hang_when_the_machine_is_oversubscribed(tmp_path: Path, reference) -> None:
    """Three workers plus four CPU burners on two cores: steps slow down, nobody is removed."""
    burn = "import time\nend = time.time() + 240\nwhile time.time() < end: pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(4)]
    try:
        code, lines, run = run_story(tmp_path, "", nodes=3)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    check(tmp_path, code, lines, reference(STEPS))
    job = run.job()
    assert job["failures"] == 0, "\n".join(lines)
    # The job may start on two nodes and grow onto the third when it registers a moment after
    # admission; what must not happen is an epoch that drops a member.
    sizes = [len(e["members"]) for e in job["events"] if e["kind"] == "epoch"]
    assert sizes == sorted(sizes), "\n".join(lines)
    assert not any(e["kind"] == "worker_dead" for e in job["events"]), "\n".join(lines)


# -- the step hooks under resizes (maitre.runtime.hooks) ---------------------------------------------
CLIP = ("--clip", "0.3")
FP16 = ("--precision", "fp16", "--loss-scale", "1e308", "--clip", "0.3")
"""The loss scaler in float64, where the comparison means something: fp16's rounding turns the
last-bit differences of another summation order (another world size) into 5e-3 of the final
parameters (measured: a story run in float32 under fp16 autocast against one process). Autocast
leaves float64 alone, and a scale of 1e308 overflows the first steps, so the run starts with
skipped steps: each commits nothing and is trained again at half the scale. fp16 autocast itself
is checked against a hand-written step in test_hooks.py."""


@pytest.mark.slow  # (the fp16 story below clips too, under the same crash and leave)
@pytest.mark.timeout(180)
def test_clipping_by_the_global_norm_under_a_crash_and_a_leave(tmp_path: Path, reference) -> None:
    """Each rank clipping its own share would clip a different vector at each world size."""
    code, lines, run = run_story(tmp_path, "kill@40,leave@150", nodes=3, extra=CLIP)
    check(tmp_path, code, lines, reference(STEPS, *CLIP))
    assert run.job()["failures"] == 1


@pytest.mark.slow  # (with ranks as threads in the default suite: tests/test_inprocess.py)
@pytest.mark.timeout(180)
def test_fp16_loss_scaling_and_clipping_under_a_crash_and_a_leave(tmp_path: Path, reference) -> None:
    code, lines, run = run_story(tmp_path, "kill@40,leave@150", nodes=3, extra=FP16)
    check(tmp_path, code, lines, reference(STEPS, *FP16))
    skips = [x for x in (tmp_path / "run" / "ledger").glob("*.jsonl") if '"k":"x"' in x.read_text()]
    assert skips, "no step overflowed: the scaler's skip was not exercised"


@pytest.mark.slow  # (with ranks as threads in the default suite: tests/test_inprocess.py)
@pytest.mark.timeout(180)
def test_a_joiner_replays_the_steps_trained_while_its_state_streamed(tmp_path: Path, reference, monkeypatch) -> None:
    """The snapshot lands 1.5 s late: the joiner hears dozens of steps meanwhile and replays
    them (clipping and the fp16 scaler included) before it trains; the result is exact."""
    monkeypatch.setenv("MAITRE_TRANSFER_DELAY_S", "1.5")
    # 2 ms of "device" a sample: at 150 steps/s the members used to finish all 400 steps before
    # the snapshot landed (the joiner then left; see the test below). The math is the same.
    code, lines, run = run_story(
        tmp_path, "join@20", nodes=2, max_nodes=3, extra=FP16 + ("--device-ms-per-sample", "2")
    )
    check(tmp_path, code, lines, reference(STEPS, *FP16))
    caught_up = [r for r in run.job()["reports"] if r["kind"] == "caught_up"]
    assert len(caught_up) == 1 and caught_up[0]["replayed"] >= 10, "\n".join(lines)


@pytest.mark.slow  # (with ranks as threads in the default suite: tests/test_inprocess.py)
@pytest.mark.timeout(180)
def test_a_job_that_finishes_while_a_joiners_state_streams_completes_without_it(
    tmp_path: Path, reference, monkeypatch
) -> None:
    """The snapshot would land long after the last step: the joiner hears the members commit
    it and leaves, holding none of the state; the job completes. It used to wait for the
    joiner, whose broken stream then made it the only member, with no state: the job trained
    all over again from step 0 (seen in CI: 400 steps rolled back)."""
    monkeypatch.setenv("MAITRE_TRANSFER_DELAY_S", "60")
    code, lines, run = run_story(tmp_path, "join@20", nodes=2, max_nodes=3)
    check(tmp_path, code, lines, reference(STEPS))
    job = run.job()  # type: ignore[attr-defined]
    kinds = [e["kind"] for e in job["events"]]
    assert "state_lost" not in kinds and "caught_up" not in kinds, "\n".join(lines)
    assert job["epoch"] == 2 and job["failures"] == 0, "\n".join(lines)
    assert audit(tmp_path / "run" / "ledger").rolled_back == 0
    assert kinds.count("worker_left") == 1, "\n".join(lines)  # the joiner, as the job ended
