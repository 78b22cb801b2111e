"""A character-level transformer on Macbeth, trained elastically. Copy this file to start.

    maitre run --nnodes 2:4 examples/train.py --steps 300           # elastic, embedded coordinator
    torchrun --nproc-per-node 2 examples/train.py --steps 300       # the same script, fixed size
    python examples/train.py --steps 300                            # one process
    python examples/train.py --checkpoint-dir ckpt                  # checkpointed; rerun to resume
    python examples/train.py --clip 1.0 --precision bf16            # a recipe's step hooks

The maitre parts are the sampler (which sample indices each rank trains on), the loop (which
finishes each step: gradient mean over the global batch, optimizer step, commit), and the
``reduction="sum"`` loss: the loop divides by the global sample count, so the update is the mean
over the same global batch at any world size. The model has no dropout, so an elastic run matches
a fixed-size run with the same seed and global batch. Clipping (``--clip``) and the fp16 loss
scaler (``--precision fp16``) are the loop's, applied to the reduced gradients: clipping each
rank's share in the loop body would clip a different vector at every world size.
"""

import argparse
import json
import math
import os
import time
from importlib import resources
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import maitre
import maitre.data

# The corpus ships inside the maitre package, so a copy of this script runs from anywhere.
DATA = resources.files("maitre") / "data" / "text" / "macbeth.txt"


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, block: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class Sequences(torch.utils.data.Dataset):
    """The corpus as ``(index, block + 1 characters)`` samples, for ``--data-workers``: what a
    :class:`maitre.data.Loader`'s worker processes load (the index comes back with the data, so
    the step can check that it trains the samples the loop gave it)."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.ids[i * self.block : (i + 1) * self.block + 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=16, help="most sequences per forward pass")
    p.add_argument("--block", type=int, default=64, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each worker on cuda:LOCAL_RANK)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--device-ms-per-sample",
        type=float,
        default=0.0,
        help="also wait this long per sequence, standing in for accelerator time "
        "(so that many workers on a few CPU cores scale like GPUs; `maitre demo`)",
    )
    p.add_argument("--out", type=Path, help="write the final parameters here (rank 0)")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="checkpoint here and resume from here "
        "(under `maitre run`, its --checkpoint-dir is used when this is not given)",
    )
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: the Young/Daly interval)")
    p.add_argument("--mtbf", type=float, help="mean time between failures (s) for the interval")
    p.add_argument("--clip", type=float, help="clip the gradients to this global norm")
    p.add_argument(
        "--precision", choices=["bf16", "fp16"], help="autocast the forward pass (fp16 with a dynamic loss scale)"
    )
    p.add_argument("--loss-scale", type=float, default=2.0**16, help="fp16's initial loss scale (default 65536)")
    p.add_argument(
        "--data-workers",
        type=int,
        default=None,
        help="load the samples through maitre.data.Loader with this many worker "
        "processes (0: in this process); by default the step indexes the corpus",
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="MiB of gradients per reduction launched while backward runs (DDP's 25)",
    )
    p.add_argument(
        "--record",
        type=Path,
        help="append the sample ids this process trains, step by step, to a file of its own in this "
        "folder (written before each backward, so a step that commits is in it; the tests audit "
        "exactly-once from it)",
    )
    args = p.parse_args()
    if not args.bucket_cap_mb > 0:
        p.error(f"--bucket-cap-mb must be a positive number of MiB, got {args.bucket_cap_mb}")
    if args.data_workers is not None and args.data_workers < 0:
        p.error(f"--data-workers must be 0 or more, got {args.data_workers}")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    torch.set_default_dtype(getattr(torch, args.dtype))

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    text = DATA.read_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    num_seqs = (len(ids) - 1) // args.block

    def sequences(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.tensor(indices) * args.block
        window = starts[:, None] + torch.arange(args.block + 1)
        chunk = ids[window].to(device)
        return chunk[:, :-1], chunk[:, 1:]

    model = CharTransformer(len(vocab), args.block, args.d_model, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)),
    )
    sampler = maitre.ElasticSampler(num_seqs, args.global_batch, seed=args.seed)
    checkpoint = (
        None
        if args.checkpoint_dir is None
        else maitre.CheckpointConfig(
            directory=args.checkpoint_dir,
            interval=maitre.IntervalConfig(every_steps=args.checkpoint_every, mtbf_s=args.mtbf),
        )
    )
    scaler = maitre.LossScaler(args.loss_scale) if args.precision == "fp16" else None
    loop = maitre.ElasticLoop(
        model,
        optimizer,
        sampler,
        lr_scheduler=schedule,
        micro_batch_size=args.micro_batch,
        checkpoint=checkpoint,
        precision=args.precision,
        clip_grad_norm=args.clip,
        loss_scaler=scaler,
        buckets=maitre.Buckets(cap_mb=args.bucket_cap_mb, first_cap_mb=min(1.0, args.bucket_cap_mb)),
    )

    loader = (
        None
        if args.data_workers is None
        else maitre.data.Loader(Sequences(ids, args.block), loop, num_workers=args.data_workers)
    )
    record = None
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        record = os.open(args.record / f"{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    started, tokens = time.monotonic(), 0
    for batch in loop.run(max_steps=args.steps):
        loaded = loader(batch) if loader is not None else iter(batch.micro_batches)
        for idx, data in zip(batch.micro_batches, loaded):
            if not idx:
                continue
            if loader is None:
                x, y = sequences(idx)
            else:
                got, chunk = data
                if got.tolist() != idx:  # (the loader's promise, checked at every step)
                    raise RuntimeError(
                        f"step {batch.step}: the loader gave samples {got.tolist()}, the loop asked for {idx}"
                    )
                chunk = chunk.to(device)
                x, y = chunk[:, :-1], chunk[:, 1:]
            if record is not None:  # (the ids of the data itself, where a loader loaded it)
                trained = idx if loader is None else got.tolist()
                line = {"epoch": loop.epoch, "step": batch.step, "data_epoch": batch.slice.data_epoch,
                        "samples": sampler.num_samples, "ids": trained}  # fmt: skip
                os.write(record, (json.dumps(line) + "\n").encode())
            with batch.autocast():
                logits = model(x)
            if logits.dtype in (torch.float16, torch.bfloat16):  # the loss in the model's dtype
                logits = logits.to(torch.get_default_dtype())
            # Sum over sequences, mean over positions: the loop divides by the global count.
            loss = F.cross_entropy(logits.reshape(-1, len(vocab)), y.reshape(-1), reduction="sum") / args.block
            batch.backward(loss)  # loss.backward(), scaled for fp16; logs the loss
            if args.device_ms_per_sample:  # a GPU computes while the CPU waits
                time.sleep(len(idx) * args.device_ms_per_sample / 1000)
        tokens += batch.global_batch_size * args.block
        if batch.rank == 0 and loop.last_loss is not None and loop.step % args.log_every == 0:
            rate = tokens / (time.monotonic() - started)
            print(
                f"step {loop.step:5d}  loss {loop.last_loss:.4f}  world {batch.world_size}  {rate:,.0f} tok/s",
                flush=True,
            )

    if loader is not None:
        loader.close()
    if record is not None:
        os.close(record)
    if loop.completed and loop.rank == 0:  # (not a worker that left, or stopped early)
        loss = "n/a (nothing left to train)" if loop.last_loss is None else f"{loop.last_loss:.4f}"
        skipped = f", {loop.scaler.skipped} steps skipped for fp16 overflow" if loop.scaler is not None else ""
        print(f"done: {loop.step} steps, final loss {loss}{skipped}", flush=True)
        if args.out is not None:
            torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
