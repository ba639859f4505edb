"""Partitioned files: how stage 2's tasks hand rows to each other without the driver.

A producer task splits its table by a partition number per row and writes one parquet
file, one row group per non-empty partition (the partitions it holds are listed in the
file's metadata); the consumer of partition ``p`` reads row group ``p`` of every
producer's file. So a shuffle of ``M`` producers into ``P`` partitions is ``M`` files,
not ``M x P``. Files are written whole or not at all (``shards/storage.atomic_writer``)
under names that depend only on the producer, so a retried or rerun task rewrites the
same file with the same rows.

Partition numbers come from stable hashes (the same on every node, in every process,
unlike Python's ``hash``): :func:`mix64` for integers, :func:`string_hash` for strings.
"""

from __future__ import annotations

import json
import posixpath

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.shards.storage import atomic_writer

PARTS_KEY = b"pairforge.parts"

# string_hash works through this many rows at a time (8 bytes of scratch per character).
_HASH_CHUNK = 1 << 16


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a stable, well-spread 64-bit hash of each integer."""
    x = np.asarray(values).astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _string_chunk_hash(array: pa.Array) -> np.ndarray:
    array = array.cast(pa.large_string())
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[array.offset:array.offset
                                                         + len(array) + 1]
    data = (np.zeros(0, np.uint8) if data_buf is None
            else np.frombuffer(data_buf, dtype=np.uint8))
    lengths = np.diff(offsets)
    first, last = int(offsets[0]), int(offsets[-1])
    # each byte hashed with its place in its string; a string's hash is the sum (wrapping)
    within = np.arange(first, last, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    tokens = mix64((within.astype(np.uint64) << np.uint64(8))
                   | data[first:last].astype(np.uint64))
    sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(tokens, dtype=np.uint64)])
    rel = offsets - first
    return mix64((sums[rel[1:]] - sums[rel[:-1]]) ^ lengths.astype(np.uint64))


def string_hash(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A stable 64-bit hash of each string (nulls hash as the empty string)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    array = array.fill_null("") if array.null_count else array
    parts = [_string_chunk_hash(array.slice(i, _HASH_CHUNK))
             for i in range(0, len(array), _HASH_CHUNK)]
    return np.concatenate([np.zeros(0, np.uint64), *parts])


def part_of(hashes: np.ndarray, parts: int) -> np.ndarray:
    """Partition number of each hash, 0..parts-1."""
    return (hashes % np.uint64(parts)).astype(np.int64)


def write_parts(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table,
                part: np.ndarray) -> None:
    """Write ``table`` to ``path`` with the rows of each partition in one row group."""
    order = np.argsort(part, kind="stable")
    ordered = table.take(order) if len(table) else table
    sorted_parts = part[order]
    present, starts = np.unique(sorted_parts, return_index=True)
    ends = np.append(starts[1:], len(sorted_parts))[:len(starts)].astype(np.int64)
    metadata = {**(table.schema.metadata or {}),
                PARTS_KEY: json.dumps([int(p) for p in present]).encode()}
    schema = table.schema.with_metadata(metadata)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with atomic_writer(fs, path) as handle, pq.ParquetWriter(handle, schema) as writer:
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            chunk = ordered.slice(start, end - start)
            writer.write_table(chunk, row_group_size=max(1, len(chunk)))


def read_part(fs: fsspec.AbstractFileSystem, paths: list[str], part: int | list[int],
              schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """The rows of partition ``part`` (or of each of several) in every file of ``paths``,
    file by file in that order."""
    wanted = [part] if isinstance(part, int) else part
    tables = [schema.empty_table() if columns is None
              else schema.empty_table().select(columns)]
    for path in paths:
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            present = json.loads(parquet.schema_arrow.metadata[PARTS_KEY])
            groups = [present.index(p) for p in wanted if p in present]
            if groups:
                found = parquet.read_row_groups(groups, columns=columns)
                tables.append(found.replace_schema_metadata(None))
    return pa.concat_tables(tables).combine_chunks()


def write_table(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table) -> None:
    """One unpartitioned table, written whole or not at all."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with atomic_writer(fs, path) as handle:
        pq.write_table(table, handle)


def read_tables(fs: fsspec.AbstractFileSystem, paths: list[str], schema: pa.Schema
                ) -> pa.Table:
    tables = [schema.empty_table()]
    for path in paths:
        with fs.open(path, "rb") as handle:
            tables.append(pq.read_table(handle).replace_schema_metadata(None).cast(schema))
    return pa.concat_tables(tables).combine_chunks()
