"""Checkpoints that barely block and never lie.

A save has two phases: a snapshot (:mod:`.snapshot`: copy this rank's part of the state into
reused host memory, the only part that blocks a step) and a persist (:mod:`.writer`: a background
thread writes safetensors and JSON files, fsyncs them, and the committing rank writes a manifest
of checksums and renames the directory into place). :mod:`.loader` verifies every checksum before
using a byte and falls back to the previous complete checkpoint; :mod:`.policy` picks the
interval (Young/Daly). :mod:`.format` is the one place that knows the bytes on disk. Sharded
state (a replica of several processes) is written by one replica, each process its own pieces,
and resharded on load for any mesh (:mod:`.reshard`).

The names below are imported on first use (PEP 562): :mod:`.policy` needs no torch, and importing
it, or ``maitre.IntervalConfig``, should not import torch through this file.
"""

from typing import TYPE_CHECKING

from maitre._lazy import lazy_exports

if TYPE_CHECKING:
    from maitre.checkpoint.checkpointer import CheckpointConfig, Checkpointer
    from maitre.checkpoint.format import CorruptCheckpoint, UnusableCheckpoint
    from maitre.checkpoint.loader import Loaded, load, load_latest
    from maitre.checkpoint.policy import IntervalConfig, daly_interval_s

_HOMES = {
    "CheckpointConfig": "maitre.checkpoint.checkpointer",
    "Checkpointer": "maitre.checkpoint.checkpointer",
    "CorruptCheckpoint": "maitre.checkpoint.format",
    "IntervalConfig": "maitre.checkpoint.policy",
    "UnusableCheckpoint": "maitre.checkpoint.format",
    "Loaded": "maitre.checkpoint.loader",
    "daly_interval_s": "maitre.checkpoint.policy",
    "load": "maitre.checkpoint.loader",
    "load_latest": "maitre.checkpoint.loader",
}
"""Where each public name is defined."""

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "CorruptCheckpoint",
    "IntervalConfig",
    "Loaded",
    "UnusableCheckpoint",
    "daly_interval_s",
    "load",
    "load_latest",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
