"""The persist phase: a background thread writes a snapshot and, on the committing rank, makes
the checkpoint durable and visible in one atomic step.

Every rank writes its files into the same temporary directory ``.tmp-step-<step>-<token>`` (the
token is drawn by the committing rank and agreed in the step's allreduce, so a half-written
directory of an earlier attempt at the same step is never mixed in), fsyncs them, then publishes
a ``rank-<r>.done`` note listing its files with their sizes and xxh3-64 checksums (or a
``rank-<r>.failed`` note with its error). The committer (rank 0 of the saving epoch) waits for
every rank's note, writes ``state.json`` and the manifest, fsyncs them and the directory, renames
the directory to ``step-<step>`` and fsyncs the root. A crash anywhere before the rename leaves
only a ``.tmp-*`` directory, which loaders ignore and later saves delete; a crash after it leaves
a complete checkpoint. Old checkpoints are deleted only after a newer one is in place.

With sharded state the notes also say where each rank's pieces lie and of which state they are:
the committer checks that every rank saved the same state and that the pieces cover each sharded
tensor exactly, and lists them in ``state.json``; a save that fails the check is not committed.

The thread runs at a lower CPU priority than training (its own nice value, Linux) and all the
work it does in Python releases the GIL (``os.write``, ``fsync``, xxh3 on large buffers).
A failed save (disk full, file size limit, a rank that never reports) is logged and recorded;
training goes on and the previous checkpoint stays as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import xxhash

from maitre.checkpoint import format as fmt
from maitre.checkpoint import reshard
from maitre.checkpoint.snapshot import Snapshot
from maitre.protocol import CHECKPOINT_FAULT as FAULT_ENV

# FAULT_ENV, for tests: ``PHASE@N`` kills this process with SIGKILL at PHASE of its N-th save
# (1-based). Phases: ``snapshot`` (halfway through the copy), ``mid_file`` (halfway through the
# shard), ``between_files``, ``before_manifest``, ``before_rename``, ``after_rename``.
PHASES = ("snapshot", "mid_file", "between_files", "before_manifest", "before_rename", "after_rename")
_POLL_S = 0.02
COMMIT_WAIT_FLOOR_S = 30.0
COMMIT_WAIT_FACTOR = 20.0
"""The committer waits for the other ranks' parts at most max(floor, factor x its own part's
time) (and never past ``commit_timeout_s``): every rank writes its part of a save at once (a
busy writer vetoes the save for all), so a part that takes far longer than this rank's is one
whose rank is gone, killed mid-save, and waiting it out would hold every later save back."""


def fault_point(phase: str, save_number: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, nth = spec.partition("@")
    if want == phase and int(nth or 1) == save_number:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(slots=True)
class SaveResult:
    step: int
    path: Path | None
    """The complete checkpoint (committer only; None on other ranks and on failure)."""
    error: str | None
    block_s: float
    persist_s: float
    """From the hand-off to the end of this rank's part (on the committer: to the rename)."""
    nbytes: int
    """This rank's part."""
    rank: int = 0
    world_size: int = 1
    total_bytes: int = 0
    """Every file of the checkpoint, all ranks' (committer only, once it is complete)."""
    interval_steps: int | None = None
    interval_s: float | None = None
    """The interval the save was taken at (filled in by the :class:`Checkpointer`)."""

    @property
    def committer(self) -> bool:
        """This rank made the checkpoint complete (or failed to): it speaks for the save."""
        return self.rank == 0


class Writer:
    """One background thread that persists snapshots one at a time."""

    def __init__(self, root: Path, *, keep: int, commit_timeout_s: float, log: Callable[[str], None]) -> None:
        self.root = root
        self.keep = keep
        self.commit_timeout_s = commit_timeout_s
        self.log = log
        self.results: list[SaveResult] = []
        self.saves = 0
        self._job: Snapshot | Callable[[], None] | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._started = self._durable_at = 0.0
        self._total_bytes = 0
        self._abandoned: str | None = None
        """Why the save in flight is given up (its committer waits for no more parts)."""
        self._thread = threading.Thread(target=self._run, name="maitre-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._job is not None

    def submit(self, job: Snapshot | Callable[[], None]) -> None:
        """Hand a snapshot (or a chore, such as growing the buffers) over; the caller must have
        waited for the previous job (:meth:`wait`)."""
        with self._cv:
            if self._job is not None:
                raise RuntimeError("a checkpoint is still being written")
            self._job, self._abandoned = job, None
            self.saves += isinstance(job, Snapshot)
            self._cv.notify_all()

    def abandon(self, reason: str) -> None:
        """The save in flight, if its commit still waits for other ranks' parts, fails now with
        ``reason`` (its epoch was lost: a rank that died under it never sends its part)."""
        with self._cv:
            if self._job is not None:
                self._abandoned = reason

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until no save is in flight; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._job is None, timeout_s)

    def close(self) -> None:
        self.wait()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        try:  # below training, so its CPU use slows training as little as it can
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                snap = self._job
            if not isinstance(snap, Snapshot):
                try:
                    snap()
                except Exception as exc:  # noqa: BLE001 -- the save itself will try again
                    self.log(f"maitre: checkpoint writer: {type(exc).__name__}: {exc}")
                with self._cv:
                    self._job = None
                    self._cv.notify_all()
                continue
            self._started = time.monotonic()
            self._durable_at = 0.0
            self._total_bytes = 0
            try:
                path = self._persist(snap)
                error = None
            except Exception as exc:  # noqa: BLE001 -- any failure of a save must not stop training
                path, error = None, f"{type(exc).__name__}: {exc}"
                self.log(
                    f"maitre: checkpoint at step {snap.step} failed on rank {snap.rank}: "
                    f"{error}; training goes on, earlier checkpoints are untouched"
                )
            ended = self._durable_at or time.monotonic()
            result = SaveResult(
                snap.step,
                path,
                error,
                snap.block_s,
                ended - self._started,
                len(snap.data),
                rank=snap.rank,
                world_size=snap.world_size,
                total_bytes=self._total_bytes,
            )
            with self._cv:
                self.results.append(result)
                self._job = None
                self._cv.notify_all()

    # -- the phases ------------------------------------------------------------------------------
    def _persist(self, snap: Snapshot) -> Path | None:
        n = self.saves
        began = time.monotonic()
        snap.wait_copied()  # (from a GPU the copy may still be running)
        tmp = self.root / fmt.tmp_dir_name(snap.step, snap.token)
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            files: dict[str, dict[str, int | str]] = {}
            if snap.entries:
                name = fmt.shard_name(snap.rank)
                header = fmt.safetensors_header(snap.entries, {"format": fmt.FORMAT})
                half = len(snap.data) // 2
                chunks: list[memoryview | bytes] = [header, snap.data[:half], snap.data[half:]]
                parts = _with_fault(chunks, 2, "mid_file", n)
                size, digest = fmt.write_file(tmp / name, parts)
                files[name] = {"size": size, "xxh3_64": digest}
            fault_point("between_files", n)
            name = fmt.rank_name(snap.rank)
            size, digest = fmt.write_json(tmp / name, snap.rank_state)
            files[name] = {"size": size, "xxh3_64": digest}
            if snap.rank != 0:
                _publish(
                    tmp / f"rank-{snap.rank:05d}.done",
                    {"files": files, "layout": _layout(snap), "pieces": _pieces(snap)},
                )
                self._durable_at = time.monotonic()
                return None
            return self._commit(snap, tmp, files, n, time.monotonic() - began)
        except BaseException as exc:
            if snap.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # tell the committer at once rather than let it wait out its timeout
                try:
                    _publish(tmp / f"rank-{snap.rank:05d}.failed", {"error": str(exc)})
                except OSError:
                    pass
            raise

    def _commit(self, snap: Snapshot, tmp: Path, files: dict[str, dict[str, int | str]], n: int, own_s: float) -> Path:
        try:
            deadline = time.monotonic() + min(
                self.commit_timeout_s, max(COMMIT_WAIT_FLOOR_S, COMMIT_WAIT_FACTOR * own_s)
            )
            layout, pieces = _layout(snap), {0: _pieces(snap)}
            for r in range(1, snap.world_size):
                note = _await_rank(tmp, r, deadline, lambda: self._abandoned)
                if note.get("layout") != layout:
                    raise RuntimeError(f"rank {r} saved other tensors than rank 0 (another state)")
                files.update(note["files"])
                pieces[r] = note.get("pieces", {})
            for name, info in files.items():  # every rank's files are in place, whole
                if (tmp / name).stat().st_size != info["size"]:
                    raise RuntimeError(f"{name} is not the size its rank wrote")
            tensors, sharded = _listed(snap, pieces)
            state = {"skeleton": snap.skeleton, "tensors": tensors, **snap.meta}
            size, digest = fmt.write_json(tmp / fmt.STATE, state)
            files[fmt.STATE] = {"size": size, "xxh3_64": digest}
            fault_point("before_manifest", n)
            body = fmt.manifest_body(
                snap.step,
                snap.world_size,
                files,
                {"created_unix_s": round(time.time(), 3), **snap.meta},
                sharded=sharded,
            )
            fmt.write_manifest(tmp / fmt.MANIFEST, body)
            for done in tmp.glob("rank-*.done"):
                done.unlink()
            fmt.fsync_dir(tmp)
            fault_point("before_rename", n)
            final = self.root / fmt.step_dir_name(snap.step)
            if final.exists():  # never reuse or overwrite a checkpoint that verifies
                self._set_aside(final)
            os.rename(tmp, final)
            fmt.fsync_dir(self.root)
            self._durable_at = time.monotonic()
            self._total_bytes = (
                sum(int(info["size"]) for info in files.values()) + (final / fmt.MANIFEST).stat().st_size
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fault_point("after_rename", n)
        self._retire(snap.step)
        return final

    def _set_aside(self, final: Path) -> None:
        """A step directory of the step being saved is there: a run that resumed from an older
        checkpoint, because this one did not verify, is saving the same step again. One that
        verifies stays (FileExistsError: this save fails, training goes on); one that does not
        is renamed out of the ``step-*`` namespace, kept for a look until it is retired."""
        try:
            fmt.verify(final)
        except fmt.CorruptCheckpoint as why:
            aside = final.with_name(f"{fmt.CORRUPT_PREFIX}{final.name}-{time.time_ns()}")
            os.rename(final, aside)
            fmt.fsync_dir(self.root)
            self.log(
                f"maitre: checkpoint {final.name} did not verify ({why}): set aside as "
                f"{aside.name}, replaced by this save"
            )
            return
        raise FileExistsError(f"{final} already exists")

    def _retire(self, newest: int) -> None:
        """Keep the newest ``keep`` checkpoints; drop temporary directories of older saves.
        A checkpoint is renamed out of the ``step-*`` namespace before it is deleted, so a kill
        halfway through the deletion never leaves a half-deleted ``step-*`` behind."""
        for _, path in fmt.list_steps(self.root)[self.keep :]:
            trash = path.with_name(f"{fmt.TRASH_PREFIX}{path.name}")
            try:
                os.rename(path, trash)
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
        kept = [step for step, _ in fmt.list_steps(self.root)]
        oldest = min(kept, default=newest)
        for path in self.root.iterdir():
            m = fmt.TMP_DIR.fullmatch(path.name)
            if (m and int(m.group(1)) <= newest) or path.name.startswith(fmt.TRASH_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
            elif (c := fmt.CORRUPT_DIR.fullmatch(path.name)) and int(c.group(1)) < oldest:
                shutil.rmtree(path, ignore_errors=True)


def _publish(path: Path, obj: object) -> None:
    """Write a small note so that it appears whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fmt.write_json(partial, obj)
    os.rename(partial, path)


def _layout(snap: Snapshot) -> str:
    """A digest of the state's tensor list (dtype, shape, who writes each), which every rank of
    a save computed alike unless they hold different states."""
    return xxhash.xxh3_64_hexdigest(json.dumps(snap.tensors, separators=(",", ":")).encode())


def _pieces(snap: Snapshot) -> dict[str, list[list[int]]]:
    return {str(i): [list(offsets), list(shape)] for i, (offsets, shape) in snap.pieces.items()}


def _listed(snap: Snapshot, pieces: dict[int, dict[str, list[list[int]]]]) -> tuple[list[list[Any]], bool]:
    """The tensor list of ``state.json``: each sharded tensor with every rank's pieces, checked
    to cover it exactly; and whether there is any sharded tensor."""
    tensors = [list(spec) for spec in snap.tensors]
    sharded = [i for i, spec in enumerate(tensors) if isinstance(spec[2], list)]
    for i in sharded:
        tensors[i][2] = []
    for r in sorted(pieces):
        for key, (offsets, shape) in pieces[r].items():
            tensors[int(key)][2].append([r, offsets, shape])
    for i in sharded:
        _, shape, listed = tensors[i]
        reason = reshard.check_cover(shape, [(tuple(o), tuple(s)) for _, o, s in listed])
        if reason is not None:
            raise RuntimeError(f"the pieces of tensor {i} do not cover it: {reason}")
    return tensors, bool(sharded)


def _await_rank(
    tmp: Path, rank: int, deadline: float, abandoned: Callable[[], str | None] = lambda: None
) -> dict[str, Any]:
    done, failed = tmp / f"rank-{rank:05d}.done", tmp / f"rank-{rank:05d}.failed"
    while True:
        if done.exists():
            note: dict[str, Any] = json.loads(done.read_bytes())
            return note
        if failed.exists():
            error = json.loads(failed.read_bytes()).get("error", "?")
            raise RuntimeError(f"rank {rank} could not write its part: {error}")
        if (why := abandoned()) is not None:
            raise RuntimeError(f"given up waiting for rank {rank}'s part: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} did not finish its part in time")
        time.sleep(_POLL_S)


T = TypeVar("T")


def _with_fault(parts: list[T], at: int, phase: str, n: int) -> Iterator[T]:
    for i, part in enumerate(parts):
        if i == at:
            fault_point(phase, n)
        yield part
