"""``maitre data prepare``: text files into token shards that :class:`~maitre.data.TokenShards`
reads, with a byte-level BPE tokenizer trained on the same text (Hugging Face ``tokenizers``,
on this machine: nothing is downloaded).

    maitre data prepare --out shards/                      # the text shipped with maitre
    maitre data prepare corpus/ more.txt --out shards/ --vocab-size 8192

The output folder holds ``tokenizer.json``, ``shard-00000.bin``... (flat ``uint16`` token ids,
``uint32`` past 65,536 ids; each document ends with the end-of-text token) and ``meta.json``
(the vocabulary size, the dtype, the token count, the inputs). It is written into a temporary
folder beside it and renamed into place once complete: an interrupted run leaves nothing half
written, and an existing folder is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

EOT = "<|endoftext|>"


class PrepareError(ValueError):
    """Input that cannot be prepared (said before anything is written)."""


def default_inputs() -> list[Path]:
    """The corpus shipped with maitre (``maitre/data/text``)."""
    with resources.as_file(resources.files("maitre") / "data" / "text") as folder:
        return sorted(Path(folder).glob("*.txt"))


def text_files(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The text files named, and the ``*.txt`` files under the folders named, in name order."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise PrepareError(f"no .txt files under {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise PrepareError(f"no such file or folder: {path}")
    for path in files:
        try:
            with path.open(encoding="utf-8") as f:
                while f.read(1 << 20):
                    pass
        except UnicodeDecodeError as exc:
            raise PrepareError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if not any(p.stat().st_size for p in files):
        raise PrepareError("the inputs hold no text")
    return files


def _documents(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8")


def prepare(
    inputs: Sequence[str | os.PathLike[str]] | None,
    out: str | os.PathLike[str],
    *,
    vocab_size: int = 4096,
    shard_tokens: int = 1 << 24,
    progress: bool = True,
) -> dict[str, object]:
    """Train the tokenizer on ``inputs`` (default: :func:`default_inputs`), write the shards to
    ``out``; returns ``meta.json``'s content."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from tqdm import tqdm
    except ImportError as exc:
        raise PrepareError(f"maitre data prepare needs {exc.name}: pip install 'maitre[data]'") from None
    if not 256 < vocab_size <= 1 << 32:
        raise PrepareError(f"--vocab-size must be above 256 (the bytes) and at most 2**32, got {vocab_size}")
    if shard_tokens < 2:
        raise PrepareError(f"--shard-tokens must be at least 2, got {shard_tokens}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise PrepareError(f"{target} exists and is not an empty folder: not overwritten")
    files = text_files(inputs) if inputs else default_inputs()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,  # (the tokenizer's own bar, for its training)
    )
    tokenizer.train_from_iterator(_documents(files), trainer=trainer)
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    eot = tokenizer.token_to_id(EOT)

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save(str(work / "tokenizer.json"))
        shards: list[str] = []
        buffer: list[np.ndarray] = []
        held = total = 0

        def flush(final: bool) -> None:
            nonlocal buffer, held
            while held >= shard_tokens or (final and held):
                flat = np.concatenate(buffer)
                piece, rest = flat[:shard_tokens], flat[shard_tokens:]
                name = f"shard-{len(shards):05d}.bin"
                piece.astype(dtype).tofile(work / name)
                shards.append(name)
                buffer, held = ([rest] if rest.size else []), int(rest.size)

        size = sum(p.stat().st_size for p in files)
        with tqdm(
            total=size, unit="B", unit_scale=True, desc="tokenizing", disable=not progress, file=sys.stderr
        ) as bar:
            for path in files:
                text = path.read_text(encoding="utf-8")
                ids = np.asarray(tokenizer.encode(text).ids + [eot], dtype=np.int64)
                buffer.append(ids)
                held += ids.size
                total += ids.size
                flush(final=False)
                bar.update(path.stat().st_size)
            flush(final=True)
        meta = {
            "vocab_size": vocab,
            "dtype": np.dtype(dtype).name,
            "tokens": total,
            "eot": eot,
            "shard_tokens": shard_tokens,
            "shards": shards,
            "inputs": [str(p) for p in files],
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # (mkdtemp's folder is private)
        if target.exists():
            target.rmdir()  # (empty: checked above)
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return meta


def open_shards(folder: str | os.PathLike[str], seq_len: int, **kwargs: object):
    """The :class:`~maitre.data.TokenShards` of a folder :func:`prepare` wrote (its dtype and
    vocabulary from ``meta.json``) and that meta."""
    from maitre.data.shards import TokenShards

    path = Path(folder)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise PrepareError(f"{path} has no meta.json: not a folder `maitre data prepare` wrote") from None
    except json.JSONDecodeError as exc:
        raise PrepareError(f"{path / 'meta.json'}: not JSON ({exc})") from None
    shards = TokenShards(
        path,
        seq_len,
        dtype=meta["dtype"],
        vocab_size=meta["vocab_size"],
        pattern="shard-*.bin",
        **kwargs,  # type: ignore[arg-type]
    )
    return shards, meta
