"""Node health probes: a short compute and memory check that the agent runs before its node
takes work and every ``interval_s`` after (``maitre agent --health-interval``), plus the site's
own check, the way Slurm runs its ``HealthCheckProgram`` (``--health-check CMD``).

Every probe runs in a child process, never in the agent's own: a probe that hangs (a GPU that
no longer answers, a file system that blocks) is killed with its process group at
``timeout_s`` and counts as a failure, and the agent goes on beating. The result rides the
node's beat (:class:`maitre.protocol.NodeHealth`); the coordinator drains a failing node and
gives it no work until a probe passes (:mod:`maitre.control.health`).

The built-in probe (``python -m maitre.agent.health``, standard library unless there are GPUs):

- **compute**: a sum of squares in a loop, checked against its closed form (a known answer),
  timed (best of three). Its speed is judged against the node's own first measurement: a node
  ``slowdown`` times slower than it was (a neighbour stealing its CPUs) fails.
- **memory**: allocate ``memory_mib``, write a pattern, read it back.
- **each visible GPU** (only where ``/dev/nvidiactl`` exists and torch has CUDA): free memory
  (``torch.cuda.mem_get_info``), a matmul with a known answer and a device sync, timed and judged
  like the CPU's, and the memory pattern on the device. *That path is not exercised by the test
  suite (no GPU here); it fails a node whose torch has CUDA but sees no device.*

A site's check (``--health-check``): exit 0 is healthy; the last lines of its output are the
detail. It runs after the built-in one passes.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from maitre import protocol

__all__ = ["HealthConfig", "HealthMonitor", "Prober", "Result", "command", "judge", "run_child"]

log = logging.getLogger("maitre.agent.health")

DETAIL_LINES = 5
"""Lines of a failing check's output kept as its detail."""
_MAX_DETAIL = 2000


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """How the agent probes its node."""

    interval_s: float = 300.0
    """Between two periodic probes (0: only at start, and when the coordinator asks)."""
    timeout_s: float = 60.0
    """A probe still running after this long is killed and counts as a failure."""
    command: list[str] | None = None
    """The site's check (exit 0 = healthy)."""
    builtin: bool = True
    slowdown: float = 3.0
    """Compute this many times slower than the node's first measurement fails."""
    memory_mib: int = 64

    def __post_init__(self) -> None:
        if not (self.interval_s == 0 or 1.0 <= self.interval_s <= 7 * 86400):
            raise ValueError(f"health interval must be 0 (at start only) or 1..604800 s, got {self.interval_s}")
        if not 0.1 <= self.timeout_s <= 3600:
            raise ValueError(f"health timeout must be 0.1..3600 s, got {self.timeout_s}")
        if not 1.0 < self.slowdown <= 1000:
            raise ValueError(f"health slowdown must be above 1, got {self.slowdown}")
        if self.command is not None and not self.command:
            raise ValueError("the health check command is empty")
        if not (self.builtin or self.command):
            raise ValueError("no probe: the built-in one is off and no --health-check is given")


@dataclass(frozen=True, slots=True)
class Result:
    ok: bool
    detail: str
    seconds: float
    probe: str


def run_child(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``argv`` in its own session; its exit code (None: killed at ``timeout_s``, with its
    whole process group) and its output (stdout and stderr together)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its children too (a shell's sleep)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild holding the pipe: give up on output
            out = ""
        return None, out or ""


def tail(text: str, lines: int = DETAIL_LINES) -> str:
    kept = [line.rstrip() for line in text.strip().splitlines()][-lines:]
    return "\n".join(kept)[-_MAX_DETAIL:]


def judge(checks: list[dict[str, Any]], baseline: dict[str, float], slowdown: float) -> tuple[bool, str]:
    """The built-in probe's checks (as its child printed them) against the node's first
    measurements (``baseline``, check name -> compute seconds, filled by the first passing
    probe). Returns (ok, detail)."""
    failed, said = [], []
    for c in checks:
        name = str(c.get("name", "?"))
        if not c.get("ok", False):
            failed.append(f"{name}: {c.get('detail') or 'failed'}")
            continue
        took = c.get("compute_s")
        first = baseline.get(name)
        if isinstance(took, (int, float)) and first and took > slowdown * first:
            failed.append(
                f"{name}: compute took {took:.3f}s, {took / first:.1f}x the node's "
                f"first measurement ({first:.3f}s; limit {slowdown:g}x)"
            )
        elif isinstance(took, (int, float)):
            said.append(f"{name} {took:.3f}s")
    if failed:
        return False, "; ".join(failed)
    return True, "ok: " + ", ".join(said) if said else "ok"


class Prober:
    """Runs a probe (built-in, then the site's command) in child processes; keeps the node's
    first compute measurements. ``python``: the interpreter of the built-in probe's child."""

    def __init__(self, cfg: HealthConfig, python: str = sys.executable) -> None:
        self.cfg = cfg
        self.python = python
        self.baseline: dict[str, float] = {}

    def probe(self) -> Result:
        began = time.monotonic()
        if self.cfg.builtin:
            ok, detail = self._builtin()
            if not ok or not self.cfg.command:
                return Result(ok, detail, round(time.monotonic() - began, 3), "builtin")
        assert self.cfg.command is not None
        left = max(0.1, self.cfg.timeout_s - (time.monotonic() - began))
        try:
            code, out = run_child(self.cfg.command, left)
        except OSError as exc:
            code, out = 127, f"cannot start {self.cfg.command[0]!r}: {exc}"
        seconds = round(time.monotonic() - began, 3)
        if code is None:
            return Result(False, tail(f"{out}\ntimed out after {self.cfg.timeout_s:g}s (killed)"), seconds, "command")
        detail = tail(out) or ("ok" if code == 0 else "")
        if code != 0:
            detail = tail(f"{detail}\nexit code {code}")
        return Result(code == 0, detail, seconds, "command")

    def _builtin(self) -> tuple[bool, str]:
        argv = [self.python, "-m", "maitre.agent.health", "--memory-mib", str(self.cfg.memory_mib)]
        try:
            code, out = run_child(argv, self.cfg.timeout_s)
        except OSError as exc:
            return False, f"cannot start the probe: {exc}"
        if code is None:
            return False, f"timed out after {self.cfg.timeout_s:g}s (killed)"
        try:
            checks = json.loads(out.strip().splitlines()[-1])["checks"]
        except (ValueError, IndexError, KeyError, TypeError):
            return False, tail(f"{out}\nthe probe exited {code} without its result")
        ok, detail = judge(checks, self.baseline, self.cfg.slowdown)
        if ok:
            for c in checks:  # the node's first measurements: what "much slower" is against
                if isinstance(c.get("compute_s"), (int, float)) and c["compute_s"] > 0:
                    self.baseline.setdefault(str(c["name"]), float(c["compute_s"]))
        return ok, detail


class HealthMonitor:
    """The agent's probes: one at start (:meth:`first`, before the node's first beat), then a
    thread that probes every ``interval_s`` and whenever :meth:`request` asks (the coordinator,
    for a suspect node). ``on_result`` is called after each (the agent beats at once)."""

    def __init__(self, cfg: HealthConfig, prober: Prober | None = None) -> None:
        self.cfg = cfg
        self.prober = prober or Prober(cfg)
        self.count = 0
        self.latest: Result | None = None
        self.on_result: Callable[[Result], None] = lambda result: None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def first(self) -> Result:
        return self._run()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="maitre-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request(self) -> None:
        """Probe now (once: requests while one runs are the same request)."""
        self._wake.set()

    def beat(self) -> protocol.NodeHealth | None:
        """The latest result, as the node's beat carries it."""
        with self._lock:
            r, count = self.latest, self.count
        if r is None:
            return None
        return protocol.NodeHealth(
            id=count, ok=r.ok, detail=r.detail[-_MAX_DETAIL:], seconds=min(float(r.seconds), 86400.0), probe=r.probe
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.interval_s or None)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._run()

    def _run(self) -> Result:
        try:
            result = self.prober.probe()
        except Exception as exc:  # a probe that cannot run is a failing one, never the agent's end
            result = Result(False, f"the probe could not run: {exc}", 0.0, "builtin")
        with self._lock:
            self.count += 1
            self.latest = result
        if not result.ok:
            log.warning("health probe failed (%s): %s", result.probe, result.detail)
        self.on_result(result)
        return result


def command(text: str) -> list[str]:
    """``--health-check``'s text as an argv (shell words; ``sh -c '...'`` for a pipeline)."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--health-check {text!r}: {exc}") from None
    if not argv:
        raise ValueError("--health-check is empty")
    return argv


# -- the built-in probe's child ------------------------------------------------------------------
def _cpu(n: int = 600_000) -> dict[str, Any]:
    want = (n - 1) * n * (2 * n - 1) // 6  # sum of i*i for i < n
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        got = 0
        for i in range(n):
            got += i * i
        best = min(best, time.perf_counter() - began)
        if got != want:
            return {"name": "cpu", "ok": False, "detail": f"sum of squares {got} != {want}"}
    return {"name": "cpu", "ok": True, "compute_s": round(best, 6)}


def _memory(mib: int) -> dict[str, Any]:
    block = bytes(range(256)) * 4096  # 1 MiB
    try:
        buf = bytearray(mib << 20)
        view = memoryview(buf)
        for k in range(mib):
            view[k << 20 : (k + 1) << 20] = block
        bad = [k for k in range(mib) if view[k << 20 : (k + 1) << 20] != block]
    except MemoryError:
        return {"name": "memory", "ok": False, "detail": f"cannot allocate {mib} MiB"}
    if bad:
        return {"name": "memory", "ok": False, "detail": f"pattern read back wrong in {len(bad)} of {mib} MiB"}
    return {"name": "memory", "ok": True}


def _gpus(mib: int) -> list[dict[str, Any]]:
    """Each visible CUDA device (untested here: no GPU in the test suite's machine)."""
    if not os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES", "x") in ("", "-1"):
        return []
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:  # a CPU build of torch: nothing to check with
            return []
        return [
            {
                "name": "cuda",
                "ok": False,
                "detail": "the node has NVIDIA devices but torch sees none (driver, or devices lost)",
            }
        ]
    torch.backends.cuda.matmul.allow_tf32 = False  # the known answer is exact in fp32
    out = []
    for i in range(torch.cuda.device_count()):
        name = f"cuda:{i}"
        try:
            dev = torch.device(name)
            free, total = torch.cuda.mem_get_info(dev)
            n = 2048
            a = torch.ones(n, n, device=dev)
            (a @ a).sum().item()  # warm-up (kernels, handles)
            torch.cuda.synchronize(dev)
            best = float("inf")
            for _ in range(3):
                began = time.perf_counter()
                c = a @ a
                torch.cuda.synchronize(dev)
                best = min(best, time.perf_counter() - began)
            if not bool((c == n).all()):
                out.append({"name": name, "ok": False, "detail": "matmul of ones gave a wrong answer"})
                continue
            size = min(mib << 20, free // 8)
            pattern = torch.arange(size, device=dev, dtype=torch.int64).remainder_(251).to(torch.uint8)
            back = pattern.clone().cpu()
            want = torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8)
            if not torch.equal(back, want):
                out.append({"name": name, "ok": False, "detail": "memory pattern read back wrong"})
                continue
            del a, c, pattern
            torch.cuda.empty_cache()
            out.append(
                {
                    "name": name,
                    "ok": True,
                    "compute_s": round(best, 6),
                    "free_mib": free >> 20,
                    "total_mib": total >> 20,
                }
            )
        except Exception as exc:  # noqa: BLE001 (an XID, an ECC error: the node's failure)
            out.append({"name": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m maitre.agent.health", description="maitre's built-in node health probe"
    )
    parser.add_argument("--memory-mib", type=int, default=64)
    args = parser.parse_args(argv)
    checks = [_cpu(), _memory(max(1, args.memory_mib))]
    checks += _gpus(max(1, args.memory_mib))
    print(json.dumps({"checks": checks}))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
