"""EpochGroup against real gloo, ranks as threads (each with its own store client)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from maitre.runtime.group import EpochGroup, EpochLost

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    yield lambda: dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                timeout=timedelta(seconds=30))


def closes_after(seconds: float):
    deadline = time.monotonic() + seconds
    return lambda: "closed by the test" if time.monotonic() > deadline else None


def test_building_a_group_is_abandoned_when_the_epoch_closes(store) -> None:
    """Rank 1 never shows up: rank 0 must not wait for the backend's 30-minute timeout."""
    t0 = time.monotonic()
    with pytest.raises(EpochLost, match="closed by the test"):
        EpochGroup.create(store(), "job/t/e1/", 0, 2, CPU, closes_after(0.3))
    assert time.monotonic() - t0 < 5


def test_collective_works_then_a_missing_peer_is_abandoned(store) -> None:
    groups: dict[int, EpochGroup] = {}

    def member(rank: int) -> None:
        groups[rank] = EpochGroup.create(store(), "job/t/e2/", rank, 2, CPU, closes_after(30))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    results = {}

    def reduce(rank: int) -> None:
        x = torch.full((4,), float(rank + 1))
        groups[rank].allreduce(x)
        results[rank] = x.tolist()

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {0: [3.0] * 4, 1: [3.0] * 4}

    # Rank 1 stops taking part (as if SIGSTOPped): rank 0's wait ends when the epoch closes.
    g0 = groups[0]
    g0._epoch_closed = closes_after(0.3)
    t0 = time.monotonic()
    with pytest.raises(EpochLost, match="closed by the test"):
        g0.allreduce(torch.ones(4))
    assert 0.25 < time.monotonic() - t0 < 5
    g0.retire()  # set aside, not destroyed: this must not block either
