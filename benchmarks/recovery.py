"""Recovery benchmark: maitre against torchrun, same model, same machine, one run.

    python benchmarks/recovery.py [--reps 3] [--steady-steps 300] [--settle 30] [--workers 3]
                                  [--smoke] [--out benchmarks/results/recovery.json]

Measured, each a median over ``--reps`` repetitions (the job trains ``--settle`` steps before
each fault or join):

* ``crash_to_step_s``: SIGKILL of one worker (of 3, ``--workers``) to the next completed step of
  the job;
* ``hang_to_step_s`` (maitre): SIGSTOP of one worker to the next completed step, default settings
  (crashes and hangs are taken in turn in one job, each once it is whole again);
* ``join_pause_s``: how long the running workers stop when a third worker joins (the gap between
  the last step before the join and the first step after it, less one ordinary step);
* ``steps_lost``: committed steps rolled back per failure (torchrun restarts every worker from its
  last checkpoint, saved every 10 steps with ``torch.save``; maitre redoes only the step in flight);
* ``step_overhead_ms`` / ``_pct``: steady-state time per step of the ElasticLoop under maitre (2
  workers) against a fixed gloo group with a plain flat-buffer allreduce and no elasticity.

Step times come from the data ledger (commit time of every step) that both maitre and the
ElasticLoop under torchrun write. torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
without which its restarts hang in torch 2.13 (pytorch#135712), and waits ``last_call_timeout``
(its default, 30 s; ``--smoke``: 1 s) for more agents before a job of 2:3 agents first starts.
``--smoke``: 2 workers (joins from 1 to 2), 2 steps between faults, one of each; the training
process's batch is 8 and its steps wait 20 ms instead of computing (``SMOKE_WORKLOAD``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from _results import parse, write_results  # noqa: E402
from maitre.launch import Run, RunConfig  # noqa: E402

WORKLOAD = HERE / "workload.py"
SMOKE_WORKLOAD = ["--global-batch", "8", "--device-ms", "20"]
"""A smoke run's training process: a small batch, and steps that wait rather than compute."""
PACE: list[str] = []
"""The training process's extra arguments in this run (:func:`pace`)."""


def workload(*args: str) -> list[str]:
    """The training process's command after the interpreter: ``args`` and this run's pace."""
    return [str(WORKLOAD), *args, *PACE]


def pace(smoke: bool) -> None:
    PACE[:] = SMOKE_WORKLOAD if smoke else []


TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


# -- reading the ledgers ------------------------------------------------------------------------
def commits(ledger: Path) -> list[dict[str, Any]]:
    """Every commit (step, epoch, t) with the start time of the process that made it."""
    out = []
    for path in sorted(ledger.glob("*.jsonl")):
        started = 0.0
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec["k"] == "h":
                started = rec["t"]
            elif rec["k"] == "c":
                out.append({"step": rec["s"], "epoch": rec["e"], "t": rec["t"], "started": started})
    return sorted(out, key=lambda c: c["t"])


def step_interval(cs: list[dict[str, Any]]) -> float:
    """Median time between consecutive committed steps (first commit of each step)."""
    first: dict[tuple[int, int], float] = {}
    for c in cs:
        first.setdefault((c["epoch"], c["step"]), c["t"])
    times = sorted(first.values())
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def ledger_step(ledger: Path) -> int:
    """The newest step committed in ``ledger`` (0 before the first)."""
    cs = commits(ledger) if ledger.exists() else []
    return max((c["step"] for c in cs), default=0)


def wait_ledger_steps(ledger: Path, n: int, timeout_s: float, what: str) -> None:
    """Until ``n`` more steps are committed in ``ledger`` (else TimeoutError(``what``))."""
    start = ledger_step(ledger)
    deadline = time.monotonic() + timeout_s
    while ledger_step(ledger) < start + n:
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def wait_ledger_restart(ledger: Path, t: float, world: int, timeout_s: float, what: str) -> None:
    """Until every one of ``world`` processes started after ``t`` committed a step in
    ``ledger`` (else TimeoutError(``what``))."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cs = commits(ledger) if ledger.exists() else []
        if len({c["started"] for c in cs if c["started"] > t}) >= world:
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def after_failure(cs: list[dict[str, Any]], t_fault: float, new_round: Callable[[dict], bool]) -> tuple[float, int]:
    """(seconds to the next completed step, committed steps rolled back) after a fault."""
    before = max(c["step"] for c in cs if c["t"] <= t_fault)
    nxt = next(c for c in cs if c["t"] > t_fault and new_round(c))
    return nxt["t"] - t_fault, max(0, before - (nxt["step"] - 1))


# -- maitre -------------------------------------------------------------------------------------
def maitre_run(run_dir: Path, *, nodes: int, max_nodes: int, steps: int, ledger: bool = True) -> Run:
    run = Run(
        RunConfig(
            command=[sys.executable, *workload("--steps", str(steps), "--run-dir", str(run_dir))],
            min_nodes=1,
            max_nodes=max_nodes,
            local_nodes=nodes,
            max_restarts=100,
            run_dir=run_dir,
            quiet_workers=True,
            ledger=ledger,
        ),
        out=lambda s: None,
    )
    return run.start()


def wait_for(run: Run, pred: Callable[[dict], bool], timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = run.job()
        if job["state"] == "RUNNING" and pred(job):
            return job
        if job["state"] in ("FAILED", "COMPLETED"):
            raise RuntimeError(f"job ended early: {job['state']} {job.get('failure')}")
        time.sleep(0.05)
    raise TimeoutError("the job did not reach the expected state")


def maitre_faults(
    signals: list[signal.Signals], reps: int, work: Path, settle: int = 30, workers: int = 3
) -> dict[signal.Signals, list[tuple[float, int]]]:
    """``reps`` faults of each kind in ``signals`` (SIGKILL: a crash, SIGSTOP: a hang), one job
    for all, taken in turn once the job is whole again and has trained ``settle`` steps."""
    run = maitre_run(work, nodes=workers, max_nodes=workers, steps=100_000)
    faults: list[tuple[signal.Signals, float, int]] = []
    try:
        for _ in range(reps):
            for sig in signals:
                job = wait_for(run, lambda j: len(j["members"]) == workers)
                job = wait_for(run, lambda j, s=job["step"]: j["step"] >= s + settle)
                victim = random.Random(len(faults)).choice(job["members"][1:])
                pid = run.pid_of(victim)
                t = time.time()
                os.kill(pid, sig)
                faults.append((sig, t, job["epoch"]))
                wait_for(run, lambda j, e=job["epoch"]: j["epoch"] > e)
        wait_for(run, lambda j: True)
        time.sleep(1.0)
    finally:
        run.shutdown()
    cs = commits(work / "ledger")
    return {
        sig: [after_failure(cs, t, lambda c, e=e: c["epoch"] > e) for s, t, e in faults if s == sig] for sig in signals
    }


def maitre_joins(reps: int, work: Path, settle: int = 30, workers: int = 3) -> list[float]:
    run = maitre_run(work, nodes=workers - 1, max_nodes=workers, steps=100_000)
    epochs = []
    try:
        run.coordinator.scale("job", workers - 1)
        for i in range(reps):
            job = wait_for(run, lambda j: len(j["members"]) == workers - 1)
            job = wait_for(run, lambda j, s=job["step"]: j["step"] >= s + settle)
            run.coordinator.scale("job", workers)  # room for one more worker
            if i == 0:
                run.add_node()  # a node with a free slot; later rounds reuse the freed slot
            job = wait_for(run, lambda j: len(j["members"]) == workers, timeout_s=180)
            epochs.append(job["epoch"])
            job = wait_for(run, lambda j, s=job["step"]: j["step"] >= s + settle)
            run.coordinator.scale("job", workers - 1)
        time.sleep(0.5)
    finally:
        run.shutdown()
    cs = commits(work / "ledger")
    return [join_pause(cs, lambda c, e=e: c["epoch"] == e) for e in epochs]


def join_pause(cs: list[dict[str, Any]], in_new: Callable[[dict], bool]) -> float:
    """Gap between the last step before the join and the first after it, less one ordinary step
    of the new membership (the first step after the join is itself a normal step)."""
    first_new = next(i for i, c in enumerate(cs) if in_new(c))
    before = [c for c in cs[:first_new] if not in_new(c)]
    gap = cs[first_new]["t"] - before[-1]["t"]
    return max(0.0, gap - step_interval([c for c in cs if in_new(c)][:60]))


def maitre_steady(steps: int, work: Path) -> float:
    run = maitre_run(work, nodes=2, max_nodes=2, steps=steps, ledger=False)
    try:
        run.wait()
    finally:
        run.shutdown()
    return steady_step(work)


def steady_step(work: Path) -> float:
    dts = []
    for path in work.glob("steps-*.jsonl"):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        dts += [r["dt"] for r in recs[len(recs) // 5 :]]  # skip warm-up
    return statistics.median(dts)


# -- torchrun -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Torchrun:
    """torchrun agents on one machine, each a node of one c10d rendezvous."""

    def __init__(
        self, work: Path, nnodes: str, steps: int, plain: bool = False, standalone_nproc: int = 0, last_call_s: int = 30
    ) -> None:
        self.work = work
        self.port = free_port()
        self.nnodes, self.steps, self.plain = nnodes, steps, plain
        self.standalone_nproc = standalone_nproc
        self.last_call_s = last_call_s
        self.agents: list[subprocess.Popen[bytes]] = []

    def add_agent(self) -> None:
        if self.standalone_nproc:
            rdzv = ["--standalone", "--nproc-per-node", str(self.standalone_nproc)]
        else:
            rdzv = [
                "--nnodes",
                self.nnodes,
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{self.port}",
                "--rdzv-id",
                "bench",
                "--max-restarts",
                "100",
                "--monitor-interval",
                "0.1",
                "--rdzv-conf",
                f"last_call_timeout={self.last_call_s}",
            ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rdzv,
            *workload("--steps", str(self.steps), "--run-dir", str(self.work)),
            *(["--plain"] if self.plain else ["--ckpt-every", "10"]),
        ]
        env = {**os.environ, **TORCHRUN_ENV, "MAITRE_LEDGER_DIR": str(self.work / "ledger")}
        self.agents.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        )

    def pid(self, rank: int) -> int:
        return int((self.work / f"pid-rank{rank}").read_text())

    def progress(self) -> int:
        return ledger_step(self.work / "ledger")

    def wait_steps(self, n: int, timeout_s: float = 180.0) -> None:
        wait_ledger_steps(self.work / "ledger", n, timeout_s, "torchrun made no progress")

    def wait_restart(self, t: float, world: int, timeout_s: float = 180.0) -> None:
        wait_ledger_restart(self.work / "ledger", t, world, timeout_s, "torchrun did not restart")

    def close(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGTERM)
        for a in self.agents:
            try:
                a.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()


def torchrun_crashes(reps: int, work: Path, settle: int = 30, workers: int = 3) -> list[tuple[float, int]]:
    tr = Torchrun(work, str(workers), 100_000)
    faults = []
    try:
        for _ in range(workers):
            tr.add_agent()
        tr.wait_steps(settle)
        for i in range(reps):
            t = time.time()
            os.kill(tr.pid(1 + i % (workers - 1)), signal.SIGKILL)
            faults.append(t)
            tr.wait_restart(t, workers)
            tr.wait_steps(settle)
    finally:
        tr.close()
    cs = commits(work / "ledger")
    return [after_failure(cs, t, lambda c, t=t: c["started"] > t) for t in faults]


def torchrun_joins(reps: int, work: Path, settle: int = 30, workers: int = 3, last_call_s: int = 30) -> list[float]:
    pauses = []
    for i in range(reps):
        d = work / f"join{i}"
        tr = Torchrun(d, f"{workers - 1}:{workers}", 100_000, last_call_s=last_call_s)
        try:
            for _ in range(workers - 1):
                tr.add_agent()
            tr.wait_steps(settle)
            t = time.time()
            tr.add_agent()
            tr.wait_restart(t, workers)
            tr.wait_steps(max(2, settle // 3))
        finally:
            tr.close()
        cs = commits(d / "ledger")
        pauses.append(join_pause(cs, lambda c, t=t: c["started"] > t))
    return pauses


def plain_steady(steps: int, work: Path) -> float:
    tr = Torchrun(work, "1", steps, plain=True, standalone_nproc=2)
    try:
        tr.add_agent()
        tr.agents[0].wait(timeout=600)
    finally:
        tr.close()
    return steady_step(work)


# -- the report ---------------------------------------------------------------------------------
def stager(work: Path) -> Callable[[str, Callable[[Path], Any]], Any]:
    """``stage(name, fn)``: runs ``fn`` in its own directory under ``work``, prints its time."""

    def stage(name: str, fn: Callable[[Path], Any]) -> Any:
        t0 = time.monotonic()
        result = fn(work / name)
        print(f"  {name:<18} {time.monotonic() - t0:6.1f}s  {result}", flush=True)
        return result

    return stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steady-steps", type=int, default=300)
    p.add_argument("--settle", type=int, default=30, help="steps the job trains before each fault or join (default 30)")
    p.add_argument(
        "--workers", type=int, default=3, help="workers of the job a fault hits; joins go from one fewer (default 3)"
    )
    p.add_argument(
        "--last-call-s",
        type=int,
        default=30,
        help="torchrun's last_call_timeout before a 2:3 job starts (default 30, torchrun's)",
    )
    p.add_argument(
        "--steady-only", action="store_true", help="rerun only the steady-state pairs and update --out in place"
    )
    args = parse(p, "recovery", smoke={"reps": 1, "steady_steps": 10, "settle": 2, "workers": 2, "last_call_s": 1})
    if args.workers < 2:
        p.error("--workers must be at least 2")
    pace(args.smoke)
    work = Path(tempfile.mkdtemp(prefix="maitre-bench-"))
    try:
        measure(args, work)
    finally:
        if args.smoke:  # (a full run keeps its work dir: the ledgers are its raw data)
            shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> None:
    med = statistics.median
    stage = stager(work)
    print(f"recovery benchmark, {args.reps} repetitions, work dir {work}")
    if args.steady_only:
        result = json.loads(args.out.read_text())
        # (the other rows keep the commit and date they were measured on)
        result["measured_before_steady_rerun"] = result.pop("measured", None)
        steady(result, args.reps, args.steady_steps, stage)
        report(result, args.out, args.smoke)
        return
    reps, settle, workers = args.reps, args.settle, args.workers
    m_faults = stage(
        "maitre-crash-hang", lambda d: maitre_faults([signal.SIGKILL, signal.SIGSTOP], reps, d, settle, workers)
    )
    m_crash, m_hang = m_faults[signal.SIGKILL], m_faults[signal.SIGSTOP]
    m_join = stage("maitre-join", lambda d: maitre_joins(reps, d, settle, workers))
    t_crash = stage("torchrun-crash", lambda d: torchrun_crashes(reps, d, settle, workers))
    t_join = stage("torchrun-join", lambda d: torchrun_joins(reps, d, settle, workers, args.last_call_s))
    result = {
        "maitre": {
            "crash_to_step_s": med(x for x, _ in m_crash),
            "hang_to_step_s": med(x for x, _ in m_hang),
            "join_pause_s": med(m_join),
            "steps_lost": med(n for _, n in m_crash),
        },
        "torchrun": {
            "crash_to_step_s": med(x for x, _ in t_crash),
            "join_pause_s": med(t_join),
            "steps_lost": med(n for _, n in t_crash),
        },
        "raw": {
            "maitre_crash": m_crash,
            "maitre_hang": m_hang,
            "maitre_join": m_join,
            "torchrun_crash": t_crash,
            "torchrun_join": t_join,
        },
        "reps": args.reps,
        "workers": workers,
        "machine": f"{os.cpu_count()} CPUs",
    }
    steady(result, args.reps, args.steady_steps, stage)
    report(result, args.out, args.smoke)


def steady(result: dict[str, Any], reps: int, steps: int, stage: Callable) -> None:
    """Steady-state step time, maitre and the fixed group back to back in pairs; the overhead is
    the median of the pairs' differences, so load that drifts between pairs cancels out."""
    m_steady, p_steady = [], []
    for i in range(reps):
        m_steady.append(stage(f"maitre-steady{i}", lambda d: maitre_steady(steps, d)))
        p_steady.append(stage(f"plain-steady{i}", lambda d: plain_steady(steps, d)))
    overhead_s = statistics.median(m - p for m, p in zip(m_steady, p_steady))
    result["maitre"]["step_overhead_ms"] = overhead_s * 1000
    result["maitre"]["step_overhead_pct"] = 100 * overhead_s / statistics.median(p_steady)
    result["raw"]["maitre_step_s"], result["raw"]["plain_step_s"] = m_steady, p_steady


def report(result: dict[str, Any], out: Path, smoke: bool = False) -> None:
    write_results(out, result, smoke=smoke)
    print()
    print(table(result))


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: maitre beside torchrun, medians."""
    m, t = result["maitre"], result["torchrun"]
    plain_step_s = statistics.median(result["raw"]["plain_step_s"])
    rows = [
        (
            "crash to next step (s)",
            f"{m['crash_to_step_s']:.3f}",
            f"{t['crash_to_step_s']:.2f}",
            f"{t['crash_to_step_s'] / m['crash_to_step_s']:.0f}x",
        ),
        ("hang to next step (s)", f"{m['hang_to_step_s']:.2f}", "-", ""),
        (
            "join pause (s)",
            f"{m['join_pause_s']:.3f}",
            f"{t['join_pause_s']:.2f}",
            f"{t['join_pause_s'] / max(m['join_pause_s'], 1e-3):.0f}x",
        ),
        ("steps rolled back per crash", f"{m['steps_lost']:.0f}", f"{t['steps_lost']:.0f}", ""),
        (
            "step overhead vs fixed gloo group",
            f"{m['step_overhead_ms']:+.2f} ms ({m['step_overhead_pct']:+.1f}%)",
            f"(fixed: {plain_step_s * 1000:.1f} ms/step)",
            "",
        ),
    ]
    lines = [
        f"| {'':<34} | {'maitre':>18} | {'torchrun':>24} | {'':>5} |",
        f"|{'-' * 36}|{'-' * 20}|{'-' * 26}|{'-' * 7}|",
    ]
    lines += [f"| {a:<34} | {b:>18} | {c:>24} | {d:>5} |" for a, b, c, d in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
