"""Shared fixtures: a clean distributed environment for every test, and elastic runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_dist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees (or leaks) torchrun's or maitre's variables."""
    for key in list(os.environ):
        if key in _DIST_VARS or key.startswith(("TORCHELASTIC_", "MAITRE_")):
            monkeypatch.delenv(key, raising=False)
    torch.set_num_threads(1)


# A tiny float64 configuration of the example: fast on 2 cores, exact enough for 1e-5 checks.
TINY = ["--dtype", "float64", "--d-model", "16", "--layers", "1", "--heads", "2", "--block", "16",
        "--global-batch", "12", "--micro-batch", "4", "--log-every", "1000"]


def example_command(steps: int, out: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps), *TINY]
    return cmd + (["--out", str(out)] if out is not None else [])

def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every finite entry of ``b`` (a must be finite in the same places)."""
    assert a.keys() == b.keys()
    num = den = 0.0
    for k in b:
        finite = torch.isfinite(b[k])
        assert torch.equal(finite, torch.isfinite(a[k])), k
        num += float((a[k][finite].double() - b[k][finite].double()).pow(2).sum())
        den += float(b[k][finite].double().pow(2).sum())
    return (num / den) ** 0.5
