"""The example runs unchanged under plain torchrun (no maitre coordinator), and as one process.

Under ``torchrun --standalone --nproc-per-node 2`` the loop uses torchrun's fixed world; its final
parameters must match a single-process run with the same seed and global batch (relative error
<= 1e-5 over the finite entries: the attention mask buffer holds -inf), also when each rank reads
its samples through maitre's loader with data workers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLE, TINY, audit_records, example_command, relative_error, run_tagged

STEPS = 30


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
@pytest.mark.parametrize("data_workers", [None, 2])
def test_example_under_torchrun_matches_single_process(
    tmp_path: Path, single: tuple[subprocess.CompletedProcess[str], Path], data_workers: int | None
) -> None:
    """With ``data_workers``, each rank reads its samples through ``maitre.data.Loader`` with 2
    worker processes: every step's samples once (the script's own record), and the same
    parameters as one process that indexes the corpus in place."""
    out = tmp_path / "torchrun.pt"
    records = tmp_path / "records"
    loader = [] if data_workers is None else ["--data-workers", str(data_workers), "--record", str(records)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        *TINY,
        *loader,
        "--out",
        str(out),
    ]
    result = run_tagged(cmd, timeout=300, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.count(f"done: {STEPS} steps") == 1, result.stdout  # rank 0 only
    assert out.is_file()
    if data_workers is not None:
        audit_records(records, steps=STEPS, complete=False)
        assert len(list(records.glob("*.jsonl"))) == 2  # (a record per rank)

    reference_result, reference_out = single
    assert reference_result.returncode == 0, reference_result.stderr
    got = torch.load(out, weights_only=True)
    want = torch.load(reference_out, weights_only=True)
    assert got["tok.weight"].dtype == torch.float64
    err = relative_error(got, want)
    assert err <= 1e-5, f"relative error {err:.3g} between torchrun and one process"
