"""A plain PyTorch training loop made elastic by one call, maitre.prepare. Copy this file to start.

    maitre run --nnodes 1:3 examples/plain_loop.py --steps 300     # elastic, embedded coordinator
    torchrun --nproc-per-node 2 examples/plain_loop.py --steps 300 # the same script, fixed size
    python examples/plain_loop.py --steps 300                      # one process

A character-level MLP language model (each sample: a window of characters and the one after it)
on Macbeth, with a DataLoader, AdamW, a cosine schedule and the usual ``loss.backward();
optimizer.step(); optimizer.zero_grad()``. The lines marked ``maitre:`` are all that differ from
the script on one GPU: ``prepare`` hands back the model, the optimizer and the data ready for the
elastic loop underneath (in-place resizes, live joins, every sample once, checkpoints). The loss
is the usual mean over the batch; ``prepare`` makes the update the mean over the *global* batch,
the same at any world size, so a run that grows, shrinks and loses workers ends where a fixed-size
run with the same seed and global batch does. For a model that spans processes (FSDP2, tensor
parallel) or fp16's loss scale, use ``maitre.ElasticLoop`` (examples/train.py, examples/train_llm.py).
"""

import argparse
import math
from importlib import resources
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import maitre

DATA = resources.files("maitre") / "data" / "text" / "macbeth.txt"


class Windows(Dataset):
    """Sample ``i``: characters ``i*stride .. i*stride+context`` and the one after them."""

    def __init__(self, ids: torch.Tensor, context: int, stride: int) -> None:
        self.ids, self.context, self.stride = ids, context, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        return self.ids[start : start + self.context], self.ids[start + self.context]


class CharMLP(nn.Module):
    def __init__(self, vocab: int, context: int, d_embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_embed)
        self.mlp = nn.Sequential(nn.Linear(context * d_embed, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(x).flatten(1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks together")
    p.add_argument("--batch", type=int, default=32, help="most samples per forward pass (the DataLoader's)")
    p.add_argument("--context", type=int, default=16, help="characters the model sees")
    p.add_argument("--stride", type=int, default=3, help="characters between two samples' starts")
    p.add_argument("--d-embed", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--checkpoint-dir", type=Path, help="checkpoint here and resume from here")
    p.add_argument("--out", type=Path, help="write the final parameters here (rank 0)")
    args = p.parse_args()
    for name in ("steps", "global_batch", "batch", "context", "stride", "d_embed", "hidden", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    if args.workers < 0:
        p.error(f"--workers must be 0 or more, got {args.workers}")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    torch.set_default_dtype(getattr(torch, args.dtype))
    text = DATA.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)

    model = CharMLP(len(vocab), args.context, args.d_embed, args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    data = DataLoader(Windows(ids, args.context, args.stride), batch_size=args.batch, num_workers=args.workers)

    # maitre: the model, the optimizer and the data, ready for the elastic loop. The schedule is
    # stepped once per committed step (a step dropped for a lost peer does not move it).
    checkpoint = None if args.checkpoint_dir is None else maitre.CheckpointConfig(directory=args.checkpoint_dir)
    model, optimizer, loader = maitre.prepare(
        model,
        optimizer,
        data,
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        seed=args.seed,
        lr_scheduler=schedule,
        checkpoint=checkpoint,
    )
    logged = loader.step
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        loader.log_loss(loss)  # maitre: optional; the global batch's mean loss, in loader.loop.last_loss
        optimizer.step()
        optimizer.zero_grad()
        if loader.step % args.log_every == 0 and loader.step != logged and loader.loop.rank == 0:
            logged = loader.step
            print(
                f"step {loader.step:5d}  world {loader.loop.world_size}  loss {loader.loop.last_loss:.4f}",
                flush=True,
            )
    # maitre: a worker that left (scaled down) or stopped with a checkpoint holds a state that is
    # not the last; only a completed loop's model is the final one.
    if loader.completed and loader.loop.rank == 0 and args.out is not None:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
