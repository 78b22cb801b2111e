"""``maitre demo``: the scheduler at work on one machine, in about three minutes.

A cluster of 4 nodes x 2 slots in 2 racks, two teams' queues (team-a is guaranteed 4 slots,
team-b 2, both may borrow), and three jobs running ``examples/train.py`` (a tiny transformer):

1. ``a-lm`` (team-a) and ``b-lm`` (team-b), elastic 1..6 replicas, fill the cluster: 4 + 4.
2. ``urgent`` (team-a, priority high, a fixed gang of 4) arrives. It does not fit, so the
   policy shrinks the elastic jobs (``b-lm`` down to its queue's guarantee, then ``a-lm``); they
   are not stopped: their workers leave at a step boundary and the rest train on.
3. ``urgent`` finishes; once the resize damping has passed the elastic jobs grow back.
4. A worker of ``b-lm`` is killed (SIGKILL); the job recovers in place.
5. Two of the nodes are spot (cheaper, reclaimable). One gets a reclaim notice with 30 s of
   warning (the demo writes the notice file its agent watches): its workers leave at a step
   boundary, the node drains, then goes (its agent stops); a reclaim, not a failure. A job whose
   only live state is on that node (where the scheduler left it: it depends on the timing)
   checkpoints within the notice instead and resumes elsewhere from it, a second incarnation
   (see :mod:`maitre.control.drain`). The cost table says what the slot-hours cost at their
   nodes' prices, and all on-demand.

Every sample also waits ``device_ms_per_sample`` ms, standing in for accelerator compute: two
CPU cores cannot show 8 GPUs' worth of scaling otherwise, and the scheduler's speedup model is
fitted from the throughput it measures. The report at the end: allocation, utilization (eta),
each job's effective training time ratio, every resize and recovery with its time split, and the
exactly-once audit of every job's data.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from maitre.launch import epoch_reports
from maitre.local import LocalCluster, UpConfig
from maitre.runtime.ledger import audit
from maitre.scheduling.model import Queue
from maitre.scheduling.policy import PolicyConfig

EXAMPLE = resources.files("maitre") / "examples" / "train.py"
"""The example training script, package data (the repository's ``examples/train.py`` links to
it), so that an installed wheel runs the demo too."""
TARGETS = {"allocation": 0.90, "utilization": 0.85}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    run_dir: Path | None = None
    steps: int = 900
    """Steps of each elastic job (about 150 s on 2 cores)."""
    urgent_steps: int = 250
    urgent_at_step: int = 150
    """``urgent`` is submitted once both elastic jobs passed this step at full size."""
    device_ms_per_sample: float = 6.0
    cooldown_s: float = 15.0
    timeout_s: float = 600.0
    """A safety net: about 150 s on 2 cores; a slower machine still gets its report."""
    script: Path | None = None
    """The script the jobs run; None: :data:`EXAMPLE`."""
    nodes: int = 4
    slots_per_node: int = 2
    spot_nodes: int = 2
    """The last nodes are spot (at most half of them); the last one is reclaimed mid-run."""
    notice_s: float = 30.0
    """The reclaim notice's warning."""
    reclaim_after_s: float = 5.0
    """The notice comes this long after the kill's recovery."""


class Demo:
    def __init__(self, cfg: DemoConfig, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.out = out
        self.run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix="maitre-demo-"))
        self.causes: list[tuple[float, str, str]] = []
        """(time, job, what): the demo's own interventions (kills), for the recovery table."""
        self.script: Path | None = None
        """The script as a file on disk, while :meth:`run` runs."""

    def _manifest(
        self, name: str, queue: str, lo: int, hi: int, steps: int, priority: str = "normal", preemptible: bool = True
    ) -> dict[str, Any]:
        return {
            "name": name,
            "queue": queue,
            "priorityClassName": priority,
            "minReplicas": lo,
            "maxReplicas": hi,
            "preemptible": preemptible,
            "gracePeriodSeconds": 30,
            "topology": {"level": "rack", "mode": "preferred"},
            "checkpointDir": str(self.run_dir / "checkpoints" / name),
            "command": [
                sys.executable,
                str(self.script),
                "--steps",
                str(steps),
                "--log-every",
                "100000",
                "--device-ms-per-sample",
                str(self.cfg.device_ms_per_sample),
            ],
        }

    def run(self) -> int:
        # Package data need not be a file (a zipped install); the workers need one to run.
        with resources.as_file(self.cfg.script or EXAMPLE) as script:
            self.script = script
            return self._run()

    def _run(self) -> int:
        cfg = self.cfg
        capacity = cfg.nodes * cfg.slots_per_node
        gang, a_quota, b_quota = max(1, capacity // 2), max(1, capacity // 2), capacity // 4
        self.out(
            f"maitre demo: {cfg.nodes} nodes x {cfg.slots_per_node} slots in 2 racks; "
            f"queues team-a (guaranteed {a_quota}) and team-b (guaranteed {b_quota}); "
            f"state in {self.run_dir}"
        )
        cluster = LocalCluster(
            UpConfig(
                state_dir=self.run_dir / "state",
                nodes=cfg.nodes,
                slots_per_node=cfg.slots_per_node,
                racks=2,
                queues=[Queue("team-a", guaranteed=a_quota), Queue("team-b", guaranteed=b_quota)],
                spot_nodes=min(cfg.spot_nodes, cfg.nodes // 2),
                policy=PolicyConfig(resize_cooldown_s=cfg.cooldown_s),
            ),
            out=self.out,
        ).start()
        self.cluster = cluster
        self.out(f"maitre demo: watch it live at {cluster.dashboard_url}")
        co = cluster.coordinator
        t0 = time.time()
        finished = False
        try:
            co.submit(self._manifest("a-lm", "team-a", 1, 6, cfg.steps))
            co.submit(self._manifest("b-lm", "team-b", 1, 6, cfg.steps))
            stage, next_line, stage_at = 0, 0.0, 0.0
            while time.time() - t0 < cfg.timeout_s:
                jobs = {j["job_id"]: j for j in co.job_list()}
                now = time.time()
                if now >= next_line:
                    next_line = now + 10
                    self.out(
                        "maitre demo: "
                        + " | ".join(
                            f"{j['job_id']} {j['state'].lower()} {len(j['members'])}w step {j['step']}"
                            for j in jobs.values()
                        )
                    )
                if all(j["state"] in ("COMPLETED", "FAILED", "CANCELLED") for j in jobs.values()):
                    finished = True
                    break
                a, b = jobs["a-lm"], jobs["b-lm"]
                if (
                    stage == 0
                    and min(a["step"], b["step"]) >= cfg.urgent_at_step
                    and len(a["members"]) + len(b["members"]) >= capacity
                ):
                    self.out(f"maitre demo: >>> a high-priority fixed gang of {gang} arrives (urgent)")
                    co.submit(
                        self._manifest(
                            "urgent", "team-a", gang, gang, cfg.urgent_steps, priority="high", preemptible=False
                        )
                    )
                    stage = 1
                elif stage == 1 and jobs.get("urgent", {}).get("state") == "COMPLETED":
                    self.out("maitre demo: >>> urgent is done; the elastic jobs may grow back")
                    stage, stage_at = 2, now
                elif (
                    stage == 2
                    and (
                        victim := max(  # the one that grew back most (b on a tie)
                            (j for j in (b, a) if j["state"] == "RUNNING" and _all_hold_state(j)),
                            key=lambda j: len(j["members"]),
                            default=None,
                        )
                    )
                    is not None
                    and (len(victim["members"]) > capacity // 4 or now - stage_at > 30)
                ):
                    self._kill_one(victim)
                    stage, stage_at = 3, now
                elif (
                    stage == 3
                    and now - stage_at > cfg.reclaim_after_s
                    and cluster.cfg.spot_nodes
                    and (live := [j for j in (a, b) if j["state"] == "RUNNING"])
                    and all(_all_hold_state(j, 1) for j in live)
                ):  # (one may run alone)
                    self._notice(f"node-{cfg.nodes - 1}")
                    stage = 4
                elif stage == 4 and self._drained(f"node-{cfg.nodes - 1}"):
                    self.out(f"maitre demo: >>> node-{cfg.nodes - 1} is drained; it goes (its agent stops)")
                    cluster.remove_node(f"node-{cfg.nodes - 1}")
                    stage = 5
                elif stage == 5 and self._reclaimed(f"node-{cfg.nodes - 1}"):
                    agent = cluster.add_node(spot=True)  # spot capacity comes back
                    self.out(f"maitre demo: >>> a new spot node {agent.node_id} comes up")
                    stage = 6
                time.sleep(0.2)
            if not finished:
                self.out(f"maitre demo: not done after {cfg.timeout_s:.0f}s; cancelling")
                for j in co.job_list():
                    if j["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
                        co.cancel(j["job_id"])
        finally:
            time.sleep(0.6)  # one more scheduling pass books the last exits
            report = co.report()
            statuses = {j["job_id"]: co.job_status(j["job_id"]) for j in co.job_list()}
            self.decisions = {
                jid: [e for e in cluster.db.events(job=jid) if e["kind"] in ("admit", "grow", "shrink", "suspend")]
                for jid in statuses
            }
            self.spot_events = [
                e for e in cluster.db.events() if e["kind"] in ("spot_notice", "node_drained", "node_reclaimed")
            ]
            cluster.stop(drain_s=10.0)
        elapsed = time.time() - t0
        ok = self.print_report(report, statuses, elapsed)
        return 0 if ok and finished else 1

    def _kill_one(self, job: dict[str, Any]) -> None:
        members = [w for w in job["workers"] if w["id"] in job["members"] and w["rank"] != 0]
        if not members:
            return
        victim = random.Random(7).choice(members)["id"]
        pid = self.cluster.pid_of(victim)
        if pid is None:
            return
        self.out(f"maitre demo: >>> SIGKILL worker {victim} of {job['job_id']} at step {job['step']}")
        self.causes.append((time.time(), job["job_id"], f"SIGKILL {victim}"))
        os.kill(pid, signal.SIGKILL)

    def _notice(self, node: str) -> None:
        """A reclaim notice for a spot node: the file its agent watches, written whole."""
        path = self.cluster.notice_file(node)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"notice_s": self.cfg.notice_s}))
        os.replace(partial, path)
        self.out(f"maitre demo: >>> spot node {node} gets a reclaim notice ({self.cfg.notice_s:.0f} s of warning)")

    def _drained(self, node: str) -> bool:
        return any(e["kind"] == "node_drained" and e.get("node") == node for e in self.cluster.db.events())

    def _reclaimed(self, node: str) -> bool:
        return any(e["kind"] == "node_reclaimed" and e.get("node") == node for e in self.cluster.db.events())

    # -- the report ------------------------------------------------------------------------------
    def print_report(self, report: dict[str, Any], statuses: dict[str, dict[str, Any]], elapsed: float) -> bool:
        lines = ["", f"maitre demo: report after {elapsed:.0f}s"]
        alloc, eta = report["allocation"], report["utilization"]

        def check(value: float | None, target: float) -> str:
            return (
                "n/a"
                if value is None
                else f"{value:.1%} ({'meets' if value >= target else 'MISSES'} the {target:.0%} target)"
            )

        lines.append(
            f"  allocation  {check(alloc, TARGETS['allocation'])}: slot-seconds held by "
            f"workers / capacity, over the {report['contended_s']:.0f}s a job waited "
            "or could grow"
        )
        lines.append(
            f"  utilization {check(eta, TARGETS['utilization'])}: slot-seconds in kept "
            "training steps / slot-seconds held"
        )
        lines.append(f"  {'job':<8} {'state':<10} {'waited':>7} {'ran':>6} {'ETTR':>6} {'eta':>6}  steps/s by workers")
        for jid, j in report["jobs"].items():
            job_eta = j["trained_slot_s"] / j["held_slot_s"] if j["held_slot_s"] else 0.0
            rates = ", ".join(f"{n}: {r:.1f}" for n, r in j["throughput"].items())
            ettr = "n/a" if j["ettr"] is None else f"{j['ettr']:.1%}"
            lines.append(
                f"  {jid:<8} {j['state']:<10} {j['waited_s']:>6.1f}s {j['ran_s']:>5.0f}s "
                f"{ettr:>6} {job_eta:>6.1%}  {rates}"
            )
        lines.extend(self._costs(report))
        lines.extend(self._spot(report, statuses))
        lines.append(
            "  resizes and recoveries, ms. detect: from the cause to a member noticing it (the "
            "members train on meanwhile); then they pause for re-sharding (rendezvous, "
            "new group, new data shares), state transfer and the first step:"
        )
        lines.append(
            f"  {'job':<8} {'epoch':>5} {'world':>5}  {'cause':<36} {'detect':>7} "
            f"{'reshard':>7} {'state':>6} {'step':>6} {'paused':>7}"
        )
        recoveries = []
        for jid, status in statuses.items():
            for r in epoch_reports(status.get("reports", [])):
                cause, cause_t = self._cause(jid, status, r)
                detect = None if cause_t is None else r["detected_at"] - cause_t
                reshard = r["rendezvous_s"] + r["group_s"]
                step = r["to_next_step_s"] - reshard - r["state_s"]
                recoveries.append(
                    {"job": jid, **r, "cause": cause, "detect_s": detect, "reshard_s": reshard, "first_step_s": step}
                )
                shown = "" if detect is None else f"{detect * 1000:.0f}"
                lines.append(
                    f"  {jid:<8} {r['epoch']:>5} {r['world_size']:>5}  {cause[:36]:<36} "
                    f"{shown:>7} {reshard * 1000:>7.0f} {r['state_s'] * 1000:>6.0f} "
                    f"{step * 1000:>6.0f} {r['to_next_step_s'] * 1000:>7.0f}"
                )
        ledger_root = self.run_dir / "state" / "ledger"
        all_ok = True
        audits = {}
        for jid in report["jobs"]:
            directory = ledger_root / jid
            result = audit(directory) if directory.exists() else None
            ok = result is not None and result.ok and report["jobs"][jid]["state"] == "COMPLETED"
            all_ok &= ok
            audits[jid] = "no ledger" if result is None else result.describe()
            lines.append(f"  data {jid}: {audits[jid]}")
        met = all(v is not None and v >= TARGETS[k] for k, v in (("allocation", alloc), ("utilization", eta)))
        lines.append(
            f"  targets {'met' if met else 'MISSED'}; every job's data exactly once: {'yes' if all_ok else 'NO'}"
        )
        (self.run_dir / "report.json").write_text(
            json.dumps(
                {
                    **report,
                    "elapsed_s": round(elapsed, 1),
                    "recoveries": recoveries,
                    "audits": audits,
                    "targets": TARGETS,
                },
                indent=2,
                default=str,
            )
        )
        lines.append(f"  report: {self.run_dir / 'report.json'}")
        lines.append(f"  watch it again: maitre dashboard {self.run_dir / 'state'}")
        self.out("\n".join(lines))
        return all_ok

    @staticmethod
    def _costs(report: dict[str, Any]) -> list[str]:
        """Per queue and in all: the slot-hours at their nodes' prices, and all on-demand."""
        if report.get("cost") is None:
            return ["  cost: no price table"]
        prices = ", ".join(f"{k} {v:g}" for k, v in report.get("prices", {}).items())
        lines = [
            f"  cost of the slot-hours held, at their nodes' prices per slot-hour ({prices}):",
            f"  {'queue':<8} {'slot-h':>7} {'on spot':>7} {'cost':>8} {'on-demand':>9} {'saved':>6}",
        ]
        for name, c in [*report.get("queues", {}).items(), ("all", report)]:
            saved = 1 - c["cost"] / c["on_demand_cost"] if c["on_demand_cost"] else 0.0
            lines.append(
                f"  {name:<8} {c['held_slot_s'] / 3600:>7.3f} "
                f"{c['spot_slot_s'] / max(c['held_slot_s'], 1e-9):>7.0%} "
                f"{c['cost']:>8.4f} {c['on_demand_cost']:>9.4f} {saved:>6.0%}"
            )
        return lines

    def _spot(self, report: dict[str, Any], statuses: dict[str, dict[str, Any]]) -> list[str]:
        events = getattr(self, "spot_events", [])
        lines = []
        for e in events:
            if e["kind"] == "spot_notice":
                lines.append(f"  spot: {e['node']} noticed ({e['notice_s']:.0f} s of warning, {e['source']})")
            elif e["kind"] == "node_drained":
                lines.append(
                    f"  spot: {e['node']} drained in {e['seconds']:.1f}s: "
                    f"{', '.join(e['workers']) or 'no workers'} left at a step boundary"
                )
            elif e["kind"] == "node_reclaimed":
                lines.append(f"  spot: {e['node']} reclaimed")
        if lines:
            failures = sum(s.get("failures", 0) for s in statuses.values())
            lines.append(
                f"  spot: {report.get('reclaims', 0)} reclaim(s); job failures in all: "
                f"{failures} (the demo's SIGKILL is one)"
            )
        return lines

    def _cause(self, job_id: str, status: dict[str, Any], r: dict[str, Any]) -> tuple[str, float | None]:
        """What started this membership change, and when (the latest cause before it was
        noticed): a kill by the demo, or the scheduler's decision."""
        candidates = [(t, what) for t, j, what in self.causes if j == job_id]
        for e in self.decisions.get(job_id, []):
            candidates.append((e["t"], f"scheduler: {e['kind']}" + (f" ({e['reason']})" if e.get("reason") else "")))
        before = [c for c in candidates if c[0] <= r["detected_at"] + 0.05]
        if r["reason"] == "join" and r["epoch"] == 1:
            if r.get("incarnation", 1) == 1:
                return "start", None
            # A new incarnation resumes from the checkpoint its suspension wrote: say why.
            suspended = [c for c in before if c[1].startswith("scheduler: suspend")]
            return ("resume after " + max(suspended)[1].removeprefix("scheduler: ") if suspended else "resume"), None
        if not before:
            return r["reason"], None
        t, what = max(before)
        if what.startswith("SIGKILL") and r["reason"].startswith("resize"):
            what = "replacement after " + what  # the lost worker's successor joins
        return what, t


def _all_hold_state(job: dict[str, Any], members: int = 2) -> bool:
    """At least ``members`` members, and every one of the running epoch has the job's state
    (joiners received it): a kill costs the job one worker, not its progress; a drain, nothing."""
    steps = [w["step"] for w in job["workers"] if w["id"] in job["members"]]
    return len(steps) >= members and min(steps) > 0 and min(steps) >= job["step"] - 2
