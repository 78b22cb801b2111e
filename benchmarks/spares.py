"""Warm spares benchmark (issue 15): from a worker's death to the first step its replacement
trains, with a warm spare and with a cold start.

    python benchmarks/spares.py [--reps 3] [--smoke] [--out benchmarks/results/spares.json]

Each repetition starts a local cluster (a coordinator and two agents, 3 slots, in this process;
the workers are processes), runs the example (tiny, float64) as a fixed gang of 2 workers with
``spares: 1`` (or 0), SIGKILLs a member once the job trains (and its spare is warm), and times:

* ``spare_join_s`` / ``cold_join_s``: from the failure's detection (the first ``worker_dead`` or
  ``epoch_closed`` event of the job after the kill, coordinator clock) to the first step the
  replacement (the promoted spare, or the worker started cold in the lost one's slot) trained
  (the first commit in its data ledger of a step it had a share of);
* where that time goes, per repetition (``*_phases``): ``epoch_s`` (to the coordinator opening
  the epoch that has the replacement: for a cold start this includes the process's start, its
  imports, data and model), ``caught_up_s`` (its group built, the committed state streamed from
  a peer while the survivor trains on, the steps it missed replayed: its ``caught_up`` report),
  ``step_s`` (to its first step with a share), and ``job_resumed_s`` (detection to the
  survivor's first step after it: the job does not wait for the replacement to catch up).

:func:`measure` returns the medians and the raw lists; ``benchmarks/stragglers.py`` imports it
(and ``SMOKE``, the arguments of ``--smoke``).
Only the spare's detection-to-step is the issue's target (1 s); the run is short, but on a loaded
machine the numbers move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from _results import parse, write_results  # noqa: E402
from maitre.local import LocalCluster, UpConfig  # noqa: E402
from maitre.scheduling.model import Queue  # noqa: E402

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
]
PHASES = ("epoch_s", "caught_up_s", "step_s", "job_resumed_s")
SMOKE = {"reps": 1}
""":func:`measure`'s arguments for ``--smoke`` (here and in ``benchmarks/stragglers.py``)."""


def _wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def _first_trained(ledger: Path, worker: str, after: float) -> float | None:
    """When ``worker`` first committed a step it trained a share of (after ``after``)."""
    path = ledger / f"{worker}.jsonl"
    if not path.exists():
        return None
    shared = set()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # (a line being written)
            continue
        if rec["k"] == "a" and rec["i"]:
            shared.add((rec["e"], rec["s"]))
        elif rec["k"] == "c" and (rec["e"], rec["s"]) in shared and rec["t"] > after:
            return rec["t"]
    return None


def one_failure(
    work: Path, *, spares: int, ms_per_sample: float = 4.0, join: str = "stream", timeout_s: float = 120.0
) -> dict[str, float]:
    """One repetition: the join time and its phases (see the module docstring)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lines: list[str] = []
    cluster = LocalCluster(UpConfig(state_dir=work / "state", queues=[Queue("q")]), out=lines.append).start()
    co = cluster.coordinator
    ledger = work / "state" / "ledger" / "b"
    try:
        cluster.add_node(slots=2)
        cluster.add_node(slots=1)
        command = [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            "--steps",
            "1000000",
            *TINY,
            "--device-ms-per-sample",
            str(ms_per_sample),
        ]
        co.submit(
            {"name": "b", "queue": "q", "minReplicas": 2, "maxReplicas": 2, "spares": spares, "command": command},
            env={"MAITRE_JOIN": join},
        )

        def trained() -> dict[str, Any] | None:
            s = co.job_status("b")
            warm = all(w["state"] == "READY" for w in s["workers"] if w.get("spare"))
            return s if s["step"] >= 5 and len(s["spares"]) == spares and warm else None

        status = _wait(trained, timeout_s, "the job to train (and its spare to be warm)")
        time.sleep(0.5)  # a few steps in the steady state
        members = list(co.job_status("b")["members"])
        spare_nodes = {co.jobs["b"].workers[w].node for w in status["spares"]}
        victim = next((m for m in members if co.jobs["b"].workers[m].node not in spare_nodes), members[0])
        survivor = next(m for m in members if m != victim)
        killed_at = time.time()
        os.kill(cluster.pid_of(victim), signal.SIGKILL)

        def replaced() -> tuple[str, float, dict[str, Any]] | None:
            for e in cluster.db.events(job="b"):
                if e["kind"] == "epoch" and e["t"] > killed_at:
                    new = [w for w in e["members"] if w not in members]
                    if new:
                        t = _first_trained(ledger, new[0], killed_at)
                        return (new[0], t, e) if t is not None else None
            return None

        worker, stepped, opened = _wait(replaced, timeout_s, "the replacement's first step")
        events = list(cluster.db.events(job="b"))
    finally:
        try:
            co.cancel("b")
        except Exception:  # noqa: BLE001 (it may have ended)
            pass
        cluster.stop(drain_s=2)
    detected = min(
        e["t"] for e in events if e["t"] >= killed_at - 0.01 and e["kind"] in ("worker_dead", "epoch_closed")
    )
    resumed = _first_trained(ledger, survivor, detected)
    caught = next((e["t"] for e in events if e["kind"] == "caught_up" and e["worker"] == worker), opened["t"])
    return {
        "join_s": stepped - detected,
        "epoch_s": opened["t"] - detected,
        "caught_up_s": caught - opened["t"],
        "step_s": stepped - caught,
        "job_resumed_s": (resumed - detected) if resumed is not None else float("nan"),
        "kill_to_detect_s": detected - killed_at,
    }


def measure(
    reps: int = 3, ms_per_sample: float = 4.0, join: str = "stream", work: Path | None = None, **_: Any
) -> dict[str, Any]:
    """Medians of ``spare_join_s`` and ``cold_join_s`` over ``reps`` repetitions, the raw
    lists (``*_all``) and each repetition's phases (``*_phases``). ``join``: how the
    replacement gets the state (``MAITRE_JOIN``: ``stream``, the default, while the survivor
    trains on; ``pause``: broadcast while it waits)."""
    out: dict[str, Any] = {"join": join, "reps": reps, "ms_per_sample": ms_per_sample}
    with tempfile.TemporaryDirectory(prefix="maitre-spares-") as tmp:
        base = Path(work or tmp)
        for name, spares in (("spare", 1), ("cold", 0)):
            runs = [
                one_failure(base / f"{name}{k}", spares=spares, ms_per_sample=ms_per_sample, join=join)
                for k in range(reps)
            ]
            out[f"{name}_join_s"] = round(statistics.median(r["join_s"] for r in runs), 3)
            out[f"{name}_join_s_all"] = [round(r["join_s"], 3) for r in runs]
            out[f"{name}_phases"] = [{k: round(v, 3) for k, v in r.items()} for r in runs]
    return out


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: from the failure's detection to the
    replacement's first step, medians with their range, and the spare's phases (to its epoch,
    catching up, its first step; ``-`` where a phase did not happen, as with paused joins)."""

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}"

    def phase(key: str) -> str:
        values = [p[key] for p in result["spare_phases"] if p.get(key) is not None]
        return f"{statistics.median(values):.3f} s" if values else "-"

    join = result.get("join", "stream")
    return "\n".join(
        [
            "| joins (`MAITRE_JOIN`) | warm spare | cold start | spare: to its epoch, catching up, first step |",
            "|---|---|---|---|",
            f"| {join}{' (default)' if join == 'stream' else ''} | {result['spare_join_s']:.3f} s "
            f"({spread(result['spare_join_s_all'])}) | {result['cold_join_s']:.3f} s "
            f"({spread(result['cold_join_s_all'])}) | {phase('epoch_s')}, {phase('caught_up_s')}, "
            f"{phase('step_s')} |",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ms-per-sample", type=float, default=4.0)
    ap.add_argument("--join", choices=("stream", "pause"), default="stream")
    args = parse(ap, "spares", smoke=SMOKE)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    result = measure(reps=args.reps, ms_per_sample=args.ms_per_sample, join=args.join)
    print(
        "from the failure's detection to the replacement's first step (medians; phases "
        "from the detection: epoch, then the replacement's own)"
    )
    print(table(result))
    write_results(args.out, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
