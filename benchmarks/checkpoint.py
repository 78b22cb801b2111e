"""Checkpoint benchmark: maitre against torch.save and torch.distributed.checkpoint, one run.

    python benchmarks/checkpoint.py [--sizes 200,1000] [--reps 5] [--segment 60] [--rounds 12]
                                    [--smoke] [--out benchmarks/results/checkpoint.json]

For a model + AdamW state of each size (MB), each a median over ``--reps`` saves after one
warm-up save (so reused buffers exist, as in a training run):

* ``copy_floor_s``: copying every tensor into preallocated host buffers (the physical floor of
  any snapshot: a save cannot block for less than a copy of the state);
* ``torch_save_s``: ``torch.save`` to a file, flushed and fsynced (durable);
* ``dcp_save_s``: ``torch.distributed.checkpoint.save`` (it fsyncs its files);
* ``dcp_async_block_s``: how long ``torch.distributed.checkpoint.async_save`` blocks the caller;
* ``maitre_block_s``: how long maitre's save blocks (state_dict, snapshot copy, hand-off);
* ``maitre_durable_s``: from the start of maitre's save until the checkpoint is renamed into
  place with every file and the directory fsynced.

Then the training cost: ``examples/train.py``'s model trained in this process, in alternating
segments of ``--segment`` steps (``--rounds`` of each mode), without checkpoints, with the
interval the policy picks (Young/Daly from the measured cost, MTBF of one hour, the 30 s lower
bound lifted so a short run sees several saves), and every 10 steps; ``train_overhead_pct`` is
the policy's: its segments' total time against those without (the median of paired differences
is reported beside it).
Measured (throughput of segments of each mode, interleaved in one run) and accounted (saves
times their measured cost over the time trained) are both reported; on a shared 2-core machine
the measured figure has a few percent of noise. All with ``torch.set_num_threads(1)``, as
training workers run here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import maitre  # noqa: E402
from _results import parse, write_results  # noqa: E402
from maitre.checkpoint import CheckpointConfig, Checkpointer, IntervalConfig  # noqa: E402
from maitre.checkpoint.snapshot import split  # noqa: E402
from maitre.runtime.state import TrainState  # noqa: E402

MB = 1e6


def make_state(size_mb: int) -> TrainState:
    """Linear layers of 1024 x 1024 float32 with AdamW moments: 12.6 MB per layer."""
    layers = max(1, round(size_mb * MB / (3 * 4 * 1024 * 1025)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return TrainState(model=model, optimizer=opt)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_size(size_mb: int, reps: int, scratch: Path) -> dict[str, float]:
    state = make_state(size_mb)
    tree = state.state_dict()
    tensors = split(tree, rank=0, world_size=1).tensors
    floor_buffers = [torch.empty_like(t, device="cpu") for t in tensors]

    def copy_floor(_: int) -> float:
        return timed(lambda: [b.copy_(t) for b, t in zip(floor_buffers, tensors)])

    def torch_save(i: int) -> float:
        path = scratch / f"torch-{i}.pt"

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(state.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(scratch)

        t = timed(save)
        path.unlink()
        return t

    def dcp_save(i: int) -> float:
        path = scratch / f"dcp-{i}"
        t = timed(lambda: dcp.save(dcp_state(state), checkpoint_id=str(path)))
        shutil.rmtree(path)
        return t

    def dcp_async(i: int) -> float:
        path = scratch / f"dcp-async-{i}"
        start = time.perf_counter()
        future = dcp.async_save(dcp_state(state), checkpoint_id=str(path))
        blocked = time.perf_counter() - start
        future.result()
        shutil.rmtree(path)
        return blocked

    ck = Checkpointer(CheckpointConfig(directory=scratch / "maitre", keep=1))
    durable: list[float] = []

    def maitre_save(i: int) -> float:
        state.step = i + 2  # a new directory each time
        blocked = ck.save(state.state_dict, step=state.step, rank=0, world_size=1, token=i + 2)
        result = ck.wait()[-1]
        if result.error:
            raise RuntimeError(result.error)
        if i >= 0:  # blocked, then written until the rename and its fsync (not retention)
            durable.append(result.block_s + result.persist_s)
        return blocked

    methods = {
        "copy_floor_s": copy_floor,
        "torch_save_s": torch_save,
        "dcp_save_s": dcp_save,
        "dcp_async_block_s": dcp_async,
        "maitre_block_s": maitre_save,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(-1, reps):  # interleaved, so a slow spell of the disk hits every method
        for name, fn in methods.items():
            t = fn(i)
            if i >= 0:
                times[name].append(t)
    out = {
        "state_mb": round(sum(t.numel() * t.element_size() for t in tensors) / MB, 1),
        **{name: statistics.median(ts) for name, ts in times.items()},
        "maitre_durable_s": statistics.median(durable),
    }
    ck.close()
    shutil.rmtree(scratch / "maitre", ignore_errors=True)
    return out


def dcp_state(state: TrainState) -> dict[str, Any]:
    return {"model": state.objects["model"].state_dict(), "optim": state.objects["optimizer"].state_dict()}


# -- training overhead ---------------------------------------------------------------------------
def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class SegmentClock:
    """A clock that runs only while its mode's segments run, so the policy sees its own time."""

    def __init__(self) -> None:
        self.total, self.since = 0.0, None

    def __call__(self) -> float:
        return self.total + (time.monotonic() - self.since if self.since is not None else 0.0)

    def run(self, on: bool) -> None:
        if on and self.since is None:
            self.since = time.monotonic()
        elif not on and self.since is not None:
            self.total += time.monotonic() - self.since
            self.since = None


def bench_training(segment: int, rounds: int, scratch: Path) -> dict[str, Any]:
    """One run of the example's default model, alternating segments of ``segment`` steps
    without checkpoints, with the policy's interval and every 10 steps: adjacent segments see
    the same machine, so drift and other tenants cancel out of the paired ratios."""
    example = load_example()
    torch.manual_seed(0)
    text = example.DATA.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    block = 64
    model = example.CharTransformer(len(vocab), block, 64, 2, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = maitre.ElasticSampler((len(ids) - 1) // block, 32)
    loop = maitre.ElasticLoop(model, opt, sampler, micro_batch_size=16)
    clock = SegmentClock()
    checkpointers: dict[str, Checkpointer | None] = {
        "none": None,
        "policy": Checkpointer(
            CheckpointConfig(
                directory=scratch / "policy",
                save_final=False,
                interval=IntervalConfig(mtbf_s=3600.0, min_interval_s=0.0),
            ),
            clock=clock,
        ),
        "every_10": Checkpointer(
            CheckpointConfig(directory=scratch / "every10", save_final=False, interval=IntervalConfig(every_steps=10))
        ),
    }
    modes = list(checkpointers)
    warmup = 40
    times: dict[str, list[float]] = {m: [] for m in modes}
    plan = [modes[(r + k) % 3] for r in range(rounds) for k in range(3)]  # rotated each round
    current, started = None, 0.0
    for batch in loop.run(max_steps=warmup + segment * len(plan)):
        index = (batch.step - 1 - warmup) // segment
        if batch.step > warmup and (batch.step - 1 - warmup) % segment == 0:
            now = time.perf_counter()
            if current is not None:
                times[current].append(now - started)
            current, started = plan[index], now
            loop.checkpointer = checkpointers[current]
            clock.run(current == "policy")
        for idx in batch.micro_batches:
            window = (torch.tensor(idx) * block)[:, None] + torch.arange(block + 1)
            chunk = ids[window]
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, len(vocab)), chunk[:, 1:].reshape(-1), reduction="sum") / block
            loss.backward()
    times[current].append(time.perf_counter() - started)  # type: ignore[index]
    policy, every = checkpointers["policy"], checkpointers["every_10"]
    assert policy is not None and every is not None
    policy.close()
    every.close()

    def overhead(mode: str) -> float:
        return 100 * (sum(times[mode]) / sum(times["none"]) - 1)

    def paired(mode: str) -> float:
        return 100 * statistics.median(a / b - 1 for a, b in zip(times[mode], times["none"]))

    def accounted(ck: Checkpointer) -> float:
        """Saves times their measured cost (blocking plus the writer's slowdown of the steps
        it overlapped), over the time trained: the same figure without run-to-run noise."""
        return 100 * len(ck.results) * (ck.policy.cost_s or 0.0) / sum(times["none"])

    print(
        f"  segments of {segment} steps, s: "
        + "; ".join(f"{m} {', '.join(f'{t:.2f}' for t in ts)}" for m, ts in times.items()),
        flush=True,
    )
    return {
        "train_steps_per_mode": segment * rounds,
        "train_none_s": sum(times["none"]),
        "train_overhead_pct": overhead("policy"),
        "train_overhead_paired_median_pct": paired("policy"),
        "train_overhead_accounted_pct": accounted(policy),
        "train_policy_saves": len(policy.results),
        "train_policy_interval_s": policy.policy.interval_s(),
        "train_policy_cost_ms": (policy.policy.cost_s or 0.0) * 1000,
        "train_every10_overhead_pct": overhead("every_10"),
        "train_every10_accounted_pct": accounted(every),
        "train_every10_cost_ms": (every.policy.cost_s or 0.0) * 1000,
        "train_every10_saves": len(every.results),
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        (
            "state",
            "copy floor",
            "torch.save",
            "dcp.save",
            "dcp async block",
            "maitre block",
            "block/floor",
            "maitre durable",
        )
    ]
    for r in results.values():
        if not isinstance(r, dict) or "state_mb" not in r:
            continue
        rows.append(
            (
                f"{r['state_mb']:.0f} MB",
                f"{r['copy_floor_s']:.3f} s",
                f"{r['torch_save_s']:.3f} s",
                f"{r['dcp_save_s']:.3f} s",
                f"{r['dcp_async_block_s']:.3f} s ({r['dcp_async_block_s'] / r['copy_floor_s']:.1f}x)",
                f"{r['maitre_block_s']:.3f} s",
                f"{r['maitre_block_s'] / r['copy_floor_s']:.2f}x",
                f"{r['maitre_durable_s']:.3f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append("")
    lines.append(
        f"training ({results['train_steps_per_mode']} steps of examples/train.py per "
        f"mode, {results['train_none_s']:.1f} s without checkpoints): policy interval "
        f"{results['train_policy_interval_s']:.1f} s (cost {results['train_policy_cost_ms']:.1f} "
        f"ms, MTBF 1 h), {results['train_policy_saves']:.0f} saves, overhead "
        f"{results['train_overhead_pct']:+.2f}% measured, "
        f"{results['train_overhead_accounted_pct']:.2f}% accounted; every 10 steps: "
        f"{results['train_every10_saves']:.0f} saves, overhead "
        f"{results['train_every10_overhead_pct']:+.2f}% measured, "
        f"{results['train_every10_accounted_pct']:.2f}% accounted"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200,1000", help="state sizes in MB, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--segment", type=int, default=60, help="steps per training segment")
    p.add_argument("--rounds", type=int, default=12, help="segments per mode")
    p.add_argument("--scratch", type=Path, help="where to write (default: a temp dir)")
    # (a state of one layer, 12.6 MB; a save every 10 steps and the policy's both happen)
    args = parse(p, "checkpoint", smoke={"sizes": "1", "reps": 1, "segment": 10, "rounds": 1})
    torch.set_num_threads(1)
    for key in [k for k in os.environ if k.startswith("MAITRE_") or k in ("RANK", "WORLD_SIZE")]:
        del os.environ[key]  # the loop must run as one plain process

    scratch = Path(tempfile.mkdtemp(prefix="maitre-ckpt-bench-", dir=args.scratch))
    results: dict[str, Any] = {}
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            print(f"state of about {size} MB ...", flush=True)
            results[str(size)] = bench_size(size, args.reps, scratch)
            print(f"  {results[str(size)]}", flush=True)
        results.update(bench_training(args.segment, args.rounds, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(table(results))
    write_results(args.out, results, smoke=args.smoke)


if __name__ == "__main__":
    main()
