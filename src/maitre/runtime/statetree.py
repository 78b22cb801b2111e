"""A pickle-free encoding of training state: a JSON skeleton plus a flat list of tensors.

State dicts of models, optimizers and schedulers are trees of dicts (with string or integer
keys), lists, tuples, numbers, strings, ``None`` and tensors. :func:`encode` replaces every tensor
with a numbered placeholder and returns the JSON-able skeleton and the tensors in order;
:func:`decode` puts tensors back. The live state transfer (:mod:`maitre.runtime.transfer`) sends
the skeleton as UTF-8 bytes and the tensors as flat buffers over ``torch.distributed``; nothing is
ever unpickled, so a peer or a file can at worst send wrong numbers, never code.
"""

from __future__ import annotations

import json
from typing import Any

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def encode(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``tree`` into a JSON-able skeleton and its tensors (in placeholder order)."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
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


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode`."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if _TENSOR in node:
                index = node[_TENSOR]
                if not isinstance(index, int) or not 0 <= index < len(tensors):
                    raise ValueError(f"tensor placeholder {index!r} out of range")
                return tensors[index]
            if _TUPLE in node:
                return tuple(walk(v) for v in node[_TUPLE])
            if _DICT in node:
                return {k: walk(v) for k, v in node[_DICT]}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)


def dumps(skeleton: Any) -> bytes:
    return json.dumps(skeleton, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return json.loads(data.decode())
