"""A small MLP sharded by FSDP2 on its replica's mesh, trained by the ElasticLoop (float64,
clipped by the global norm). Alone it is one replica of one process; under torchrun the world is
split into replicas of ``--dp-shard`` processes. Writes the final full parameters (``--out``).
``--checkpoint-dir`` checkpoints it (under torchrun or alone; ``maitre run`` passes its own) and
resumes from the newest checkpoint there."""

import argparse
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import maitre

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--dp-shard", type=int, default=1)
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

mesh = maitre.replica_mesh(dp_shard=args.dp_shard, device_type="cpu")
model = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                            torch.nn.Tanh(), torch.nn.Linear(32, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh["dp_shard"])
fully_shard(model, mesh=mesh["dp_shard"])
optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
loop = maitre.ElasticLoop(model, optimizer, maitre.ElasticSampler(N, 24, seed=0),
                          micro_batch_size=4, clip_grad_norm=args.clip,
                          precision="fp16" if args.loss_scale else None,
                          loss_scaler=maitre.LossScaler(args.loss_scale) if args.loss_scale else None,
                          checkpoint=maitre.CheckpointConfig(
                              directory=args.checkpoint_dir,
                              interval=maitre.IntervalConfig(every_steps=args.checkpoint_every))
                          if args.checkpoint_dir else None)
for batch in loop.run(max_steps=args.steps):
    for idx in batch.micro_batches:
        # Every process runs the same number of forward passes (FSDP's collectives need it),
        # an empty micro-batch adding nothing.
        batch.backward(torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum"))
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
if loop.rank == 0 and torch.distributed.get_rank() == 0:  # one process of one replica
    torch.save(full, args.out)
    skipped = loop.scaler.skipped if loop.scaler is not None else 0
    print(f"done: {loop.step} steps, loss {loop.last_loss:.6f}, {skipped} skipped", flush=True)
