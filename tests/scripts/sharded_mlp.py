"""A small MLP sharded by FSDP2 and optionally split by tensor parallelism on its replica's mesh,
trained by the ElasticLoop (float64, clipped by the global norm). Alone it is one replica of one
process; under torchrun the world is split into replicas of ``--dp-shard`` x ``--tp``
processes. Writes the final full parameters (``--out``). ``--checkpoint-dir`` checkpoints it
(under torchrun or alone; ``maitre run`` passes its own) and resumes from the newest checkpoint
there.

With ``--tp``, the first Linear is ColwiseParallel and the second RowwiseParallel on the mesh's
``tp`` dimension; the last Linear and the Rowwise bias stay whole on every tp rank. ``--no-fsdp``
leaves FSDP2 out (tensor parallelism alone: the last Linear's parameters stay plain).
``--check-grads`` compares, on the first step, every reduced and clipped gradient and the
global norm with one process's on the whole global batch. ``--bad-tp`` puts a plain gain on
the tp shard of the activations (each tp rank's gradient of it is a partial sum): refused."""

import argparse
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import maitre

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--dp-shard", type=int)
p.add_argument("--tp", type=int)
p.add_argument("--no-fsdp", action="store_true")
p.add_argument("--check-grads", action="store_true")
p.add_argument("--bad-tp", action="store_true")
p.add_argument("--clip", type=float, default=0.5)
p.add_argument("--loss-scale", type=float, help="fp16's loss scaler, starting at this scale")
p.add_argument("--out", type=Path, required=True)
p.add_argument("--checkpoint-dir", type=Path)
p.add_argument("--checkpoint-every", type=int)
args = p.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
N, D = 96, 8
g = torch.Generator().manual_seed(1)
x, y = torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)


class Gain(torch.nn.Module):
    """tanh(gain * x): a plain parameter on whatever part of the activations this rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.gain * h)


mesh = maitre.replica_mesh(dp_shard=args.dp_shard, tp=args.tp, device_type="cpu")
model = torch.nn.Sequential(
    torch.nn.Linear(D, 32),
    Gain() if args.bad_tp else torch.nn.Tanh(),
    torch.nn.Linear(32, 32),
    torch.nn.Tanh(),
    torch.nn.Linear(32, 1),
)
reference = [t.detach().clone() for t in model.parameters()] if args.check_grads else None
if mesh["tp"].size() > 1:
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
if not args.no_fsdp:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])


def loss_of(module: torch.nn.Module, idx: list[int]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x[idx]), y[idx], reduction="sum")


def check_grads(batch: maitre.Batch) -> None:
    """Step 1: the loop's gradients (reduced, divided, clipped) against one process's."""
    if batch.step != 1:
        return
    plain = torch.nn.Sequential(
        torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    with torch.no_grad():
        for mine, init in zip(plain.parameters(), reference):
            mine.copy_(init)
    idx = batch.slice.global_indices
    (loss_of(plain, idx) / len(idx)).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip))
    worst = abs(batch.grad_norm - norm) / norm
    for mine, want in zip(model.parameters(), plain.parameters()):
        got = mine.grad.full_tensor() if hasattr(mine.grad, "full_tensor") else mine.grad
        worst = max(worst, float((got - want.grad).norm() / want.grad.norm()))
    if worst > 1e-12:
        raise AssertionError(f"step 1's gradients are {worst:.3g} off one process's")
    if torch.distributed.get_rank() == 0:
        print(f"gradients of step 1 match one process's to {worst:.1e}", flush=True)


optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
loop = maitre.ElasticLoop(
    model,
    optimizer,
    maitre.ElasticSampler(N, 24, seed=0),
    micro_batch_size=4,
    clip_grad_norm=args.clip,
    on_reduced_grads=check_grads if args.check_grads else None,
    precision="fp16" if args.loss_scale else None,
    loss_scaler=maitre.LossScaler(args.loss_scale) if args.loss_scale else None,
    checkpoint=maitre.CheckpointConfig(
        directory=args.checkpoint_dir, interval=maitre.IntervalConfig(every_steps=args.checkpoint_every)
    )
    if args.checkpoint_dir
    else None,
)
for batch in loop.run(max_steps=args.steps):
    for idx in batch.micro_batches:
        # Every process runs the same number of forward passes (FSDP's collectives need it),
        # an empty micro-batch adding nothing.
        batch.backward(loss_of(model, idx))
if loop.completed:  # (not a replica that left, or stopped with a checkpoint)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
if loop.completed and loop.rank == 0 and torch.distributed.get_rank() == 0:  # one process of one replica
    torch.save(full, args.out)
    skipped = loop.scaler.skipped if loop.scaler is not None else 0
    print(f"done: {loop.step} steps, loss {loop.last_loss:.6f}, {skipped} skipped", flush=True)
