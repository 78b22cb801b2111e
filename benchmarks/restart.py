"""Restart benchmark: a node lost, and the same job brought back three ways, on one machine;
and a node joining a restart-mode job.

    python benchmarks/restart.py [--reps 3] [--settle 30] [--workers 3] [--last-call-s 30]
                                 [--smoke] [--out benchmarks/results/restart.json]

The job is ``benchmarks/workload.py`` (the example's model) on ``--workers`` nodes of one process
each. It trains ``--settle`` steps; then one node is lost: its agent and its worker are SIGKILLed
at once, and nobody is told. Measured, each a median over ``--reps`` losses:

* ``to_step_s``: from the loss to the job's next committed step (the data ledger's commit times);
* ``steps_lost``: committed steps trained again.

Restart mode also gets a node that joins (``restart.join``): the job runs on ``--workers`` - 1
nodes of the run (it may grow to ``--workers``), and a new node's agent starts in a process of
its own, as on a new machine (``maitre agent``, with its own fork server, which imports torch as
it starts); the gang is stopped and started again with it. For a loss and for a join:

* ``stop_to_step_s`` (``restart.lost``, ``restart.join``): from the running gang's stop (its last
  process gone: the coordinator's ``gang_stopped``) to the next gang's first committed step: the
  time every node sits idle for the restart itself. A join's used to include what was left of
  the new node's imports (its agent was known, and the gang stopped for it, before its fork
  server had torch imported); the target is a join within 0.5 s of a loss;
* the join's ``to_step_s``: from the new agent's start to that step (its imports included,
  while the old gang trains on), and ``steps_lost``.

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
2 workers (a join from 1 to 2), 3 steps between losses, one of each, a 1 s last call, the
training process paced as in ``recovery.py``'s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
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
def maitre_run(d: Path, elastic: str, nodes: int, workers: int) -> Run:
    """A job of ``workers`` - 1 to ``workers`` nodes in ``elastic`` mode, ``nodes`` of them local
    (agents in this process)."""
    command = [sys.executable, *workload("--steps", "100000", "--run-dir", str(d))]
    if elastic == "restart":
        command += ["--ckpt-every", str(CKPT_EVERY)]
    run = Run(
        RunConfig(
            command=command,
            min_nodes=workers - 1,
            max_nodes=workers,
            local_nodes=nodes,
            max_restarts=100,
            run_dir=d,
            quiet_workers=True,
            elastic=elastic,
            grace_period_s=5.0,
        ),
        out=lambda s: None,
    )
    return run.start()


def stop_to_step(run: Run, ledger: Path, t: float) -> tuple[float, int]:
    """(seconds from the first gang stopped after ``t`` to the next gang's first committed
    step, committed steps trained again): the gang is stopped when its last process is gone
    (the coordinator's ``gang_stopped``, on the ledger's clock, the wall clock)."""
    stopped = next(e["t"] for e in run.job()["events"] if e["kind"] == "gang_stopped" and e["t"] >= t)
    return after_failure(commits(ledger), stopped, lambda c: c["started"] > stopped)


def maitre_losses(reps: int, work: Path, settle: int, workers: int, elastic: str) -> list[dict[str, float]]:
    """One maitre job per loss, in ``elastic`` mode: ``to_step_s``, ``steps_lost`` and, in
    restart mode, ``stop_to_step_s``."""
    out = []
    for i in range(reps):
        d = work / f"loss{i}"
        run = maitre_run(d, elastic, workers, workers)
        ledger = d / "ledger"
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
            stopped = stop_to_step(run, ledger, t)[0] if elastic == "restart" else None
        finally:
            run.shutdown()
        cs = commits(ledger)
        if elastic == "restart":
            to_step, lost = after_failure(cs, t, lambda c, t=t: c["started"] > t)
        else:
            to_step, lost = after_failure(cs, t, lambda c, e=epoch: c["epoch"] > e)
        rec = {"to_step_s": to_step, "steps_lost": lost}
        if stopped is not None:
            rec["stop_to_step_s"] = stopped
        out.append(rec)
    return out


def new_node(run: Run, log: Path) -> subprocess.Popen[bytes]:
    """A node that joins as from a machine of its own: ``maitre agent`` in a new process (its own
    fork server, importing torch as it starts), maitre from this tree; its health check is
    ``true`` (the run's own nodes have none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAITRE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "maitre.cli", "agent", "--coordinator", run.server.address]
    command += ["--token-file", str(run.token_file), "--node-id", "joiner", "--nproc-per-node", "1"]
    command += ["--no-health-builtin", "--health-check", "true", "--health-interval", "0"]
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def end_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, as at a terminal: the agent stops its workers and its fork server ends with it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def restart_joins(reps: int, work: Path, settle: int, workers: int) -> list[dict[str, float]]:
    """One restart-mode job per join: ``workers`` - 1 nodes, then a new one (:func:`new_node`)."""
    out = []
    for i in range(reps):
        d = work / f"join{i}"
        run = maitre_run(d, "restart", workers - 1, workers)
        ledger, node = d / "ledger", None
        try:
            wait_for(run, lambda j: len(j["members"]) == workers - 1)
            wait_ledger_steps(ledger, settle, 180.0, "no progress")
            t = time.time()
            node = new_node(run, d / "joiner.log")
            wait_ledger_restart(ledger, t, workers, 180.0, "the job did not grow")
            wait_ledger_steps(ledger, 2, 180.0, "no progress after the join")
            stopped, lost = stop_to_step(run, ledger, t)
        finally:
            if node is not None:
                end_node(node)
            run.shutdown()
        grown = next(c for c in commits(ledger) if c["started"] > t and c["t"] > t)
        out.append({"stop_to_step_s": stopped, "to_step_s": grown["t"] - t, "steps_lost": lost})
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
    torchrun = stage("torchrun", lambda d: torchrun_losses(reps, d, settle, workers, args.last_call_s))
    restart = stage("maitre-restart", lambda d: maitre_losses(reps, d, settle, workers, "restart"))
    joins = stage("maitre-restart-join", lambda d: restart_joins(reps, d, settle, workers))
    inplace = stage("maitre-inplace", lambda d: maitre_losses(reps, d, settle, workers, "inplace"))
    raw: dict[str, Any] = {  # (each way's losses as [to_step_s, steps_lost], as before the joins)
        "torchrun": torchrun,
        "restart": [(r["to_step_s"], r["steps_lost"]) for r in restart],
        "inplace": [(r["to_step_s"], r["steps_lost"]) for r in inplace],
    }
    med = statistics.median
    result: dict[str, Any] = {
        way: {"to_step_s": med(x for x, _ in losses), "steps_lost": med(n for _, n in losses)}
        for way, losses in raw.items()
    }
    result["restart"]["lost"] = {"stop_to_step_s": med(r["stop_to_step_s"] for r in restart)}
    result["restart"]["join"] = {
        key: med(r[key] for r in joins) for key in ("stop_to_step_s", "to_step_s", "steps_lost")
    }
    raw["restart_lost_stop_to_step_s"] = [r["stop_to_step_s"] for r in restart]
    raw["restart_join"] = joins
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
    lost, join = result["restart"].get("lost"), result["restart"].get("join")
    if lost and join:  # (results from before the joins were measured have neither)
        lines += [
            "",
            "| restart mode | from the gang's stop to the next gang's step (s) |",
            "|---|---|",
            f"| a node lost ({result['workers']} to {result['workers'] - 1} nodes) | {lost['stop_to_step_s']:.2f} |",
            f"| a node joins ({result['workers'] - 1} to {result['workers']} nodes) | {join['stop_to_step_s']:.2f} |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
