"""The benchmark's training process: the example's model, run three ways.

* under ``maitre`` (elastic): the ElasticLoop, live recovery, no checkpoint;
* under ``torchrun`` (static ElasticLoop): a ``torch.save`` checkpoint every ``--ckpt-every``
  steps, loaded at start-up, as a torchrun job must do to survive its restarts;
* ``--plain`` under ``torchrun``: no maitre at all; a fixed gloo group, flat-buffer allreduce, the
  anchor for the steady-state overhead.

Each process writes ``<run-dir>/pid-<worker>`` at start, and appends one line per completed step to
``<run-dir>/steps-<worker>.jsonl``: ``{"step", "t" (wall), "dt" (seconds since the last step),
"epoch", "world", "pid"}``. The drivers (``recovery.py``, ``restart.py``) read only these files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import maitre

spec = importlib.util.spec_from_file_location(
    "example", Path(__file__).resolve().parent.parent / "examples" / "train.py"
)
example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(example)  # type: ignore[union-attr]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="each step also waits this long, as for a device's compute (smoke runs: their jobs train "
        "until each fault, and steps that wait leave the cores to the processes under test)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    text = example.DATA.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    block = 64
    num_seqs = (len(ids) - 1) // block
    model = example.CharTransformer(len(vocab), block, 64, 2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = maitre.ElasticSampler(num_seqs, args.global_batch, seed=0)

    def loss_of(idx: list[int]) -> torch.Tensor:
        time.sleep(args.device_ms / 1000)
        window = torch.tensor(idx)[:, None] * block + torch.arange(block + 1)
        chunk = ids[window]
        logits = model(chunk[:, :-1])
        return F.cross_entropy(logits.reshape(-1, len(vocab)), chunk[:, 1:].reshape(-1), reduction="sum") / block

    worker = os.environ.get("MAITRE_WORKER_ID") or f"rank{os.environ.get('RANK', '0')}"
    args.run_dir.mkdir(parents=True, exist_ok=True)
    (args.run_dir / f"pid-{worker}").write_text(str(os.getpid()))
    timing = open(args.run_dir / f"steps-{worker}.jsonl", "a", buffering=1)
    last = time.perf_counter()

    def record(step: int) -> None:  # seconds per step, for the steady-state comparison
        nonlocal last
        now = time.perf_counter()
        timing.write(json.dumps({"step": step, "dt": now - last}) + "\n")
        last = now

    if args.plain:
        run_plain(model, optimizer, sampler, loss_of, args.steps, record)
        return
    loop = maitre.ElasticLoop(model, optimizer, sampler)
    ckpt = args.run_dir / "checkpoint.pt"
    if args.ckpt_every and ckpt.exists():
        loop.state.load_state_dict(torch.load(ckpt, weights_only=True))
        with open(args.run_dir / f"restored-{worker}", "a") as f:
            f.write(f"{time.time()} {loop.step}\n")
    recorded = loop.step
    for batch in loop.run(max_steps=args.steps):
        if loop.step > recorded:  # the previous step committed in the loop's next()
            recorded = loop.step
            record(recorded)
            if args.ckpt_every and loop.rank == 0 and loop.step % args.ckpt_every == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save(loop.state.state_dict(), tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, ckpt)
        loss_of(batch.indices).backward()


def run_plain(model, optimizer, sampler, loss_of, steps, record) -> None:
    """A fixed gloo group with no elasticity: what the loop costs beyond this is maitre's."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params))
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=False)
        slc = sampler.next_slice(rank, world)
        loss_of(slc.local_indices).backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)
        dist.all_reduce(flat)
        flat /= slc.global_count
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        sampler.advance(slc)
        record(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
