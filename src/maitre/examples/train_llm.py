"""A small Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU) on the bundled text, sharded by
FSDP2 inside each replica and optionally split by tensor parallelism, clipped by the global norm,
optionally in bf16. Copy it to start.

    maitre run --nnodes 1:4 --nproc-per-replica 2 examples/train_llm.py --steps 200
    maitre run --nnodes 1:4 --nproc-per-replica 2 --mesh tp=2 examples/train_llm.py --steps 200
    torchrun --nproc-per-node 4 examples/train_llm.py --dp-shard 2 --steps 200   # 2 replicas of 2
    torchrun --nproc-per-node 4 examples/train_llm.py --dp-shard 2 --tp 2 --steps 200  # 1 of 2x2
    python examples/train_llm.py --steps 200                                     # one process
    maitre data prepare --out shards/ && \
      maitre run --nnodes 1:4 examples/train_llm.py --data shards/ --data-workers 2 --steps 200

Under ``maitre run`` the job's replicas are ``--nproc-per-replica`` processes each, on the mesh
``--mesh`` declares (default: all of them ``dp_shard``), and the job grows and shrinks by whole
replicas; under torchrun the world is split into replicas of ``--dp-shard`` x ``--tp``
processes; alone it is one replica of one process. The script is the same: it builds its model
on :func:`maitre.replica_mesh` as it would on torchrun's mesh, and the loop does the rest (the
mean gradient over the global batch, clipping, the fp16 loss scale).

Tensor parallelism (Megatron's split, on the mesh's ``tp`` dimension): q, k, v and SwiGLU's
gate and up projections are ColwiseParallel (each tp rank holds ``heads / tp`` heads and their
rotary embedding), o and down are RowwiseParallel (their outputs summed over tp), so the
residual stream, the norms, the embedding and the head are whole on every tp rank. FSDP2 then
shards every block over ``dp_shard``.
"""

import argparse
import math
import os
import time
from importlib import resources
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import maitre
import maitre.data
from maitre.data.prepare import open_shards

DATA = resources.files("maitre") / "data" / "text" / "macbeth.txt"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels by their position's angle (RoFormer's rotary embedding)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1 = nn.Linear(dim, hidden, bias=False)  # SwiGLU: w2(silu(w1 x) * w3 x)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        # -1: this rank's heads (all of them, or heads / tp under tensor parallelism)
        q, k, v = (w(h).view(b, t, -1, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        hidden = (8 * dim // 3 + 7) // 8 * 8  # Llama's 8/3 d, rounded up to a multiple of 8
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(block, dtype=torch.float64), freqs)
        self.register_buffer("cos", angles.cos().to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("sin", angles.sin().to(torch.get_default_dtype()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, self.cos[:t], self.sin[:t])
        return self.head(self.norm(h))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=4, help="most sequences per forward pass")
    p.add_argument("--block", type=int, default=64, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="clip to this global gradient norm")
    p.add_argument("--precision", choices=["bf16", "fp16"], help="autocast the forward pass")
    p.add_argument(
        "--dp-shard",
        type=int,
        help="processes a replica shards over (default: the "
        "job's under maitre run, a node's over --tp under torchrun, 1 alone)",
    )
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel processes inside a replica (default: "
        "the job's under maitre run, 1 otherwise); --heads must divide by it",
    )
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", type=Path, help="write the final full parameters here")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each process on cuda:LOCAL_RANK)")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="MiB of gradients per reduction across replicas (DDP's 25)"
    )
    p.add_argument(
        "--data",
        type=Path,
        help="token shards `maitre data prepare` wrote, read "
        "through maitre.data.Loader (default: the bundled text, a token a character)",
    )
    p.add_argument(
        "--data-workers", type=int, default=0, help="with --data: data-loading processes beside each training process"
    )
    args = p.parse_args()
    if not args.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be a positive number of MiB, got {args.bucket_cap_mb}")
    if args.data_workers < 0:
        p.error(f"--data-workers must be 0 or more, got {args.data_workers}")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # every process builds the same initial model
    torch.set_default_dtype(getattr(torch, args.dtype))
    shards = None
    if args.data is not None:  # a tokenized corpus, read by the loader's workers
        try:
            shards, meta = open_shards(args.data, args.block)
        except (ValueError, OSError) as exc:
            p.error(f"--data {args.data}: {exc}")
        n_vocab = int(meta["vocab_size"])
    else:  # the bundled text, one token per character, indexed in place
        text = DATA.read_text()
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        n_vocab = len(vocab)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if shards is None:
            ids = ids.to(device)

    mesh = maitre.replica_mesh(dp_shard=args.dp_shard, tp=args.tp, device_type=device.type)
    tp = mesh["tp"].size()
    if args.heads % tp:
        p.error(f"--heads {args.heads} do not split over tp={tp} processes")
    model = Decoder(n_vocab, args.block, args.d_model, args.layers, args.heads).to(device)
    if tp > 1:  # before FSDP2, which then shards the TP pieces over dp_shard
        plan = {
            "wq": ColwiseParallel(),
            "wk": ColwiseParallel(),
            "wv": ColwiseParallel(),
            "wo": RowwiseParallel(),
            "w1": ColwiseParallel(),
            "w3": ColwiseParallel(),
            "w2": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    for block in model.blocks:  # one FSDP unit per block, then the rest
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)),
    )
    try:
        sampler = (
            maitre.ElasticSampler.of(shards, args.global_batch, seed=args.seed)
            if shards is not None
            else maitre.ElasticSampler((len(ids) - 1) // args.block, args.global_batch, seed=args.seed)
        )
    except ValueError as exc:
        p.error(str(exc))
    loop = maitre.ElasticLoop(
        model,
        optimizer,
        sampler,
        lr_scheduler=schedule,
        micro_batch_size=args.micro_batch,
        clip_grad_norm=args.clip,
        precision=args.precision,
        buckets=maitre.Buckets(cap_mb=args.bucket_cap_mb, first_cap_mb=min(1.0, args.bucket_cap_mb)),
    )

    loader = (
        None
        if shards is None
        else maitre.data.Loader(shards, loop, num_workers=args.data_workers, pin_memory=device.type == "cuda")
    )
    empty = torch.empty(0, args.block + 1, dtype=torch.long)
    first = torch.distributed.get_rank() == 0  # of its replica
    warm = min(5, args.steps // 4)  # tokens/s over the steps committed after step `warm` (the
    began = 0.0  # first ones allocate and warm up)
    for batch in loop.run(max_steps=args.steps):
        if loop.step == warm and not began:
            began = time.perf_counter()
        loaded = loader(batch) if loader is not None else iter(batch.micro_batches)
        for idx, data in zip(batch.micro_batches, loaded):  # (as many on every process of a
            if loader is not None:  # replica, some of them empty)
                chunk = (empty if data is None else data).to(device, non_blocking=True)
            else:
                starts = torch.tensor(idx, dtype=torch.long, device=device) * args.block
                chunk = ids[starts[:, None] + torch.arange(args.block + 1, device=device)]
            with batch.autocast():
                logits = model(chunk[:, :-1])
            # Sum over sequences, mean over positions: the loop divides by the global count.
            loss = (
                F.cross_entropy(
                    logits.to(torch.get_default_dtype()).reshape(-1, n_vocab), chunk[:, 1:].reshape(-1), reduction="sum"
                )
                / args.block
            )
            batch.backward(loss)
        if loop.rank == 0 and first and loop.last_loss is not None and loop.step % args.log_every == 0:
            print(
                f"step {loop.step:5d}  loss {loop.last_loss:.4f}  replicas {batch.world_size}  "
                f"grad norm {loop.last_grad_norm:.3f}",
                flush=True,
            )
    if loader is not None:
        loader.close()
    if not loop.completed:  # a replica that left, or stopped with a checkpoint: not the final model
        return
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a replica's collective
    if loop.rank == 0 and first:
        tokens = (loop.step - warm) * args.global_batch * args.block
        rate = tokens / (time.perf_counter() - began) if began else float("nan")
        print(
            f"done: {loop.step} steps, final loss {loop.last_loss:.4f}, {rate:.0f} tokens/s "
            f"(steps {warm + 1}-{loop.step}, all replicas)",
            flush=True,
        )
        if args.out is not None:
            torch.save(full, args.out)


if __name__ == "__main__":
    main()
