"""The elastic loader: torch's DataLoader (worker processes, prefetch, pinned memory, collate)
fed with exactly the samples the loop trains, step after step, at any world size.

The loop decides which samples a step trains (:class:`~maitre.runtime.sampler.ElasticSampler`:
the committed cursor, the rank and the world size of the membership epoch); the loader only
serves them. It asks the loop for the micro-batches of the steps to come
(:meth:`ElasticLoop.upcoming`) and hands that plan to a DataLoader as its batch sampler, so the
workers load ahead along it. Every micro-batch a step asks for is checked against the plan's
head: the same indices, the prefetched batch is used; other indices (a resize changed the
shares, a step was dropped and is trained again, the job resumed elsewhere), the prefetched
batches are dropped with their workers and a new plan starts from the step being trained. A
data worker that dies (SIGKILL, the OOM killer) is replaced the same way and its batches are
loaded again. Nothing here is state: the cursor is the sampler's, committed with each step, so
what a joiner receives and a checkpoint holds is unchanged and O(1), and a resume at any world
size or worker count loads its first batch without reading the skipped data.

    loader = maitre.data.Loader(dataset, loop, num_workers=4, pin_memory=True)
    for batch in loop.run(max_steps):
        for x, y in loader(batch):           # one collated micro-batch at a time
            batch.backward(loss_fn(model(x), y))

An exception raised by the dataset (a corrupt shard: :class:`maitre.data.DataError`) reaches the
training script as it would from a DataLoader: the job stops at that step, its committed state
intact (under ``maitre run`` the coordinator fails the job at once on a :class:`DataError`: no
peer or replacement is handed the same record; another exception is a worker's crash, retried
as any other, until every member fails with it). With ``on_error="skip"`` a record that
raises is left out instead: the rest of its micro-batch is collated without it, the step's mean
is over the samples trained (:meth:`Batch.skip <maitre.runtime.loop.Batch.skip>`: the same at
any world size), each skip is printed with its error (the file and byte offset, for shards) and
counted (``loader.skipped`` here, ``loop.skipped`` over all ranks, committed with the steps);
past ``max_skipped`` in the whole job the error stops it (a :class:`DataError`), so a bug that
fails every record is not trained around.
"""

from __future__ import annotations

import itertools
import os
import select
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator

from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils import signal_handling as _signals

from maitre import procs
from maitre.data.shards import DataError
from maitre.protocol import DATA_WORKER_NAME

if TYPE_CHECKING:
    from maitre.runtime.loop import Batch, ElasticLoop


class _Plan:
    """The DataLoader's batch sampler: the micro-batches the steps to come will ask for. It
    remembers what it issued, in order, so that each batch coming back is known by its indices
    (a DataLoader returns batches in the order it drew their indices)."""

    def __init__(self) -> None:
        self.source: Iterator[list[int]] = iter(())
        self.issued: deque[list[int]] = deque()
        self._peeked: deque[list[int]] = deque()

    def restart(self, source: Iterator[list[int]]) -> None:
        self.source = source
        self.issued.clear()
        self._peeked.clear()

    def head(self) -> list[int] | None:
        """The indices of the next batch the DataLoader will return (None: the plan ended)."""
        if self.issued:
            return self.issued[0]
        if not self._peeked:
            nxt = next(self.source, None)
            if nxt is None:
                return None
            self._peeked.append(nxt)
        return self._peeked[0]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            item = self._peeked.popleft() if self._peeked else next(self.source, None)
            if item is None:
                return
            self.issued.append(item)
            yield item


class _WorkerInit:
    """Each data worker's start: its name, a watch on the training process that owns it, then
    the user's ``worker_init_fn``.

    The name (``maitre-data-N`` in ``ps`` and ``top``: :data:`maitre.protocol.DATA_WORKER_NAME`)
    is how ``maitre run --events kill-data`` tells a data worker from the other processes a
    training process starts (the fork server its data workers are children of under forkserver,
    multiprocessing's resource tracker), wherever it sits below the training process.

    torch's own watchdog ends a data worker whose *parent* is gone. Started by fork the parent
    is the training process; started by forkserver or spawn it is not (a worker that maitre's
    agent started warm has forkserver as its default: its data workers do not inherit its
    sockets, so its peers see it die at once), and a SIGKILLed training process would leave
    its data workers, and the fork server they keep alive, running for good."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.owner = os.getpid()
        self.user = user

    def __call__(self, worker_id: int) -> None:
        procs.name_self(f"{DATA_WORKER_NAME}-{worker_id}")
        try:
            owner = os.pidfd_open(self.owner)
        except ProcessLookupError:  # gone already
            os._exit(0)
        except (AttributeError, OSError):  # no pidfd here: torch's watchdog alone
            owner = None
        if owner is not None:

            def watch() -> None:
                select.select([owner], [], [])  # readable once the owner has exited
                os._exit(0)

            threading.Thread(target=watch, name="maitre-owner-watch", daemon=True).start()
        if self.user is not None:
            self.user(worker_id)


class _Skipped:
    """A record the dataset raised on (``on_error="skip"``), in place of its sample."""

    __slots__ = ("index", "error")

    def __init__(self, index: int, error: str) -> None:
        self.index, self.error = index, error


class _Guarded(Dataset):
    """The user's dataset, each record read on its own: one that raises becomes a
    :class:`_Skipped` (no ``__getitems__``: one bad record must not cost its neighbours)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:  # noqa: BLE001 (the user asked for any bad record skipped)
            return _Skipped(index, f"{type(exc).__name__}: {exc}")


class _Collate:
    """The user's collate over the records that loaded; returns (data or None, the skipped
    records' (index, error))."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate

    def __call__(self, items: list[Any]) -> tuple[Any, list[tuple[int, str]]]:
        good = [x for x in items if not isinstance(x, _Skipped)]
        bad = [(x.index, x.error) for x in items if isinstance(x, _Skipped)]
        return (self.collate(good) if good else None), bad


class Loader:
    """Serves each step's micro-batches from ``dataset`` through a DataLoader.

    Args:
        dataset: any map-style dataset (``__getitem__`` and ``__len__``: a Hugging Face
            ``datasets.Dataset``, :class:`~maitre.data.TokenShards`...) of the loop's sampler.
        loop: the :class:`~maitre.runtime.loop.ElasticLoop` whose steps it feeds.
        num_workers: data worker processes, as torch's DataLoader's (0: none, the records
            load in the training process).
        prefetch_factor: batches loaded ahead per worker, as torch's DataLoader's.
        pin_memory: as torch's DataLoader's.
        collate_fn: as torch's DataLoader's.
        worker_init_fn: as torch's DataLoader's.
        multiprocessing_context: as torch's DataLoader's.
        timeout: as torch's DataLoader's.
        max_worker_restarts: data workers lost (killed, out of memory) before the error is
            raised to the script instead of replacing them.
        on_error: ``"raise"`` (a record that raises stops the job at that step) or ``"skip"``
            (it is left out and counted; a micro-batch whose every record was skipped comes
            as None).
        max_skipped: records skipped in the whole job (every rank, across restarts and resumes:
            ``loop.skipped`` and this step's) before the next one's error is raised after all,
            as a :class:`DataError`.
    """

    def __init__(
        self,
        dataset: Dataset,
        loop: "ElasticLoop",
        *,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        max_worker_restarts: int = 10,
        on_error: str = "raise",
        max_skipped: int = 1000,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be 0 or more, got {num_workers}")
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError("prefetch_factor needs worker processes (num_workers > 0)")
        if len(dataset) != loop.sampler.num_samples:  # type: ignore[arg-type]
            raise ValueError(
                f"the dataset has {len(dataset)} samples but the loop's sampler "  # type: ignore[arg-type]
                f"{loop.sampler.num_samples}: build it with "
                "ElasticSampler.of(dataset, ...)"
            )
        self.dataset, self.loop = dataset, loop
        self._plan = _Plan()
        self._guarded = on_error == "skip"
        self._loader = DataLoader(
            _Guarded(dataset) if self._guarded else dataset,
            batch_sampler=self._plan,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            collate_fn=_Collate(collate_fn) if self._guarded else collate_fn,
            worker_init_fn=_WorkerInit(worker_init_fn),
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
            persistent_workers=False,
        )
        self._it: Iterator[Any] | None = None
        self.max_worker_restarts = max_worker_restarts
        self.restarts = 0
        """Plans started again: the first one, and one per resize, dropped step or resume."""
        self.worker_restarts = 0
        """Data workers lost and replaced."""
        self.dropped = 0
        """Prefetched batches dropped because their step's shares changed."""
        self.max_skipped = max_skipped
        self.skipped = 0
        """Records of this rank's steps left out because they raised (``on_error="skip"``)."""

    def __call__(self, batch: "Batch") -> Iterator[Any]:
        """The collated data of each of ``batch``'s micro-batches, in order (None for an empty
        one: a rank with no samples in the last step of a data epoch)."""
        for k, indices in enumerate(batch.micro_batches):
            if not indices:
                yield None
                continue
            data = self._get(batch, k)
            if self._guarded:
                data, bad = data
                for j, (index, error) in enumerate(bad):
                    before = self.loop.skipped + batch.skipped + j  # the job's, committed, and this step's here
                    if before >= self.max_skipped:  # (a DataError: under maitre run the job fails at once)
                        raise DataError(
                            f"sample {index}: {error} (and {before} records skipped before it: more than max_skipped)"
                        )
                    self.skipped += 1
                    print(f"maitre: step {batch.step}: skipped sample {index}: {error}", file=sys.stderr, flush=True)
                if bad:
                    batch.skip(len(bad))
            yield data

    def _get(self, batch: "Batch", k: int) -> Any:
        want = batch.micro_batches[k]
        while True:
            if self._it is None or self._plan.head() != want:
                self._start(batch, k)
            try:
                data = next(self._it)  # type: ignore[arg-type]
            except (RuntimeError, OSError, EOFError) as exc:
                if not self._lost_worker(exc) or self.worker_restarts >= self.max_worker_restarts:
                    raise
                self.worker_restarts += 1
                print(
                    f"maitre: a data worker was lost ({exc}); its batches are loaded again "
                    f"({self.worker_restarts} lost so far)",
                    file=sys.stderr,
                    flush=True,
                )
                self._stop()
                continue
            got = self._plan.issued.popleft()
            assert got == want, (got, want)
            return data

    def _start(self, batch: "Batch", k: int) -> None:
        """A new plan from micro-batch ``k`` of the step being trained, and fresh workers."""
        if self._it is not None:
            self.dropped += len(self._plan.issued)
            self._stop()
        rest = [m for m in batch.micro_batches[k:] if m]
        later = (m for step in itertools.islice(self.loop.upcoming(), 1, None) for m in step if m)
        self._plan.restart(itertools.chain(rest, later))
        self._it = iter(self._loader)
        if getattr(self._it, "_worker_pids_set", False):
            # torch's SIGCHLD handler raises a lost worker's error wherever the main thread
            # is: in the middle of the step's collectives, say. Unregistered, the loss is
            # found where it can be handled: in next(), which checks its workers while it
            # waits for a batch (every few seconds).
            _signals._remove_worker_pids(id(self._it))
            self._it._worker_pids_set = False  # type: ignore[attr-defined]
        self.restarts += 1

    def _lost_worker(self, exc: BaseException) -> bool:
        """Whether ``exc`` from the DataLoader means a data worker died: torch's own error, or
        the socket error of a batch whose shared memory its dead sender can no longer pass
        (seen before the sender is reaped: wait a moment for it)."""
        if isinstance(exc, RuntimeError):
            return str(exc).startswith("DataLoader worker")
        workers = getattr(self._it, "_workers", [])
        deadline = time.monotonic() + 2.0
        while True:
            if any(not w.is_alive() for w in workers):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _stop(self) -> None:
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        """Stop the data workers (also when the loader is garbage collected)."""
        self._stop()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
