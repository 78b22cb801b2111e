"""Control-plane benchmark: the coordinator's cost at 64, 256 and 1,024 nodes of 8 slots.

    python benchmarks/control_plane.py [--sizes 16,64,256,1024] [--steady-s 25]
                                       [--before-sizes 16,32,64,256,1024] [--generators 2]
                                       [--grow-scale-delay-s 0] [--worker-start-s 0]
                                       [--smoke] [--out benchmarks/results/control_plane.json]

The real coordinator (``CoordinatorServer`` over a ``ClusterState`` and a ``Store`` in a temporary
directory, built as ``maitre up --nodes 0`` builds it) runs in a child process of its own, so its
CPU time is that process's utime + stime (``/proc/<pid>/stat``, every thread). Simulated agents
and workers speak the real protocol over HTTP/1.1 keep-alive connections from ``--generators``
other processes (asyncio, raw sockets), each driving a share of the nodes:

* **new protocol** (this tree): a node beat (``NodeBeat`` with its 8 workers' progress) every 2 s
  on a fixed schedule, one ``watch`` long-poll always open; workers rendezvous (long-poll) and
  never beat the coordinator.
* **before** (commit 5913ed4, from ``/tmp/maitre-before/src`` first on ``PYTHONPATH``): a node
  beat (``{slots, labels, running}``) every 0.25 s, and every worker's own heartbeat every 0.1 s.

A simulated agent starts a worker for every start order (from a beat reply or a watch); the
worker rendezvous from epoch 0 until told ``train``, then makes progress (reported in its node's
beat, or in its own heartbeat before); a view that says ``change`` or ``closed`` sends it back to
rendezvous. A worker told to leave says ``left``, and one told to leave or stop ends with its
agent reporting its exit, code 0, as ``maitre agent`` reports a process's (a kill order: -9).
The cluster is filled with fixed gangs of 256 (``minReplicas == maxReplicas``, one slot each),
one fixed job of 240 and an elastic job ``grow`` of 8, leaving 8 slots idle.

Measured per size, in a steady window of ``--steady-s`` seconds once every worker trains:

* ``hb_p50_ms`` / ``hb_p99_ms``: node beat round trips (before: also ``worker_hb_*``);
* ``cpu_s_per_s``: coordinator CPU seconds per wall second;
* ``epoch_open_256_s``: a gang of 256 forming in the steady cluster (``fill-0`` is cancelled and
  ``again`` takes its slots): its last worker's first rendezvous request to the first ``train``
  answer; ``epoch_open_256_fill_s``: the same for every gang forming at once while the cluster
  fills (the worst of them; the median too), where the arrivals of all of them queue together;
* ``grow_to_start_s``: ``POST /jobs/grow/scale`` 8 -> 16 to the first start order a simulated agent
  receives (and to the last; the split between the scheduling pass, seen in the coordinator's
  events, and delivery is reported).

The load generators' own lag is measured too (how late each beat is sent against its schedule,
and their CPU), so that a saturated generator is not mistaken for a slow coordinator. The
before-coordinator is run at the ``--before-sizes`` it survives: a size where beats' p99 passes
1 s, or where the cluster never fills in time, is recorded as not surviving and larger ones are
skipped. ``--smoke``: 8 nodes (gangs of 32), a steady window of 1 s, no before-coordinator.

A size that did not survive, or whose jobs did not all end where the run expects them (every
one RUNNING, ``fill-0`` CANCELLED; the row's ``notes`` name each one that did not, its state and
its ``failure``), keeps its evidence in ``control_plane[-before]-failed-<size>/`` next to the
JSON (the row's ``evidence``): the coordinator's ``state.db`` and its events as
``events.jsonl``, its log, the simulated agents' logs (``agents-N.log``: each worker's start,
first epoch, leave or stop, exit), ``GET /jobs/<id>`` of each such job and the row.

Issue 41 (``grow`` FAILED at 1,024 nodes, its 8 members training): ``--grow-scale-delay-s 0.5
--worker-start-s 2`` lands the scale of ``grow`` to 8 after the pass that admitted it at 16, as
a busy coordinator did; ``--smoke --steady-s 16`` with them shows it in a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import parse, write_results

HERE = Path(__file__).resolve().parent
NEW_SRC = HERE.parent / "src"
BEFORE_SRC = Path("/tmp/maitre-before/src")
SLOTS = 8
GANG = 256
TARGETS = {"hb_p99_ms": 50.0, "cpu_s_per_s": 0.5, "epoch_open_256_s": 1.0, "grow_to_start_s": 1.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listen_overflows() -> int:
    """This host's count of connections dropped from a full accept queue (TcpExt)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return -1
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:]))
            return int(table.get("ListenOverflows", -1))
    return -1


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- the coordinator, in a child process --------------------------------------------------------
def serve_coordinator(state_dir: str) -> None:
    """Child process: the coordinator as ``maitre up --nodes 0`` builds it; prints its address."""
    import secrets

    import maitre
    from maitre.control.cluster import ClusterState
    from maitre.control.detectors import DetectorConfig, PhiConfig
    from maitre.control.store import Store
    from maitre.scheduling.model import Queue
    from maitre.scheduling.policy import PolicyConfig

    try:
        from maitre.control.api import CoordinatorServer
    except ImportError:  # the coordinator of 5913ed4
        from maitre.control.server import CoordinatorServer
    _raise_nofile()
    import logging

    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("maitre").setLevel(logging.INFO)  # (its stderr is coordinator.log)
    root = Path(state_dir)
    db = Store(root / "state.db")
    token = secrets.token_urlsafe(32)
    cluster = ClusterState(
        [Queue("default")],
        run_dir=root,
        policy=PolicyConfig(),
        phi=PhiConfig(),
        detector=DetectorConfig(),
        max_restarts=3,
    )
    server = CoordinatorServer(
        host="127.0.0.1", port=0, store_port=0, on_event=lambda job, event: None, token=token, cluster=cluster, db=db
    )
    server.start()
    print(
        json.dumps({"address": server.address, "token": token, "pid": os.getpid(), "maitre": maitre.__file__}),
        flush=True,
    )
    import gc

    pauses: list[float] = []
    started: list[float] = []

    def gc_timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(gc_timer)
    sys.stdin.read()  # until the parent closes it
    if pauses:
        print(
            f"coordinator gc: {len(pauses)} collections, max {max(pauses) * 1000:.1f} ms, total {sum(pauses):.2f} s",
            file=sys.stderr,
            flush=True,
        )
    server.stop()
    db.close()


class Coordinator:
    """The coordinator's child process, its state (``state.db``), its log (``coordinator.log``)
    and the load generators' logs (``agents-N.log``) in a temporary directory."""

    def __init__(self, which: str) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix=f"maitre-cp-{which}-")
        src = NEW_SRC if which == "new" else BEFORE_SRC
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        self.log_path = Path(self.dir.name) / "coordinator.log"
        with self.log_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", self.dir.name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                text=True,
            )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {which} coordinator did not start: {self.log_path.read_text()[-2000:]}")
        info = json.loads(line)
        if not info["maitre"].startswith(str(src)):
            raise RuntimeError(f"the {which} coordinator imported {info['maitre']}")
        self.address, self.token, self.pid = info["address"], info["token"], info["pid"]

    def call(self, method: str, path: str, body: Any = None, timeout_s: float = 30.0) -> Any:
        import http.client

        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(
                method,
                "/v1" + path,
                body=data,
                headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            )
            reply = conn.getresponse()
            out = json.loads(reply.read() or b"{}")
            if reply.status != 200:
                raise RuntimeError(f"{method} {path}: {reply.status} {out}")
            return out
        finally:
            conn.close()

    def stop(self, keep: Path | None = None) -> None:
        """Stop it (its store closes); with ``keep``, copy its state, its events (as
        ``events.jsonl``) and the logs there first."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("coordinator gc:"):
                    print(line, file=sys.stderr, flush=True)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                for path in Path(self.dir.name).iterdir():
                    if path.is_file():
                        shutil.copy2(path, keep / path.name)
                export_events(keep / "state.db", keep / "events.jsonl")
        finally:
            self.dir.cleanup()


def export_events(db: Path, out: Path) -> None:
    """The coordinator's event log (its store's ``events`` table) as JSON lines, oldest first."""
    if not db.exists():
        return
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        with out.open("w") as f:
            for seq, t, job, kind, body in conn.execute("SELECT seq, t, job, kind, body FROM events ORDER BY seq"):
                f.write(json.dumps({"seq": seq, "t": t, "job": job, "kind": kind, **json.loads(body)}) + "\n")
    except sqlite3.Error as exc:  # (the coordinator of 5913ed4 may keep them otherwise)
        out.with_suffix(".error").write_text(f"{exc}\n")
    finally:
        conn.close()


# -- the load generators ------------------------------------------------------------------------
class Conn:
    """One HTTP/1.1 keep-alive connection (a request at a time)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
        try:
            return await asyncio.wait_for(self._post(path, body), timeout_s)
        except BaseException:
            self.close()
            raise

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            (
                f"POST /v1{path} HTTP/1.1\r\nHost: {self.host}\r\n{self.auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
            + data
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length, close = 0, False
        for line in lines[1:]:
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                close = True
        payload = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, json.loads(payload) if payload else {}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class SimWorker:
    __slots__ = ("wid", "job", "node", "epoch", "state", "t_train", "task", "hb_task")

    def __init__(self, wid: str, job: str, node: "SimNode") -> None:
        self.wid, self.job, self.node = wid, job, node
        self.epoch, self.state, self.t_train = 0, "rdv", 0.0
        self.task: asyncio.Task | None = None
        self.hb_task: asyncio.Task | None = None

    def progress(self, now: float) -> tuple[int, float]:
        if self.state != "train":
            return 0, 0.0
        return int((now - self.t_train) * 2), round(now - self.t_train, 3)


class SimNode:
    def __init__(self, gen: "Generator", index: int) -> None:
        self.gen, self.name = gen, f"node-{index}"
        self.labels = {"rack": f"rack-{index // 32}"}
        self.version = -1
        self.workers: dict[str, SimWorker] = {}
        self.beat_conn = gen.conn()
        self.watch_conn = gen.conn()


class Generator:
    """One process's share of the nodes, on one asyncio loop."""

    def __init__(self, cfg: dict[str, Any], pipe: Any, counters: Any) -> None:
        self.cfg = cfg
        self.new = cfg["protocol"] == "new"
        self.host, port = cfg["address"].rsplit(":", 1)
        self.port = int(port)
        self.pipe, self.counters = pipe, counters
        self.node_beats: list[tuple[float, float, float]] = []  # (scheduled, lag, latency)
        self.worker_beats: list[tuple[float, float, float]] = []
        self.starts: list[tuple[str, str, float, float]] = []  # (job, worker, mono, wall)
        self.rdv: dict[str, dict[str, Any]] = {}  # worker -> first sent, train received
        self.errors: dict[str, int] = {}
        self.stop = False
        self.start_s = float(cfg.get("worker_start_s", 0.0))
        """A simulated worker's start-up before its first rendezvous (0: none)."""
        self.log = open(Path(cfg["log_dir"]) / f"agents-{cfg['index']}.log", "w")
        """What the simulated agents did with their workers, a line each (``agents-N.log``)."""

    def note(self, node: SimNode, wid: str, what: str) -> None:
        self.log.write(f"{time.time():.4f} {node.name} {wid} {what}\n")

    def conn(self) -> Conn:
        return Conn(self.host, self.port, self.cfg["token"])

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1
        self.counters[2] += 1

    # -- agents ------------------------------------------------------------------------------
    async def beat_loop(self, node: SimNode) -> None:
        period = 2.0 if self.new else 0.25
        due = time.monotonic() + random.random() * period
        first = True
        while not self.stop:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = time.monotonic()
            if self.new:
                body = {
                    "slots": SLOTS,
                    "labels": node.labels,
                    "since": node.version,
                    "workers": [self.worker_beat(w, sent) for w in node.workers.values()],
                }
            else:
                body = {"slots": SLOTS, "labels": node.labels, "running": list(node.workers)}
            try:
                status, reply = await node.beat_conn.post(f"/nodes/{node.name}/heartbeat", body, 10.0)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                self.error("node_beat")
                status, reply = 0, {}
            got = time.monotonic()
            self.node_beats.append((due, sent - due, got - sent if status == 200 else -1.0))
            if status == 200:
                self.apply(node, reply)
                if first and self.new:
                    first = False
                    asyncio.ensure_future(self.watch_loop(node))
                if first:
                    first = False
                    self.counters[3] += 1
            due += period

    @staticmethod
    def worker_beat(w: SimWorker, now: float) -> dict[str, Any]:
        step, trained = w.progress(now)
        return {
            "id": w.wid,
            "step": step,
            "stalled": False,
            "trained_s": trained,
            "silent_s": round(random.random() * 0.1, 4),
            "gap_mean_s": 0.1,
            "gap_std_s": 0.01,
        }

    async def watch_loop(self, node: SimNode) -> None:
        self.counters[3] += 1
        while not self.stop:
            try:
                status, reply = await node.watch_conn.post(
                    f"/nodes/{node.name}/watch", {"since": node.version, "wait_s": 30.0}, 45.0
                )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                self.error("watch")
                await asyncio.sleep(0.5)
                continue
            if status == 200:
                self.apply(node, reply)
            else:
                self.error(f"watch_{status}")
                await asyncio.sleep(0.5)

    def apply(self, node: SimNode, orders: dict[str, Any]) -> None:
        now, wall = time.monotonic(), time.time()
        if "version" in orders:
            node.version = max(node.version, orders["version"])
        for order in orders.get("start", []):
            wid = order["worker_id"]
            self.starts.append((order["job_id"], wid, now, wall))
            w = node.workers[wid] = SimWorker(wid, order["job_id"], node)
            self.counters[0] += 1
            self.note(node, wid, "start")
            w.task = asyncio.ensure_future(self.rendezvous(w, 0))
            if not self.new:
                w.hb_task = asyncio.ensure_future(self.worker_hb_loop(w))
        for wid in orders.get("kill", []):  # an agent reports each process's exit once
            if self.remove(node, wid):
                self.note(node, wid, "killed: exit -9")
                asyncio.ensure_future(self.once(f"/workers/{wid}/exit", {"code": -9}))
        for wid, view in (orders.get("views") or {}).items():
            self.on_view(node, wid, view)

    def on_view(self, node: SimNode, wid: str, view: dict[str, Any]) -> None:
        w = node.workers.get(wid)
        if w is None:
            return
        if view.get("stop"):
            self.end(node, wid, "view: stop", left=False)
        elif view.get("leave") and w.state == "train":
            self.end(node, wid, "view: leave", left=True)
        elif w.state == "train" and view.get("member_epoch") == w.epoch and (view.get("closed") or view.get("change")):
            w.state = "rdv"
            self.counters[1] -= 1
            w.task = asyncio.ensure_future(self.rendezvous(w, w.epoch))

    def end(self, node: SimNode, wid: str, why: str, *, left: bool) -> None:
        """The worker ends as a real one does when it is told to leave (``left``: it says so,
        ``/left``) or to stop; then its agent reports its exit, code 0 (``/exit``), as ``maitre
        agent`` reports every process's. (Before issue 41 a worker answered ``leave`` in its
        rendezvous went without a word: the coordinator declared it lost 15 s later.)"""
        if self.remove(node, wid):
            self.note(node, wid, f"{why}: {'left, ' if left else ''}exit 0")
            asyncio.ensure_future(self.ended(wid, left))

    async def ended(self, wid: str, left: bool) -> None:
        if left:
            await self.once(f"/workers/{wid}/left", {})
        await self.once(f"/workers/{wid}/exit", {"code": 0})

    def remove(self, node: SimNode, wid: str) -> bool:
        w = node.workers.pop(wid, None)
        if w is None:
            return False
        if w.state == "train":
            self.counters[1] -= 1
        w.state = "gone"
        for t in (w.task, w.hb_task):
            if t is not None and t is not asyncio.current_task():
                t.cancel()
        return True

    async def once(self, path: str, body: dict[str, Any]) -> None:
        c = self.conn()
        what = path.rsplit("/", 1)[1]
        try:
            status, _ = await c.post(path, body, 10.0)
            if status != 200:
                self.error(f"{what}_{status}")
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            self.error(what)
        finally:
            c.close()

    # -- workers -----------------------------------------------------------------------------
    async def rendezvous(self, w: SimWorker, from_epoch: int) -> None:
        c = self.conn()
        rec = (
            self.rdv.setdefault(w.wid, {"job": w.job, "first": None, "first_wall": None, "train": None, "epoch": None})
            if from_epoch == 0
            else None
        )
        try:
            if from_epoch == 0 and self.start_s > 0:  # imports, model: a real worker's start-up
                await asyncio.sleep(self.start_s)
            while not self.stop and w.state == "rdv":
                sent = time.monotonic()
                if rec is not None and rec["first"] is None:
                    rec["first"], rec["first_wall"] = sent, time.time()
                try:
                    status, reply = await c.post(
                        f"/workers/{w.wid}/rendezvous",
                        {
                            "from_epoch": from_epoch,
                            "step": w.progress(sent)[0],
                            "reason": "joining" if from_epoch == 0 else "membership change",
                            "wait_s": 30.0,
                        },
                        60.0,
                    )
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                    self.error("rendezvous")
                    await asyncio.sleep(0.5)
                    continue
                if status != 200:
                    self.error(f"rendezvous_{status}")
                    await asyncio.sleep(0.5)
                    continue
                action = reply.get("action")
                if action == "train":
                    w.epoch, w.state, w.t_train = reply["epoch"], "train", time.monotonic()
                    self.counters[1] += 1
                    if rec is not None:
                        rec["train"], rec["epoch"] = w.t_train, reply["epoch"]
                    if from_epoch == 0:
                        self.note(w.node, w.wid, f"trains in epoch {w.epoch}")
                    return
                if action in ("leave", "stop"):
                    self.end(w.node, w.wid, f"rendezvous: {action}", left=action == "leave")
                    return
        finally:
            c.close()

    async def worker_hb_loop(self, w: SimWorker) -> None:
        """Before: every worker beats the coordinator at 10 Hz."""
        c = self.conn()
        due = time.monotonic() + random.random() * 0.1
        try:
            while not self.stop and w.state != "gone":
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                sent = time.monotonic()
                step, trained = w.progress(sent)
                try:
                    status, reply = await c.post(
                        f"/workers/{w.wid}/heartbeat", {"step": step, "stalled": False, "trained_s": trained}, 10.0
                    )
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                    self.error("worker_beat")
                    status, reply = 0, {}
                got = time.monotonic()
                self.worker_beats.append((due, sent - due, got - sent if status == 200 else -1.0))
                if status == 200:
                    self.on_view(w.node, w.wid, reply)
                due += 0.1
        finally:
            c.close()

    # -- the process -------------------------------------------------------------------------
    async def main(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        loop.add_reader(self.pipe.fileno(), stopped.set)
        nodes = [SimNode(self, i) for i in self.cfg["nodes"]]
        tasks = [asyncio.ensure_future(self.beat_loop(n)) for n in nodes]
        cpu0, t0 = cpu_s(os.getpid()), time.monotonic()
        await stopped.wait()
        window = self.pipe.recv()
        self.stop = True
        for t in tasks:
            t.cancel()
        self.log.close()
        return {
            "node_beats": self.node_beats,
            "worker_beats": self.worker_beats,
            "starts": self.starts,
            "rdv": self.rdv,
            "errors": self.errors,
            "cpu_s": cpu_s(os.getpid()) - cpu0,
            "wall_s": time.monotonic() - t0,
            "window": window,
        }


def generator_main(cfg: dict[str, Any], pipe: Any, counters: Any) -> None:
    _raise_nofile()
    gen = Generator(cfg, pipe, counters)
    pipe.send(asyncio.run(gen.main()))


# -- one size, one coordinator ------------------------------------------------------------------
def wait_for(pred: Any, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic()


def manifest(name: str, lo: int, hi: int) -> dict[str, Any]:
    return {
        "manifest": {
            "name": name,
            "queue": "default",
            "minReplicas": lo,
            "maxReplicas": hi,
            "gpusPerReplica": 1,
            "command": ["python", "train.py"],
        }
    }


def run_size(
    which: str,
    num_nodes: int,
    steady_s: float,
    num_gens: int,
    log: Any,
    keep_dir: Path | None = None,
    grow_scale_delay_s: float = 0.0,
    worker_start_s: float = 0.0,
) -> dict[str, Any]:
    """Fill a cluster of ``num_nodes`` x 8, measure; returns the row (raises nothing). A row
    that did not survive, or whose jobs did not all end where they should, keeps its evidence
    (:func:`keep_evidence`) in ``keep_dir/control_plane[-before]-failed-<num_nodes>/``."""
    row: dict[str, Any] = {
        "hb_p50_ms": None,
        "hb_p99_ms": None,
        "cpu_s_per_s": None,
        "epoch_open_256_s": None,
        "grow_to_start_s": None,
    }
    notes: list[str] = []
    slots = num_nodes * SLOTS
    gang = min(GANG, slots // 2)  # a small cluster gets gangs of half its slots
    row["gang"] = gang
    gangs = slots // gang - 1
    jobs = [(f"fill-{i}", gang, gang) for i in range(gangs)] + [("fill-rest", gang - 16, gang - 16)]
    expected = slots - 8
    overflows0 = listen_overflows()
    co = Coordinator(which)
    ctx = mp.get_context("fork")
    gens = []
    states: dict[str, str] = {}  # each job's state at the end, as the run expects it
    evidence: dict[str, Any] = {}  # what the coordinator said of the jobs that were not
    try:
        for g in range(num_gens):
            parent, child = ctx.Pipe()
            counters = ctx.Array("l", 4, lock=False)  # started, training, errors, nodes up
            cfg = {
                "protocol": which,
                "address": co.address,
                "token": co.token,
                "nodes": list(range(g, num_nodes, num_gens)),
                "index": g,
                "log_dir": co.dir.name,
                "worker_start_s": worker_start_s,
            }
            proc = ctx.Process(target=generator_main, args=(cfg, child, counters), daemon=True)
            proc.start()
            gens.append((proc, parent, counters))
        total = lambda k: sum(c[k] for _, _, c in gens)  # noqa: E731
        t_start = time.monotonic()
        wait_for(lambda: total(3) >= num_nodes, 30 + num_nodes * 0.05, "every node beating")
        log(f"  {which} {num_nodes}: {num_nodes} nodes up in {time.monotonic() - t_start:.1f} s")
        t_submit, c_submit = time.monotonic(), cpu_s(co.pid)
        # grow: 8 of at most 16 (the manifest's ceiling, so that the membership may grow to 16;
        # see the report), held at 8 by a scale, usually before its first scheduling pass: on a
        # busy coordinator (or after --grow-scale-delay-s) after it, when 8 of its 16 workers
        # are turned away as they start (issue 41)
        co.call("POST", "/jobs", manifest("grow", 8, 16))
        if grow_scale_delay_s > 0:
            time.sleep(grow_scale_delay_s)
        co.call("POST", "/jobs/grow/scale", {"workers": 8})
        for name, lo, hi in jobs:
            co.call("POST", "/jobs", manifest(name, lo, hi))
        states.update({name: "RUNNING" for name in ["grow"] + [name for name, _, _ in jobs]})
        try:
            t_full = wait_for(lambda: total(1) >= expected, 60 + num_nodes * 0.1, f"{expected} workers training")
        except TimeoutError as exc:
            notes.append(f"{exc} ({total(0)} started, {total(1)} training)")
            row["survived"] = False
            try:  # which jobs did not get there, as the coordinator sees them
                stuck = {
                    j["job_id"]: f"{j['state']} epoch {j['epoch']} members "
                    f"{len(j['members'])}/{j.get('max_workers')} {j.get('waiting_for', '')}"
                    + (f" failure: {j['failure']}" if j.get("failure") else "")
                    for j in co.call("GET", "/jobs", timeout_s=30)["jobs"]
                }
                notes.append(f"jobs: {stuck}")
            except Exception as exc2:  # noqa: BLE001
                notes.append(f"jobs: {exc2}")
            t_full = None
        if t_full is not None:
            row["fill_s"] = round(t_full - t_submit, 2)
            log(f"  {which} {num_nodes}: {expected} workers training {row['fill_s']} s after submitting")
            time.sleep(3.0)  # let the last epochs' views settle
            w0, c0 = time.monotonic(), cpu_s(co.pid)
            gen_c0 = [cpu_s(p.pid) for p, _, _ in gens]
            time.sleep(steady_s)
            w1, c1 = time.monotonic(), cpu_s(co.pid)
            gen_c1 = [cpu_s(p.pid) for p, _, _ in gens]
            row["cpu_s_per_s"] = round((c1 - c0) / (w1 - w0), 3)
            row["gen_cpu_s_per_s"] = [round((b - a) / (w1 - w0), 3) for a, b in zip(gen_c0, gen_c1)]
            # grow: 8 -> 16 on the idle slots
            t_scale = time.monotonic()
            wall_scale = time.time()
            try:
                co.call("POST", "/jobs/grow/scale", {"workers": 16}, timeout_s=10)
            except Exception as exc:  # noqa: BLE001 - record it, measure the rest
                notes.append(f"scale failed: {exc}")
            t_scaled = time.monotonic()
            try:
                wait_for(lambda: total(0) >= expected + 8, 15, "8 grow start orders")
            except TimeoutError as exc:
                notes.append(str(exc))
            time.sleep(1.0)
            # one gang of 256 forming in a steady cluster: fill-0 ends, "again" takes its slots
            try:
                co.call("POST", "/jobs/fill-0/cancel", {}, timeout_s=10)
                states["fill-0"] = "CANCELLED"
                wait_for(lambda: total(1) <= expected + 8 - gang, 30, "fill-0's workers gone")
                co.call("POST", "/jobs", manifest("again", gang, gang), timeout_s=10)
                states["again"] = "RUNNING"
                wait_for(lambda: total(1) >= expected + 8, 30, "again's 256 workers training")
            except (TimeoutError, RuntimeError, OSError) as exc:
                notes.append(f"again: {exc}")
            time.sleep(0.5)
        else:  # never steady: the beats and CPU of the fill itself are the evidence
            w0, w1 = t_submit, time.monotonic()
            row["cpu_s_per_s"] = round((cpu_s(co.pid) - c_submit) / (w1 - w0), 3)
            notes.append("hb and cpu measured during the fill (it never became steady)")
            t_scale = t_scaled = wall_scale = 0.0
        if which == "new" or row.get("survived") is False:  # (the before-coordinator's only when it failed)
            try:  # every job where the run expects it? Which were not, as the coordinator saw them
                off = jobs_off(co, states, evidence)
                if off:
                    notes.append(f"jobs not as expected: {off}")
                    row["survived"] = False
            except Exception as exc:  # noqa: BLE001
                notes.append(f"jobs: {exc}")
        results = []
        for _proc, pipe, _ in gens:
            pipe.send((w0, w1))
        for proc, pipe, _ in gens:
            results.append(pipe.recv() if pipe.poll(60) else None)
            proc.join(timeout=10)
        if any(r is None for r in results):
            notes.append("a load generator did not answer")
            results = [r for r in results if r is not None]
        # -- the numbers ---------------------------------------------------------------------
        in_window = lambda rows: [r for r in rows if w0 <= r[0] <= w1]  # noqa: E731
        nb = [r for res in results for r in in_window(res["node_beats"])]
        wb = [r for res in results for r in in_window(res["worker_beats"])]
        lat = [r[2] * 1000 for r in nb if r[2] >= 0]
        row["hb_p50_ms"] = round(pct(lat, 0.5), 2) if lat else None
        row["hb_p99_ms"] = round(pct(lat, 0.99), 2) if lat else None
        row["hb_count"] = len(nb)
        row["hb_failed"] = sum(1 for r in nb if r[2] < 0)
        row["hb_max_ms"] = round(max(lat), 1) if lat else None
        lag = [r[1] * 1000 for r in nb]
        row["gen_lag_p50_ms"] = round(pct(lag, 0.5), 2) if lag else None
        row["gen_lag_p99_ms"] = round(pct(lag, 0.99), 2) if lag else None
        if wb:
            wl = [r[2] * 1000 for r in wb if r[2] >= 0]
            row["worker_hb_p50_ms"] = round(pct(wl, 0.5), 2) if wl else None
            row["worker_hb_p99_ms"] = round(pct(wl, 0.99), 2) if wl else None
            row["worker_hb_count"] = len(wb)
            row["worker_hb_failed"] = sum(1 for r in wb if r[2] < 0)
            wlag = [r[1] * 1000 for r in wb]
            row["worker_gen_lag_p99_ms"] = round(pct(wlag, 0.99), 2)
            # beats sent in the window against the schedule's count: does it keep real time?
            row["worker_hb_per_s"] = round(len(wb) / max(1e-9, w1 - w0), 1)
        if nb:
            row["hb_per_s"] = round(len(nb) / max(1e-9, w1 - w0), 1)
        errors: dict[str, int] = {}
        for res in results:
            for k, v in res["errors"].items():
                errors[k] = errors.get(k, 0) + v
        if errors:
            row["errors"] = errors
        # Connections the kernel dropped from a full accept queue during this size (their
        # clients retry after 1 s, 3 s...): a burst of new connections the loop did not accept
        row["listen_overflows"] = listen_overflows() - overflows0
        # epoch open of the 256-gangs
        rdv = {wid: r for res in results for wid, r in res["rdv"].items()}
        opens, spreads = [], []
        again = [r for r in rdv.values() if r["job"] == "again"]
        if len(again) == gang and all(r["train"] is not None for r in again):
            row["epoch_open_256_s"] = round(min(r["train"] for r in again) - max(r["first"] for r in again), 4)
            row["arrival_spread_again_s"] = round(max(r["first"] for r in again) - min(r["first"] for r in again), 4)
            try:  # the coordinator's own clock: when the epoch opened, after the last arrival
                ev = co.call("GET", "/jobs/again", timeout_s=30).get("events", [])
                ep = [e["t"] for e in ev if e.get("kind") == "epoch"]
                if ep:
                    row["epoch_open_256_coordinator_again_s"] = round(ep[0] - max(r["first_wall"] for r in again), 4)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"again events: {exc}")
        for name, lo, _ in jobs:
            if lo != gang:
                continue
            rs = [r for r in rdv.values() if r["job"] == name]
            if len(rs) < gang or any(r["train"] is None for r in rs):
                continue
            opens.append(min(r["train"] for r in rs) - max(r["first"] for r in rs))
            spreads.append(max(r["first"] for r in rs) - min(r["first"] for r in rs))
            if name == "fill-0":
                last_wall = max(r["first_wall"] for r in rs)
                try:
                    ev = co.call("GET", "/jobs/fill-0", timeout_s=30).get("events", [])
                    ep = [e["t"] for e in ev if e.get("kind") == "epoch"]
                    if ep:
                        row["epoch_open_256_coordinator_s"] = round(ep[0] - last_wall, 4)
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"fill-0 events: {exc}")
        if spreads:
            row["arrival_spread_256_s"] = round(max(spreads), 3)
        if opens:  # every gang forming at once, as the cluster fills: the worst, the median
            row["epoch_open_256_fill_s"] = round(max(opens), 4)
            row["epoch_open_256_fill_median_s"] = round(statistics.median(opens), 4)
            row["epoch_open_256_fill_jobs"] = len(opens)
        # grow
        grow = sorted(t for res in results for (job, _, t, _) in res["starts"] if job == "grow" and t >= t_scale > 0)
        if grow:
            row["grow_to_start_s"] = round(grow[0] - t_scale, 4)
            row["grow_to_last_start_s"] = round(grow[-1] - t_scale, 4)
            row["grow_scale_call_s"] = round(t_scaled - t_scale, 4)
            row["grow_starts"] = len(grow)
            joined = [r["train"] for r in rdv.values() if r["job"] == "grow" and r["train"] and r["first"] >= t_scale]
            if joined:
                row["grow_to_joiners_train_s"] = round(max(joined) - t_scale, 4)
            try:
                events = co.call("GET", "/jobs/grow", timeout_s=30).get("events", [])
                placed = [
                    e
                    for e in events
                    if isinstance(e.get("t"), (int, float))
                    and e["t"] >= wall_scale
                    and e.get("kind") not in ("max_replicas",)
                ]
                if placed:
                    first = min(placed, key=lambda e: e["t"])
                    row["grow_first_event"] = {
                        "kind": first.get("kind"),
                        "after_scale_s": round(first["t"] - wall_scale, 4),
                    }
            except Exception as exc:  # noqa: BLE001
                notes.append(f"grow events: {exc}")
        if row.get("survived") is None:
            row["survived"] = bool(
                row["hb_p99_ms"] is not None
                and row["hb_p99_ms"] <= 1000
                and (not wb or (row.get("worker_hb_p99_ms") or 1e9) <= 1000)
            )
        if notes:
            row["notes"] = "; ".join(notes)
        return row
    except Exception as exc:  # noqa: BLE001 - a size that fails is a result, not a crash
        row["survived"] = False
        row["notes"] = "; ".join(notes + [f"{type(exc).__name__}: {exc}"])
        return row
    finally:
        for proc, _pipe, _ in gens:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        keep = None
        if row.get("survived") is False and keep_dir is not None:
            keep = keep_dir / f"control_plane{'' if which == 'new' else '-before'}-failed-{num_nodes}"
            shutil.rmtree(keep, ignore_errors=True)
            row["evidence"] = str(keep)
        co.stop(keep=keep)
        if keep is not None:
            keep_evidence(keep, row, evidence)
            log(f"  {which} {num_nodes}: did not survive; its coordinator's state, events and logs are in {keep}")


def jobs_off(co: Coordinator, states: dict[str, str], evidence: dict[str, Any]) -> dict[str, str]:
    """The jobs not in the state the run expects them in (``states``; any job it does not know
    of), each as the coordinator tells it, its ``failure`` too; their ``GET /jobs/<id>`` (events
    included) go into ``evidence``."""
    off = {}
    for j in co.call("GET", "/jobs", timeout_s=30)["jobs"]:
        job_id, state = j["job_id"], j["state"]
        if state == states.get(job_id) or (state == "RENDEZVOUS" and states.get(job_id) == "RUNNING"):
            continue  # (an epoch that closed for a change is one the job trains on after)
        off[job_id] = (
            f"{state} (expected {states.get(job_id, 'no such job')}) epoch {j.get('epoch')} members "
            f"{len(j.get('members') or [])}/{j.get('max_workers')}"
            + (f" waiting for {j['waiting_for']}" if j.get("waiting_for") else "")
            + (f": {j['failure']}" if j.get("failure") else "")
        )
        try:
            evidence[job_id] = co.call("GET", f"/jobs/{job_id}", timeout_s=30)
        except Exception as exc:  # noqa: BLE001
            evidence[job_id] = {"error": str(exc)}
    return off


def keep_evidence(keep: Path, row: dict[str, Any], evidence: dict[str, Any]) -> None:
    """Next to the coordinator's state (``state.db``, ``events.jsonl``, ``coordinator.log``)
    and the simulated agents' logs (``agents-N.log``), already there: the row, and each job
    that was not where it should be as ``jobs/<id>.json`` (``GET /jobs/<id>``)."""
    keep.mkdir(parents=True, exist_ok=True)
    (keep / "row.json").write_text(json.dumps(row, indent=2) + "\n")
    if evidence:
        (keep / "jobs").mkdir(exist_ok=True)
        for job_id, body in evidence.items():
            (keep / "jobs" / f"{job_id}.json").write_text(json.dumps(body, indent=2) + "\n")


# -- the table ----------------------------------------------------------------------------------
def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if isinstance(v, float) else f"{v}{unit}"


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown, a row per size and coordinator ("before":
    the coordinator of 5913ed4, "now": this tree's). The last column is the load generators' own
    lag: a figure is the coordinator's only while it stays small."""

    def ms(v: float | None) -> str:
        return "-" if v is None else (f"{v:.1f} ms" if v < 100 else f"{v:,.0f} ms")

    def sec(v: float | None) -> str:
        return "-" if v is None else (f"{v:.3f} s" if v < 1 else f"{v:.2f} s" if v < 10 else f"{v:.1f} s")

    lines = [
        "| nodes x 8 | coordinator | beat p50 | beat p99 | CPU-s/s | gang of 256 opens "
        "(steady) | gangs open while filling (worst) | grow to start order | "
        "load generators' lag p99 |",
        "|---" * 9 + "|",
    ]
    sizes = sorted({int(s) for s in result["nodes"]} | {int(s) for s in result["before"]})
    for size in sizes:
        for label, key in (("before", "before"), ("now", "nodes")):
            r = result[key].get(str(size))
            if r is None:
                continue
            p99 = ms(r.get("hb_p99_ms"))
            if r.get("worker_hb_p99_ms") is not None:
                p99 += f" (worker beats {ms(r['worker_hb_p99_ms'])})"
            opens = r.get("epoch_open_256_s")
            if opens is None:
                lag = r.get("gen_lag_p99_ms")
                opens = "never filled" + (
                    f" (its load generator {lag / 1000:.0f} s behind)" if lag is not None and lag > 1000 else ""
                )
            else:
                opens = sec(opens) + ("" if r.get("gang", 256) == 256 else f" (gang of {r['gang']})")
            if not r.get("survived", True):
                label += ", did not survive"
            cpu = r.get("cpu_s_per_s")
            lines.append(
                f"| {size:,} | {label} | {ms(r.get('hb_p50_ms'))} | {p99} | "
                f"{'-' if cpu is None else f'{cpu:.3f}'} | {opens} | "
                f"{sec(r.get('epoch_open_256_fill_s'))} | "
                f"{sec(r.get('grow_to_start_s'))} | {ms(r.get('gen_lag_p99_ms'))} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument(
        "--before-sizes",
        default="16,32,64,256,1024",
        help="sizes for the coordinator of 5913ed4 (stops at the first it fails)",
    )
    p.add_argument("--steady-s", type=float, default=25.0)
    p.add_argument("--generators", type=int, default=2)
    p.add_argument(
        "--grow-scale-delay-s",
        type=float,
        default=0.0,
        help="seconds between submitting grow and scaling it to 8 (issue 41: with "
        "--worker-start-s, the scale lands after the pass that admits grow at 16)",
    )
    p.add_argument(
        "--worker-start-s",
        type=float,
        default=0.0,
        help="a simulated worker's start-up before its first rendezvous (a real one imports, builds its model)",
    )
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = parse(p, "control_plane", smoke={"sizes": "8", "before_sizes": "", "steady_s": 1.0})
    if args.serve:
        serve_coordinator(args.serve)
        return
    log = lambda s: print(s, flush=True)  # noqa: E731
    result: dict[str, Any] = {"nodes": {}, "before": {}}
    notes: list[str] = []

    def run(which: str, size: int) -> dict[str, Any]:
        return run_size(
            which,
            size,
            args.steady_s,
            args.generators,
            log,
            args.out.parent,
            args.grow_scale_delay_s,
            args.worker_start_s,
        )

    for size in (int(s) for s in args.sizes.split(",") if s):
        log(f"new coordinator, {size} nodes x {SLOTS} slots")
        result["nodes"][str(size)] = run("new", size)
    if BEFORE_SRC.exists():
        for size in (int(s) for s in args.before_sizes.split(",") if s):
            log(f"coordinator of 5913ed4, {size} nodes x {SLOTS} slots")
            row = run("before", size)
            result["before"][str(size)] = row
            if not row.get("survived"):
                notes.append(f"before: did not survive {size} nodes; larger sizes not run")
                break
    else:
        notes.append(f"before: {BEFORE_SRC} missing (git archive 5913ed4 src | tar -x -C /tmp/maitre-before)")
    big = result["nodes"].get("1024")
    if big is not None:
        met = {}
        for key, limit in TARGETS.items():
            v = big.get(key)
            met[key] = None if v is None else v <= limit
        result["targets_1024"] = met
    result["machine"] = {"cpus": os.cpu_count(), "generators": args.generators, "steady_s": args.steady_s}
    if args.grow_scale_delay_s or args.worker_start_s:  # (a reproduction's settings, not the benchmark's)
        result["machine"].update(grow_scale_delay_s=args.grow_scale_delay_s, worker_start_s=args.worker_start_s)
    if notes:
        result["notes"] = "; ".join(notes)
    print(table(result))
    if "targets_1024" in result:
        for key, ok in result["targets_1024"].items():
            verdict = "not measured" if ok is None else ("met" if ok else "NOT met")
            print(f"target at 1,024 nodes: {key} <= {TARGETS[key]:g}: {verdict} ({fmt(big.get(key))})")
    write_results(args.out, result, smoke=args.smoke)


if __name__ == "__main__":
    main()
