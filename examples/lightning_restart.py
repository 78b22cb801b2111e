"""A PyTorch Lightning script with nothing of maitre's: a small regression model, DDP, and
Lightning's own checkpoints. It runs as it is under torchrun and under maitre's restart mode::

    torchrun --nproc-per-node 2 examples/lightning_restart.py --checkpoint-dir /tmp/pl
    maitre run --elastic restart --nnodes 1:4 examples/lightning_restart.py --checkpoint-dir /tmp/pl

As under torchrun, the world comes from the environment: ``devices`` is ``LOCAL_WORLD_SIZE`` and
``num_nodes`` is ``GROUP_WORLD_SIZE`` (Lightning checks that their product is ``WORLD_SIZE``).
Each start resumes from ``last.ckpt`` (``ckpt_path="last"``). Needs
``pip install 'maitre[integrations]'``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        self.step_s = step_s
        """Extra time per step (``--step-ms``: a larger model's step on a small machine)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if self.step_s:
            time.sleep(self.step_s)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint-dir", type=Path, required=True)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--step-ms", type=float, default=0.0, help="extra time per step (a larger model's)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(
        dirpath=args.checkpoint_dir, every_n_train_steps=args.save_every, save_last=True, save_top_k=0
    )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = args.checkpoint_dir / "last.ckpt"
    trainer.fit(Regression(args.step_ms / 1000), loader, ckpt_path=str(last) if last.exists() else None)
    if trainer.is_global_zero:
        print(f"training done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
