"""Parquet shards: a directory of Parquet files, one sample per row, read a row group at a time.

Sample ``i`` is a row: a dict of its columns' values (``columns`` chooses them), or what
``transform`` makes of that dict in the data worker (tokenize a ``text`` column, decode an
image's bytes). Rows are numbered through the files in name order; the order of a data epoch is
the one of :class:`~maitre.data.shards.Shards`: blocks of ``block`` consecutive rows of one
file, shuffled from ``(seed, data_epoch)`` alone, so a worker reads a row group once for the
rows of its block that fall in it and reads stay sequential, whatever the world size or the
number of workers. A worker keeps the last row group it read (``cache_groups`` of them).

A file that is not Parquet (a bad footer, a truncated copy) raises
:class:`~maitre.data.DataError` naming it and the footer's byte offset when the source is
built; a row group that does not decode, naming the group's first byte, when a sample in it is
read (from a data worker too). The files' names and sizes are the source's description: a resume
onto a directory that changed is refused with what changed. Needs ``pyarrow`` (``pip install
'maitre[data]'``).
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from typing import Any, Callable

from maitre.data.shards import DataError, Shards, shard_files


class ParquetShards(Shards):
    """The rows of the Parquet files in ``directory``.

    Args:
        directory: the shards' folder; its files matching ``pattern``, in name order.
        columns: the columns each sample holds (None: all).
        transform: called in the data worker with a row's dict; its result is the sample.
        block: consecutive rows kept together by the shuffle.
        cache_groups: decoded row groups a worker keeps.
    """

    kind = "parquet_shards"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        columns: list[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        pattern: str = "*.parquet",
        block: int = 64,
        cache_groups: int = 2,
    ) -> None:
        import pyarrow.parquet as pq

        if block < 1:
            raise ValueError(f"block must be at least 1, got {block}")
        if cache_groups < 1:
            raise ValueError(f"cache_groups must be at least 1, got {cache_groups}")
        self.directory, self.files = shard_files(directory, pattern)
        self.columns, self.transform, self.block = columns, transform, block
        self.cache_groups = cache_groups
        self.sizes = [p.stat().st_size for p in self.files]
        self.counts: list[int] = []
        self._groups: list[list[int]] = []
        """Per file: the first row of each row group, and its row count last."""
        self._offsets: list[list[int]] = []
        """Per file: each row group's first byte."""
        for path, size in zip(self.files, self.sizes):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as exc:  # pyarrow's ArrowInvalid, OSError...: the footer
                raise DataError(path, max(0, size - 8), f"not a Parquet file: {exc}") from None
            if columns is not None:
                missing = sorted(set(columns) - set(meta.schema.names))
                if missing:
                    raise DataError(
                        path,
                        max(0, size - 8),
                        f"no column(s) {', '.join(missing)} (it has {', '.join(meta.schema.names)})",
                    )
            firsts, offsets, rows = [], [], 0
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                firsts.append(rows)
                col = group.column(0) if group.num_columns else None
                offsets.append(
                    0
                    if col is None
                    else min(x for x in (col.dictionary_page_offset, col.data_page_offset) if x is not None)
                )
                rows += group.num_rows
            self._groups.append([*firsts, rows])
            self._offsets.append(offsets)
            self.counts.append(rows)
        self._index()
        self._open: dict[int, Any] = {}
        self._cache: OrderedDict[tuple[int, int], list[dict[str, Any]]] = OrderedDict()

    def __repr__(self) -> str:
        return f"ParquetShards({str(self.directory)!r}: {len(self.files)} files, {len(self)} rows)"

    def _settings(self) -> dict[str, Any]:
        return {"columns": self.columns, "block": self.block}

    def _rows(self, shard: int, group: int) -> list[dict[str, Any]]:
        key = (shard, group)
        rows = self._cache.get(key)
        if rows is not None:
            self._cache.move_to_end(key)
            return rows
        import pyarrow.parquet as pq

        try:
            f = self._open.get(shard)
            if f is None:
                f = self._open[shard] = pq.ParquetFile(self.files[shard])
            rows = f.read_row_group(group, columns=self.columns).to_pylist()
        except Exception as exc:  # a page that does not decode, a file cut short since
            raise DataError(
                self.files[shard], self._offsets[shard][group], f"row group {group} does not decode: {exc}"
            ) from None
        self._cache[key] = rows
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return rows

    def __getitem__(self, index: int) -> Any:
        shard, row = self.locate(int(index))
        firsts = self._groups[shard]
        group = bisect.bisect_right(firsts, row) - 1
        record = self._rows(shard, group)[row - firsts[group]]
        return record if self.transform is None else self.transform(record)

    def __getstate__(self) -> dict[str, Any]:  # (each data worker opens its own files)
        return {**self.__dict__, "_open": {}, "_cache": OrderedDict()}
