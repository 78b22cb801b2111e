"""maitre: elastic training for PyTorch on shared clusters.

The public surface of a training script is small: an :class:`ElasticSampler` for the data, an
:class:`ElasticLoop` that owns the step boundary, and optionally a scaling rule; or, for a script
that keeps its own ``loss.backward(); optimizer.step()`` loop, :func:`prepare`, which hands back
its model, optimizer and data ready for the same loop underneath. Everything else (coordinator,
agents, CLI) runs around the script.

The names are imported on first use (PEP 562), so that ``import maitre`` and the parts that never
touch a tensor (the CLI's client commands, the scheduling policy, the simulator) do not pay for
importing torch.
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from maitre._lazy import lazy_exports

if TYPE_CHECKING:
    from maitre.checkpoint import CheckpointConfig, IntervalConfig
    from maitre.errors import WorkerStopped
    from maitre.runtime.hooks import LossScaler
    from maitre.runtime.loop import Batch, ElasticLoop
    from maitre.runtime.prepare import prepare
    from maitre.runtime.reduction import Buckets
    from maitre.runtime.replica import replica_mesh
    from maitre.runtime.sampler import ElasticSampler
    from maitre.runtime.scaling import ConstantBatch, LinearScaling, SqrtScaling
    from maitre.runtime.state import TrainState

_HOMES = {
    "Batch": "maitre.runtime.loop",
    "Buckets": "maitre.runtime.reduction",
    "CheckpointConfig": "maitre.checkpoint.checkpointer",
    "ConstantBatch": "maitre.runtime.scaling",
    "ElasticLoop": "maitre.runtime.loop",
    "ElasticSampler": "maitre.runtime.sampler",
    "IntervalConfig": "maitre.checkpoint.policy",
    "LinearScaling": "maitre.runtime.scaling",
    "LossScaler": "maitre.runtime.hooks",
    "SqrtScaling": "maitre.runtime.scaling",
    "TrainState": "maitre.runtime.state",
    "prepare": "maitre.runtime.prepare",
    "WorkerStopped": "maitre.errors",
    "replica_mesh": "maitre.runtime.replica",
}
"""Where each public name is defined."""

__all__ = [
    "Batch",
    "Buckets",
    "CheckpointConfig",
    "ConstantBatch",
    "ElasticLoop",
    "ElasticSampler",
    "IntervalConfig",
    "LinearScaling",
    "LossScaler",
    "SqrtScaling",
    "TrainState",
    "WorkerStopped",
    "prepare",
    "replica_mesh",
]
try:  # the version is written once, in pyproject.toml; an installed package's metadata has it
    __version__ = _metadata.version("maitre")
except _metadata.PackageNotFoundError:  # (the source tree on sys.path, never installed)
    __version__ = "0+unknown"


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
