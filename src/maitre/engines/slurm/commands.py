"""Slurm's commands, run in one place: every failure names the command and Slurm's message.

Slurm finds its cluster by ``SLURM_CONF`` (or its default ``/etc/slurm/slurm.conf``): the
environment given here is passed to every command, so tests point it at their own cluster.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class SlurmError(RuntimeError):
    """A Slurm command failed or could not be run; ``str()`` is the one line to show."""

    def __init__(self, command: Sequence[str], message: str) -> None:
        self.command = list(command)
        self.message = message.strip() or "no message"
        super().__init__(f"{shlex.join(self.command)}: {self.message}")


@dataclass(slots=True)
class Slurm:
    """Runs Slurm's command-line tools, each with a timeout."""

    env: Mapping[str, str] | None = None
    """The environment of every command (None: this process's)."""
    timeout_s: float = 30.0
    calls: list[list[str]] = field(default_factory=list)
    """Every command run, in order (what a test or a log wants to see)."""

    def __call__(self, *args: str) -> str:
        """Run ``args`` and return its standard output; :class:`SlurmError` if it fails."""
        cmd = list(args)
        self.calls.append(cmd)
        try:
            done = subprocess.run(
                cmd,
                env=None if self.env is None else dict(self.env),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            raise SlurmError(
                cmd, f"{cmd[0]} is not installed (Slurm's client tools are needed on the coordinator's machine)"
            ) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(cmd, f"no answer within {self.timeout_s:g} s (is slurmctld reachable?)") from None
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            raise SlurmError(cmd, lines[-1] if lines else f"exit status {done.returncode}")
        return done.stdout
