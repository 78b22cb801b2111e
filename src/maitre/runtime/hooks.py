"""The step's recipe between the reduced gradients and ``optimizer.step()``.

What real recipes do there must see the *global* gradient, the mean over the whole global batch,
never one rank's share: in the loop body a rank holds only its share's sum, so a script that
clips there clips a different vector at every world size and trains differently each time it is
resized. :class:`~maitre.runtime.loop.ElasticLoop` therefore runs these itself, after its
allreduce and its division by the global sample count, on every rank alike:

1. **Loss scaling** (``precision="fp16"``): the script backpropagates ``batch.backward(loss)``,
   which multiplies by the current scale. After the reduction the loop checks the reduced
   gradients for inf/NaN. They are the same tensor on every rank, so every rank decides the same
   way with no extra collective. A step with an overflow *commits nothing*: no optimizer step,
   no LR-schedule step, the data cursor stays, and the same step is trained again at half the
   scale. The samples are trained once, in the step that commits. Otherwise the gradients are
   unscaled in the same multiply as the division by the sample count, and after
   ``growth_interval`` steps in a row without an overflow the scale doubles
   (``torch.amp.GradScaler``'s rule). The scale is part of the job's state: it goes to joiners
   and into checkpoints.
2. **Clipping by the global norm** (``clip_grad_norm=c``):
   ``torch.nn.utils.clip_grad_norm_`` over the reduced gradients. In a replica of several
   processes (FSDP2, TP) the norm is summed over the replica's pieces, each element counted
   once (see :func:`clip`), so it is the global norm there as well.
3. **``on_reduced_grads(batch)``**, a callback for anything else: gradient noise statistics,
   per-layer scaling, logging. It runs on every rank. It must depend only on the reduced
   gradients and the committed state, never on rank-local data, or the ranks' models diverge.
   ``batch.grad_norm`` holds the norm the loop clipped by (None without clipping).

Mixed precision: ``batch.autocast()`` is ``torch.autocast`` for the loop's precision
(``"bf16"`` or ``"fp16"``; a no-op without one). The parameters, their gradients and the
optimizer state stay in the parameters' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from maitre.runtime import replica as replicas

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scaling decided on the reduced gradients (see the module docstring)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Steps in a row without an overflow since the scale last changed."""
        self.skipped = 0
        """Steps skipped for an overflow so far."""

    def update(self, finite: bool) -> None:
        """After a step's overflow check: back off on an overflow, grow after a run of good steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped": self.skipped,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])


@dataclass(frozen=True, slots=True)
class StepHooks:
    """What the loop runs between the reduced gradients and the optimizer's step."""

    precision: str | None = None
    """``"bf16"``, ``"fp16"`` (with a :class:`LossScaler`) or None."""
    clip_grad_norm: float | None = None
    on_reduced_grads: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None, got {self.precision!r}")
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be a positive number, got {self.clip_grad_norm}")
        if self.on_reduced_grads is not None and not callable(self.on_reduced_grads):
            raise ValueError("on_reduced_grads must be callable")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return PRECISIONS.get(self.precision) if self.precision else None


def all_finite(buffers: list[torch.Tensor]) -> bool:
    """No inf or NaN in any of the (reduced) gradient buffers."""
    return all(bool(torch.isfinite(b).all()) for b in buffers)


def clip(params: list[torch.nn.Parameter], max_norm: float, replica: "replicas.Replica | None" = None) -> float:
    """Clip the (reduced) gradients to ``max_norm`` by their global norm; returns that norm.

    In a replica of several processes (by default this process's, :func:`replicas.current`)
    the norm is over the whole model, whose pieces lie on different meshes (FSDP2 on
    ``dp_shard``, TP on both dimensions, plain or ``dp_shard``-only parameters replicated on
    ``tp``), which ``torch.nn.utils.clip_grad_norm_`` cannot mix: each process sums the squares
    of the pieces it counts (:func:`replicas.counted`: every element once, a ``tp``-replicated
    one not ``tp`` times), one allreduce inside the replica adds them up, and every process
    scales its pieces by the same factor, as torch's rule does (``max_norm / (norm + 1e-6)``,
    at most 1). The gradients are reduced over the replicas already: every replica computes the
    same norm."""
    rep = replica or replicas.current()
    if rep is None or rep.nproc == 1:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    local = [g.to_local() if replicas.is_sharded(g) else g for g in grads]
    device = local[0].device
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    for g, mine in zip(grads, local):
        if replicas.counted(g, rep) and mine.numel():
            squares += torch.linalg.vector_norm(mine).double().square()
    torch.distributed.all_reduce(squares, group=rep.group)
    norm = squares.sqrt()
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for mine in local:
        mine.mul_(factor.to(mine.dtype))
    return float(norm)
