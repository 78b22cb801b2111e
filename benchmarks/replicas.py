"""Replicas benchmark: joins that do not stop the job, against the join that does, one run.

    python benchmarks/replicas.py [--sizes 200,1000] [--reps 3] [--settle 30] [--smoke]
                                  [--out benchmarks/results/replicas.json]

A job of replicas of two processes (an MLP sharded by FSDP2 on each replica's mesh, AdamW,
float32) on this machine, for each state size (the replica's parameters and optimizer state,
in MB):

* ``join_pause_s`` / ``join_pause_before_s``: how long the two running replicas stop when a
  third joins, with ``MAITRE_JOIN=stream`` (this work: the joiner listens while a live replica
  streams it a snapshot) and ``MAITRE_JOIN=pause`` (maitre before it: every member waits while
  the state is broadcast). The pause is the gap between the last step before the join and the
  first after it, less one ordinary step (from the data ledger's commit times); the median of
  ``--reps`` joins of each kind, run alternately;
* ``step_s``: the running replicas' ordinary step before the join, the yardstick of the target
  (a pause of at most one step);
* ``transfer_vs_raw``: maitre's transfer of one process's shards (a flat buffer per dtype into
  buffers the listener allocated while the source copied its snapshot, and the unpacking into
  the state tree) against a raw gloo broadcast of the same bytes into a buffer of its own, on
  the same idle pair of processes, one after the other (median of 3 x ``--reps``; ``whole_s`` in the
  raw numbers adds the header, the copy and the allocation, which in a join run beside a step);
* ``stream_mb_s``: the snapshot's rate in the job, where it shares the cores with training;
* ``crash_to_step_s``: SIGKILL of one process of one replica (of three) to the job's next
  committed step (median of ``--reps``, after ``--settle`` steps each; a small model: this is
  the protocol's latency).

``--smoke``: a state of one layer 256 wide, one join of each kind and one crash, each step
waiting 20 ms (``--device-ms``) instead of the cores' compute.

On two CPU cores every process shares them: the job's six processes, the transfer's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _results import parse, write_results  # noqa: E402
from recovery import (  # noqa: E402
    after_failure,
    commits,
    join_pause,
    stager,
    step_interval,
    wait_for,
)

from maitre.launch import Run, RunConfig  # noqa: E402

PACE: list[str] = []
"""The job's ``--device-ms`` argument, when it has one."""
WIDTH = 2048
"""The MLP's width: one layer is WIDTH**2 parameters, 48 MB of state with AdamW in float32."""


# -- the training process ------------------------------------------------------------------------
def layers_for(state_mb: int, width: int = WIDTH) -> int:
    return max(1, round(state_mb * 1e6 / (3 * 4 * width * width)))


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    import maitre

    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = 64
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)
    mesh = maitre.replica_mesh(dp_shard=2, device_type="cpu")
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loop = maitre.ElasticLoop(model, optimizer, maitre.ElasticSampler(n, 8, seed=0))
    for batch in loop.run(max_steps=args.steps):
        time.sleep(args.device_ms / 1000)
        for idx in batch.micro_batches:
            batch.backward(torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum"))


# -- joins ---------------------------------------------------------------------------------------
def job(work: Path, *, layers: int, nodes: int, max_nodes: int, width: int = WIDTH) -> Run:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--layers",
        str(layers),
        "--width",
        str(width),
        "--steps",
        "100000",
        *PACE,
    ]
    return Run(
        RunConfig(
            command=command,
            min_nodes=1,
            max_nodes=max_nodes,
            local_nodes=nodes,
            nproc_per_node=2,
            nproc_per_replica=2,
            max_restarts=100,
            run_dir=work,
            quiet_workers=True,
        ),
        out=lambda s: None,
    ).start()


def join(work: Path, state_mb: int, mode: str, width: int = WIDTH) -> dict[str, float]:
    """One join of a third replica into a job of two, in ``mode``; its pause and step times."""
    os.environ["MAITRE_JOIN"] = mode  # the local agents' workers inherit it
    run = job(work, layers=layers_for(state_mb, width), nodes=2, max_nodes=3, width=width)
    try:
        run.coordinator.scale("job", 2)
        j = wait_for(run, lambda j: len(j["members"]) == 2, timeout_s=300)
        j = wait_for(run, lambda j, s=j["step"]: j["step"] >= s + 8, timeout_s=300)
        run.coordinator.scale("job", 3)
        run.add_node()
        j = wait_for(run, lambda j: len(j["members"]) == 3, timeout_s=300)
        epoch = j["epoch"]
        if mode == "stream":
            j = wait_for(run, lambda j: any(r["kind"] == "caught_up" for r in j["reports"]), timeout_s=300)
        j = wait_for(run, lambda j, s=j["step"]: j["step"] >= s + 5, timeout_s=300)
        reports = j["reports"]
    finally:
        run.shutdown()
        os.environ.pop("MAITRE_JOIN", None)
    cs = commits(work / "ledger")
    before = [c for c in cs if c["epoch"] < epoch]
    out = {
        "pause_s": join_pause(cs, lambda c: c["epoch"] == epoch),
        "step_s": step_interval(before[len(before) // 2 :]),
    }
    caught = [r for r in reports if r["kind"] == "caught_up"]
    if caught:
        r = caught[0]
        out.update(
            listened_s=r["listened_s"],
            replayed=r["replayed"],
            stream_mb_s=r["state_bytes"] / 1e6 / max(r["transfer_s"], 1e-9),
            shard_mb=r["state_bytes"] / 1e6,
        )
    return out


# -- the transfer against a raw broadcast ------------------------------------------------------
def pair(args: argparse.Namespace) -> None:
    """One of two processes: a raw gloo broadcast of the bytes, then maitre's transfer of a
    state of the same bytes, ``--reps`` times each; rank 1 prints the times as JSON."""
    import torch
    import torch.distributed as dist

    from maitre.runtime.group import EpochGroup
    from maitre.runtime.transfer import Packed, allocate, receive_flats, receive_header, unpack

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, 2, is_master=args.rank == 0)
    backend = dist.ProcessGroupGloo(store, args.rank, 2)
    group = EpochGroup(backend, args.rank, 2, torch.device("cpu"))
    per = args.width * args.width // 2  # a shard of one layer: its parameter, Adam's moments
    tree = {
        "model": [torch.randn(per) for _ in range(args.layers)],
        "optim": [
            {"exp_avg": torch.randn(per), "exp_avg_sq": torch.rand(per), "step": torch.tensor(7.0)}
            for _ in range(args.layers)
        ],
    }
    nbytes = sum(t.numel() * 4 for t in tree["model"]) * 3
    raw = torch.zeros(nbytes // 4)
    lazy = {t.data_ptr() for t in tree["model"]} | {v.data_ptr() for o in tree["optim"] for v in o.values()}
    times: dict[str, list[float]] = {"raw": [], "maitre": [], "whole": []}
    cpu = torch.device("cpu")
    for _ in range(args.reps):
        group.allreduce(torch.zeros(1))
        t0 = time.perf_counter()
        group.broadcast(raw, 0)
        times["raw"].append(time.perf_counter() - t0)
        # As a join does it: the header, then the source copies its snapshot while the
        # listener allocates its buffers; then the bytes (timed apart: the wire).
        group.allreduce(torch.zeros(1))
        t0 = time.perf_counter()
        if args.rank == 0:
            packed = Packed.of(tree, cpu, lazy=lazy)
            packed.send_header(group, 0)
            packed.copy_lazy()
        else:
            meta = receive_header(group, 0)
            flats = allocate(meta, cpu)
        group.allreduce(torch.zeros(1))
        t1 = time.perf_counter()
        if args.rank == 0:
            packed.send_flats(group, 0)
        else:
            receive_flats(group, 0, flats)
            unpack(meta, flats)
        t2 = time.perf_counter()
        times["maitre"].append(t2 - t1)
        times["whole"].append(t2 - t0)
    if args.rank == 1:
        print(json.dumps({"bytes": nbytes, **times}))


def transfer_vs_raw(state_mb: int, reps: int, width: int = WIDTH) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layers = layers_for(state_mb, width)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--pair",
        "--port",
        str(port),
        "--layers",
        str(layers),
        "--width",
        str(width),
        "--reps",
        str(reps),
    ]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the transfer pair failed: {[p.returncode for p in procs]}")
    times = json.loads(outs[1])
    raw, maitre = statistics.median(times["raw"]), statistics.median(times["maitre"])
    return {
        "bytes": times["bytes"],
        "raw_s": raw,
        "maitre_s": maitre,
        "whole_s": statistics.median(times["whole"]),
        "raw_mb_s": times["bytes"] / 1e6 / raw,
        "maitre_mb_s": times["bytes"] / 1e6 / maitre,
        "ratio": raw / maitre,
    }


# -- crashes -------------------------------------------------------------------------------------
def crashes(work: Path, reps: int, settle: int = 30) -> list[float]:
    """SIGKILL of the first process of one replica of three; seconds to the next step."""
    run = job(work, layers=2, width=256, nodes=3, max_nodes=3)
    faults = []
    try:
        for i in range(reps):
            j = wait_for(run, lambda j: len(j["members"]) == 3, timeout_s=300)
            j = wait_for(run, lambda j, s=j["step"]: j["step"] >= s + settle, timeout_s=300)
            victim = j["members"][1 + i % 2]
            t = time.time()
            os.kill(run.pid_of(victim), signal.SIGKILL)  # type: ignore[arg-type]
            faults.append((t, j["epoch"]))
            wait_for(run, lambda j, e=j["epoch"]: j["epoch"] > e, timeout_s=300)
        # The survivors have committed since the last kill (a new epoch may open before it).
        wait_for(run, lambda j, s=j["step"]: j["step"] >= s + 5, timeout_s=300)
        time.sleep(0.5)
    finally:
        run.shutdown()
    cs = commits(work / "ledger")
    return [after_failure(cs, t, lambda c, e=e: c["epoch"] > e)[0] for t, e in faults]


# -- the report ----------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200,1000", help="state sizes in MB, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=int, default=30, help="steps the job trains before each crash (default 30)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--width", type=int, default=WIDTH, help=f"the MLP's width (default {WIDTH}: 48 MB of state a layer)"
    )
    p.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="each step of the job also waits this long, as for a device's compute (the smoke run: its "
        "jobs train until each join or crash, and steps that wait leave the cores to the others)",
    )
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parse(p, "replicas", smoke={"sizes": "1", "reps": 1, "settle": 3, "width": 256, "device_ms": 20})
    if args.worker:
        return worker(args)
    if args.pair:
        return pair(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    PACE[:] = ["--device-ms", str(args.device_ms)] if args.device_ms else []
    work = Path(tempfile.mkdtemp(prefix="maitre-bench-replicas-"))

    try:
        result = measure(sizes, args, stager(work), work)
    finally:
        if args.smoke:
            shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, result, smoke=args.smoke)
    print(table(result))


def measure(sizes: list[int], args: argparse.Namespace, stage: Any, work: Path) -> dict[str, Any]:
    print(f"replicas benchmark, sizes {sizes} MB, work dir {work}")
    crash = stage("crash", lambda d: crashes(d, args.reps, args.settle))
    result: dict[str, Any] = {
        "join_pause_s": {},
        "join_pause_before_s": {},
        "step_s": {},
        "transfer_vs_raw": {},
        "stream_mb_s": {},
        "crash_to_step_s": statistics.median(crash),
        "raw": {"crash": crash},
    }
    med = statistics.median
    for mb in sizes:
        key = str(mb)
        raw = stage(f"transfer-{mb}", lambda d, mb=mb: transfer_vs_raw(mb, 3 * args.reps, args.width))
        before, now = [], []
        for i in range(args.reps):  # alternately, so that the machine's drift hits both
            before.append(stage(f"join-pause-{mb}-{i}", lambda d, mb=mb: join(d, mb, "pause", args.width)))
            now.append(stage(f"join-stream-{mb}-{i}", lambda d, mb=mb: join(d, mb, "stream", args.width)))
        result["join_pause_s"][key] = med(r["pause_s"] for r in now)
        result["join_pause_before_s"][key] = med(r["pause_s"] for r in before)
        result["step_s"][key] = med(r["step_s"] for r in before + now)
        result["transfer_vs_raw"][key] = raw["ratio"]
        result["stream_mb_s"][key] = med(r["stream_mb_s"] for r in now)
        result["raw"][key] = {"transfer": raw, "pause": before, "stream": now}
    if args.width != WIDTH:
        result["width"] = args.width
    return result


def table(r: dict[str, Any]) -> str:
    lines = [
        "| state | step | join pause, before (`pause`) | join pause, now (`stream`) | "
        "transfer / raw gloo | snapshot in the job |",
        "|---|---|---|---|---|---|",
    ]
    for key in r["join_pause_s"]:
        stream = r["stream_mb_s"].get(key)
        lines.append(
            f"| {key} MB | {r['step_s'][key]:.2f} s | "
            f"{r['join_pause_before_s'][key]:.2f} s | {r['join_pause_s'][key]:.2f} s | "
            f"{r['transfer_vs_raw'][key] * 100:.0f}% | "
            f"{'-' if stream is None else f'{stream:.0f} MB/s'} |"
        )
    lines.append(f"\ncrash to next step, replicas of 2 processes: {r['crash_to_step_s']:.3f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
