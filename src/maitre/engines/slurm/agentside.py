"""A replica job's agent (``maitre agent --slurm``): which node it is, and its labels.

Inside a Slurm job step, ``SLURMD_NODENAME`` names the node (several ``slurmd -N`` may share a
host) and ``SLURM_JOB_ID`` the replica job; the node's labels (switches as ``rack``/``block``,
the GPU type as ``accelerator``) are Slurm's, read with ``scontrol``.
"""

from __future__ import annotations

from collections.abc import Mapping

from maitre.engines.slurm import inventory
from maitre.engines.slurm.commands import Slurm, SlurmError


def identity(env: Mapping[str, str], slurm: Slurm) -> tuple[str, dict[str, str]]:
    """(node name, labels) of the node this job step runs on; ValueError outside Slurm."""
    node = env.get("SLURMD_NODENAME")
    if not node or not env.get("SLURM_JOB_ID"):
        raise ValueError(
            "--slurm: not inside a Slurm job (no SLURMD_NODENAME/SLURM_JOB_ID); "
            "maitre up --slurm submits the agents itself"
        )
    try:
        found = inventory.read(slurm).node(node)
    except SlurmError as exc:
        raise ValueError(f"--slurm: {exc}") from None
    return node, dict(found.labels) if found is not None else {}
