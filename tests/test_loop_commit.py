"""ElasticLoop's commit after a long step: it waits for the coordinator's word (as the agent
relays it) and drops the step if the coordinator gave up on the rank's epoch meanwhile."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from maitre.runtime.group import EpochLost
from maitre.runtime.heartbeat import CoordinatorView
from maitre.runtime.loop import ElasticLoop
from maitre.runtime.streamjoin import StreamJoin

pytestmark = pytest.mark.timeout(30)


def loop_at_epoch(epoch: int, view: CoordinatorView) -> ElasticLoop:
    """Just what the step boundary reads: a group, the heartbeat's view, step times of 50 ms
    (so its stall threshold is 0.5 s)."""
    loop = ElasticLoop.__new__(ElasticLoop)
    loop.epoch, loop.group, loop._confirming = epoch, object(), False
    loop._step_times = deque([0.05] * 5)
    loop._heartbeat = SimpleNamespace(view=view)
    loop.env = SimpleNamespace(coordinator_timeout_s=20.0)
    loop.state = SimpleNamespace(step=84)
    return loop


def later(loop: ElasticLoop, delay_s: float, **view) -> threading.Thread:
    """The heartbeat thread brings a view heard after now + ``delay_s``."""

    def bring() -> None:
        time.sleep(delay_s)
        loop._heartbeat.view = CoordinatorView(heard_at=time.monotonic(), **view)

    thread = threading.Thread(target=bring, daemon=True)
    thread.start()
    return thread


def test_a_short_step_commits_without_waiting() -> None:
    loop = loop_at_epoch(1, CoordinatorView(member_epoch=1, job_state="RUNNING"))
    t0 = time.monotonic()
    loop._confirm_epoch(t0 - 0.1)
    assert time.monotonic() - t0 < 0.05


def test_a_long_step_of_a_removed_worker_is_dropped_once_the_coordinator_is_heard() -> None:
    """The cut-off rank: its collective completed when the link came back, on a view from
    before the cut; its agent then hears that it was removed."""
    loop = loop_at_epoch(1, CoordinatorView(member_epoch=1, job_state="RUNNING", heard_at=time.monotonic() - 10))
    seen_stalled = []
    later(loop, 0.3, member_epoch=1, job_state="RUNNING", stop=True)
    threading.Thread(target=lambda: (time.sleep(0.1), seen_stalled.append(loop._confirming)), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(EpochLost, match="removed this worker"):
        loop._confirm_epoch(t0 - 9.0)
    assert 0.25 < time.monotonic() - t0 < 2, "it waited for the coordinator's word"
    assert seen_stalled == [True] and not loop._confirming  # its agent beat at once meanwhile


def test_a_long_step_is_dropped_if_its_epoch_was_closed_and_commits_if_not() -> None:
    loop = loop_at_epoch(1, CoordinatorView(member_epoch=1, job_state="RUNNING", heard_at=time.monotonic() - 5))
    later(loop, 0.1, member_epoch=1, job_state="RENDEZVOUS", closed=True)
    with pytest.raises(EpochLost, match="closed the epoch"):
        loop._confirm_epoch(time.monotonic() - 2.0)

    loop = loop_at_epoch(1, CoordinatorView(member_epoch=1, job_state="RUNNING", heard_at=time.monotonic() - 5))
    later(loop, 0.1, member_epoch=1, job_state="RUNNING")
    loop._confirm_epoch(time.monotonic() - 2.0)  # still open: it commits


def test_the_last_step_stands_when_the_job_completed_meanwhile() -> None:
    """A faster member committed the last step and reported done: the job is over and every
    view is closed, but that step is the job's last, not one its peers dropped."""
    loop = loop_at_epoch(3, CoordinatorView(member_epoch=3, job_state="RUNNING", heard_at=time.monotonic() - 5))
    later(loop, 0.1, member_epoch=3, job_state="COMPLETED", closed=True, stop=True)
    loop._confirm_epoch(time.monotonic() - 2.0)


def test_a_process_left_behind_in_an_older_epoch_abandons_it() -> None:
    """A replica's processes share one worker: if one went on to a newer epoch while another
    still waits to build the old one's group, that wait ends (it would never complete)."""
    loop = loop_at_epoch(2, CoordinatorView(member_epoch=3, job_state="RUNNING", heard_at=time.monotonic()))
    assert loop._epoch_closed() == "the coordinator moved this worker to a newer epoch"
    loop = loop_at_epoch(3, CoordinatorView(member_epoch=3, job_state="RUNNING", heard_at=time.monotonic()))
    assert loop._epoch_closed() is None  # its own epoch, open
    loop = loop_at_epoch(0, CoordinatorView(member_epoch=1, job_state="RUNNING"))
    assert loop._epoch_closed() is None  # a joiner, before its first epoch


class _Writer:
    """A checkpointer whose writer is always busy with an earlier save (what it is asked)."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(save_final=True)
        self.busy, self.saved, self.prepared = True, [], 0

    def save(self, state, *, step: int, rank: int, world_size: int, token: int, updated=None) -> float:
        self.saved.append(step)
        return 0.0

    def prepare(self, state, *, rank: int, world_size: int) -> None:
        self.prepared += 1


def loop_saving(step: int, max_steps: int) -> tuple[ElasticLoop, _Writer]:
    loop = ElasticLoop.__new__(ElasticLoop)
    loop._ledger = loop._recovery = loop._reporter = loop.replica = None
    loop._join = StreamJoin()  # (no listener: it trains)
    loop.rank, loop.world_size, loop._max_steps = 0, 1, max_steps  # (it writes part 0 of 1)
    loop.device = torch.device("cpu")
    loop.checkpointer = writer = _Writer()
    loop.state = SimpleNamespace(step=step, state_dict=dict)
    return loop, writer


def test_a_busy_writer_vetoes_a_save_but_not_the_last_steps() -> None:
    """A save asked while a rank still writes the previous one waits for the next step; the
    last step has none, so its save waits for the writer instead of being lost."""

    from maitre.runtime.control import SLOTS, Slot

    control = torch.zeros(SLOTS)
    control[Slot.SAVE], control[Slot.BUSY] = 2.0, 1.0  # due on two ranks, one of them still writing
    loop, writer = loop_saving(step=5, max_steps=6)
    loop._commit(SimpleNamespace(step=5), control, stop=False)
    assert writer.saved == [] and writer.prepared == 1
    loop, writer = loop_saving(step=6, max_steps=6)
    loop._commit(SimpleNamespace(step=6), control, stop=False)
    assert writer.saved == [6]
    control[Slot.SAVE] = 0.0  # not due (no save_final): nothing, busy or not
    loop, writer = loop_saving(step=6, max_steps=6)
    writer.cfg.save_final = False
    loop._commit(SimpleNamespace(step=6), control, stop=False)
    assert writer.saved == []
