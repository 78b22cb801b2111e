"""maitre: elastic training for PyTorch on shared clusters.

The public surface of a training script is small: an :class:`ElasticSampler` for the data, an
:class:`ElasticLoop` that owns the step boundary, and optionally a scaling rule. Everything else
(coordinator, agents, CLI) runs around the script.
"""

from maitre.checkpoint import CheckpointConfig, IntervalConfig
from maitre.runtime.loop import Batch, ElasticLoop
from maitre.runtime.sampler import ElasticSampler
from maitre.runtime.scaling import ConstantBatch, LinearScaling, SqrtScaling
from maitre.runtime.state import TrainState

__all__ = ["Batch", "CheckpointConfig", "ConstantBatch", "ElasticLoop", "ElasticSampler",
           "IntervalConfig", "LinearScaling", "SqrtScaling", "TrainState"]
__version__ = "0.1.0"
