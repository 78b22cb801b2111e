"""Data for the elastic loop: an input pipeline on torch's DataLoader that stays exactly once
through resizes, failures and resumes (:class:`Loader`), and the sources it reads
(:class:`TokenShards`, :class:`ParquetShards`, any map-style dataset). The folders beside this
module hold the data shipped with maitre (a text corpus, cluster traces): package data, not
code."""

from maitre.data.loader import Loader
from maitre.data.parquet import ParquetShards
from maitre.data.shards import DataError, Shards, TokenShards

__all__ = ["DataError", "Loader", "ParquetShards", "Shards", "TokenShards"]
