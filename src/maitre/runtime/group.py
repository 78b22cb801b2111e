"""One membership epoch's process group, and collectives that can be abandoned.

Every membership epoch gets a fresh ``torch.distributed`` backend (gloo on CPU, NCCL on GPUs)
built on its own store prefix ``job/<id>/e<epoch>/``, so no key of an earlier epoch can be read by a
later one. Collectives are issued asynchronously and waited on in short slices; between slices
the waiter asks whether the epoch is still open (the coordinator closes it when a member dies or
hangs). A crashed peer makes gloo raise at once; a hung one does not, and then the coordinator's
decision is what ends the wait.

A group whose collective hung is never destroyed: destroying it blocks until the backend's own
timeout. It is kept in :data:`_GRAVEYARD` (its sockets then die with the process); NCCL
communicators are aborted instead, which is the only way to free a hung one.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

# Groups set aside after their epoch ended. Never destroyed while the process lives.
_GRAVEYARD: list[object] = []


def _bury(backend: object) -> None:
    """Keep ``backend`` for the life of the process, the interpreter's exit included: a group's
    destructor waits for a collective still in flight, up to the backend's own timeout (a test
    run hung at its exit for that, when a module's globals were cleared). An extra reference
    that nothing releases keeps it; the process's end frees it all."""
    _GRAVEYARD.append(backend)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))


WAIT_SLICE = timedelta(milliseconds=50)
"""How often a waiting collective checks whether its epoch was closed."""

BACKEND_TIMEOUT = timedelta(minutes=30)
"""The backend's own timeout; maitre never relies on it (hangs are decided by the coordinator)."""


class EpochLost(Exception):
    """The membership epoch ended under a collective: a peer crashed, hung or was removed."""

    def __init__(
        self, reason: str, detected_at: float, *, unbuilt: bool = False, unreachable: list[str] | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detected_at = detected_at
        self.unbuilt = unbuilt
        """The epoch's group could not be built (its members could not all connect)."""
        self.unreachable = unreachable or []
        """The peer addresses the backend named, when it did (``remote=[...]``)."""


class EpochGroup:
    """The process group of one membership epoch.

    Args:
        backend: the ``torch.distributed`` process group (see :meth:`create`).
        rank, world_size: this member's place in the epoch.
        device: ``cpu`` (gloo) or a CUDA device (NCCL).
        epoch_closed: polled between wait slices; returns a reason once the coordinator has closed
            the epoch, else ``None``.
    """

    def __init__(
        self,
        backend: object,
        rank: int,
        world_size: int,
        device: torch.device,
        epoch_closed: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._epoch_closed = epoch_closed
        self.waiting_since: float | None = None

    @classmethod
    def create(
        cls,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        device: torch.device,
        epoch_closed: Callable[[], str | None],
    ) -> "EpochGroup":
        """A fresh backend on the epoch's own store prefix.

        Building one waits for every member to publish its address; a member that died or hung
        before it did would block the others for the backend's whole timeout. So the backend is
        built on a helper thread (the binding releases the GIL) and the wait is abandoned, like a
        collective's, once the coordinator closes the epoch; a late backend goes to the graveyard.

        Each build has a store client of its own (``store.clone()``): an abandoned builder still
        waits in a ``get`` for the missing member's address, and a client shared with it blocks
        every later request behind that wait (the next epoch's build hung for the backend's
        whole timeout: a replica of two processes whose peer replica was killed as a new epoch
        opened with it, found by tests/test_tensor_parallel.py).
        """
        prefixed = dist.PrefixStore(prefix, store.clone())
        built: dict[str, object] = {}

        def build() -> None:
            try:
                if device.type == "cuda":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = BACKEND_TIMEOUT
                    backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
                    # NCCL creates its communicator lazily, and the first collective's launch
                    # blocks until every member is there. Do that first collective here, on this
                    # thread, where waiting for a member that never comes can be abandoned.
                    probe = torch.zeros(1, device=device)
                    ar = dist.AllreduceOptions()
                    backend.allreduce([probe], ar).wait()
                    torch.cuda.current_stream(device).synchronize()
                    built["backend"] = backend
                else:
                    built["backend"] = dist.ProcessGroupGloo(prefixed, rank, world_size, BACKEND_TIMEOUT)
            except Exception as exc:  # surfaced below as a lost epoch
                built["error"] = exc
            if abandoned.is_set() and "backend" in built:
                _bury(built["backend"])

        abandoned = threading.Event()
        builder = threading.Thread(target=build, name="maitre-group-build", daemon=True)
        builder.start()
        while builder.is_alive():
            builder.join(WAIT_SLICE.total_seconds())
            closed = epoch_closed() if builder.is_alive() else None
            if closed is not None:
                abandoned.set()
                raise EpochLost(closed, time.monotonic())
        if "error" in built:
            error = str(built["error"])
            raise EpochLost(
                f"group not built: {first_line(built['error'])}",  # type: ignore[arg-type]
                time.monotonic(),
                unbuilt=True,
                unreachable=sorted(set(re.findall(r"remote=\[([^\]]{1,100})\]", error))),
            )
        return cls(built["backend"], rank, world_size, device, epoch_closed)

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        self.wait(self.allreduce_async(tensor, op))

    def allreduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> dist.Work:
        """Launch an allreduce of ``tensor`` in place; :meth:`wait` on the work it returns.
        Every member must launch the same collectives in the same order."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.backend.allreduce([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.wait(self.backend.broadcast([tensor], opts))

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work``; raise :class:`EpochLost` if a peer failed or the epoch was closed."""
        start = time.monotonic()
        self.waiting_since = start
        try:
            if self.device.type == "cuda":
                self._wait_cuda(work)
            else:
                self._wait_gloo(work)
        finally:
            self.waiting_since = None

    def _wait_gloo(self, work: dist.Work) -> None:
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:  # gloo raises RuntimeError for both timeouts and errors
                if "timed out" not in str(exc):
                    raise EpochLost(f"peer failed: {first_line(exc)}", time.monotonic()) from exc
            closed = self._epoch_closed()
            if closed is not None:
                raise EpochLost(closed, time.monotonic())

    def _wait_cuda(self, work: dist.Work) -> None:
        # NCCL's wait() only orders streams; poll completion on the CPU instead, and abort the
        # communicator (never wait on it) when the epoch is closed.
        while not work.is_completed():
            exc = work.exception() if hasattr(work, "exception") else None
            if exc is not None:
                raise EpochLost(f"peer failed: {first_line(exc)}", time.monotonic())
            closed = self._epoch_closed()
            if closed is not None:
                raise EpochLost(closed, time.monotonic())
            time.sleep(0.0002)  # (a step's host sync: a coarse poll shows in its time)
        work.wait()

    # -- end of the epoch -----------------------------------------------------------------------
    def retire(self) -> None:
        """Set the group aside for good. NCCL communicators are aborted; gloo ones are kept."""
        if self.device.type == "cuda":
            abort = getattr(self.backend, "abort", None) or getattr(self.backend, "_abort", None)
            if abort is not None:  # ~1 s even when idle (H200, NCCL 2.28): off the recovery path
                threading.Thread(target=abort, name="maitre-nccl-abort", daemon=True).start()
        _bury(self.backend)


def first_line(exc: BaseException) -> str:
    """The gist of a backend error: its first sentence, without gloo's ``[file:line]`` prefix."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0])
    return text.split(". ")[0][:120]
