"""What SIGTERM means to a training process, and the handler the loop installs for it.

Under torchrun or alone, SIGTERM (a preemption, ``scancel``, a pod deleted) means: finish the
step, checkpoint it, exit (:class:`SigtermLatch`: the loop reads it at the step boundary, and
delivers the signal again once it has ended). Under
an agent whose own SIGTERM is a spot notice, the one that reaches the worker too (Slurm's
``proctrack/cgroup`` signals the whole step) is the same notice: the agent drains its node and
the worker leaves at a step boundary when told (:func:`let_pass`). Under maitre otherwise the
coordinator suspends a job; the loop leaves the signal alone.

A handler is only installed from the main thread (Python's rule), and the one it replaced is
put back when the loop ends (:meth:`SigtermLatch.restore`).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class SigtermLatch:
    """The process's SIGTERM handler while the loop runs."""

    def __init__(self) -> None:
        self.heard: str | None = None
        """``"SIGTERM"`` once one came (with :meth:`catch`)."""
        self._previous: Any = None
        self._installed = False

    def catch(self) -> None:
        """SIGTERM is heard, not fatal: the loop stops with a checkpoint at the step boundary."""

        def on_sigterm(signum: int, frame: Any) -> None:
            self.heard = "SIGTERM"

        self._install(on_sigterm)

    def let_pass(self, worker_id: str) -> None:
        """SIGTERM is the agent's notice: said once, and otherwise left to the agent's drain."""
        said: list[bool] = []

        def on_sigterm(signum: int, frame: Any) -> None:
            if not said:
                said.append(True)
                print(
                    f"maitre: {worker_id} heard SIGTERM: its agent drains the node, it leaves at a step boundary "
                    "when told",
                    file=sys.stderr,
                    flush=True,
                )

        self._install(on_sigterm)

    def deliver(self) -> None:
        """The SIGTERM heard while the loop ran, once more, with the process's own handler back:
        the process ends as the signal meant (killed by it, 143 to a shell), or its handler runs."""
        if self.heard and threading.current_thread() is threading.main_thread():
            self.restore()
            signal.raise_signal(signal.SIGTERM)

    def restore(self) -> None:
        """Put back the handler the process had."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _install(self, handler: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # (a loop on a thread: ranks as threads in tests)
        previous = signal.signal(signal.SIGTERM, handler)
        if not self._installed:
            self._previous, self._installed = previous, True
