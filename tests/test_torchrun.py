"""The example runs unchanged under plain torchrun (no maitre coordinator), and as one process.

Under ``torchrun --standalone --nproc-per-node 2`` the loop uses torchrun's fixed world; its final
parameters must match a single-process run with the same seed and global batch (relative error
<= 1e-5 over the finite entries: the attention mask buffer holds -inf).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLE, ROOT, TINY, example_command, relative_error

STEPS = 30
TAG_VAR = "TORCHRUN_TEST_TAG"


def _tagged_pids(tag: str) -> list[int]:
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def run_tagged(cmd: list[str], timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on a timeout, or if anything it started outlives it, kill those by pid."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1"}, **extra_env)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _tagged_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        for pid in _tagged_pids(tag):  # nothing should be left; never leak it if it is
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)



@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("single") / "final.pt"
    return run_tagged(example_command(STEPS, out), timeout=200), out


@pytest.mark.timeout(240)
def test_single_process_mode(single: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, out = single
    assert result.returncode == 0, result.stderr
    assert f"done: {STEPS} steps" in result.stdout, result.stdout
    assert out.is_file()
    state = torch.load(out, weights_only=True)
    assert "mask" in state and not torch.isfinite(state["mask"]).all()  # why only finite entries
    assert all(torch.isfinite(v).all() for k, v in state.items() if k != "mask")


@pytest.mark.timeout(420)
def test_example_under_torchrun_matches_single_process(
        tmp_path: Path, single: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    out = tmp_path / "torchrun.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--steps", str(STEPS), *TINY, "--out", str(out)]
    result = run_tagged(cmd, timeout=300, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.count(f"done: {STEPS} steps") == 1, result.stdout  # rank 0 only
    assert out.is_file()

    reference_result, reference_out = single
    assert reference_result.returncode == 0, reference_result.stderr
    got = torch.load(out, weights_only=True)
    want = torch.load(reference_out, weights_only=True)
    assert got["tok.weight"].dtype == torch.float64
    err = relative_error(got, want)
    assert err <= 1e-5, f"relative error {err:.3g} between torchrun and one process"
