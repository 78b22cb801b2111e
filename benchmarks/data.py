"""Data benchmark: maitre's elastic loader against torch's DataLoader, on samples that cost real
decode work, one run.

    python benchmarks/data.py [--images 4096] [--batch 64] [--workers 2] [--reps 5] [--smoke]
                              [--out benchmarks/results/data.json]

The data: ``--images`` JPEGs (96x96, generated once into a temporary folder: gradients and
noise, so that they compress and decode as photos do) decoded with Pillow into float tensors,
and token shards (``uint16``, read through memory maps as sequences of 256 tokens). Measured, in
one process with ``torch.set_num_threads(1)`` and ``--workers`` data workers:

* ``throughput``: samples per second of maitre's :class:`maitre.data.Loader` against torch's
  ``DataLoader`` (the same workers, batch and prefetch, over a random sampler), and torchdata's
  ``StatefulDataLoader`` when it is installed, each feeding the same :class:`~maitre.ElasticLoop`
  (whose own cost is in all of them); the median of ``--reps`` runs of each, interleaved (the
  machine's drift hits all) and each loader first in turn. ``maitre_vs_dataloader`` is the ratio.
  MosaicML Streaming is not measured: installed beside ``torch==2.13.0`` it replaces torch (its
  torchvision pulls a CUDA torch 2.14.1), and it reads its own shard format (MDS);
* ``wait``: a training run whose step computes for ``--compute-ms`` (a sleep: a GPU busy while
  the host waits) with workers that keep up: the share of the step time spent waiting for data;
* ``first_batch``: from a resume (a new loop and loader from the sampler's state, at the start,
  the middle and the end of a data epoch) and from a plan started again mid-run (what a resize
  does: new shares, new workers) to the first batch, against the step time: no skipped sample
  is read again;
* ``state_bytes``: the sampler state a joiner receives and a checkpoint holds, at 1 k and 1 M
  samples.

``--smoke``: 128 images, a batch of 16, one rep, a few steps.

The token shards hold ``--token-steps`` + 2 batches of sequences, and a throughput run over them
times ``--token-steps`` batches (600: a sequence costs little to read, so fewer would time the
noise of the machine rather than the loader).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, RandomSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _results import parse, write_results  # noqa: E402

import maitre  # noqa: E402
from maitre.data import Loader, TokenShards  # noqa: E402
from maitre.runtime.env import WorkerEnv  # noqa: E402

SIDE = 96
SEQ = 256


class Jpegs(Dataset):
    """The JPEGs of a folder, decoded: a 3 x SIDE x SIDE float tensor and a label."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as im:
            pixels = np.asarray(im.convert("RGB"), dtype=np.float32)
        return torch.from_numpy(pixels).permute(2, 0, 1).div_(255.0), i % 10


def make_jpegs(folder: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    for i in range(n):
        base = (np.sin(xx / (3 + i % 7)) + np.cos(yy / (4 + i % 5))) * 60 + 128
        img = np.stack([base, base[::-1], base[:, ::-1]], axis=-1) + rng.normal(0, 12, (SIDE, SIDE, 3))
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        (folder / f"{i:06d}.jpg").write_bytes(buf.getvalue())


def make_shards(folder: Path, tokens: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(1)
    for k in range(4):
        rng.integers(0, 50000, tokens // 4, dtype=np.uint16).tofile(folder / f"shard-{k}.bin")


def a_loop(dataset: Dataset, batch: int, state: dict | None = None) -> maitre.ElasticLoop:
    model = torch.nn.Linear(1, 1)
    sampler = maitre.ElasticSampler.of(dataset, batch, seed=0)
    if state is not None:
        sampler.load_state_dict(state)
    return maitre.ElasticLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.0), sampler, env=WorkerEnv.from_environ({})
    )


def step_body(batch: Any, data: Any, model: torch.nn.Module, compute_s: float) -> None:
    if compute_s:
        time.sleep(compute_s)
    batch.backward(model.weight.sum() * 0.0)


# -- throughput ------------------------------------------------------------------------------------
def rate(
    kind: str, dataset: Dataset, args: argparse.Namespace, steps: int, make: Callable[..., Any] | None = None
) -> float:
    """Samples per second through ``steps`` steps of the same ElasticLoop, the data from
    maitre's loader (``kind == "maitre"``) or from ``make``'s loader (DataLoader,
    StatefulDataLoader) over a random sampler: the loop's own cost is in both, the loader is
    what differs. Timed from the first batch (the workers' start apart)."""
    loop = a_loop(dataset, args.batch)
    prefetch = args.prefetch if args.workers else None
    if kind == "maitre":
        loader: Any = Loader(dataset, loop, num_workers=args.workers, prefetch_factor=prefetch)
    else:
        assert make is not None
        loader = make(
            dataset,
            batch_size=args.batch,
            sampler=RandomSampler(dataset),
            num_workers=args.workers,
            prefetch_factor=prefetch,
            drop_last=True,
        )
        it = iter(loader)
    t0, n = 0.0, 0
    for b in loop.run(max_steps=steps + 1):
        data = next(iter(loader(b))) if kind == "maitre" else next(it)
        if b.step == 1:
            t0 = time.perf_counter()
        else:
            n += len(data[0]) if isinstance(data, (list, tuple)) else len(data)
        step_body(b, data, loop.model, 0.0)
    elapsed = time.perf_counter() - t0
    if kind == "maitre":
        loader.close()
    else:
        del it
    return n / elapsed


def stateful_loader() -> Callable[..., Any] | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def throughput(dataset: Dataset, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    stateful = stateful_loader()
    runs: dict[str, list[float]] = {"maitre": [], "dataloader": []}
    if stateful is not None:
        runs["stateful_dataloader"] = []
    makers: dict[str, Callable[[], float]] = {
        "dataloader": lambda: rate("torch", dataset, args, steps, DataLoader),
        "maitre": lambda: rate("maitre", dataset, args, steps),
    }
    if stateful is not None:
        makers["stateful_dataloader"] = lambda: rate("torch", dataset, args, steps, stateful)
    names = list(makers)
    for rep in range(args.reps):  # interleaved: the machine's drift hits every loader alike,
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each first in turn
            runs[name].append(makers[name]())
    out: dict[str, Any] = {f"{k}_samples_s": round(statistics.median(v), 1) for k, v in runs.items()}
    out["maitre_vs_dataloader"] = round(statistics.median(runs["maitre"]) / statistics.median(runs["dataloader"]), 3)
    if stateful is None:
        out["stateful_dataloader_samples_s"] = None  # (torchdata is not installed)
    out["raw"] = runs
    return out


# -- waiting for data in training -----------------------------------------------------------------
def wait_share(dataset: Dataset, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    loop = a_loop(dataset, args.batch)
    waited, began = [], []
    with Loader(dataset, loop, num_workers=args.workers, prefetch_factor=args.prefetch) as loader:
        for b in loop.run(max_steps=steps):
            began.append(time.perf_counter())
            t = time.perf_counter()
            data = next(iter(loader(b)))
            waited.append(time.perf_counter() - t)
            step_body(b, data, loop.model, args.compute_ms / 1000)
        began.append(time.perf_counter())
    step_s = [b - a for a, b in zip(began, began[1:])][2:]  # (the workers' start apart)
    wait_s = waited[2:]
    return {
        "compute_ms": args.compute_ms,
        "step_ms": round(1000 * statistics.median(step_s), 2),
        "wait_ms_mean": round(1000 * statistics.mean(wait_s), 3),
        "wait_fraction_of_step": round(sum(wait_s) / sum(step_s), 4),
    }


# -- first batch after a resume or a new plan ------------------------------------------------------
def first_batch(dataset: Dataset, args: argparse.Namespace, step_ms: float) -> dict[str, Any]:
    n = len(dataset)
    out: dict[str, Any] = {"step_ms": step_ms}
    for where, fraction in (("start", 0.0), ("middle", 0.5), ("end", 0.95)):
        state = a_loop(dataset, args.batch).sampler.state_dict()
        state["cursor"] = int(fraction * n) // args.batch * args.batch
        times = []
        for _ in range(args.reps):
            loop = a_loop(dataset, args.batch, state)
            t0 = time.perf_counter()
            with Loader(dataset, loop, num_workers=args.workers, prefetch_factor=args.prefetch) as loader:
                for b in loop.run(max_steps=1):
                    next(iter(loader(b)))
                    times.append(time.perf_counter() - t0)
                    step_body(b, None, loop.model, 0.0)
        out[f"resume_at_{where}_ms"] = round(1000 * statistics.median(times), 2)
    # A plan started again mid-run, as after a resize: new workers, the step's new shares.
    loop = a_loop(dataset, args.batch)
    times = []
    with Loader(dataset, loop, num_workers=args.workers, prefetch_factor=args.prefetch) as loader:
        for b in loop.run(max_steps=4 + 2 * args.reps):
            if b.step > 4 and b.step % 2:
                loader._stop()  # (what a changed share does at the next fetch)
                t0 = time.perf_counter()
                next(iter(loader(b)))
                times.append(time.perf_counter() - t0)
            else:
                next(iter(loader(b)))
            step_body(b, None, loop.model, args.compute_ms / 1000)
    out["new_plan_ms"] = round(1000 * statistics.median(times), 2)
    worst = max(v for k, v in out.items() if k.endswith("_ms") and k != "step_ms")
    out["worst_vs_step"] = round(worst / step_ms, 3)
    return out


def state_bytes() -> dict[str, int]:
    out = {}
    for n in (1_000, 1_000_000):
        sampler = maitre.ElasticSampler(n, 64, seed=0)
        sampler.cursor = n // 2
        out[str(n)] = len(pickle.dumps(sampler.state_dict()))
    return out


STREAMING_NOT_MEASURED = (
    "MosaicML Streaming installed beside torch 2.13.0 replaces it (its torchvision pulls a CUDA "
    "torch 2.14.1), and it reads only its own shard format (MDS)"
)


def table(r: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown."""
    rows = []
    for name in ("jpeg", "tokens"):
        t = r[name]["throughput"]
        sdl = t["stateful_dataloader_samples_s"]
        rows.append(
            f"| {name} | {t['dataloader_samples_s']:,.0f} | {t['maitre_samples_s']:,.0f} "
            f"| {t['maitre_vs_dataloader']:.3f} | "
            f"{'-' if sdl is None else f'{sdl:,.0f}'} |"
        )
    w, f = r["wait"], r["first_batch"]
    return "\n\n".join(
        [  # (the lines under the table: paragraphs of their own in Markdown)
            "\n".join(
                [
                    "| data | DataLoader samples/s | maitre samples/s | maitre / DataLoader | "
                    "StatefulDataLoader samples/s |",
                    "|---|---|---|---|---|",
                    *rows,
                ]
            ),
            f"waiting for data: {100 * w['wait_fraction_of_step']:.2f}% of a {w['step_ms']:.1f} ms "
            f"step ({w['compute_ms']:g} ms of compute)",
            f"first batch after a resume at the start / middle / end of a data epoch: "
            f"{f['resume_at_start_ms']:.0f} / {f['resume_at_middle_ms']:.0f} / "
            f"{f['resume_at_end_ms']:.0f} ms; after a new plan (a resize): {f['new_plan_ms']:.0f} ms "
            f"(a step: {f['step_ms']:.0f} ms; worst {f['worst_vs_step']:.2f} steps)",
            f"sampler state: {r['state_bytes']['1000']} bytes at 1 k samples, {r['state_bytes']['1000000']} at 1 M",
            f"MosaicML Streaming: not measured ({r.get('streaming', {}).get('why', STREAMING_NOT_MEASURED)})",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="batches of JPEGs timed per throughput run")
    p.add_argument(
        "--token-steps",
        type=int,
        default=600,
        help="batches of token sequences timed per throughput run (default 600: about half a second, "
        "for they cost little each)",
    )
    p.add_argument(
        "--compute-ms", type=float, default=150.0, help="each training step's compute in the wait run (default 150)"
    )
    p.add_argument("--reps", type=int, default=5)
    args = parse(
        p, "data", smoke={"images": 128, "batch": 16, "steps": 4, "token_steps": 4, "reps": 1, "compute_ms": 40.0}
    )
    for name in ("images", "batch", "workers", "steps", "token_steps", "reps"):
        if getattr(args, name) < (0 if name == "workers" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'workers' else 1}")
    if args.workers < 1:
        p.error("--workers must be at least 1: the benchmark compares loaders with workers")
    if args.batch * (args.steps + 2) > args.images:
        p.error(f"--images {args.images} must hold --steps + 2 batches of --batch")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="maitre-data-") as tmp:
        root = Path(tmp)
        (root / "jpeg").mkdir()
        t0 = time.perf_counter()
        make_jpegs(root / "jpeg", args.images)
        sequences = (args.token_steps + 2) * args.batch
        make_shards(root / "tokens", sequences * (SEQ + 1))
        print(
            f"data: {args.images} JPEGs and {sequences} sequences of {SEQ} tokens made in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        jpegs, tokens = Jpegs(root / "jpeg"), TokenShards(root / "tokens", SEQ)
        result: dict[str, Any] = {
            "setup": {
                "images": args.images,
                "side": SIDE,
                "batch": args.batch,
                "workers": args.workers,
                "prefetch_factor": args.prefetch,
                "steps": args.steps,
                "token_steps": args.token_steps,
                "reps": args.reps,
                "seq_len": SEQ,
                "cpus": os.cpu_count(),
            }
        }
        for name, ds, steps in (("jpeg", jpegs, args.steps), ("tokens", tokens, args.token_steps)):
            result[name] = {"throughput": throughput(ds, args, steps)}
            print(f"{name}: {result[name]['throughput']['maitre_vs_dataloader']:.3f}x DataLoader", flush=True)
        result["wait"] = wait_share(jpegs, args, min(args.steps, len(jpegs) // args.batch - 1))
        result["first_batch"] = first_batch(jpegs, args, result["wait"]["step_ms"])
        result["state_bytes"] = state_bytes()
        result["streaming"] = {"samples_s": None, "why": STREAMING_NOT_MEASURED}
        result["dataloader_throughput_ratio"] = result["jpeg"]["throughput"]["maitre_vs_dataloader"]
        result["wait_fraction"] = result["wait"]["wait_fraction_of_step"]
    write_results(args.out, result, smoke=args.smoke)
    print(table(result))


if __name__ == "__main__":
    main()
