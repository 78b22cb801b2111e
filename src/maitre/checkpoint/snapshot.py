"""The blocking phase of a save: copy this rank's part of the state into reused CPU buffers.

Data-parallel state is replicated: every rank holds the same model, optimizer and schedule. So
the tensors are split across the ranks (greedily by size, the same plan computed on every rank
with no communication) and each rank copies and later writes only its part: with W ranks the
copy that blocks training is about 1/W of the state. Per-rank state (the random number
generators) is small and each rank keeps its own.

Sharded state (a replica of several processes, FSDP2's DTensors on its mesh) is written by the
processes of one replica, each its own pieces: its local shard of every sharded tensor (a piece
held alike by several processes, on a ``Replicate`` dimension, by the first of them only), and
process 0 the tensors that are not sharded. The snapshot says where each piece lies in its
tensor (:mod:`.reshard`), so the committer can check that they cover it and a loader can cut its
own pieces from them on another mesh.

The buffer is one byte tensor per process, laid out in the order of the shard file (see
:func:`maitre.checkpoint.format.layout`), so the writer streams it to disk with no further copy.
It is kept between saves and only grows, so steady-state saves allocate nothing; the views into
it are cached while the layout stays the same.

**State on a GPU is copied while training goes on.** The device-to-host copies are issued on a
side stream of the device, after the work already queued there (the update), into the pinned
buffer, and ``take`` returns at once. Nothing waits on the host: the copy overlaps the next
step's forward and backward, and the device waits only where a tensor still being copied is
about to be written (:meth:`Snapshot.fence`). What the update alone writes (the parameters the
optimizer owns and its state: the ``updated`` storages) is copied last and fenced before the
next update; everything else (module buffers that a forward may write in place, such as
batch-norm statistics, parameters the optimizer does not own, the user's registered state) is
copied first and fenced before the next step begins, which costs that copy only (small). So a
script's step must leave the optimizer's parameters and state to the optimizer, as torch's own
optimizers do; the rest it may write anywhere. The writer waits for the copy on the host before it
reads the buffer; the next save waits for the writer, so the buffer is never overwritten under a
copy. Each source tensor is recorded on the side stream, so the allocator reuses none of them
before its copy is done.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from maitre.checkpoint import format as fmt
from maitre.checkpoint import reshard
from maitre.runtime import statetree
from maitre.runtime.state import storage


@dataclass(slots=True)
class Snapshot:
    """One rank's part of one checkpoint, in CPU memory."""

    step: int
    token: int
    rank: int
    world_size: int
    skeleton: Any
    """The replicated state with tensors replaced by placeholders (JSON)."""
    tensors: list[list[Any]]
    """Per tensor index: [dtype code, shape, rank that writes it], or for a sharded tensor
    [dtype code, global shape, []] (the committer lists its pieces there)."""
    entries: list[fmt.TensorEntry]
    """This rank's tensors, as laid out in ``data``."""
    data: memoryview
    rank_state: dict[str, Any]
    pieces: dict[int, reshard.Box] = field(default_factory=dict)
    """Where this rank's pieces of sharded tensors lie in them, by tensor index."""
    meta: dict[str, Any] = field(default_factory=dict)
    block_s: float = 0.0
    copy: "DeviceCopy | None" = None
    """The copy into ``data`` still running on a GPU, if any (see the module docstring)."""

    def fence(self, *, update: bool) -> None:
        """The device's current stream waits (on the device: the host goes on) until what the
        next step (``update=False``) or the next update (``update=True``) writes is copied."""
        if self.copy is not None:
            self.copy.fence(update=update)

    def wait_copied(self) -> None:
        """Block the host until ``data`` holds the whole copy (the writer, before it reads)."""
        if self.copy is not None:
            self.copy.done.synchronize()


class DeviceCopy:
    """One snapshot's copy from a CUDA device, on the side stream ``stream``: issued after the
    work already queued on the device's current stream; ``first`` is recorded once the tensors
    a step may write are copied, ``done`` once all are."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.device = stream.device
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.first: Any = None
        self.done: Any = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue one copy (the caller holds ``torch.cuda.stream(self.stream)``)."""
        if not src.is_cuda:
            dst.copy_(src)
            return
        dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # its memory is not reused before the copy is done

    def mark_first(self) -> None:
        self.first = self.stream.record_event()

    def finish(self) -> None:
        if self.first is None:
            self.mark_first()
        # A blocking event: the writer's wait sleeps instead of spinning a core.
        self.done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        self.done.record(self.stream)

    def fence(self, *, update: bool) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done if update else self.first)


@dataclass(slots=True)
class Parts:
    """A state split into what each rank writes (see the module docstring)."""

    skeleton: Any
    tensors: list[torch.Tensor]
    """Each tensor as this process holds it (a sharded one's local shard)."""
    specs: list[list[Any]]
    """As :attr:`Snapshot.tensors`."""
    mine: list[int]
    """The tensors this rank writes."""
    pieces: dict[int, reshard.Box]


def split(state: dict[str, Any], rank: int, world_size: int) -> Parts:
    """The replicated part of ``state`` (its ``rng`` entry is per rank) as a skeleton, its
    tensors, and what ``rank`` of ``world_size`` writes."""
    originals: list[torch.Tensor] = []
    skeleton, tensors = statetree.encode({k: v for k, v in state.items() if k != "rng"}, originals)
    boxes = [_piece(t) for t in originals]
    sharded = any(b is not None for b in boxes)
    whole = [i for i, b in enumerate(boxes) if b is None]
    # Sharded state: process 0 writes what is not sharded, so a loader reads its own pieces'
    # files and that one.
    sizes = [tensors[i].numel() * tensors[i].element_size() for i in whole]
    owner = [0] * len(whole) if sharded else plan(sizes, world_size)
    specs: list[list[Any]] = [[]] * len(tensors)
    mine, pieces = [], {}
    for i, r in zip(whole, owner):
        specs[i] = [fmt.dtype_code(tensors[i].dtype), list(tensors[i].shape), r]
        if r == rank:
            mine.append(i)
    for i, b in enumerate(boxes):
        if b is None:
            continue
        specs[i] = [fmt.dtype_code(tensors[i].dtype), list(originals[i].shape), []]
        writes, box = b
        if writes and reshard.numel(box):
            mine.append(i)
            pieces[i] = box
    return Parts(skeleton, tensors, specs, sorted(mine), pieces)


def _piece(t: torch.Tensor) -> tuple[bool, reshard.Box] | None:
    """For a tensor sharded over several processes: whether this process writes its piece (the
    first of those that hold it alike), and where the piece lies. None for any other tensor."""
    if not statetree.is_sharded(t) or t.device_mesh.size() == 1:
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    placements: list[list[Any]] = []
    for p in t.placements:
        if type(p) is Replicate:
            placements.append(["replicate"])
        elif type(p) is Shard:  # (not a subclass: _StridedShard lays out otherwise)
            placements.append(["shard", p.dim])
        else:
            raise TypeError(f"cannot checkpoint a tensor placed as {p!r}")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TypeError("cannot checkpoint a tensor on a mesh this process is not part of")
    box = reshard.box_of(t.shape, placements, mesh.shape, coordinate)
    if box[1] != tuple(t.to_local().shape):
        raise TypeError(
            f"a tensor of shape {list(t.shape)} placed as {t.placements} holds a "
            f"local shard of shape {list(t.to_local().shape)}, not {list(box[1])}"
        )
    first = all(c == 0 for c, p in zip(coordinate, placements) if p == ["replicate"])
    return first, box


def part_bytes(state: dict[str, Any], rank: int, world_size: int) -> tuple[int, bool]:
    """Bytes of ``rank``'s part of ``state`` at ``world_size``, and whether it lives on a GPU."""
    parts = split(state, rank, world_size)
    mine = sum(parts.tensors[i].numel() * parts.tensors[i].element_size() for i in parts.mine)
    return mine, any(t.is_cuda for t in parts.tensors)


def plan(sizes: list[int], world_size: int) -> list[int]:
    """The rank that writes each tensor: largest first, to the least-loaded rank (ties to the
    lowest rank), so every rank computes the same plan and loads differ by at most one tensor."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class SnapshotBuffers:
    """Reused host memory for this rank's part of the state."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._key: tuple[Any, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def take(
        self,
        state: dict[str, Any],
        *,
        step: int,
        token: int,
        rank: int,
        world_size: int,
        halfway: Callable[[], None] | None = None,
        updated: frozenset[int] | None = None,
    ) -> Snapshot:
        """Copy ``state`` (a TrainState tree with its ``rng`` entry) into the buffers. With
        ``updated`` (the storages that only the optimizer's update writes:
        :func:`maitre.runtime.state.updated_storages`), a copy from a GPU goes on after this
        returns, and the caller fences what it writes next (:meth:`Snapshot.fence`; see the
        module docstring); without, it is done when this returns. ``halfway`` is called
        halfway through the copy (fault injection in tests)."""
        parts = split(state, rank, world_size)
        tensors = parts.tensors
        rng = state.get("rng")
        entries, nbytes = fmt.layout([(str(i), tensors[i].dtype, tuple(tensors[i].shape)) for i in parts.mine])
        key = tuple((e.key, e.dtype, e.shape) for e in entries)
        if key != self._key:
            self._views = self._prepare(entries, nbytes, pin=any(t.is_cuda for t in tensors))
            self._key = key
        sources = [tensors[int(e.key)] for e in entries]
        copy = self._device_copy(sources) if updated is not None else None
        late = updated or frozenset()
        order = list(range(len(entries)))
        if copy is not None:  # what a step may write first, what only the update writes last
            order.sort(key=lambda j: storage(sources[j]) in late)
        half = len(entries) // 2
        with torch.cuda.stream(copy.stream) if copy is not None else contextlib.nullcontext():
            for n, j in enumerate(order):
                if n == half and halfway is not None:
                    halfway()
                if copy is None:
                    self._views[j].copy_(sources[j])
                    continue
                if copy.first is None and storage(sources[j]) in late:
                    copy.mark_first()
                copy.copy(self._views[j], sources[j])
        if copy is not None:
            copy.finish()
        data = self._buffer.numpy().data.cast("B")[:nbytes]
        return Snapshot(
            step,
            token,
            rank,
            world_size,
            parts.skeleton,
            parts.specs,
            entries,
            data,
            {"rng": rng_to_json(rng) if rng is not None else None},
            parts.pieces,
            copy=copy,
        )

    def _device_copy(self, sources: list[torch.Tensor]) -> DeviceCopy | None:
        """A copy on the side stream of the one CUDA device the sources live on; None when none
        is on a GPU, or when they span devices (then each copy is synchronous)."""
        devices = {t.device for t in sources if t.is_cuda}
        if len(devices) != 1 or not self._buffer.is_pinned():
            return None
        (device,) = devices
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return DeviceCopy(stream)

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Grow the buffer to ``nbytes`` and touch every page, so that the save after it only
        copies (first-touch page faults cost seconds per GB on some machines)."""
        if nbytes <= self.capacity:
            return
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
        buffer.fill_(0)
        self._buffer, self._key = buffer, None

    def _prepare(self, entries: list[fmt.TensorEntry], nbytes: int, pin: bool) -> list[torch.Tensor]:
        self.reserve(nbytes, pin)
        return [self._buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries]


# -- per-rank state as JSON ----------------------------------------------------------------------
def rng_to_json(rng: dict[str, Any]) -> dict[str, Any]:
    """The generator states of :func:`maitre.runtime.state.rng_state` as plain JSON."""
    out: dict[str, Any] = {}
    for name, value in rng.items():
        if isinstance(value, torch.Tensor):  # torch generator state: a byte tensor
            out[name] = {"bytes": base64.b64encode(value.cpu().numpy().tobytes()).decode()}
        elif name == "python":  # (version, 625 ints, gauss): a list is 10x cheaper than a walk
            version, internal, gauss = value
            out[name] = [version, list(internal), gauss]
        else:
            out[name] = value  # numpy: already lists and numbers
    return out


def rng_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in doc.items():
        if isinstance(value, dict) and "bytes" in value:
            raw = bytearray(base64.b64decode(value["bytes"]))
            out[name] = torch.frombuffer(raw, dtype=torch.uint8).clone()
        elif name == "python":
            version, internal, gauss = value
            out[name] = (version, tuple(internal), gauss)
        else:
            out[name] = value
    return out
