"""Loading: find the newest checkpoint that verifies, at any world size and on any mesh.

Every file is read whole and checked against the manifest's size and xxh3-64 before a byte of
it is used, so a truncated, altered or half-written checkpoint is never loaded: it is skipped
with a warning naming the reason, and the next older one is tried. The state is replicated, so
a checkpoint saved by W ranks loads on any number of ranks: each rank reads every shard (the
whole state) and takes the per-rank state (random generators) of saved rank ``rank % W``.

Sharded tensors are resharded: a process with a mesh (``mesh_of``) computes its own piece of
each on its mesh, with the placements it was saved with, and reads only the shards that hold a
part of it (and the one that holds the unsharded tensors); a process without one gets them
whole. Before that, the pieces must cover each tensor exactly, or the checkpoint is refused
(:class:`~maitre.checkpoint.format.UnusableCheckpoint`). The processes of a replica read
different files, so they agree on the checkpoint (``agree``): one that any of them cannot load
is skipped by all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from maitre.checkpoint import format as fmt
from maitre.checkpoint import reshard
from maitre.checkpoint.snapshot import rng_from_json
from maitre.runtime import statetree


@dataclass(slots=True)
class Loaded:
    step: int
    path: Path
    tree: dict[str, Any]
    """The TrainState tree (with this rank's ``rng``), tensors on the CPU."""
    world_size: int
    nbytes: int


MeshOf = Callable[[tuple[str, ...]], Any]


def load(path: Path, rank: int = 0, mesh_of: MeshOf | None = None) -> Loaded:
    """Load and verify one checkpoint directory; raises :class:`CorruptCheckpoint` (or
    :class:`UnusableCheckpoint`). ``mesh_of(dims)`` is this process's mesh of those dims, for
    sharded tensors (without it they come whole)."""
    manifest = fmt.read_manifest(path)
    files = manifest.get("files")
    step, world = manifest.get("step"), manifest.get("world_size")
    if not isinstance(files, dict) or not isinstance(step, int) or not isinstance(world, int) or world < 1:
        raise fmt.CorruptCheckpoint("the manifest lacks files, step or world size")
    if fmt.STEP_DIR.fullmatch(path.name) and int(path.name[5:]) != step:
        raise fmt.CorruptCheckpoint(f"the manifest is for step {step}, not {path.name}")

    def read(name: str) -> bytearray:
        info = files.get(name)
        if not isinstance(info, dict):
            raise fmt.CorruptCheckpoint(f"the manifest does not list {name}")
        return fmt.read_verified(path / name, int(info.get("size", -1)), str(info.get("xxh3_64")))

    try:
        state = json.loads(read(fmt.STATE))
        specs = state["tensors"]
        per_rank = json.loads(read(fmt.rank_name(rank % world)))
        rng = per_rank.get("rng")
        slots = statetree.placeholders(state["skeleton"])
        if sorted(slots) != list(range(len(specs))):
            raise ValueError("its skeleton and tensor list do not match")
        wanted = [_wanted(i, spec, slots, mesh_of, path) for i, spec in enumerate(specs)]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise fmt.CorruptCheckpoint(f"state.json or the rank file is malformed: {exc}") from None

    # Every piece by (tensor, rank); the shards to read are those that hold a part of a box
    # this process needs, and each must hold exactly the pieces state.json says it does.
    listed = {(i, r): box for i, (_, pieces) in enumerate(wanted) for r, box in pieces}
    needed = [[(r, box) for r, box in pieces if reshard.overlap(box, target) is not None] for target, pieces in wanted]
    found: dict[tuple[int, int], torch.Tensor] = {}
    nbytes = 0
    for r in sorted({r for pieces in needed for r, _ in pieces}):
        name = fmt.shard_name(r)
        data = read(name)
        nbytes += len(data)
        held = fmt.parse_safetensors(data, name)
        for key, tensor in held.items():
            i = int(key) if key.isdigit() else -1
            box = listed.get((i, r))
            if box is None or fmt.dtype_code(tensor.dtype) != specs[i][0] or tuple(tensor.shape) != box[1]:
                raise fmt.CorruptCheckpoint(f"{name}: tensor {key} does not match state.json")
            found[(i, r)] = tensor
        if len(held) != sum(1 for _, q in listed if q == r):
            raise fmt.CorruptCheckpoint(f"{name} lacks tensors that state.json puts there")
    # A tensor is a view of its shard's bytes, and keeps them all in memory (the optimizer's
    # state keeps the tensors it is given): what comes from a shard that this process uses
    # only part of is copied out, so that the rest of the shard is freed.
    exact = {
        (i, r) for i, ((target, _), pieces) in enumerate(zip(wanted, needed)) for r, box in pieces if box == target
    }
    partly = {r for i, r in listed if (i, r) not in exact}
    tensors = []
    for i, ((target, _), pieces) in enumerate(zip(wanted, needed)):
        tensor = reshard.cut(target, [(box, found[(i, r)]) for r, box in pieces], fmt.dtype_of(specs[i][0]))
        if pieces and (i, pieces[0][0]) in exact and pieces[0][0] in partly:
            tensor = tensor.clone()
        tensors.append(tensor)
    try:
        tree = statetree.decode(state["skeleton"], tensors, mesh_of, whole=mesh_of is None)
    except (ValueError, KeyError, TypeError) as exc:
        raise fmt.CorruptCheckpoint(f"state.json skeleton is malformed: {exc}") from None
    if rng is not None:
        tree["rng"] = rng_from_json(rng)
    return Loaded(step, path, tree, world, nbytes)


def _wanted(
    i: int, spec: list[Any], slots: dict[int, tuple[str, dict[str, Any] | None]], mesh_of: MeshOf | None, path: Path
) -> tuple[reshard.Box, list[tuple[int, reshard.Box]]]:
    """Tensor ``i``'s box that this process needs, and its saved pieces (rank, box), which are
    checked to cover it."""
    code, shape, where = spec
    fmt.dtype_of(code)
    shape = [int(d) for d in shape]
    name, holder = slots[i]
    if isinstance(where, int):
        pieces = [(where, reshard.whole(shape))]
    else:
        pieces = [(int(r), (tuple(int(o) for o in offsets), tuple(int(n) for n in size))) for r, offsets, size in where]
        if len({r for r, _ in pieces}) != len(pieces):
            raise ValueError(f"tensor {i} has two pieces in one shard")
        reason = reshard.check_cover(shape, [box for _, box in pieces])
        if reason is not None:
            raise fmt.UnusableCheckpoint(f"{path} is refused: its shards do not cover {name} (shape {shape}): {reason}")
    target = reshard.whole(shape)
    if holder is not None and mesh_of is not None:
        if [int(d) for d in holder["shape"]] != shape:
            raise ValueError(f"tensor {i} has two shapes")
        try:
            mesh = mesh_of(tuple(holder["mesh"]))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise fmt.UnusableCheckpoint(
                f"{path}: {name} was sharded on mesh dims {holder['mesh']}, which this process's mesh lacks: {exc}"
            ) from None
        target = reshard.box_of(shape, holder["placements"], mesh.shape, mesh.get_coordinate())
    return target, pieces


def load_latest(
    root: Path,
    rank: int = 0,
    log: Callable[[str], None] = print,
    *,
    mesh_of: MeshOf | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> Loaded | None:
    """The newest checkpoint under ``root`` that verifies; None if there is none. ``agree(ok)``
    (the processes of a replica, together) is whether every one of them could load it."""
    for _, path in fmt.list_steps(root):
        loaded, why = None, None
        try:
            loaded = load(path, rank, mesh_of)
        except fmt.CorruptCheckpoint as exc:
            why = str(exc)
        except OSError as exc:
            why = f"cannot read it: {exc}"
        if agree is not None and not agree(loaded is not None) and why is None:
            why = "another process of this replica could not load it"
        if why is None:
            return loaded
        log(f"maitre: skipping checkpoint {path}: {why}; trying the previous one")
    return None


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint directory whose manifest is in place (files not read)."""
    for _, path in fmt.list_steps(root):
        try:
            fmt.read_manifest(path)
            return path
        except fmt.CorruptCheckpoint:
            continue
    return None
