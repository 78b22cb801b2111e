"""Checkpointer: what the training loop calls. Snapshot now, persist in the background.

The loop asks :meth:`Checkpointer.due` at each step boundary (the answer rides in the step's
allreduce, so every rank saves at the same step), calls :meth:`save` after the step committed,
and :meth:`load_latest` when a job starts with no live state to take from a peer. ``save``
blocks only for the copy into reused host memory (and, when the previous save is still being
written, for that to finish: the wait counts as cost, so the interval backs off). From a GPU the
copy runs on while the next step computes; the loop calls :meth:`fence` before the next step
and before the next update, where the device waits for what it is about to write.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from maitre.checkpoint import loader
from maitre.checkpoint.policy import IntervalConfig, IntervalPolicy
from maitre.checkpoint.snapshot import Snapshot, SnapshotBuffers, part_bytes
from maitre.checkpoint.writer import SaveResult, Writer, fault_point
from maitre.protocol import CHECKPOINT_DIR as DIR_ENV
from maitre.protocol import CHECKPOINT_EVERY as EVERY_ENV
from maitre.protocol import CHECKPOINT_KEEP as KEEP_ENV
from maitre.protocol import MTBF_S as MTBF_ENV


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


KEEP = 3
"""Complete checkpoints kept by default."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    directory: Path
    """Root of this job's checkpoints (shared by all ranks: a shared file system in a cluster)."""
    interval: IntervalConfig = field(default_factory=IntervalConfig)
    keep: int = KEEP
    """Complete checkpoints kept; older ones are deleted once a newer one is in place."""
    resume: bool = True
    """Load the newest complete checkpoint when the job starts with no live state."""
    save_final: bool = True
    """Write a checkpoint at the last step, so a longer run can continue from it."""
    commit_timeout_s: float = 600.0
    """The longest the committing rank waits for the others' parts before giving the save up
    (it waits less when its own part was quick: see ``writer.COMMIT_WAIT_FLOOR_S``)."""

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if self.commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be positive, got {self.commit_timeout_s}")

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "CheckpointConfig | None":
        """The configuration ``maitre run --checkpoint-dir`` passes to its workers, if any."""
        env = os.environ if env is None else env
        if not env.get(DIR_ENV):
            return None
        every = env.get(EVERY_ENV)
        mtbf = env.get(MTBF_ENV)
        keep = int(env[KEEP_ENV]) if env.get(KEEP_ENV) else KEEP
        return cls(
            directory=Path(env[DIR_ENV]),
            keep=keep,
            interval=IntervalConfig(every_steps=int(every) if every else None, mtbf_s=float(mtbf) if mtbf else None),
        )


class Checkpointer:
    """One per training process; see the module docstring."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        meta: dict[str, Any] | None = None,
        log: Callable[[str], None] = _stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.meta = meta or {}
        self.log = log
        self.clock = clock
        self.policy = IntervalPolicy(cfg.interval, clock())
        self._buffers = SnapshotBuffers()
        self._writer: Writer | None = None
        self._reported = 0
        self._prepared_for: tuple[int, int] | None = None
        self.results: list[SaveResult] = []
        """Every finished save of this process, oldest first."""
        self.on_result: Callable[[SaveResult], None] | None = None
        """Called with each finished save, on the thread that collects it (the training loop's,
        at its next step boundary): the committer's result tells the coordinator (telemetry)."""
        self._interval: tuple[int | None, float | None] = (None, None)
        self._copying: Snapshot | None = None

    # -- saving ----------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._writer is not None and self._writer.busy

    def due(self, step: int) -> bool:
        return self.policy.due(step, self.clock())

    def record_step(self, duration_s: float) -> None:
        self.policy.record_step(duration_s, self.busy)
        self._collect()

    def save(
        self,
        state: dict[str, Any] | Callable[[], dict[str, Any]],
        *,
        step: int,
        rank: int,
        world_size: int,
        token: int,
        updated: frozenset[int] | None = None,
    ) -> float:
        """Snapshot ``state`` (a TrainState tree, or a function returning one) and hand it to the
        writer; returns the seconds this blocked. With ``updated`` (the storages only the
        optimizer's update writes: :func:`~maitre.runtime.state.updated_storages`), a copy
        from a GPU runs on after this returns, and the caller calls :meth:`fence` before it
        writes the state; without, the copy is done when this returns."""
        started = self.clock()
        writer = self._writer_started()
        writer.wait()
        self._collect()
        tree = state() if callable(state) else state
        snap = self._buffers.take(
            tree,
            step=step,
            token=token,
            rank=rank,
            world_size=world_size,
            halfway=lambda: fault_point("snapshot", writer.saves + 1),
            updated=updated,
        )
        self._copying = snap if snap.copy is not None else None
        snap.meta = dict(self.meta)
        snap.block_s = self.clock() - started
        every = self.cfg.interval.every_steps
        self._interval = (every, None) if every is not None else (None, self.policy.interval_s())
        writer.submit(snap)
        self.policy.started(step, self.clock(), snap.block_s)
        return snap.block_s

    def fence(self, *, update: bool) -> None:
        """The live state is about to be written: by the next step (``update=False``: module
        buffers, registered state) or by the update (``update=True``: parameters, optimizer
        state). The device waits for the last save's copy of those, if it still runs; the host
        does not wait. Cheap when there is nothing to wait for."""
        if self._copying is not None:
            self._copying.fence(update=update)
            if update:
                self._copying = None

    def saved_elsewhere(self, step: int) -> None:
        """The job saved ``step`` without this process (another replica wrote its shards): the
        interval counts from there, should this process be a writer later."""
        self.policy.resumed(step, self.clock())

    def prepare(self, state: Callable[[], dict[str, Any]], *, rank: int, world_size: int) -> None:
        """Size the host buffer for this rank's part at this world size, in the background, so
        that no save pays for allocating it. Cheap when already done for (rank, world size)."""
        if self._prepared_for == (rank, world_size) or self.busy:
            return
        need, pin = part_bytes(state(), rank, world_size)
        if need > self._buffers.capacity:
            self._writer_started().submit(lambda: self._buffers.reserve(need, pin))
        self._prepared_for = (rank, world_size)

    def abandon(self, reason: str) -> None:
        """The save in flight will not get every rank's part (a rank died under it): as its
        committer, give it up now rather than wait (see :meth:`Writer.abandon`)."""
        if self._writer is not None:
            self._writer.abandon(reason)

    def wait(self) -> list[SaveResult]:
        """Block until the save in flight is durable (or failed); returns results not yet seen."""
        if self._writer is None:
            return []
        self._writer.wait()
        return self._collect()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._collect()
            self._writer = None
            self._reported = 0

    def _writer_started(self) -> Writer:
        if self._writer is None:
            self.cfg.directory.mkdir(parents=True, exist_ok=True)
            self._writer = Writer(
                self.cfg.directory, keep=self.cfg.keep, commit_timeout_s=self.cfg.commit_timeout_s, log=self.log
            )
        return self._writer

    def _collect(self) -> list[SaveResult]:
        if self._writer is None:
            return []
        fresh = self._writer.results[self._reported :]
        if fresh:
            self._reported += len(fresh)
            self.results += fresh
            for result in fresh:  # (one save at a time: the interval of the last one started)
                result.interval_steps, result.interval_s = self._interval
            self.policy.finished()
            if self.on_result is not None:
                for result in fresh:
                    self.on_result(result)
        return fresh

    # -- loading ---------------------------------------------------------------------------------
    def load_latest(
        self, rank: int, *, mesh_of: loader.MeshOf | None = None, agree: Callable[[bool], bool] | None = None
    ) -> loader.Loaded | None:
        """The newest checkpoint that verifies (see :func:`loader.load_latest`), sharded tensors
        cut for this process's mesh (``mesh_of``)."""
        loaded = loader.load_latest(self.cfg.directory, rank, self.log, mesh_of=mesh_of, agree=agree)
        if loaded is not None:
            self.policy.resumed(loaded.step, self.clock())
        return loaded
