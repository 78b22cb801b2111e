"""Loading: find the newest checkpoint that verifies, at any world size.

Every file is read whole and checked against the manifest's size and xxh3-64 before a byte of
it is used, so a truncated, altered or half-written checkpoint is never loaded: it is skipped
with a warning naming the reason, and the next older one is tried. The state is replicated, so
a checkpoint saved by W ranks loads on any number of ranks: each rank reads every shard (the
whole state) and takes the per-rank state (random generators) of saved rank ``rank % W``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from maitre.checkpoint import format as fmt
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


def load(path: Path, rank: int = 0) -> Loaded:
    """Load and verify one checkpoint directory; raises :class:`CorruptCheckpoint`."""
    manifest = fmt.read_manifest(path)
    files = manifest.get("files")
    step, world = manifest.get("step"), manifest.get("world_size")
    if not isinstance(files, dict) or not isinstance(step, int) or not isinstance(world, int) \
            or world < 1:
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
    except (ValueError, KeyError, TypeError) as exc:
        raise fmt.CorruptCheckpoint(f"state.json or the rank file is malformed: {exc}") from None

    tensors: list[torch.Tensor | None] = [None] * len(specs)
    nbytes = 0
    for r in sorted({int(s[2]) for s in specs}):
        name = fmt.shard_name(r)
        data = read(name)
        nbytes += len(data)
        for key, tensor in fmt.parse_safetensors(data, name).items():
            i = int(key)
            if not 0 <= i < len(specs) or int(specs[i][2]) != r \
                    or fmt.dtype_code(tensor.dtype) != specs[i][0] \
                    or list(tensor.shape) != list(specs[i][1]):
                raise fmt.CorruptCheckpoint(f"{name}: tensor {key} does not match state.json")
            tensors[i] = tensor
    missing = [i for i, t in enumerate(tensors) if t is None]
    if missing:
        raise fmt.CorruptCheckpoint(f"{len(missing)} tensors are in no shard (first: {missing[0]})")
    try:
        tree = statetree.decode(state["skeleton"], tensors)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError) as exc:
        raise fmt.CorruptCheckpoint(f"state.json skeleton is malformed: {exc}") from None
    if rng is not None:
        tree["rng"] = rng_from_json(rng)
    return Loaded(step, path, tree, world, nbytes)


def load_latest(root: Path, rank: int = 0,
                log: Callable[[str], None] = print) -> Loaded | None:
    """The newest checkpoint under ``root`` that verifies; None if there is none."""
    for _, path in fmt.list_steps(root):
        try:
            return load(path, rank)
        except fmt.CorruptCheckpoint as exc:
            log(f"maitre: skipping checkpoint {path}: {exc}; trying the previous one")
        except OSError as exc:
            log(f"maitre: skipping checkpoint {path}: cannot read it: {exc}; trying the previous one")
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
