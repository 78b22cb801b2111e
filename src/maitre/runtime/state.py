"""TrainState: everything that makes two workers interchangeable at a step boundary.

The committed state of a job is its step count plus the state of every stateful object that
training touches: model, optimizer, LR schedule, sampler (data epoch and cursor), the scaling
rule, random number generators (python, torch, and numpy when the script uses it) and any extra
object the user registers (anything with ``state_dict`` / ``load_state_dict``). The runtime
captures it to send to a peer that is behind; the checkpoint writer will capture the same tree.

Both copy it while the next step computes, where they can: the parameters the optimizer owns and
its state are written by nothing but the optimizer's update, so they may still be read until the
next update (:func:`updated_storages`); everything else is copied before the next step begins.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Protocol

import torch

from maitre.runtime import statetree


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")  # only if the script already uses numpy
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


class TrainState:
    """The stateful objects of one training process and its committed step."""

    def __init__(self, **objects: Stateful | None) -> None:
        self.objects: dict[str, Stateful] = {k: v for k, v in objects.items() if v is not None}
        self.step = 0
        self.skipped = 0
        """Samples left out of the committed steps because their data could not be read
        (``on_error="skip"``), over all ranks and every run the state went through."""

    def register(self, name: str, obj: Stateful) -> None:
        """Add a user object (anything with ``state_dict``/``load_state_dict``) to the state."""
        if name in self.objects or name in ("step", "skipped", "rng"):
            raise ValueError(f"state name {name!r} is already taken")
        self.objects[name] = obj

    def state_dict(self) -> dict[str, Any]:
        tree: dict[str, Any] = {name: obj.state_dict() for name, obj in self.objects.items()}
        tree["step"] = self.step
        tree["skipped"] = self.skipped
        tree["rng"] = rng_state()
        return tree

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        missing = set(self.objects) - set(tree)
        if missing:
            raise ValueError(f"state has no entry for {sorted(missing)}")
        for name, obj in self.objects.items():
            obj.load_state_dict(tree[name])
        self.step = int(tree["step"])
        self.skipped = int(tree.get("skipped", 0))  # (none in a state saved before it was kept)
        set_rng_state(tree["rng"])


def storage(t: torch.Tensor) -> int:
    """The address of the memory ``t`` is a view of (tensors that share it share this)."""
    return t.untyped_storage().data_ptr()


def updated_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """The storages that only ``optimizer``'s update writes: the parameters it owns (a sharded
    one's local shard) and its state. Not the model's other parameters (a frozen teacher or an
    EMA copy that the step's body may write), nor its buffers, which a forward may write in
    place (batch-norm statistics), nor a weight its forward renormalizes in place (an
    ``nn.Embedding`` with ``max_norm``), nor anything sharing their storage."""
    tensors: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    for per_param in optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    written: list[torch.Tensor] = [*model.buffers()]
    written += [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.max_norm is not None]
    return frozenset(_storage(t) for t in tensors) - {_storage(t) for t in written}


def _storage(t: torch.Tensor) -> int:
    return storage(t.to_local() if statetree.is_sharded(t) else t)
