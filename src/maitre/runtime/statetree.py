"""A pickle-free encoding of training state: a JSON skeleton plus a flat list of tensors.

State dicts of models, optimizers and schedulers are trees of dicts (with string or integer
keys), lists, tuples, numbers, strings, ``None`` and tensors. :func:`encode` replaces every tensor
with a numbered placeholder and returns the JSON-able skeleton and the tensors in order;
:func:`decode` puts tensors back. The live state transfer (:mod:`maitre.runtime.transfer`) sends
the skeleton as UTF-8 bytes and the tensors as flat buffers over ``torch.distributed``; nothing is
ever unpickled, so a peer or a file can at worst send wrong numbers, never code.

A sharded tensor (a DTensor: FSDP2's parameters and optimizer state) is encoded as its local
shard plus its placements, global shape and stride and the names of its mesh's dimensions;
:func:`decode` rebuilds it on the receiver's mesh of those names (``mesh_of``), so a process
receives the shards of its own position from its peer at the same position of another replica.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_TENSOR = "__tensor__"
_DTENSOR = "__dtensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def encode(tree: Any, originals: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """Split ``tree`` into a JSON-able skeleton and its tensors (in placeholder order; a sharded
    tensor's local shard). ``originals``, if given, receives the tensors as they were in
    ``tree`` (sharded ones as DTensors), in the same order."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            if originals is not None:
                originals.append(node)
            if is_sharded(node):
                tensors.append(node.to_local())
                mesh = node.device_mesh
                return {
                    _DTENSOR: len(tensors) - 1,
                    "mesh": list(mesh.mesh_dim_names or ()),
                    "placements": [_placement(p) for p in node.placements],
                    "shape": list(node.shape),
                    "stride": list(node.stride()),
                }
            tensors.append(node)
            return {_TENSOR: len(tensors) - 1}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in node):
                return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
            for k in node:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state key {k!r} at {path} is not a str or int")
            return {_DICT: [[k, walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if type(node).__module__ == "numpy":  # numpy scalars and arrays from RNG states
            if hasattr(node, "shape") and node.shape != ():
                return walk(torch.from_numpy(node.copy()), path)
            return node.item()
        raise TypeError(f"cannot encode {type(node).__name__} at {path or 'root'}")

    return walk(tree, ""), tensors


def decode(
    skeleton: Any,
    tensors: list[torch.Tensor],
    mesh_of: Callable[[tuple[str, ...]], Any] | None = None,
    *,
    whole: bool = False,
) -> Any:
    """Inverse of :func:`encode`; ``mesh_of(names)`` gives the mesh sharded tensors go on. With
    ``whole``, a sharded tensor's placeholder takes its tensor as given, a plain tensor (a
    checkpoint's whole tensors, for a process without a mesh)."""

    def tensor(index: Any) -> torch.Tensor:
        if not isinstance(index, int) or not 0 <= index < len(tensors):
            raise ValueError(f"tensor placeholder {index!r} out of range")
        return tensors[index]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if _TENSOR in node:
                return tensor(node[_TENSOR])
            if _DTENSOR in node:
                if whole:
                    return tensor(node[_DTENSOR])
                if mesh_of is None:
                    raise ValueError("the state holds sharded tensors and no mesh was given to put them on")
                from torch.distributed.tensor import DTensor

                return DTensor.from_local(
                    tensor(node[_DTENSOR]),
                    mesh_of(tuple(node["mesh"])),
                    [_placement_of(p) for p in node["placements"]],
                    run_check=False,
                    shape=torch.Size(node["shape"]),
                    stride=tuple(node["stride"]),
                )
            if _TUPLE in node:
                return tuple(walk(v) for v in node[_TUPLE])
            if _DICT in node:
                return {k: walk(v) for k, v in node[_DICT]}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)


def placeholders(skeleton: Any) -> dict[int, tuple[str, dict[str, Any] | None]]:
    """Each tensor of an encoded tree by index: its path in the tree (``model.0.weight``), and
    for a sharded one its placeholder (mesh dims, placements, global shape and stride)."""
    found: dict[int, tuple[str, dict[str, Any] | None]] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif isinstance(node, dict):
            if _TENSOR in node:
                found[node[_TENSOR]] = (path, None)
            elif _DTENSOR in node:
                found[node[_DTENSOR]] = (path, node)
            elif _TUPLE in node:
                walk(node[_TUPLE], path)
            elif _DICT in node:
                for k, v in node[_DICT]:
                    walk(v, f"{path}.{k}" if path else str(k))
            else:
                for k, v in node.items():
                    walk(v, f"{path}.{k}" if path else k)

    walk(skeleton, "")
    return found


def is_sharded(t: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor (see :func:`maitre.runtime.replica.is_sharded`)."""
    from maitre.runtime import replica

    return replica.is_sharded(t)


def _placement(p: Any) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # FSDP2 over TP: no Shard in torch 2.13, and its split
        return ["strided_shard", p.dim, int(p.split_factor)]  # factor orders the pieces
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise TypeError(f"cannot encode a tensor placed as {p!r} (partial sums are not state)")


def _placement_of(spec: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if spec == ["replicate"]:
        return Replicate()
    if not isinstance(spec, list) or not all(isinstance(v, int) for v in spec[1:]):
        raise ValueError(f"unknown placement {spec!r}")
    if len(spec) == 2 and spec[0] == "shard":
        return Shard(spec[1])
    if len(spec) == 3 and spec[0] == "strided_shard" and spec[2] >= 1:
        return _StridedShard(spec[1], split_factor=spec[2])
    raise ValueError(f"unknown placement {spec!r}")


def dumps(skeleton: Any) -> bytes:
    return json.dumps(skeleton, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return json.loads(data.decode())
