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
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield lambda: dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))


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


_EXIT_WITH_A_COLLECTIVE_IN_FLIGHT = """
import threading, torch, torch.distributed as dist
from datetime import timedelta
from maitre.runtime.group import EpochGroup
torch.set_num_threads(1)
server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
groups = {}
def build(rank):
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    groups[rank] = EpochGroup.create(store, "t/", rank, 2, torch.device("cpu"), lambda: None)
threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
[t.start() for t in threads]; [t.join() for t in threads]
groups[0].allreduce_async(torch.ones(1000))  # its peer never takes part
groups[1].retire()
groups[0].retire()
print("exiting", flush=True)
"""


def test_a_process_exits_at_once_with_a_retired_group_whose_collective_is_in_flight() -> None:
    """A retired group is never destroyed, not even by the interpreter's exit: its destructor
    would wait for the collective in flight for the backend's whole timeout (30 min; a test run
    hung at its exit so)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_COLLECTIVE_IN_FLIGHT], capture_output=True, text=True, timeout=45
    )
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr
