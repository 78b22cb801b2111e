"""Live state transfer: after a membership change, peers that are behind get the state from one
that is ahead, over the new epoch's process group. Joiners never read disk.

Protocol (all members take part, so every step is a collective of the new group):

1. ``sync_steps``: one allreduce of a vector holding each member's committed step at its rank.
   Every member learns all steps; the source is the lowest rank at the highest step.
2. If anyone is behind, ``broadcast_state`` from the source: the length of the skeleton, the
   skeleton (JSON as bytes), then one flat buffer per dtype with every tensor of the state.
   Members already at the highest step receive too but keep their own state (their RNG streams
   stay theirs).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch

from maitre.runtime import statetree
from maitre.runtime.group import EpochGroup

_DTYPES = {str(t): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


def sync_steps(group: EpochGroup, step: int) -> list[int]:
    """Every member's committed step, indexed by rank."""
    steps = torch.zeros(group.world_size, dtype=torch.int64, device=group.device)
    steps[group.rank] = step
    group.allreduce(steps)
    return steps.tolist()


def broadcast_state(group: EpochGroup, tree: Any | None, src: int,
                    mesh_of: Callable[[tuple[str, ...]], Any] | None = None) -> tuple[Any, int]:
    """Send ``tree`` from rank ``src`` to every member; returns (tree, payload bytes).

    On the source, ``tree`` is the state to send; elsewhere it is ignored and the received
    tree is returned (tensors on the group's device; sharded ones on ``mesh_of``'s mesh)."""
    device = group.device
    if group.rank == src:
        skeleton, tensors = statetree.encode(tree)
        specs = [[str(t.dtype), list(t.shape)] for t in tensors]
        header = statetree.dumps({"skeleton": skeleton, "tensors": specs})
        size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(size, src)
    header_buf = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
                  if group.rank == src else
                  torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    group.broadcast(header_buf, src)
    meta = statetree.loads(bytes(header_buf.cpu().tolist()))
    specs = meta["tensors"]

    by_dtype: dict[str, list[int]] = defaultdict(list)
    for i, (dtype, _) in enumerate(specs):
        if dtype not in _DTYPES:
            raise ValueError(f"state tensor of unsupported dtype {dtype}")
        by_dtype[dtype].append(i)
    received: list[torch.Tensor | None] = [None] * len(specs)
    payload = len(header_buf)
    for dtype, indices in sorted(by_dtype.items()):
        numels = [_numel(specs[i][1]) for i in indices]
        if group.rank == src:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in indices])
        else:
            flat = torch.empty(sum(numels), dtype=_DTYPES[dtype], device=device)
        group.broadcast(flat, src)
        payload += flat.numel() * flat.element_size()
        for i, part in zip(indices, torch.split(flat, numels)):
            received[i] = part.view(specs[i][1])
    if group.rank == src:
        return tree, payload
    return statetree.decode(meta["skeleton"], received, mesh_of), payload  # type: ignore[arg-type]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
