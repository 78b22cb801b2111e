"""A Hugging Face ``Trainer`` script with nothing of maitre's: a small GPT-2 built from a config,
a byte-level BPE tokenizer trained here with ``tokenizers`` (no download), the Trainer's own
checkpoints. It runs as it is under torchrun and under maitre's restart mode::

    torchrun --nproc-per-node 2 examples/hf_trainer.py --output-dir /tmp/gpt2
    maitre run --elastic restart --nnodes 1:4 examples/hf_trainer.py --output-dir /tmp/gpt2

Each start resumes from the newest checkpoint in ``--output-dir`` (``get_last_checkpoint``), as a
torchrun job that must survive restarts does. Needs ``pip install 'maitre[integrations]'``.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.trainer_utils import get_last_checkpoint

TEXT = resources.files("maitre") / "data" / "text" / "macbeth.txt"
"""A public-domain play shipped with maitre (any text file will do: ``--text``)."""


def tokenizer_for(text: str, vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``text`` (deterministic: every rank trains the same one)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    learn = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([text], learn)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


class Pace(TrainerCallback):
    """Each step takes ``seconds`` longer (``--step-ms``: a larger model's step on a small machine)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4, help="per process")
    ap.add_argument("--block", type=int, default=64, help="tokens a sample")
    ap.add_argument("--text", type=Path, help="the text to train on (default: the play shipped with maitre)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="extra time per step (a larger model's)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    text = args.text.read_text() if args.text else TEXT.read_text()
    tok = tokenizer_for(text, vocab=512)
    ids = tok(text)["input_ids"]
    block = args.block
    samples = [ids[i : i + block] for i in range(0, len(ids) - block, block)]
    dataset = [{"input_ids": s, "labels": s} for s in samples]
    config = GPT2Config(vocab_size=len(tok), n_positions=block, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)

    cuda = torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=10,
        report_to=[],
        seed=0,
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[Pace(args.step_ms / 1000)] if args.step_ms else None,
    )
    last = get_last_checkpoint(str(args.output_dir)) if args.output_dir.is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"training done at step {trainer.state.global_step} (resumed from {last})", flush=True)


if __name__ == "__main__":
    main()
