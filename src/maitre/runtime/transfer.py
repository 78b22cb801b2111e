"""Live state transfer: after a membership change, peers that are behind get the state from one
that is ahead. Joiners never read disk.

Every member takes part in ``sync_steps``: one allreduce of a vector holding each member's
committed step at its rank, so every member learns all steps.

Then one of two ways, chosen by the job (``MAITRE_JOIN``):

- ``stream`` (the default): the members behind *listen* (see :mod:`maitre.runtime.loop`) while a
  source ahead streams them a snapshot of its committed state in the background
  (:class:`Sender`, :class:`Receiver`), each pair on a two-member group of its own. The snapshot
  of the tensors that only the optimizer changes (parameters, optimizer state) is copied on the
  sender's thread while the next forward and backward run; the loop waits for that copy
  (:meth:`Sender.copied`) before its next update. The running members pause for the group
  rebuild only.
- ``pause``: ``broadcast_state`` from the source over the epoch's group, every member waiting.

The wire format is one header (the skeleton and each tensor's dtype and shape, JSON as bytes,
preceded by its length) and then one flat buffer per dtype with every tensor of the state.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from maitre.protocol import TRANSFER_DELAY_S
from maitre.runtime import statetree
from maitre.runtime.group import EpochGroup
from maitre.runtime.state import storage

_DTYPES = {str(t): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


def sync_steps(group: EpochGroup, step: int) -> list[int]:
    """Every member's committed step, indexed by rank."""
    steps = torch.zeros(group.world_size, dtype=torch.int64, device=group.device)
    steps[group.rank] = step
    group.allreduce(steps)
    return steps.tolist()


def broadcast_state(
    group: EpochGroup, tree: Any | None, src: int, mesh_of: Callable[[tuple[str, ...]], Any] | None = None
) -> tuple[Any, int]:
    """Send ``tree`` from rank ``src`` to every member; returns (tree, payload bytes).

    On the source, ``tree`` is the state to send; elsewhere it is ignored and the received
    tree is returned (tensors on the group's device; sharded ones on ``mesh_of``'s mesh).
    Members already at the source's step receive too but keep their own state (their RNG
    streams stay theirs)."""
    if group.rank == src:
        packed = Packed.of(tree, group.device)
        packed.copy_lazy()
        return tree, packed.send(group, src)
    meta, flats, payload = receive(group, src)
    return unpack(meta, flats, mesh_of), payload


class Packed:
    """A state laid out for the wire: the header, and one flat buffer per dtype.

    :meth:`of` copies every tensor at once except those whose storage is in ``lazy`` (tensors
    that only the optimizer's step changes: :func:`maitre.runtime.state.updated_storages`);
    :meth:`copy_lazy` copies those, on any thread, before that step."""

    def __init__(
        self, header: bytes, flats: list[torch.Tensor], pending: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.header = header
        self.flats = flats
        self._pending = pending

    @classmethod
    def of(cls, tree: Any, device: torch.device, lazy: frozenset[int] = frozenset()) -> "Packed":
        skeleton, tensors = statetree.encode(tree)
        specs = [[str(t.dtype), list(t.shape)] for t in tensors]
        header = statetree.dumps({"skeleton": skeleton, "tensors": specs})
        flats: list[torch.Tensor] = []
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dtype, indices in _by_dtype(specs):
            parts = [tensors[i].detach() for i in indices]
            flat = torch.empty(sum(t.numel() for t in parts), dtype=_DTYPES[dtype], device=device)
            offset = 0
            for t in parts:
                slot = flat[offset : offset + t.numel()].view(t.shape)
                offset += t.numel()
                if t.numel() and t.device == device and storage(t) in lazy:
                    pending.append((slot, t))
                else:
                    slot.copy_(t)
            flats.append(flat)
        return cls(header, flats, pending)

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(f.numel() * f.element_size() for f in self.flats)

    def copy_lazy(self) -> None:
        for slot, t in self._pending:
            slot.copy_(t)
        self._pending = []

    def send(self, group: EpochGroup, src: int) -> int:
        """Broadcast from ``src`` (this member) to the group; returns the payload bytes."""
        self.send_header(group, src)
        self.send_flats(group, src)
        return self.nbytes

    def send_header(self, group: EpochGroup, src: int) -> None:
        header = torch.frombuffer(bytearray(self.header), dtype=torch.uint8).to(group.device)
        group.broadcast(torch.tensor([len(self.header)], dtype=torch.int64, device=group.device), src)
        group.broadcast(header, src)

    def send_flats(self, group: EpochGroup, src: int) -> None:
        for flat in self.flats:
            group.broadcast(flat, src)


def receive(group: EpochGroup, src: int) -> tuple[dict[str, Any], list[torch.Tensor], int]:
    """The other side of :meth:`Packed.send`: (header, flat buffers, payload bytes)."""
    meta = receive_header(group, src)
    flats = allocate(meta, group.device)
    receive_flats(group, src, flats)
    return meta, flats, payload(meta, flats)


def receive_header(group: EpochGroup, src: int) -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(size, src)
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(header, src)
    meta = statetree.loads(header.cpu().numpy().tobytes())
    meta["header_bytes"] = len(header)
    return meta


def allocate(meta: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    """The flat buffers a header announces, touched: the bytes then land in memory that is
    mapped already (fresh pages cost a fault each: a third of the transfer's time on CPU)."""
    return [
        torch.empty(sum(_numel(meta["tensors"][i][1]) for i in indices), dtype=_DTYPES[dtype], device=device).zero_()
        for dtype, indices in _by_dtype(meta["tensors"])
    ]


def receive_flats(group: EpochGroup, src: int, flats: list[torch.Tensor]) -> None:
    for flat in flats:
        group.broadcast(flat, src)


def payload(meta: dict[str, Any], flats: list[torch.Tensor]) -> int:
    return meta["header_bytes"] + sum(f.numel() * f.element_size() for f in flats)


def unpack(
    meta: dict[str, Any], flats: list[torch.Tensor], mesh_of: Callable[[tuple[str, ...]], Any] | None = None
) -> Any:
    """The state tree of a received header and its flat buffers (views into them)."""
    specs = meta["tensors"]
    received: list[torch.Tensor | None] = [None] * len(specs)
    for (_, indices), flat in zip(_by_dtype(specs), flats):
        numels = [_numel(specs[i][1]) for i in indices]
        for i, part in zip(indices, torch.split(flat, numels)):
            received[i] = part.view(specs[i][1])
    return statetree.decode(meta["skeleton"], received, mesh_of)  # type: ignore[arg-type]


class Sender:
    """Streams one snapshot to the listeners it sources, one after the other, each on a
    two-member group of its own (``<epoch prefix>join/<listener rank>/``), on a thread.

    ``abandon`` is polled while it waits: a reason once the epoch is over (a peer failed, the
    job resized) makes it give up, and the snapshot is freed."""

    def __init__(
        self,
        store: dist.Store,
        prefixes: list[str],
        packed: Packed,
        device: torch.device,
        abandon: Callable[[], str | None],
    ) -> None:
        self.copied = threading.Event()
        """Set once the snapshot no longer reads the live state (see :meth:`Packed.copy_lazy`)."""
        self.done = threading.Event()
        self.error: str | None = None
        self._args = (store, prefixes, device, abandon)
        self._packed: Packed | None = packed
        self._thread = threading.Thread(target=self._run, name="maitre-state-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, prefixes, device, abandon = self._args
        packed = self._packed
        assert packed is not None
        # The copy runs beside the pair's group build and the header, so the listener
        # allocates its buffers while it runs; and the loop's wait for it never hangs on a
        # listener that does not come.
        copier = threading.Thread(target=self._copy, args=(packed,), daemon=True, name="maitre-state-copy")
        copier.start()
        try:
            for prefix in prefixes:
                pair = EpochGroup.create(store, prefix, 0, 2, device, abandon)
                try:
                    packed.send_header(pair, 0)
                    self.copied.wait()
                    if self.error is not None:
                        return
                    packed.send_flats(pair, 0)
                finally:
                    pair.retire()
        except Exception as exc:  # the listener or the epoch is gone: nothing to send to
            self.error = str(exc)
        finally:
            copier.join()
            self._packed = None
            self.done.set()

    def _copy(self, packed: Packed) -> None:
        try:
            packed.copy_lazy()
        except Exception as exc:
            self.error = f"the snapshot's copy failed: {exc}"
        finally:
            self.copied.set()


class Receiver:
    """The listener's side of :class:`Sender`: receives the snapshot on a thread. Once
    :attr:`done`, :attr:`result` holds (header, flat buffers, bytes) or :attr:`error` why not."""

    def __init__(self, store: dist.Store, prefix: str, device: torch.device, abandon: Callable[[], str | None]) -> None:
        self.done = threading.Event()
        self.result: tuple[dict[str, Any], list[torch.Tensor], int] | None = None
        self.error: str | None = None
        self.seconds = 0.0
        """How long the bytes took once the buffers were ready (includes waiting for the
        source's copy, when it is slower than the allocation)."""
        self._thread = threading.Thread(
            target=self._run, args=(store, prefix, device, abandon), name="maitre-state-receive", daemon=True
        )
        self._thread.start()

    def _run(self, store: dist.Store, prefix: str, device: torch.device, abandon: Callable[[], str | None]) -> None:
        try:
            pair = EpochGroup.create(store, prefix, 1, 2, device, abandon)
            try:
                meta = receive_header(pair, 0)
                flats = allocate(meta, device)  # while the source copies its snapshot
                began = time.monotonic()
                receive_flats(pair, 0, flats)
                self.seconds = time.monotonic() - began
            finally:
                pair.retire()
            result = (meta, flats, payload(meta, flats))
            time.sleep(float(os.environ.get(TRANSFER_DELAY_S, "0") or 0))
            self.result = result
        except Exception as exc:
            self.error = str(exc)
        finally:
            self.done.set()


def _by_dtype(specs: list[list[Any]]) -> list[tuple[str, list[int]]]:
    """Tensor indices grouped by dtype, in the wire's order (by dtype name)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (dtype, _) in enumerate(specs):
        if dtype not in _DTYPES:
            raise ValueError(f"state tensor of unsupported dtype {dtype}")
        groups[dtype].append(i)
    return sorted(groups.items())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
