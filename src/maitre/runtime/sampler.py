"""The elastic sampler: which sample indices each rank trains on, at any world size.

Every data epoch has one global order, a permutation of ``range(num_samples)`` drawn from
``(seed, data_epoch)`` alone. A training step consumes the next global slice
``order[cursor : cursor + global_batch]`` and each rank takes a contiguous share of that slice by
its rank and the world size of the current membership epoch. The cursor is the only moving part
and it is part of the committed training state: it advances once per committed step, never for a
step that was dropped, so a resize or a failure between two steps can neither skip nor repeat a
sample. The last step of a data epoch takes what is left (a smaller global batch), so every index
is consumed exactly once per data epoch.

The sampler never talks to other ranks; the runtime hands it the rank and world size.

A data source may order its samples itself (``order``: token shards read in shard-aware blocks,
so that reads stay sequential) and describe itself (``source``: its files and their sizes): the
description is kept in the sampler's state, and a resume onto a source that changed is refused
with what changed (``check``). Either way the order depends on ``(seed, data_epoch)`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

Order = Callable[[int, int], "list[int] | np.ndarray"]
"""``order(seed, data_epoch)``: a permutation of the source's sample indices."""


def compact(order: "list[int] | np.ndarray | torch.Tensor") -> np.ndarray:
    """An order as an array of the smallest integers that hold it (int32 below 2**31 samples:
    4 bytes a sample, where a Python list of ints takes about 36)."""
    arr = order.detach().cpu().numpy() if isinstance(order, torch.Tensor) else np.asarray(order)
    if arr.size == 0:
        return arr.astype(np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= len(arr):
        raise ValueError(f"an order must hold the sample ids 0..{len(arr) - 1}, each once: got {arr[:8]}...")
    return arr.astype(np.int32 if len(arr) < 2**31 else np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class StepSlice:
    """The global slice of one step and this rank's share of it."""

    data_epoch: int
    cursor: int
    global_indices: list[int]
    local_indices: list[int]

    @property
    def global_count(self) -> int:
        return len(self.global_indices)


def share_bounds(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """Start and end of rank's contiguous share of ``count`` items; the first ``count % world``
    ranks take one more item, so shares differ by at most one."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ElasticSampler:
    """Deterministic, resumable, world-size-independent global batches.

    Args:
        num_samples: size of the data set (indices ``0 .. num_samples - 1``).
        global_batch_size: samples per optimizer step across all ranks (the scaling rule may
            change it; see :mod:`maitre.runtime.scaling`).
        seed: the order of data epoch ``d`` is a permutation drawn from ``(seed, d)``.
        shuffle: ``False`` keeps the natural order (useful for tests and streams).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        order: Order | None = None,
        source: dict[str, Any] | None = None,
        check: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"the data set is empty (num_samples {num_samples}): nothing to train on")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if global_batch_size > num_samples:
            raise ValueError(
                f"the global batch ({global_batch_size}) is larger than the data set ({num_samples} samples)"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        self._order_fn = order
        self._check = check
        self.data_epoch = 0
        self.cursor = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int32)

    @classmethod
    def of(cls, dataset: Any, global_batch_size: int, *, seed: int = 0, shuffle: bool = True) -> "ElasticSampler":
        """The sampler of ``dataset`` (``len(dataset)`` samples): with its own ``order``,
        ``describe`` and ``changes`` where it has them (:class:`maitre.data.TokenShards`)."""
        describe = getattr(dataset, "describe", None)
        if len(dataset) == 0:
            raise ValueError(f"the data set is empty ({dataset!r}): nothing to train on")
        return cls(
            len(dataset),
            global_batch_size,
            seed=seed,
            shuffle=shuffle,
            order=getattr(dataset, "order", None) if shuffle else None,
            source=describe() if describe is not None else None,
            check=getattr(dataset, "changes", None),
        )

    def order(self, data_epoch: int) -> np.ndarray:
        """The global sample order of one data epoch, as an array (cached for the current one;
        at 100 M samples it holds 400 MB, a list would hold 3.6 GB)."""
        if data_epoch != self._order_epoch:
            self._order = self._draw(data_epoch)
            self._order_epoch = data_epoch
        return self._order

    def _draw(self, data_epoch: int) -> np.ndarray:
        if not self.shuffle:
            return compact(np.arange(self.num_samples))
        if self._order_fn is not None:
            order = compact(self._order_fn(self.seed, data_epoch))
            if len(order) != self.num_samples:
                raise ValueError(f"the source's order has {len(order)} samples, not {self.num_samples}")
            return order
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + data_epoch)
        return compact(torch.randperm(self.num_samples, generator=gen))

    def upcoming(self, size: Callable[[], int]) -> Iterator[list[int]]:
        """The global slices of the steps after the committed cursor, in order, as they will be
        drawn if nothing changes (``size()``: each step's global batch); nothing is consumed.
        A loader prefetches along it. (The cursor is read now, not at the first ``next``.)"""
        epoch, cursor = self.data_epoch, self.cursor
        order = self.order(epoch)

        def walk(epoch: int, cursor: int, order: np.ndarray) -> Iterator[list[int]]:
            while True:
                piece = order[cursor : cursor + size()].tolist()
                yield piece
                cursor += len(piece)
                if cursor >= self.num_samples:
                    epoch, cursor = epoch + 1, 0
                    order = self._draw(epoch)

        return walk(epoch, cursor, order)

    def next_slice(self, rank: int, world_size: int, global_batch_size: int | None = None) -> StepSlice:
        """The slice of the next step, without consuming it (see :meth:`advance`)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        batch = self.global_batch_size if global_batch_size is None else global_batch_size
        if batch <= 0:
            raise ValueError(f"global batch size must be positive, got {batch}")
        order = self.order(self.data_epoch)
        global_indices = order[self.cursor : self.cursor + batch].tolist()
        lo, hi = share_bounds(len(global_indices), rank, world_size)
        return StepSlice(self.data_epoch, self.cursor, global_indices, global_indices[lo:hi])

    def advance(self, consumed: StepSlice) -> None:
        """Commit a step: move the cursor past its global slice (rolling into the next epoch)."""
        if (consumed.data_epoch, consumed.cursor) != (self.data_epoch, self.cursor):
            raise RuntimeError(
                f"advance() of slice at epoch {consumed.data_epoch} cursor {consumed.cursor}, "
                f"but the sampler is at epoch {self.data_epoch} cursor {self.cursor}"
            )
        self.cursor += consumed.global_count
        if self.cursor >= self.num_samples:
            self.data_epoch += 1
            self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        state = {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "data_epoch": self.data_epoch,
            "cursor": self.cursor,
        }
        if self.source is not None:
            state["source"] = self.source
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._check is not None and state.get("source") is not None:
            changed = self._check(state["source"])
            if changed:
                raise ValueError(f"the data changed since this state was saved: {changed}")
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for a different data set: it was saved with "
                f"{state['num_samples']} samples, this one has {self.num_samples}"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(
                "sampler state is for a different data set or seed: "
                f"{ {k: state[k] for k in ('num_samples', 'seed', 'shuffle')} }"
            )
        self.global_batch_size = int(state["global_batch_size"])
        self.data_epoch = int(state["data_epoch"])
        self.cursor = int(state["cursor"])
