"""Step time side by side: torch DDP, FSDP2, and maitre's ElasticLoop, on the same job.

    python benchmarks/throughput.py                  # loopback and a 1 Gbit link, 2 and 4 ranks
    python benchmarks/throughput.py --setting link --ranks 2
    python benchmarks/throughput.py --smoke          # seconds; tests/test_benchmarks.py

The job: an MLP of ``--params-m`` million float32 parameters (``--layers`` square layers), SGD
with momentum, a fixed global batch of synthetic samples split evenly over the ranks, the loss
summed (maitre divides by the global count; DDP and FSDP2 average, which costs them nothing).
Each run trains ``--warmup`` steps, then times ``--steps`` steps: the median time from one step's
start to the next's, on rank 0. Each mode runs ``--rounds`` times, the modes interleaved (round
``r`` starts ``r`` modes later): a row's step time is the median of its rounds, and its ratio to
DDP or FSDP2 the median of the ratios within each round, so that the drift of a shared machine
between one run and the next falls on both sides of a ratio. The modes, each a fresh group of
processes under torchrun:

- ``local``: each rank trains its share with no reduction at all: the compute alone, so
  ``step - local`` is the communication a mode leaves exposed;
- ``ddp``: ``DistributedDataParallel`` (25 MiB buckets reduced while backward runs);
- ``fsdp2``: ``fully_shard`` per layer over all ranks (reduce-scatter and all-gather per layer);
- ``maitre``: ``ElasticLoop`` with its default buckets (DDP's sizes, launched from hooks);
- ``maitre-flat``: the same loop with one flat buffer per dtype reduced after backward, as it was
  before the bucketed reduction (``Buckets(cap_mb=inf, overlap=False)``): what overlap bought;
- ``maitre-prepare``: the plain loop of a DDP script (a mean loss, ``loss.backward();
  optimizer.step(); optimizer.zero_grad()``) on :func:`maitre.prepare`: the same engine, with
  each gradient scaled by the batch's sample count as it reaches its parameter;
- ``maitre-fsdp2``: ``ElasticLoop`` on FSDP2 replicas (``replica_mesh``: one replica of all
  ranks, sharded per layer), against ``fsdp2``;
- ``maitre-run`` (loopback only): ``maitre run --nnodes N``, the loop under its own coordinator
  and agents, elastic.

Settings: ``loopback`` (every rank on this machine's loopback; gloo's copies cost CPU, which two
cores share with the compute, so overlap has little to hide behind) and ``link``: each rank on
a host of its own (a network namespace) whose link is shaped with ``tc qdisc ... tbf rate
1gbit``, so communication takes link time, as on a cluster, and overlap shows (needs root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import ROOT, parse, write_results  # noqa: E402

MODES = ("local", "ddp", "fsdp2", "maitre", "maitre-flat", "maitre-prepare", "maitre-fsdp2", "maitre-run")
LINK_MODES = MODES[:-1]  # maitre run's own coordinator and agents stay on one host here
IN_DIM = OUT_DIM = 64
SAMPLES = 4096


# -- the training process ------------------------------------------------------------------------
def worker(mode: str, width: int, layers: int, global_batch: int, warmup: int, steps: int, result: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN_DIM, width),
        *[m for _ in range(layers) for m in (nn.Tanh(), nn.Linear(width, width))],
        nn.Tanh(),
        nn.Linear(width, OUT_DIM),
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, IN_DIM, generator=g), torch.randn(SAMPLES, OUT_DIM, generator=g)
    times: list[float] = []
    last = time.perf_counter()

    def tick() -> None:
        nonlocal last
        now = time.perf_counter()
        times.append(now - last)
        last = now

    total = warmup + steps
    if mode.startswith("maitre"):
        import maitre

        if mode == "maitre-fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = maitre.replica_mesh(dp_shard=int(os.environ.get("WORLD_SIZE", "1")), device_type="cpu")
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
        buckets = (
            maitre.Buckets(cap_mb=math.inf, first_cap_mb=math.inf, overlap=False)
            if mode == "maitre-flat"
            else maitre.Buckets()
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if mode == "maitre-prepare":  # a DDP script's loop: a mean loss, backward, step
            model, opt, loader = maitre.prepare(
                model, opt, _Rows(x, y), global_batch_size=global_batch, max_steps=total, collate_fn=_whole
            )
            for xb, yb in loader:
                tick()  # (one micro-batch a step: each item is a step)
                loss = nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                float(loss)
                opt.step()
                opt.zero_grad()
            loop = loader.loop
        else:
            loop = maitre.ElasticLoop(model, opt, maitre.ElasticSampler(SAMPLES, global_batch), buckets=buckets)
            for batch in loop.run(max_steps=total):
                tick()
                for idx in batch.micro_batches:
                    if idx:
                        i = torch.tensor(idx)
                        batch.backward(nn.functional.mse_loss(model(x[i]), y[i], reduction="sum"))
        tick()
        # (on FSDP2 replicas every process of the one replica is its rank 0: the global rank)
        rank = dist.get_rank() if mode == "maitre-fsdp2" else loop.rank
        if dist.is_initialized():  # replica_mesh's group (the loop's own is destroyed by it)
            dist.destroy_process_group()
    else:
        distributed = mode in ("ddp", "fsdp2") or "WORLD_SIZE" in os.environ
        if distributed:
            dist.init_process_group("gloo")
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if mode == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        share = global_batch // world
        for step in range(total + 1):
            tick()
            if step == total:
                break
            start = (step * global_batch + rank * share) % (SAMPLES - share)
            loss = nn.functional.mse_loss(model(x[start : start + share]), y[start : start + share], reduction="sum")
            loss.backward()
            float(loss)  # (the loop reads the loss too)
            opt.step()
            opt.zero_grad()
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        step_times = times[1:][warmup:]  # from the first step's start on
        result.write_text(json.dumps({"step_s": statistics.median(step_times), "steps_s": step_times}))


class _Rows:
    """The samples as a map-style dataset that fetches a batch's rows at once (``__getitems__``,
    what torch's DataLoader calls when it is there): the same indexing as the other modes, so
    the row times the engine, not per-sample collation."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> Any:
        import torch

        i = torch.tensor(indices)
        return self.x[i], self.y[i]


def _whole(batch: Any) -> Any:
    """The collate of :class:`_Rows`: its batch is collated already."""
    return batch


# -- the runs ------------------------------------------------------------------------------------
ABORTED = "terminate called without an active exception"
"""What a process that torch's C++ side aborted printed last (see :func:`run_loopback`)."""


def run_loopback(mode: str, ranks: int, args: argparse.Namespace, work: Path) -> float:
    result = work / f"loopback-{mode}-{ranks}.json"
    script = [str(Path(__file__).resolve()), *worker_args(mode, args, result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if mode == "maitre-run":
        cmd = [
            sys.executable,
            "-m",
            "maitre.cli",
            "run",
            "--nnodes",
            str(ranks),
            "--run-dir",
            str(work / f"run-{ranks}"),
            *script,
        ]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0 and ABORTED in done.stdout + done.stderr:
        # torch's C++ side, rarely and only on a loaded machine, aborts a plain DDP process of
        # the smoke run (seen once in CI, beside two other benchmarks; never in 200 runs here,
        # four at a time). It is no error of the mode timed: run it once more, and say so.
        print(f"throughput: {mode} x{ranks} was aborted by torch (SIGABRT); running it again", flush=True)
        result.unlink(missing_ok=True)
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(
            f"{mode} x{ranks} on loopback failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return float(json.loads(result.read_text())["step_s"])


def run_link(mode: str, hosts: list[Any], args: argparse.Namespace, work: Path) -> float:
    result = work / f"link-{mode}-{len(hosts)}.json"
    script = [str(Path(__file__).resolve()), *worker_args(mode, args, result)]
    port = 29400 + len(hosts)
    procs = []
    for i, host in enumerate(hosts):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(hosts)),
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(i),
            "--master-addr",
            hosts[0].ip,
            "--master-port",
            str(port),
            *script,
        ]
        procs.append(
            host.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                extra_env={"GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            )
        )
    outputs, failed = [], False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failed = True
        outputs.append(out or "")
        failed = failed or proc.returncode != 0
    if failed or not result.exists():
        raise RuntimeError(f"{mode} x{len(hosts)} over the link failed:\n" + "\n".join(o[-2000:] for o in outputs))
    return float(json.loads(result.read_text())["step_s"])


def worker_args(mode: str, args: argparse.Namespace, result: Path) -> list[str]:
    return [
        "--worker",
        mode,
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--global-batch",
        str(args.global_batch),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--result",
        str(result),
    ]


def _netns() -> Any:
    """tests/hosts.py: the test harness's network namespaces, shared."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hosts  # noqa: PLC0415

    return hosts


def shaped_hosts(n: int, rate: str) -> tuple[Any, list[Any]]:
    """``n`` hosts in network namespaces (tests/hosts.py), each link shaped to ``rate``."""
    netns = _netns()
    netns._remove_leftovers()
    net = netns.Network()
    try:
        made = net.add_hosts(n)
        for host in made:
            netns._ip(
                "netns",
                "exec",
                host.netns,
                "tc",
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            )
    except BaseException:
        net.close()
        raise
    return net, made


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON, or the settings' part of it) in Markdown: ms a step, the
    median, with the communication left exposed in brackets (the step minus ``local``'s); the
    ratios in bold are the targets'. A mode or setting that did not run is ``-``."""
    rate = result.get("job", {}).get("link_rate", "")
    link = re.sub(r"(\d+)([kmg])bit", lambda m: f"{m[1]} {m[2].upper()}bit", rate) or "shaped"

    def step(row: dict[str, Any], mode: str) -> str:
        m = row.get(mode)
        if m is None:
            return "-"
        exposed = m.get("exposed_comm_s")
        return f"{1000 * m['step_s']:.0f}" + ("" if exposed is None or mode == "local" else f" ({1000 * exposed:.0f})")

    def ratio(row: dict[str, Any], mode: str, base: str) -> str:
        value = row.get(mode, {}).get(f"ratio_to_{base}")
        return "-" if value is None else f"**{value:.3f}**"

    def against_ddp(row: dict[str, Any], mode: str) -> str:
        m = row.get(mode)
        return "-" if m is None else f"{1000 * m['step_s']:.0f} ({m.get('ratio_to_ddp', float('nan')):.3f})"

    lines = [
        "| setting | ranks | local | DDP | maitre before | maitre | maitre / DDP | prepare (/ DDP) | FSDP2 | "
        "maitre on FSDP2 | / FSDP2 | maitre run (/ DDP) |",
        "|---" * 12 + "|",
    ]
    for setting, label in (("loopback", "loopback"), ("link", f"{link} link")):
        for ranks, row in sorted(result.get(setting, {}).items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {label} | {ranks} | {step(row, 'local')} | {step(row, 'ddp')} | "
                f"{step(row, 'maitre-flat')} | {step(row, 'maitre')} | "
                f"{ratio(row, 'maitre', 'ddp')} | {against_ddp(row, 'maitre-prepare')} | {step(row, 'fsdp2')} | "
                f"{step(row, 'maitre-fsdp2')} | {ratio(row, 'maitre-fsdp2', 'fsdp2')} | "
                f"{against_ddp(row, 'maitre-run')} |"
            )
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", choices=MODES)
        for name in ("width", "layers", "global-batch", "warmup", "steps"):
            p.add_argument(f"--{name}", type=int, required=True)
        p.add_argument("--result", type=Path, required=True)
        a = p.parse_args()
        worker(a.worker, a.width, a.layers, a.global_batch, a.warmup, a.steps, a.result)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=("loopback", "link", "both"), default="both")
    p.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help="on loopback, comma-separated, of " + ", ".join(MODES))
    p.add_argument(
        "--link-modes", default=",".join(LINK_MODES), help="over the link, comma-separated, of " + ", ".join(LINK_MODES)
    )
    p.add_argument("--width", type=int, default=2048, help="hidden width (params ~ layers x width^2)")
    p.add_argument("--layers", type=int, default=12, help="hidden square layers")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rate", default="1gbit", help="the link's rate (tc tbf)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of each mode, interleaved (round r starts r modes later); a row's step is the "
        "median of its rounds, its ratio the median of the ratios within each round",
    )
    # smoke: one rank (every mode's code, not its collectives' cost); not maitre-flat (maitre's
    # code with other Buckets) nor local (ddp's without the wrapper); over the link one mode
    # (the hosts, the shaping and torchrun across them are the same for every mode)
    args = parse(
        p,
        "throughput",
        {
            "ranks": "1",
            "width": 64,
            "layers": 2,
            "global_batch": 16,
            "warmup": 1,
            "steps": 2,
            "timeout_s": 120.0,
            "rounds": 1,
            "modes": ",".join(m for m in MODES if m not in ("maitre-flat", "local")),
            "link_modes": "maitre",
        },
    )
    try:
        world_sizes = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks takes whole numbers, comma-separated, got {args.ranks!r}")
    modes = {"loopback": args.modes.split(","), "link": args.link_modes.split(",")}
    for setting, allowed in (("loopback", MODES), ("link", LINK_MODES)):
        if unknown := [m for m in modes[setting] if m not in allowed]:
            p.error(f"unknown mode(s) for {setting}: {', '.join(unknown)}: choose from {', '.join(allowed)}")
    if any(r < 1 or args.global_batch % r for r in world_sizes):
        p.error(f"--global-batch {args.global_batch} must split evenly over every world size")
    for name in ("width", "layers", "warmup", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    params = IN_DIM * args.width + args.layers * args.width**2 + args.width * OUT_DIM
    settings = ["loopback", "link"] if args.setting == "both" else [args.setting]
    if "link" in settings and (reason := _netns()._can_make_namespaces()) is not None:
        if not args.smoke:
            p.error(f"the link setting needs network namespaces: {reason} (--setting loopback runs without)")
        print(f"throughput: the link setting is skipped: {reason}", flush=True)
        settings.remove("link")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="maitre-throughput-") as tmp:
        work = Path(tmp)
        for setting in settings:
            results[setting] = {}
            for ranks in world_sizes:
                net = None
                if setting == "link":
                    net, made = shaped_hosts(ranks, args.rate)
                names = modes[setting]
                times: dict[str, list[float]] = {mode: [] for mode in names}
                try:
                    for r in range(args.rounds):  # interleaved, each round in another order
                        for mode in names[r % len(names) :] + names[: r % len(names)]:
                            step = (
                                run_loopback(mode, ranks, args, work)
                                if setting == "loopback"
                                else run_link(mode, made, args, work)
                            )
                            times[mode].append(step)
                            print(
                                f"{setting} x{ranks} round {r + 1}/{args.rounds} {mode}: {1000 * step:.0f} ms/step",
                                flush=True,
                            )
                finally:
                    if net is not None:
                        net.close()
                row: dict[str, dict[str, Any]] = {
                    mode: {"step_s": statistics.median(ts), "rounds_s": ts} for mode, ts in times.items()
                }
                for mode, m in row.items():
                    for base in ("ddp", "fsdp2"):
                        if base in row and mode != base:  # paired within a round, then the median
                            pairs = [a / b for a, b in zip(times[mode], times[base])]
                            m[f"ratio_to_{base}"] = statistics.median(pairs)
                if "local" in row:
                    for m in row.values():
                        m["exposed_comm_s"] = max(0.0, m["step_s"] - row["local"]["step_s"])
                results[setting][str(ranks)] = row
    print(table(results))
    write_results(
        args.out,
        {
            "job": {
                "params": params,
                "width": args.width,
                "layers": args.layers,
                "global_batch": args.global_batch,
                "dtype": "float32",
                "optimizer": "SGD",
                "warmup": args.warmup,
                "steps": args.steps,
                "rounds": args.rounds,
                "link_rate": args.rate,
            },
            "machine": {"cpus": os.cpu_count(), "torch_threads_per_rank": 1},
            **results,
        },
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
