"""Each rank's compute per step, shared in the control slots, and rank 0's straggler verdicts.

A step's *compute* is the time from its start to this rank's arrival at its first collective;
divided by the rank's work (samples, or tokens when the script logs them) it is comparable
across ranks with uneven shares. Each rank keeps a window of them
(:class:`maitre.runtime.stragglers.Window`); at a window's last step its value, its held pace
and its work per step go into its three timing slots (:mod:`maitre.runtime.control`), the
step's reduction carries them to every rank, and rank 0 runs the detector on them
(:class:`maitre.runtime.stragglers.Detector`). With the policy ``off`` nothing is shared.

The settings come from the process's environment (``MAITRE_STRAGGLER_*``, set by the
coordinator from the job's ``stragglers``; ``MAITRE_SLOW_RANK`` and ``MAITRE_STEP_JITTER``
inject a slow rank for tests and benchmarks; ``MAITRE_STRAGGLER_TRACE`` records every step's
timing for diagnostics). A bad one is a :class:`ValueError` naming the variable.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any, Mapping

import torch

from maitre import protocol
from maitre.runtime import stragglers
from maitre.runtime.control import SLOTS, split_timing, timing, timing_slots
from maitre.runtime.env import WorkerEnv


class StepTiming:
    """This rank's timing of its steps, its window, and (rank 0) the detector."""

    def __init__(self, env: WorkerEnv, environ: Mapping[str, str]) -> None:
        thresholds = stragglers.Thresholds.from_environ(environ)
        self.faults = stragglers.Injected.from_environ(environ)
        self.detector = stragglers.Detector(thresholds) if thresholds.policy != "off" else None
        """Rank 0's verdicts on the ranks' timings (None: policy ``off``, nothing shared)."""
        self.window = stragglers.Window(thresholds.window * thresholds.windows)
        """This rank's compute per unit of work over the window so far, and its last steps."""
        self.trace = _trace_file(environ.get(protocol.STRAGGLER_TRACE, ""), env)
        """Diagnostics: where this rank appends its timing per step (None: not asked)."""
        self.began = self._cpu_began = 0.0

    def slots(self, world_size: int) -> int:
        """The timing slots an epoch of ``world_size`` members shares (none with ``off``)."""
        return timing_slots(world_size) if self.detector is not None else 0

    def begin(self) -> float:
        """A step starts now (``time.monotonic()``, returned)."""
        self.began = time.monotonic()
        self._cpu_began = time.thread_time()
        return self.began

    def end(
        self,
        control: torch.Tensor,
        *,
        step: int,
        work: int,
        epoch: int,
        rank: int,
        world_size: int,
        group: tuple[int, int] | None,
        trains: bool,
    ) -> None:
        """This rank arrived at the step's first collective: its compute this step into its
        window (and its trace); at a window's last step, its three timing slots filled (every
        other timing slot zero). ``group``: (rank, size) in the epoch's group (None: none yet);
        ``trains``: not a listener (injected slowness applies to training ranks only)."""
        if trains and self.faults:  # MAITRE_SLOW_RANK, _FACTOR, _STEP_JITTER
            time.sleep(self.faults.pause(rank, step, time.monotonic() - self.began))
        compute_s = time.monotonic() - self.began
        if self.trace is not None:
            line = {
                "step": step,
                "epoch": epoch,
                "rank": rank,
                "world_size": world_size,
                "work": work,
                "compute_s": round(compute_s, 7),
                "cpu_s": round(time.thread_time() - self._cpu_began, 7),
            }
            self.trace.write(json.dumps(line) + "\n")
        if self.detector is None or group is None:
            return
        self.window.add(compute_s, work)
        control[SLOTS:] = 0.0
        if step % self.detector.t.window == 0:
            for index, value in zip(timing(group[1], group[0]), self.window.take()):
                control[index] = value

    def judge(self, control: torch.Tensor, step: int, members: list[str]) -> tuple[list[Any], bool]:
        """At a window's last step, the detector's verdicts on every member's reduced timing
        slots, and whether they name their workers (``members``: worker ids by group rank, when
        the coordinator named them); no verdict on other steps."""
        det = self.detector
        if det is None or step % det.t.window:
            return [], False
        values, held, works = split_timing([float(v) for v in control[SLOTS:].tolist()])
        keys = members if len(members) == len(values) else None
        return det.observe(max(1, step - det.t.window + 1), step, values, keys, works, held), keys is not None

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _trace_file(directory: str, env: WorkerEnv) -> IO[str] | None:
    """``MAITRE_STRAGGLER_TRACE`` (diagnostics): this process's trace, line-buffered (None when
    unset)."""
    if not directory.strip():
        return None
    name = env.worker_id if env.nproc == 1 else f"{env.worker_id}.p{env.proc}"
    path = Path(directory) / f"{name}.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", buffering=1)
    except OSError as exc:
        raise ValueError(f"{protocol.STRAGGLER_TRACE}={directory!r}: {exc}") from None
