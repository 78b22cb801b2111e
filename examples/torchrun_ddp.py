"""A plain torchrun script, with nothing of maitre's: DDP, and checkpoints of its own.

It runs under torchrun as it is::

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 300 --checkpoint-dir /tmp/ddp

and under maitre's restart mode, where the scheduler may resize it, a spot notice or a failure
stops it, and every change restarts it whole at the new size (it resumes from its checkpoint)::

    maitre run --elastic restart --nnodes 1:4 examples/torchrun_ddp.py --steps 300 --checkpoint-dir /tmp/ddp

Each step trains on the same global batch whatever the world size (each rank takes its share),
so a run restarted at other sizes learns what a fixed-size run learns.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--checkpoint-dir", type=Path, required=True)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=0.0, help="extra time per step (a larger model's)")
    ap.add_argument("--out", type=Path, help="rank 0 saves the final parameters here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")  # env://: RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    latest = args.checkpoint_dir / "latest.pt"
    if latest.exists():
        state = torch.load(latest, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    ddp = DistributedDataParallel(model)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"rank {rank} of {world}: restart {restart}, resuming at step {step}", flush=True)

    while step < args.steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.global_batch, 32, generator=g, dtype=torch.float64)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        xs, ys = x.tensor_split(world)[rank].to(device), y.tensor_split(world)[rank].to(device)
        # DDP averages gradients over ranks: this rank's sum over the global batch size, times
        # the world size, makes that average the gradient of the global batch's mean loss.
        loss = ((ddp(xs) - ys) ** 2).sum() * (world / args.global_batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        if step % args.checkpoint_every == 0 or step == args.steps:
            if rank == 0:  # written whole or not at all
                args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                partial = latest.with_suffix(".partial")
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                torch.save(state, partial)
                os.replace(partial, latest)
            dist.barrier()
    if rank == 0:
        if args.out is not None:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out)
        print(f"training done at step {step}", flush=True)
    dist.barrier()  # (no rank leaves while another may still be connecting to it)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
