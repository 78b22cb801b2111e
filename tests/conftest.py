"""Shared fixtures: a clean distributed environment for every test, and elastic runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"

# A suite started in the background of a script (`pytest ... &`, nohup) inherits SIGINT ignored,
# and so would every process it starts: the tests that stop agents and coordinators with SIGINT,
# as Ctrl-C does, would find them still running. Their SIGINT is python's again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _slowdown() -> float:
    """How many times slower than on a quiet machine this session's processes may run, because
    other processes take the cores: 1 on a quiet machine, 1 / (the share of the cores others
    left free) on a busy one, at most 4 (``tests/fairclock.py``), sampled over a second as the
    suite starts. ``SUITE_SLOWDOWN`` sets it."""
    if os.environ.get("SUITE_SLOWDOWN"):
        return max(1.0, float(os.environ["SUITE_SLOWDOWN"]))
    from fairclock import free_share

    from maitre import procs

    before, at = procs.table(live_only=False), time.monotonic()
    time.sleep(1.0)
    after, dt = procs.table(live_only=False), time.monotonic() - at
    free = free_share(os.getpid(), before, after, dt, len(os.sched_getaffinity(0)))
    return 1.0 if free >= 0.8 else round(min(4.0, 1.0 / max(free, 0.25)), 2)


SLOWDOWN = _slowdown()
"""Every wall-clock limit of the suite is multiplied by it: pytest-timeout's, :func:`run_tagged`'s,
:func:`wait_for`'s. A machine busy with something else slows the tests without failing them; a
test that hangs still fails, later."""


def pytest_report_header(config: pytest.Config) -> str:
    return f"time limits x{SLOWDOWN:g} (others' load as the suite started; SUITE_SLOWDOWN sets it)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SLOWDOWN == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = float(
            marker.args[0] if marker and marker.args else (marker.kwargs.get("timeout", default) if marker else default)
        )
        if limit > 0:
            item.add_marker(pytest.mark.timeout(limit * SLOWDOWN), append=False)


_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_dist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees (or leaks) torchrun's or maitre's variables."""
    for key in list(os.environ):
        if key in _DIST_VARS or key.startswith(("TORCHELASTIC_", "MAITRE_")):
            monkeypatch.delenv(key, raising=False)
    torch.set_num_threads(1)


# A tiny float64 configuration of the example: fast on 2 cores, exact enough for 1e-5 checks.
# Buckets of 4 KiB: its gradients are reduced in several buckets, launched while backward runs.
TINY = [
    "--dtype",
    "float64",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--block",
    "16",
    "--global-batch",
    "12",
    "--micro-batch",
    "4",
    "--log-every",
    "1000",
    "--bucket-cap-mb",
    "0.004",
]


def example_command(steps: int, out: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The example, TINY, for ``steps`` steps; ``extra`` flags come last (and win)."""
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps), *TINY, *extra]
    return cmd + (["--out", str(out)] if out is not None else [])


def audit_records(*runs: Path, steps: int, complete: bool = True) -> None:
    """Every sample once, from the training script's own record (``examples/train.py
    --record``), not maitre's ledger: of each step the attempt that committed is the last one
    tried (the highest membership epoch of the latest of ``runs``: a dropped step is tried again
    only in a later epoch or run). Steps 1 to ``steps`` each have one, and their samples cover
    every complete data epoch exactly once and the one in progress at most once (``complete``:
    and at least one data epoch was completed). Not for fp16 runs: a step an overflow skipped is
    tried again in the same epoch, and the record cannot tell the two attempts apart."""
    import json
    from collections import Counter, defaultdict

    last: dict[int, tuple[tuple[int, int], list[dict]]] = {}
    for r, folder in enumerate(runs):
        for path in sorted(folder.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                e = json.loads(line)
                key, have = (r, e["epoch"]), last.get(e["step"])
                if have is None or key > have[0]:
                    last[e["step"]] = (key, [e])
                elif key == have[0]:
                    have[1].append(e)
    missing = sorted(set(range(1, steps + 1)) - set(last))
    assert not missing and max(last) == steps, f"steps with no record: {missing[:20]}, last {max(last, default=0)}"
    seen: dict[int, Counter] = defaultdict(Counter)
    for _, entries in last.values():
        for e in entries:
            seen[e["data_epoch"]].update(e["ids"])
    samples = next(iter(last.values()))[1][0]["samples"]
    for d, counts in sorted(seen.items()):
        twice = sorted(i for i, c in counts.items() if c > 1)
        assert not twice, f"data epoch {d}: samples trained more than once: {twice[:20]}"
        if d < max(seen):
            lost = sorted(set(range(samples)) - set(counts))
            assert not lost, f"data epoch {d}: samples never trained: {lost[:20]}"
    assert len(seen) > 1 or not complete, "no data epoch completed: nothing to audit"


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every finite entry of ``b`` (a must be finite in the same places)."""
    assert a.keys() == b.keys()
    num = den = 0.0
    for k in b:
        finite = torch.isfinite(b[k])
        assert torch.equal(finite, torch.isfinite(a[k])), k
        num += float((a[k][finite].double() - b[k][finite].double()).pow(2).sum())
        den += float(b[k][finite].double().pow(2).sum())
    return (num / den) ** 0.5


TAG_VAR = "MAITRE_TEST_TAG"


def _tagged_pids(tag: str) -> list[int]:
    return pids_with_env(TAG_VAR, tag)


def pids_with_env(name: str, value: str) -> list[int]:
    """The live processes (but this one) whose environment sets ``name`` to ``value``."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every live process tagged ``tag``; returns those there were (none: clean)."""
    left = _tagged_pids(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


class Procs:
    """``maitre`` commands run by one test, tagged so that none outlives it (``cleanup``)."""

    def __init__(self, tmp: Path) -> None:
        self.tag = os.urandom(8).hex()
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, *args: str, **extra_env: str) -> subprocess.Popen[str]:
        """``maitre <args>``, its output in ``<name>.log``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
        env.update({TAG_VAR: self.tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env})
        log = open(self.tmp / f"{name}.log", "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "maitre.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in _tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_tagged(cmd: list[str], timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on a timeout, or if anything it started outlives it, kill those by pid."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1"}, **extra_env)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout * SLOWDOWN)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout * SLOWDOWN:g} s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        kill_tagged(tag)  # nothing should be left; never leak it if it is
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """``reference(steps, *extra)``: the final parameters of the example (TINY, then ``extra``
    flags) trained by one fixed-size process for ``steps`` steps, computed once per setting for
    the whole session."""
    cache: dict[tuple[int, tuple[str, ...]], dict[str, torch.Tensor]] = {}

    def get(steps: int, *extra: str) -> dict[str, torch.Tensor]:
        if (steps, extra) not in cache:
            out = tmp_path_factory.mktemp("reference") / "final.pt"
            result = run_tagged(example_command(steps, out, extra), timeout=300)
            assert result.returncode == 0, result.stderr
            cache[(steps, extra)] = torch.load(out, weights_only=True)
        return cache[(steps, extra)]

    return get


def play(tmp_path: Path, command: list[str], events: str, **cfg: object) -> tuple[int, list[str], object]:
    """Run ``command`` under an embedded ``maitre run`` with its scripted story (``events``);
    returns (exit code, its lines, the run). ``cfg``: more of :class:`RunConfig`. Asserts the
    story was played whole and nothing is left running; a run that hangs says where it is
    before pytest-timeout kills it."""
    import threading

    from maitre.launch import Run, RunConfig
    from maitre.story import parse_events

    lines: list[str] = []
    run = Run(
        RunConfig(command=command, events=parse_events(events), run_dir=tmp_path / "run", quiet_workers=True, **cfg),  # type: ignore[arg-type]
        out=lines.append,
    )
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(150 * SLOWDOWN):
            print(
                "still running after 150 s:\n" + "\n".join(lines) + f"\njob: {run.job()}", file=sys.stderr, flush=True
            )

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        code = run.start().wait()
    finally:
        done.set()
    assert run.played == run.cfg.events, "the job ended before the story did:\n" + "\n".join(lines)
    for agent in run.agents:  # every process of every worker is gone
        for worker in agent.workers.values():
            assert not worker.alive(), f"{worker.worker_id} still running"
    return code, lines, run


def wait_for(predicate, timeout: float, what: str, log: Path | list[str] | Callable[[], str] | None = None):
    """``predicate()``'s first true value within ``timeout`` s (polled), else an AssertionError
    naming ``what``, with the end of ``log`` (a file, or lines), or what ``log()`` says then.
    (``timeout`` times :data:`SLOWDOWN`.)"""
    deadline = time.monotonic() + timeout * SLOWDOWN
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    if callable(log):
        detail = log()
    elif isinstance(log, list):
        detail = "\n".join(log)[-6000:]
    else:
        detail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{detail}")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (the daemons a test starts are told them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def announced_address(log: Path) -> str | None:
    """The address ``maitre up`` printed in ``log`` (``coordinator at HOST:PORT``), once it has."""
    lines = [ln for ln in log.read_text().splitlines() if "coordinator at " in ln]
    return lines[0].split("coordinator at ")[1].split()[0] if lines else None
