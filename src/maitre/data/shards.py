"""Token shards: a directory of tokenized text, read through memory maps, as fixed-length
sequences.

Each shard is a flat array of token ids, as nanoGPT's ``prepare.py`` and ``maitre data
prepare`` write them: raw ``.bin`` files of ``uint16`` (or ``uint32``) tokens, ``.npy`` files
(their header says the dtype), or lit-gpt's packed ``.bin`` chunks (``PackedDatasetBuilder``: a
24-byte header, ``LITPKDS``, version 1, a dtype code, the chunk's token count, then the tokens,
``uint16`` or ``int32``; recognized by the header whatever the file is called). Sample ``i``
is a packed sequence of ``seq_len + 1`` tokens (the inputs and, shifted by one, the targets),
cut from one shard without crossing into the next; a shard's last partial sequence is left out.

The order of a data epoch is shard-aware: the sequences of each shard are cut into blocks of
``block`` consecutive sequences, and the blocks of all shards are shuffled (from ``(seed,
data_epoch)`` alone), so a step's samples come from a few places of a few files and reads stay
sequential, whatever the world size or the number of workers.

The shards' names and sizes are the source's description, kept in the sampler's state: a resume
onto a directory that changed (a file added, removed or resized) is refused with what changed.
A shard whose size is not a whole number of tokens, or which holds a token id at or above
``vocab_size``, raises :class:`DataError` naming the file and the byte offset.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npy_format
from torch.utils.data import Dataset

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
LITGPT_MAGIC = b"LITPKDS"
LITGPT_DTYPES = {8: np.dtype("<u2"), 4: np.dtype("<i4")}
"""lit-gpt's dtype codes of token chunks (its table also has floats and signed bytes: not tokens)."""


class DataError(ValueError):
    """A data file that cannot be read as what it claims to be; names the file and the byte
    offset where it goes wrong."""

    def __init__(self, path: str | os.PathLike[str], offset: int | None = None, problem: str | None = None) -> None:
        if offset is None:  # one message: a DataLoader raising again what a worker raised
            super().__init__(str(path))
            found = _SAID.findall(str(path))
            self.path, self.offset, self.problem = (
                (found[-1][0], int(found[-1][1]), found[-1][2]) if found else ("", -1, str(path))
            )
            return
        self.path, self.offset, self.problem = str(path), offset, problem or ""
        super().__init__(f"{path}: at byte {offset}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return DataError, (self.path, self.offset, self.problem)


_SAID = re.compile(r"DataError: (.+?): at byte (\d+): (.*)")


def _layout(path: Path, dtype: np.dtype) -> tuple[int, np.dtype]:
    """(byte offset of the first token, dtype) of a shard; checks its size."""
    size = path.stat().st_size
    offset = 0
    with path.open("rb") as f:
        head = f.read(24)
    if head.startswith(LITGPT_MAGIC):
        return _litgpt_layout(path, head, size)
    if path.suffix == ".npy":
        with path.open("rb") as f:
            try:
                version = npy_format.read_magic(f)
                header = (npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0)(
                    f
                )
            except ValueError as exc:
                raise DataError(path, f.tell(), f"not a .npy file: {exc}") from None
            shape, fortran, dtype = header
            offset = f.tell()
        if dtype.str.lstrip("<>=|") not in ("u2", "u4") or len(shape) != 1:
            raise DataError(path, 0, f"holds {dtype} of shape {shape}, not a flat array of uint16 or uint32 tokens")
        if size - offset < shape[0] * dtype.itemsize:
            whole = offset + (size - offset) // dtype.itemsize * dtype.itemsize
            raise DataError(
                path,
                whole,
                f"truncated: its header says {shape[0]} tokens, the file holds {(size - offset) // dtype.itemsize}",
            )
    elif (size - offset) % dtype.itemsize:
        whole = size - (size - offset) % dtype.itemsize
        raise DataError(
            path,
            whole,
            f"truncated: {size} bytes is not a whole number of {dtype} tokens ({size - whole} bytes left over)",
        )
    return offset, dtype


def _litgpt_layout(path: Path, head: bytes, size: int) -> tuple[int, np.dtype]:
    """(24, dtype) of a lit-gpt packed chunk, whose header is checked against its size."""
    if len(head) < 24:
        raise DataError(path, len(head), "truncated: a lit-gpt packed chunk's header is 24 bytes")
    version, code, tokens = struct.unpack("<QBQ", head[len(LITGPT_MAGIC) :])
    if version != 1:
        raise DataError(path, 7, f"lit-gpt packed format version {version}, not 1")
    dtype = LITGPT_DTYPES.get(code)
    if dtype is None:
        raise DataError(path, 15, f"lit-gpt dtype code {code}: not tokens of uint16 (8) or int32 (4)")
    held = (size - 24) // dtype.itemsize
    if held != tokens or (size - 24) % dtype.itemsize:
        whole = 24 + min(held, tokens) * dtype.itemsize
        raise DataError(
            path, whole, f"its header says {tokens} tokens, the file holds {(size - 24) / dtype.itemsize:g}"
        )
    return 24, dtype


class Shards(Dataset):
    """What every sharded source shares: its files in name order, each holding ``counts[k]``
    samples (sample ``i`` is in the shard ``bisect(starts, i) - 1``), one global order of
    blocks of ``block`` consecutive samples of one shard, shuffled from ``(seed, data_epoch)``
    alone, and the files' names and sizes as the source's description (:meth:`changes`)."""

    kind = "shards"
    """The source's kind in its description."""
    files: list[Path]
    sizes: list[int]
    counts: list[int]
    block: int
    directory: Path

    def _index(self) -> None:
        """Set ``starts`` from ``counts``."""
        self.starts = [0, *np.cumsum(self.counts).tolist()]

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, the sample's position in it) of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside 0..{len(self) - 1}")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    # -- what the sampler asks of a source --------------------------------------------------------
    def order(self, seed: int, data_epoch: int) -> np.ndarray:
        """Every sample once: blocks of ``block`` consecutive samples of one shard, the blocks
        shuffled from ``(seed, data_epoch)``."""
        starts = np.concatenate(
            [np.arange(self.starts[k], self.starts[k + 1], self.block) for k in range(len(self.files))] or [[]]
        ).astype(np.int64)
        ends = np.minimum(starts + self.block, np.asarray(self.starts)[np.searchsorted(self.starts, starts, "right")])
        gen = torch.Generator().manual_seed(seed * 1_000_003 + data_epoch)
        perm = torch.randperm(len(starts), generator=gen).numpy()
        lengths = ends[perm] - starts[perm]
        # Block b's samples, for the blocks in perm's order: each block's start, then +1 within it.
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return np.repeat(starts[perm], lengths) + within  # (the sampler keeps it as int32)

    def _settings(self) -> dict[str, Any]:
        """What else besides the files a saved order depends on."""
        return {"block": self.block}

    def describe(self) -> dict[str, Any]:
        """What the sampler's state keeps of this source: its shards' names and sizes."""
        return {
            "kind": self.kind,
            **self._settings(),
            "files": [[p.name, size] for p, size in zip(self.files, self.sizes)],
        }

    def changes(self, saved: dict[str, Any]) -> str | None:
        """What changed since ``saved`` (a :meth:`describe`), or None."""
        if saved.get("kind") != self.kind:
            return f"the state was saved from a {saved.get('kind')!r} source, not {self.kind!r}"
        said = [
            f"{key} {saved.get(key)} -> {value}" for key, value in self._settings().items() if saved.get(key) != value
        ]
        before = {name: size for name, size in saved.get("files", [])}
        now = {p.name: size for p, size in zip(self.files, self.sizes)}
        added = sorted(set(now) - set(before))
        removed = sorted(set(before) - set(now))
        resized = [
            f"{n} ({before[n]} -> {now[n]} bytes)" for n in sorted(set(now) & set(before)) if before[n] != now[n]
        ]
        for what, names in (("added", added), ("removed", removed), ("resized", resized)):
            if names:
                said.append(f"{what}: {', '.join(names)}")
        return f"shards in {self.directory}: " + "; ".join(said) if said else None


def shard_files(directory: str | os.PathLike[str], pattern: str) -> tuple[Path, list[Path]]:
    """The folder and its files matching ``pattern``, in name order; none is an error."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"no shard directory {folder}")
    files = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not files:
        raise ValueError(f"no shards matching {pattern!r} in {folder}")
    return folder, files


class TokenShards(Shards):
    """Sequences of ``seq_len + 1`` tokens from the shards in ``directory``.

    Args:
        directory: the shards' folder; its files matching ``pattern``, in name order.
        seq_len: tokens of input per sample (a sample holds one more: the last target).
        dtype: ``"uint16"`` or ``"uint32"``, for raw ``.bin`` shards (``.npy`` files and
            lit-gpt's packed chunks say their own).
        vocab_size: when given, a token id at or above it is a corrupt shard.
        block: consecutive sequences kept together by the shuffle.
    """

    kind = "token_shards"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        seq_len: int,
        *,
        dtype: str = "uint16",
        pattern: str = "*.bin",
        vocab_size: int | None = None,
        block: int = 64,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if block < 1:
            raise ValueError(f"block must be at least 1, got {block}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.directory, self.files = shard_files(directory, pattern)
        self.seq_len, self.vocab_size, self.block = seq_len, vocab_size, block
        self._layouts = [_layout(p, np.dtype(DTYPES[dtype])) for p in self.files]
        self.sizes = [p.stat().st_size for p in self.files]
        self.counts = []
        for (offset, dt), size in zip(self._layouts, self.sizes):
            tokens = (size - offset) // dt.itemsize
            self.counts.append(max(0, (tokens - 1) // seq_len))
        self._index()
        self._maps: dict[int, np.memmap] = {}

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.directory)!r}, seq_len={self.seq_len}: "
            f"{len(self.files)} shards, {len(self)} sequences)"
        )

    def _map(self, shard: int) -> np.memmap:
        mm = self._maps.get(shard)
        if mm is None:
            offset, dt = self._layouts[shard]
            mm = np.memmap(self.files[shard], dtype=dt, mode="r", offset=offset)
            self._maps[shard] = mm
        return mm

    def __getitem__(self, index: int) -> torch.Tensor:
        shard, position = self.locate(int(index))
        first = position * self.seq_len
        tokens = np.asarray(self._map(shard)[first : first + self.seq_len + 1])
        if tokens.dtype.kind == "i" and tokens.size and int(tokens.min()) < 0:  # (lit-gpt's int32)
            raise self._bad_token(shard, first, tokens, tokens < 0, "is negative")
        if self.vocab_size is not None and tokens.size and int(tokens.max()) >= self.vocab_size:
            words = f"is not below the vocabulary size {self.vocab_size}: a corrupt shard"
            raise self._bad_token(shard, first, tokens, tokens >= self.vocab_size, words)
        return torch.from_numpy(tokens.astype(np.int64))

    def _bad_token(self, shard: int, first: int, tokens: np.ndarray, bad: np.ndarray, words: str) -> DataError:
        """The error naming the first of ``tokens`` (from token ``first`` of ``shard``) that is
        ``bad``, with its byte offset in the file."""
        at = int(np.argmax(bad))
        offset, dt = self._layouts[shard]
        return DataError(self.files[shard], offset + (first + at) * dt.itemsize, f"token id {int(tokens[at])} {words}")

    def __getstate__(self) -> dict[str, Any]:  # (a worker started by spawn maps its own)
        return {**self.__dict__, "_maps": {}}

    def _settings(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "block": self.block}
