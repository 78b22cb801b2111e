"""Restart benchmark: a node lost, and the same job brought back three ways, on one machine.

    python benchmarks/restart.py [--reps 3] [--settle 30] [--workers 3] [--last-call-s 30]
                                 [--smoke] [--out benchmarks/results/restart.json]

The job is ``benchmarks/workload.py`` (the example's model) on ``--workers`` nodes of one process
each. It trains ``--settle`` steps; then one node is lost: its agent and its worker are SIGKILLed
at once, and nobody is told. Measured, each a median over ``--reps`` losses:

* ``to_step_s``: from the loss to the job's next committed step (the data ledger's commit times);
* ``steps_lost``: committed steps trained again.

The three ways:

* **torchrun elastic** (``--nnodes W-1:W``, c10d rendezvous, ``--max-restarts``): the survivors'
  workers fail on their lost peer, their agents rendezvous again without the lost node (waiting
  ``last_call_timeout``, torchrun's default 30 s, for more) and restart every worker, which loads
  the last ``torch.save`` checkpoint (every 10 steps);
* **maitre restart mode** (``elastic: restart``): the same script unmodified under torchrun's
  environment, its checkpoint the same; the coordinator stops the gang when its workers fail,
  learns that the node is gone from its silence, and starts the gang again at W-1;
* **maitre in place** (``ElasticLoop`` as it is meant to run): the survivors rebuild their group
  without the lost node and go on from their live state.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see ``recovery.py``). ``--smoke``:
2 workers, 3 steps between losses, one of each, a 1 s last call, the training process paced as in
``recovery.py``'s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from _results import parse, write_results  # noqa: E402
from recovery import (  # noqa: E402
    Torchrun,
    after_failure,
    commits,
    pace,
    stager,
    wait_for,
    wait_ledger_restart,
    wait_ledger_steps,
    workload,
)

from maitre.launch import Run, RunConfig, _children  # noqa: E402

CKPT_EVERY = 10
"""Steps between the script's own checkpoints (torchrun and restart mode)."""


def wait_whole(ledger: Path, world: int, timeout_s: float = 180.0) -> None:
    """Until the job's latest commits come from ``world`` processes (torchrun may start a job
    of W-1:W nodes with fewer, and restart it when the last one comes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cs = commits(ledger) if ledger.exists() else []
        if len({c["started"] for c in cs[-2 * world :]}) >= world:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job never trained with {world} processes")
        time.sleep(0.1)


# -- torchrun -----------------------------------------------------------------------------------
def torchrun_losses(reps: int, work: Path, settle: int, workers: int, last_call_s: int) -> list[tuple[float, int]]:
    """One torchrun job per loss (a lost node does not come back)."""
    out = []
    for i in range(reps):
        d = work / f"loss{i}"
        tr = Torchrun(d, f"{workers - 1}:{workers}", 100_000, last_call_s=last_call_s)
        ledger = d / "ledger"
        try:
            # The first agent hosts the rendezvous store (the first to bind its port): it starts
            # alone, and the node lost is another one (torchrun cannot survive its store's host).
            tr.add_agent()
            time.sleep(3.0)
            for _ in range(workers - 1):
                tr.add_agent()
            wait_whole(ledger, workers)
            wait_ledger_steps(ledger, settle, 180.0, "no progress")
            lost = tr.agents[-1]
            kids = _children(lost.pid)
            t = time.time()
            for pid in [lost.pid, *kids]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_ledger_restart(ledger, t, workers - 1, 180.0, "the job did not come back")
            wait_ledger_steps(ledger, 2, 180.0, "no progress after the loss")
        finally:
            tr.close()
        out.append(after_failure(commits(ledger), t, lambda c, t=t: c["started"] > t))
    return out


# -- maitre -------------------------------------------------------------------------------------
def maitre_losses(reps: int, work: Path, settle: int, workers: int, elastic: str) -> list[tuple[float, int]]:
    """One maitre job per loss, in ``elastic`` mode."""
    out = []
    for i in range(reps):
        d = work / f"loss{i}"
        command = [sys.executable, *workload("--steps", "100000", "--run-dir", str(d))]
        if elastic == "restart":
            command += ["--ckpt-every", str(CKPT_EVERY)]
        run = Run(
            RunConfig(
                command=command,
                min_nodes=workers - 1,
                max_nodes=workers,
                local_nodes=workers,
                max_restarts=100,
                run_dir=d,
                quiet_workers=True,
                elastic=elastic,
                grace_period_s=5.0,
            ),
            out=lambda s: None,
        )
        ledger = d / "ledger"
        run.start()
        try:
            wait_for(run, lambda j: len(j["members"]) == workers)
            wait_ledger_steps(ledger, settle, 180.0, "no progress")
            epoch = run.job()["epoch"]
            t = time.time()
            run.agents[-1].lose()
            if elastic == "restart":
                wait_ledger_restart(ledger, t, workers - 1, 180.0, "the job did not come back")
            else:
                wait_for(run, lambda j, e=epoch: j["epoch"] > e)
            wait_ledger_steps(ledger, 2, 180.0, "no progress after the loss")
        finally:
            run.shutdown()
        cs = commits(ledger)
        if elastic == "restart":
            out.append(after_failure(cs, t, lambda c, t=t: c["started"] > t))
        else:
            out.append(after_failure(cs, t, lambda c, e=epoch: c["epoch"] > e))
    return out


# -- the report ---------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=int, default=30, help="steps the job trains before the loss (default 30)")
    p.add_argument("--workers", type=int, default=3, help="nodes of the job before the loss (default 3)")
    p.add_argument("--last-call-s", type=int, default=30, help="torchrun's last_call_timeout (default 30, torchrun's)")
    args = parse(p, "restart", smoke={"reps": 1, "settle": 3, "workers": 2, "last_call_s": 1})
    if args.workers < 2:
        p.error("--workers must be at least 2")
    pace(args.smoke)
    work = Path(tempfile.mkdtemp(prefix="maitre-bench-restart-"))
    try:
        measure(args, work)
    finally:
        if args.smoke:  # (a full run keeps its work dir: the ledgers are its raw data)
            shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> None:
    stage = stager(work)
    print(f"restart benchmark: a node of {args.workers} lost, {args.reps} times each way, work dir {work}")
    reps, settle, workers = args.reps, args.settle, args.workers
    raw = {
        "torchrun": stage("torchrun", lambda d: torchrun_losses(reps, d, settle, workers, args.last_call_s)),
        "restart": stage("maitre-restart", lambda d: maitre_losses(reps, d, settle, workers, "restart")),
        "inplace": stage("maitre-inplace", lambda d: maitre_losses(reps, d, settle, workers, "inplace")),
    }
    med = statistics.median
    result = {
        way: {"to_step_s": med(x for x, _ in losses), "steps_lost": med(n for _, n in losses)}
        for way, losses in raw.items()
    }
    result.update(
        raw=raw,
        reps=reps,
        workers=workers,
        checkpoint_every=CKPT_EVERY,
        last_call_s=args.last_call_s,
        machine=f"{os.cpu_count()} CPUs",
    )
    write_results(args.out, result, smoke=args.smoke)
    print()
    print(table(result))


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: the three ways side by side, medians."""
    names = {
        "torchrun": "torchrun elastic",
        "restart": "maitre restart mode (unmodified script)",
        "inplace": "maitre in place (`ElasticLoop`)",
    }
    lines = [
        f"| a node of {result['workers']} lost | to the next step (s) | steps trained again |",
        "|---|---|---|",
    ]
    for way, name in names.items():
        r = result[way]
        lines.append(f"| {name} | {r['to_step_s']:.2f} | {r['steps_lost']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
