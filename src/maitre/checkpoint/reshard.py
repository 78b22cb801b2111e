"""Pieces of sharded tensors: where each lies in the whole, whether they cover it, and a process's
own piece cut from them.

A sharded tensor (a DTensor: FSDP2's parameters and optimizer state) is saved as the pieces its
processes hold, each a box of the whole: its offsets and its shape. A box is what a placement
gives a process on its mesh: ``Shard(d)`` on a mesh dimension of ``k`` processes cuts tensor
dimension ``d`` into ``k`` chunks as ``torch.chunk`` does (the last ones smaller or empty, as
FSDP2 and DTensor cut them), mesh dimensions applying in order; ``Replicate`` leaves it whole. So a
checkpoint written on one mesh loads on another: each process computes its box on its own mesh
and copies from every saved piece the part that overlaps it (:func:`cut`).

Before a byte is read, :func:`check_cover` proves that a tensor's pieces cover it exactly (every
element in one piece): a checkpoint whose pieces leave a hole or overlap is refused, not loaded.
Pure arithmetic on shapes; the only tensors touched are in :func:`cut`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, shape) of a piece in its whole tensor."""


def whole(shape: Sequence[int]) -> Box:
    return tuple(0 for _ in shape), tuple(int(d) for d in shape)


def box_of(
    shape: Sequence[int], placements: Sequence[list[Any]], sizes: Sequence[int], coordinate: Sequence[int]
) -> Box:
    """The box of the process at ``coordinate`` of a mesh of ``sizes``, for a tensor of global
    ``shape`` placed as ``placements`` (statetree's encoding: ``["shard", d]``, ``["replicate"]``;
    one per mesh dimension)."""
    if not len(placements) == len(sizes) == len(coordinate):
        raise ValueError(f"{len(placements)} placements for a mesh of {len(sizes)} dimensions")
    offsets, extent = list(whole(shape)[0]), list(whole(shape)[1])
    for placement, k, c in zip(placements, sizes, coordinate):
        if placement == ["replicate"]:
            continue
        d = placement[1]
        if not 0 <= d < len(extent):
            raise ValueError(f"shard dimension {d} of a tensor of {len(extent)} dimensions")
        chunk = -(-extent[d] // k)  # torch.chunk's chunk size
        start = min(extent[d], chunk * c)
        size = max(0, min(extent[d], start + chunk) - start)
        offsets[d] += start
        extent[d] = size
    return tuple(offsets), tuple(extent)


def numel(box: Box) -> int:
    n = 1
    for d in box[1]:
        n *= d
    return n


def overlap(a: Box, b: Box) -> Box | None:
    """The box both cover (None if they share no element)."""
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1])]
    if any(high <= low for low, high in zip(lo, hi)):
        return None
    return tuple(lo), tuple(high - low for low, high in zip(lo, hi))


def check_cover(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not cover a tensor of ``shape`` exactly (None when they do): each box
    inside the whole, no two overlapping, their sizes adding up to the whole's."""
    full = whole(shape)
    boxes = [b for b in boxes if numel(b)]
    for b in boxes:
        if (
            len(b[0]) != len(full[0])
            or len(b[1]) != len(full[1])
            or any(o < 0 or o + n > s for o, n, s in zip(b[0], b[1], full[1]))
        ):
            return f"a piece at {list(b[0])} of shape {list(b[1])} lies outside {list(full[1])}"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if overlap(a, b) is not None:
                return f"the pieces at {list(a[0])} and {list(b[0])} overlap"
    have, need = sum(numel(b) for b in boxes), numel(full)
    if have != need:
        return f"its pieces hold {have} of its {need} elements"
    return None


def cut(target: Box, pieces: Sequence[tuple[Box, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The ``target`` box of a tensor, copied from the saved ``pieces`` that overlap it (which
    cover it: :func:`check_cover`). A piece that is the target itself is returned as it is."""
    for box, tensor in pieces:
        if box == target:
            return tensor
    out = torch.empty(target[1], dtype=dtype)
    for box, tensor in pieces:
        common = overlap(box, target)
        if common is None:
            continue
        src, dst = tensor, out
        for d, (lo, n) in enumerate(zip(*common)):
            src = src.narrow(d, lo - box[0][d], n)
            dst = dst.narrow(d, lo - target[0][d], n)
        dst.copy_(src)
    return out
