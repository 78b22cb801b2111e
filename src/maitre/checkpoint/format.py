"""The on-disk format of a checkpoint, and the only code that reads or writes its bytes.

A complete checkpoint is a directory ``step-<9 digits>`` under the checkpoint root::

    step-000001200/
        manifest.json          the last file written: every other file's size and xxh3-64,
                               and a checksum of its own body
        state.json             the replicated state's JSON skeleton, where each tensor lives
        shard-00000.safetensors   tensors written by rank 0 (safetensors format)
        shard-00001.safetensors   ... by rank 1 (replicated tensors are split across ranks)
        rank-00000.json        per-rank state (random number generators)
        ...

In ``state.json`` each tensor is ``[dtype, shape, rank]``: the whole tensor, in that rank's
shard. A sharded tensor (a DTensor, saved by the processes of one replica, each its own piece)
is ``[dtype, global shape, [[rank, offsets, shape], ...]]``: its pieces, each a box of the whole
in that rank's shard, which together cover it exactly (checked before a commit and before a
load). A checkpoint that holds sharded tensors is format ``/2``, which older code refuses as
unknown; one that holds none is byte for byte the ``/1`` it always was.

It is written as ``.tmp-step-<9 digits>-<token>`` and renamed into place only after every file
and the manifest are fsynced, and renamed to ``.deleting-step-*`` before it is deleted, so a
directory named ``step-*`` is complete unless something changed it afterwards, which the
checksums catch. Tensors are stored in the safetensors format
(any safetensors reader opens a shard); everything else is JSON. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, cast

import torch
import xxhash

FORMAT = "maitre-checkpoint/1"
FORMAT_SHARDED = "maitre-checkpoint/2"
FORMATS = (FORMAT, FORMAT_SHARDED)
MANIFEST = "manifest.json"
STATE = "state.json"
STEP_DIR = re.compile(r"step-(\d{9})")
TMP_DIR = re.compile(r"\.tmp-step-(\d{9})-(\d+)")
TRASH_PREFIX = ".deleting-"
CORRUPT_PREFIX = ".corrupt-"
"""A step directory that did not verify, set aside when a save of that step replaces it."""
CORRUPT_DIR = re.compile(re.escape(CORRUPT_PREFIX) + r"step-(\d+)-\d+")
CHUNK = 16 << 20  # bytes per write() and hash update

# safetensors dtype names
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class CorruptCheckpoint(Exception):
    """A checkpoint directory that is incomplete, truncated, altered or not a checkpoint."""


class UnusableCheckpoint(Exception):
    """A checkpoint whose files verify but that cannot be loaded here: the pieces of a sharded
    tensor do not cover it, or it was sharded on mesh dimensions this process lacks. Not damage
    that an older checkpoint stands in for (it was never whole, or is another job's), so the
    job does not start on it, nor on an older one."""


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def tmp_dir_name(step: int, token: int) -> str:
    return f".tmp-step-{step:09d}-{token}"


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def dtype_of(code: str) -> torch.dtype:
    try:
        return _CODES[code]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tensor dtype {code!r}") from None


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"cannot checkpoint tensors of dtype {dtype}") from None


# -- durable writes ------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, parts: Iterable[memoryview | bytes]) -> tuple[int, str]:
    """Write ``parts`` to a new file, fsync it; returns (size, xxh3-64 hex)."""
    digest = xxhash.xxh3_64()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), CHUNK):
                chunk = view[start : start + CHUNK]
                digest.update(chunk)
                size += len(chunk)
                while chunk:  # os.write may write less than asked
                    chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def write_json(path: Path, obj: Any) -> tuple[int, str]:
    return write_file(path, [json.dumps(obj, separators=(",", ":")).encode()])


def read_verified(path: Path, size: int, checksum: str) -> bytearray:
    """The bytes of ``path``, checked against the manifest's size and xxh3-64."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path.name} is missing") from None
    if actual != size:
        raise CorruptCheckpoint(f"{path.name} has {actual} bytes, the manifest says {size}")
    data = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(data), 0
        while done < size:
            n = f.readinto(view[done : done + CHUNK])
            if not n:
                raise CorruptCheckpoint(f"{path.name} ended after {done} of {size} bytes")
            done += n
    if xxhash.xxh3_64_hexdigest(data) != checksum:
        raise CorruptCheckpoint(
            f"{path.name}: checksum mismatch (the file was altered or damaged after it was written)"
        )
    return data


# -- safetensors ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the data section
    nbytes: int


def layout(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[TensorEntry], int]:
    """Place tensors back to back, widest element first, so every tensor is aligned to its
    element size with no gaps (safetensors forbids holes). Returns (entries, data bytes)."""
    placed, offset = [], 0
    for key, dtype, shape in sorted(entries, key=lambda e: -_itemsize(e[1])):
        nbytes = _numel(shape) * _itemsize(dtype)
        placed.append(TensorEntry(key, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return placed, offset


def safetensors_header(entries: list[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, Any] = {
        e.key: {"dtype": dtype_code(e.dtype), "shape": list(e.shape), "data_offsets": [e.offset, e.offset + e.nbytes]}
        for e in entries
    }
    if metadata:
        header["__metadata__"] = metadata
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # data starts 8-byte aligned
    return len(body).to_bytes(8, "little") + body


def parse_safetensors(data: bytearray, name: str) -> dict[str, torch.Tensor]:
    """Tensors of a verified shard, as views of ``data`` (no copy)."""
    if len(data) < 8:
        raise CorruptCheckpoint(f"{name}: too short for a safetensors file")
    hlen = int.from_bytes(data[:8], "little")
    if hlen > len(data) - 8:
        raise CorruptCheckpoint(f"{name}: header length {hlen} beyond the file")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
    except ValueError as exc:
        raise CorruptCheckpoint(f"{name}: header is not JSON: {exc}") from None
    header.pop("__metadata__", None)
    start = 8 + hlen
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensors, end = {}, 0
    for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        try:
            dtype = _CODES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{name}: bad header entry for {key!r}") from None
        if (
            lo != end
            or hi - lo != _numel(shape) * _itemsize(dtype)
            or start + hi > len(data)
            or (start + lo) % _itemsize(dtype)
        ):
            raise CorruptCheckpoint(f"{name}: tensor {key!r} has inconsistent offsets")
        tensors[key] = raw[start + lo : start + hi].view(dtype).view(shape)
        end = hi
    if start + end != len(data):
        raise CorruptCheckpoint(f"{name}: {len(data) - start - end} bytes after the last tensor")
    return tensors


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# -- manifest ------------------------------------------------------------------------------------
def manifest_body(
    step: int, world_size: int, files: dict[str, dict[str, Any]], meta: dict[str, Any], *, sharded: bool = False
) -> dict[str, Any]:
    return {
        "format": FORMAT_SHARDED if sharded else FORMAT,
        "step": step,
        "world_size": world_size,
        "files": dict(sorted(files.items())),
        **meta,
    }


def write_manifest(path: Path, body: dict[str, Any]) -> None:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    write_json(path, {"body": body, "xxh3_64": xxhash.xxh3_64_hexdigest(canonical)})


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpoint("no manifest (the save did not finish)") from None
    try:
        doc = json.loads(raw)
        body, checksum = doc["body"], doc["xxh3_64"]
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint("the manifest is not valid JSON of the expected shape") from None
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if xxhash.xxh3_64_hexdigest(canonical) != checksum:
        raise CorruptCheckpoint("the manifest's checksum does not match its body")
    if body.get("format") not in FORMATS:
        raise CorruptCheckpoint(f"unknown format {body.get('format')!r} (expected {' or '.join(FORMATS)})")
    return cast(dict[str, Any], body)


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` once it and every file it lists check out (every byte is
    read); :class:`CorruptCheckpoint` otherwise."""
    body = read_manifest(directory)
    for name, info in body.get("files", {}).items():
        read_verified(directory / name, int(info.get("size", -1)), str(info.get("xxh3_64")))
    return body


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Directories named like complete checkpoints, newest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)
