"""Checkpoints that barely block and never lie.

A save has two phases: a snapshot (:mod:`.snapshot`: copy this rank's part of the state into
reused host memory, the only part that blocks a step) and a persist (:mod:`.writer`: a background
thread writes safetensors and JSON files, fsyncs them, and the committing rank writes a manifest
of checksums and renames the directory into place). :mod:`.loader` verifies every checksum before
using a byte and falls back to the previous complete checkpoint; :mod:`.policy` picks the
interval (Young/Daly). :mod:`.format` is the one place that knows the bytes on disk.
"""

from maitre.checkpoint.checkpointer import CheckpointConfig, Checkpointer
from maitre.checkpoint.format import CorruptCheckpoint
from maitre.checkpoint.loader import Loaded, load, load_latest
from maitre.checkpoint.policy import IntervalConfig, daly_interval_s

__all__ = ["CheckpointConfig", "Checkpointer", "CorruptCheckpoint", "IntervalConfig", "Loaded",
           "daly_interval_s", "load", "load_latest"]
