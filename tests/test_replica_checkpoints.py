"""Checkpoints of sharded state, end to end: FSDP2 replicas of two processes write one checkpoint
(each process its own shards, one replica for all), and it resumes on another number of replicas
and another mesh, resharded on load: one replica of two, three unsharded replicas of one, one
process alone, and under ``maitre run`` (suspended and resumed on fewer replicas; every process
killed at once, resumed from the newest periodic checkpoint) with every sample once. The final
parameters must be one process's (float64, clipped by the global norm). A checkpoint whose shards
do not cover the model stops the job before it trains, with nothing written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, relative_error, run_tagged
from maitre.checkpoint import format as fmt

SCRIPT = ROOT / "tests" / "scripts" / "sharded_mlp.py"
HALF, STEPS = 6, 12


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        *args,
    ]


def run(cmd: list[str]) -> str:
    result = run_tagged(cmd, timeout=100, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "final.pt"
    run([sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", str(out)])
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of step 6 by two replicas of two processes (dp_shard=2) under torchrun."""
    root = tmp_path_factory.mktemp("saved")
    run(
        torchrun(
            4,
            "--dp-shard",
            "2",
            "--steps",
            str(HALF),
            "--checkpoint-dir",
            str(root / "ckpt"),
            "--out",
            str(root / "half.pt"),
        )
    )
    return root / "ckpt" / fmt.step_dir_name(HALF)


@pytest.mark.timeout(120)
def test_two_replicas_of_two_write_one_sharded_checkpoint(saved: Path) -> None:
    manifest = fmt.read_manifest(saved)
    assert manifest["format"] == fmt.FORMAT_SHARDED and manifest["world_size"] == 2
    assert sorted(p.name for p in saved.glob("shard-*")) == [fmt.shard_name(0), fmt.shard_name(1)]
    state = json.loads((saved / fmt.STATE).read_bytes())
    weight = state["tensors"][state["skeleton"]["model"]["0.weight"]["__dtensor__"]]
    assert weight == ["F64", [32, 8], [[0, [0, 0], [16, 8]], [1, [16, 0], [16, 8]]]]


RESUMES = {
    "1 replica of 2": lambda args: torchrun(2, "--dp-shard", "2", *args),
    "3 replicas of 1": lambda args: torchrun(3, "--dp-shard", "1", *args),
    "alone": lambda args: [sys.executable, str(SCRIPT), *args],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "where",
    [  # (onto one process by default; the others: -m slow)
        pytest.param(w, marks=pytest.mark.slow) if w != "alone" else w for w in RESUMES
    ],
)
def test_a_sharded_checkpoint_resumes_on_another_mesh(tmp_path: Path, saved: Path, alone, where: str) -> None:
    shutil.copytree(saved, tmp_path / "ckpt" / saved.name)
    out = tmp_path / "final.pt"
    stdout = run(RESUMES[where](["--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]))
    assert f"resumed from {tmp_path / 'ckpt' / saved.name} at step {HALF}" in stdout, stdout
    assert stdout.count("maitre: resumed from") == 1, stdout  # one line, not one per process
    error = relative_error(torch.load(out, weights_only=True), alone)
    assert error <= 1e-10, error


@pytest.mark.timeout(60)
def test_shards_that_do_not_cover_the_model_stop_the_job_before_it_trains(tmp_path: Path, saved: Path) -> None:
    """A checkpoint whose every checksum is right but whose pieces leave out half of a weight
    (rank 1's shard is gone, and the manifest and state.json say nothing of it): one clear
    error, a non-zero exit, and nothing written."""
    ckpt = tmp_path / "ckpt" / saved.name
    shutil.copytree(saved, ckpt)
    state = json.loads((ckpt / fmt.STATE).read_bytes())
    for spec in state["tensors"]:
        if isinstance(spec[2], list):
            spec[2] = [piece for piece in spec[2] if piece[0] == 0]
    for name in (fmt.STATE, fmt.MANIFEST, fmt.shard_name(1)):
        (ckpt / name).unlink()
    body = fmt.read_manifest(saved)
    del body["files"][fmt.shard_name(1)]
    size, digest = fmt.write_json(ckpt / fmt.STATE, state)
    body["files"][fmt.STATE] = {"size": size, "xxh3_64": digest}
    fmt.write_manifest(ckpt / fmt.MANIFEST, body)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())

    out = tmp_path / "final.pt"
    result = run_tagged(
        [
            sys.executable,
            str(SCRIPT),
            "--steps",
            str(STEPS),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ],
        timeout=60,
    )
    assert result.returncode != 0
    assert (
        f"UnusableCheckpoint: {ckpt} is refused: its shards do not cover model.0.weight "
        "(shape [32, 8]): its pieces hold 128 of its 256 elements" in result.stderr
    ), result.stderr
    assert "skipping" not in result.stderr and "resumed" not in result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
    assert not out.exists()


# -- under maitre run: suspended on two replicas of two, resumed on one, every sample once ---------
MAITRE_STEPS = 60


def start_run(tmp_path: Path, *, nodes: int, resume: bool = False, every: int | None = None):
    from maitre.launch import Run, RunConfig

    lines: list[str] = []
    command = [
        sys.executable,
        str(SCRIPT),
        "--dp-shard",
        "2",
        "--steps",
        str(MAITRE_STEPS),
        "--out",
        str(tmp_path / "final.pt"),
    ]
    run = Run(
        RunConfig(
            command=command,
            min_nodes=1,
            max_nodes=3,
            local_nodes=nodes,
            nproc_per_node=2,
            nproc_per_replica=2,
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


@pytest.fixture(scope="module")
def alone_60(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "final.pt"
    run([sys.executable, str(SCRIPT), "--steps", str(MAITRE_STEPS), "--out", str(out)])
    return torch.load(out, weights_only=True)


def ledger_resumes(tmp_path: Path) -> list[int]:
    """The steps that processes resumed from, as their ledgers recorded."""
    return [
        json.loads(line)["s"]
        for path in (tmp_path / "run" / "ledger").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if json.loads(line)["k"] == "r"
    ]


@pytest.mark.timeout(180)
def test_suspended_fsdp_replicas_resume_on_fewer_with_every_sample_once(tmp_path: Path, alone_60) -> None:
    import threading
    import time

    from maitre.checkpoint.loader import newest_complete
    from maitre.runtime.ledger import audit

    first, lines = start_run(tmp_path, nodes=2)

    def suspend_at_20() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.job()["step"] < 20:
            time.sleep(0.02)
        first.request_stop("SIGTERM")

    threading.Thread(target=suspend_at_20, daemon=True).start()
    code = first.wait()
    job = first.job()
    assert code == 0 and job["state"] == "SUSPENDED", "\n".join(lines)
    newest = newest_complete(tmp_path / "ckpt")
    assert newest is not None and newest.name == fmt.step_dir_name(job["step"])
    manifest = fmt.read_manifest(newest)
    assert manifest["format"] == fmt.FORMAT_SHARDED and manifest["world_size"] == 2

    second, lines = start_run(tmp_path, nodes=1, resume=True)
    code = second.wait()
    assert code == 0, "\n".join(lines)
    assert len(second.job()["members"]) == 1
    resumed = ledger_resumes(tmp_path)
    assert 20 <= job["step"] < MAITRE_STEPS and resumed == [job["step"]] * 2, resumed
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == MAITRE_STEPS, result.describe()
    error = relative_error(torch.load(tmp_path / "final.pt", weights_only=True), alone_60)
    assert error <= 1e-10, error


@pytest.mark.timeout(180)
def test_fsdp_replicas_lost_whole_resume_from_their_newest_sharded_checkpoint(tmp_path: Path, alone_60) -> None:
    """Two replicas of two save every 10 steps; every process is killed at once; the
    replacements have no live state, so they load the newest complete checkpoint and train the
    lost steps again: every sample once, and one process's parameters."""
    import os
    import signal
    import threading
    import time

    from maitre.runtime.ledger import audit

    job_run, lines = start_run(tmp_path, nodes=2, every=10)

    def kill_everyone() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job_run.job()["step"] < 25:
            time.sleep(0.02)
        for agent in job_run.agents:
            for wid in list(agent.workers):
                for proc in agent.workers[wid].procs:  # every process of every replica
                    os.kill(proc.pid, signal.SIGKILL)

    threading.Thread(target=kill_everyone, daemon=True).start()
    code = job_run.wait()
    assert code == 0, "\n".join(lines)
    assert job_run.job()["failures"] >= 1, "\n".join(lines)
    points = ledger_resumes(tmp_path)
    assert points and all(p % 10 == 0 and p >= 20 for p in points), (points, "\n".join(lines))
    # every 10 steps, as the writing replica's interval says (the other asks for none)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [fmt.step_dir_name(s) for s in (40, 50, 60)], (
        "\n".join(lines)
    )
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == MAITRE_STEPS, result.describe()
    error = relative_error(torch.load(tmp_path / "final.pt", weights_only=True), alone_60)
    assert error <= 1e-10, error
