"""Warm worker start: fork workers from a process that has already imported torch.

A Python worker spends seconds importing torch before it trains a single step (3 s of CPU on a
laptop core, far more on a node whose cores are busy training). During a join that is time its
slot is held and idle. The agent instead keeps a fork server (:mod:`multiprocessing`'s
``forkserver``, started once per agent process with torch and maitre preloaded) and forks each
worker from it: the worker starts with its imports done, in tens of milliseconds, and shares the
imported pages copy-on-write with its siblings.

Only commands that run a Python script or module with this interpreter can start warm
(``python script.py ...`` or ``python -m module ...``); anything else, or ``MAITRE_WARM_START=0``,
starts with :class:`subprocess.Popen` as before. Both kinds of job start warm: an ``ElasticLoop``
joiner, and every process of a restart-mode gang (an unmodified script, started again whole at
each restart: the imports were most of a restart). The forked worker gets the command's
arguments, environment and working directory, its own session (signals meant for it never reach
the agent), its stdout and stderr on pipes the agent reads, the thread count its
``OMP_NUM_THREADS`` asks for, and the end python gives a script (its non-daemon threads waited
for, its ``atexit`` functions run, its traceback as python prints it, ``sys.exit``'s code), as a
cold-started one does. The fork
server only imports (torch initialises CUDA lazily, at first use), so forked workers should be
free to use CUDA; that is not yet checked on a GPU machine: with a CUDA fork error, set
``MAITRE_WARM_START=0``.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from maitre import procs
from maitre.protocol import WARM_START as ENV

PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "maitre", "maitre.runtime.loop"]
"""Imported once in the fork server. torch._dynamo is what `torch.optim` optimizers import
lazily at construction (about 2.5 s of a worker's start here)."""

_lock = threading.Lock()
_context: Any = None


def _ctx() -> Any:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


def prewarm() -> None:
    """Start the fork server now (it imports torch once, for a few seconds), not at the
    first worker. Returns at once: the imports go on in the fork server (see :func:`warm`)."""
    if enabled():
        _ctx()
        multiprocessing.forkserver.ensure_running()


WARM_TIMEOUT_S = 120.0
"""How long :func:`warm` waits for the fork server's imports (torch's take 3 s of a laptop core,
tens of seconds on a node whose cores are busy)."""

_probe: "_Probe | None" = None
_cold: str | None = None
"""Why this process's fork server cannot start workers (it failed to start): they start cold."""


class _Probe:
    """A process forked from the fork server to do nothing, on a thread of its own: its start
    returns once the fork server has forked it, which it does only after its imports. (The fork
    server takes requests before then: its socket exists from its start, and nothing else says
    when it is ready.)"""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        threading.Thread(target=self._run, name="maitre-warm-probe", daemon=True).start()

    def _run(self) -> None:
        try:
            proc = _ctx().Process(target=_noop, name="maitre-warm-probe", daemon=True)
            proc.start()
            proc.join()
        except Exception as exc:  # noqa: BLE001 -- the fork server died (an import crashed it)
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            self.done.set()


def _noop() -> None:
    pass


def warm(timeout_s: float | None = None, stop: threading.Event | None = None) -> str | None:
    """Start the fork server if need be and wait until it has done its imports: None once it
    has (at once after the first time in a process, or when warm start is off), else why not.

    The agent calls it before its first beat, so that a node is known to the coordinator only
    once its workers can start in milliseconds: a node that registered while its fork server
    was still importing torch was given its share of a restart-mode gang at once, and the whole
    gang, stopped for it, waited for those imports in its process group (14.5 s after a join
    on a busy machine, 0.5 s after a loss). A joiner of an in-place job pays the same imports
    before its first step either way; the running workers train on meanwhile.

    Bounded: past ``timeout_s`` (default :data:`WARM_TIMEOUT_S`) it says so and the node goes
    on (its workers are forked once the imports are done, as they were before); a fork server
    that failed turns warm start off for this process (its workers start cold, with ``exec``).
    ``stop`` set: it returns at once (the agent is stopping). Several agents in one process (a
    local run's nodes) share the fork server, and the one probe."""
    global _probe, _cold
    if not enabled():
        return None
    with _lock:
        if _probe is None:
            _probe = _Probe()
        probe = _probe
    limit = WARM_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    while not probe.done.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
        if stop is not None and stop.is_set():
            return "stopped while the fork server imported"
        if time.monotonic() >= deadline:
            return f"the fork server's imports ({', '.join(PRELOAD)}) were not done after {limit:g}s"
    if probe.error is not None:
        _cold = f"the fork server failed ({probe.error})"
        return f"{_cold}: workers start cold"
    return None


def reap(timeout_s: float = 5.0) -> None:
    """SIGKILL every warm worker of this process still running (its session: what it started
    too) and wait for it: the last act of a process that ran an agent. A warm worker is a
    non-daemon child (so that it may start DataLoader workers of its own), which python waits
    for at exit: one left running would keep the agent's process alive as long as it runs."""
    children = multiprocessing.active_children() if _context is not None else []
    for proc in children:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # (before its setsid: not yet a group)
            proc.kill()
    for proc in children:
        proc.join(timeout_s)


def enabled(env: dict[str, str] | None = None) -> bool:
    return (env or os.environ).get(ENV, "1") != "0" and sys.platform != "win32" and _cold is None


def warm_target(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``("path"|"module", target, argv)`` when ``command`` runs Python code with this very
    interpreter, else None (then it is started cold)."""
    if len(command) < 2 or Path(command[0]).resolve() != Path(sys.executable).resolve():
        return None
    if command[1] == "-m" and len(command) >= 3:
        return "module", command[2], [command[2], *command[3:]]
    if command[1].startswith("-"):
        return None  # interpreter flags (-X, -u, -c ...): run it as asked
    return "path", command[1], list(command[1:])


class WarmProcess:
    """What the agent needs of a worker process (a :class:`subprocess.Popen` look-alike)."""

    def __init__(self, command: Sequence[str], env: dict[str, str], cwd: str | None = None) -> None:
        target = warm_target(command)
        if target is None:
            raise ValueError(f"not a Python command of this interpreter: {command!r}")
        ctx = _ctx()
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        args = (*target, env, cwd or os.getcwd(), out_w, err_w, os.getpid())
        self._proc = ctx.Process(target=_child, args=args, daemon=False)
        self._proc.start()
        out_w.close()
        err_w.close()
        self.pid = self._proc.pid
        self.stdout = io.open(os.dup(out_r.fileno()), "r", errors="replace")
        self.stderr = io.open(os.dup(err_r.fileno()), "r", errors="replace")
        out_r.close()
        err_r.close()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            import subprocess

            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def _threads(env: dict[str, str]) -> None:
    """torch sized its thread pool when the fork server imported it, from the agent's
    environment: a worker told ``OMP_NUM_THREADS=1`` (every worker is, unless its job says
    otherwise, as under torchrun) would otherwise compute with one thread per core of the node,
    each of its siblings too."""
    value = env.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def _watch_agent(agent: int) -> None:
    """End this worker, and everything in its session, once the agent that asked for it is gone
    (at once when it is gone already). Called first thing in the forked worker.

    The fork server outlives its agent for a moment: it ends when it reads that the agent
    closed its end of their pipe, and a request it took before that still forks a worker, whose
    agent is gone then (an agent stopped while a worker's start is under way; outside checks saw
    one train on for 5 minutes). A worker is also in a session of its own (signals meant for it
    never reach the agent), so an agent killed outright takes nothing with it. So the worker
    watches the agent itself: a pidfd, readable once that process has ended. The pid could name
    another process only after the agent ended and its pid was reused; the agent started the
    fork server (the worker's parent), so while the fork server's parent is the agent, the
    pidfd opened just before is the agent's."""
    try:
        pidfd: int | None = os.pidfd_open(agent)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the fork server's end instead
        pidfd = None
    server = os.getppid()
    if (proc := procs.stat(server)) is None or proc.parent != agent:
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while os.getppid() == server:  # (the fork server ends with its agent)
                time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)  # (the worker leads its session's group: all it started)
        os._exit(1)

    threading.Thread(target=watch, name="maitre-agent-watch", daemon=True).start()


def _child(
    kind: str, target: str, argv: list[str], env: dict[str, str], cwd: str, out_w: Any, err_w: Any, agent: int
) -> None:
    """Runs in the forked worker: become the command, as ``python`` would have started it,
    for as long as its agent (the process ``agent``) lives."""
    os.setsid()
    _watch_agent(agent)
    procs.name_self(Path(target).name)  # (the script's in ps and top, not the fork server's)
    os.dup2(out_w.fileno(), 1)
    os.dup2(err_w.fileno(), 2)
    out_w.close()
    err_w.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    _threads(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    try:
        if kind == "module":
            sys.path.insert(0, cwd)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            script = Path(target)
            sys.path.insert(0, str(script.resolve().parent))
            sys.argv[0] = str(script)
            runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 -- printed as python prints it, then exit 1
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
        traceback.print_exception(type(exc), exc, _script_frames(exc.__traceback__))
    _exit(code)


def _exit_code(exc: SystemExit) -> int:
    """``sys.exit(x)``'s exit code, as python gives it."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _script_frames(tb: Any) -> Any:
    """The traceback from the script's first frame: not this module's nor runpy's, which a
    cold-started script does not have."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return tb


def _exit(code: int) -> None:
    """End as python ends: wait for the script's non-daemon threads, run its ``atexit``
    functions, flush, exit (a negative ``code``: by that signal, as python ends on an uncaught
    KeyboardInterrupt). (multiprocessing would end the process with ``os._exit`` right after
    the target returns, skipping the script's ``atexit`` functions.)"""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)
