"""The node's processes as ``/proc`` shows them: who is whose parent, what each is named, the CPU
each has used; and the name a process gives itself. Linux only. One reader of
``/proc/<pid>/stat`` for the agent (a warm worker's check on its agent), the local launcher (a
story's data worker, found anywhere below a training process) and the tests (what a busy
neighbour takes of the machine); one writer of ``/proc/self/comm`` for a warm worker (its
script's name) and a data worker (``maitre-data-N``). Imports nothing of maitre's: the agent,
the launcher and the training process's data pipeline all use it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    parent: int
    state: str
    """``R``, ``S``, ``D``, ``Z`` (a zombie: ended, not yet waited for), ``X`` (dead) ..."""
    name: str
    """``comm``: 15 bytes of the program's name, or what the process named itself."""
    cpu_s: float
    """User and system CPU seconds it has used (its threads', not its children's)."""

    @property
    def live(self) -> bool:
        return self.state not in "ZX"


def stat(pid: int) -> Proc | None:
    """Process ``pid`` now, or None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    name, rest = text[text.index("(") + 1 :].rsplit(")", 1)  # (the name, in brackets, may hold spaces)
    fields = rest.split()
    return Proc(pid, int(fields[1]), fields[0], name, (int(fields[11]) + int(fields[12])) / TICK_S)


def table(live_only: bool = True) -> dict[int, Proc]:
    """Every process now (the live ones unless ``live_only`` is false), by pid."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := stat(int(entry))) is not None and (proc.live or not live_only):
            procs[proc.pid] = proc
    return procs


def children(pid: int, procs: dict[int, Proc] | None = None) -> list[int]:
    """The live child processes of ``pid``."""
    procs = table() if procs is None else procs
    return sorted(p.pid for p in procs.values() if p.parent == pid)


def descendants(pid: int, procs: dict[int, Proc] | None = None) -> list[int]:
    """Every process below ``pid`` at any depth (its children, theirs ...), not ``pid``."""
    procs = table() if procs is None else procs
    below: dict[int, list[int]] = {}
    for proc in procs.values():
        below.setdefault(proc.parent, []).append(proc.pid)
    found, todo = [], list(below.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(below.get(p, []))
    return sorted(found)


def name_self(name: str) -> None:
    """Name this process ``name`` in ``ps``, ``top`` and ``pgrep`` (``comm`` holds 15 bytes).
    Best effort; elsewhere than Linux nothing is named."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass
