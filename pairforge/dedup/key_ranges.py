"""The last phase of a partitioned dedup: its duplicates as one file sorted by key.

The deciding tasks write their rows by key range (:func:`key_range_of`, between
:func:`key_boundaries` the driver picks from sampled keys); each range is sorted by one
task (:func:`sort_range`), and one task writes the ranges in order as a single parquet
file (:func:`concat_sorted`), merging in an earlier run's file for an append. Stage 2 and
the semantic pass share them.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.dedup.decide import DUPLICATES_SCHEMA
from pairforge.dedup.shuffle import read_part, read_tables, write_table
from pairforge.dedup.work import Work
from pairforge.shards.storage import atomic_writer


def key_boundaries(samples: list[str], ranges: int) -> list[str]:
    """Keys that cut the sampled keys into ``ranges`` ranges of about equal size."""
    if ranges <= 1 or not samples:
        return []
    picks = {samples[len(samples) * i // ranges] for i in range(1, ranges)}
    return sorted(picks)


def key_range_of(keys: pa.ChunkedArray, boundaries: list[str]) -> np.ndarray:
    if not boundaries:
        return np.zeros(len(keys), np.int64)
    found = np.searchsorted(np.array(boundaries, dtype=object),
                            keys.to_numpy(zero_copy_only=False), side="right")
    return found.astype(np.int64)


def sort_range(work: Work, key_range: int, schema: pa.Schema = DUPLICATES_SCHEMA) -> int:
    """Phase 8a: one key range of the duplicates, sorted."""
    fs = work.fs()
    found = read_part(fs, work.files("duplicates", work.parts), key_range, schema)
    found = found.take(pc.sort_indices(found, sort_keys=[("key", "ascending")]))
    write_table(fs, work.file("sorted", key_range), found)
    return len(found)


def _earlier_groups(url: str, storage_options: dict[str, Any], schema: pa.Schema
                    ) -> Iterator[pa.Table]:
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    with fs.open(path, "rb") as handle:
        reader = pq.ParquetFile(handle)
        for group in range(reader.num_row_groups):
            yield reader.read_row_group(group).cast(schema)


def _last_key(tables: list[pa.Table]) -> str | None:
    for table in reversed(tables):
        if len(table):
            return table["key"][-1].as_py()
    return None


def merge_sorted(earlier: Iterator[pa.Table], new: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Two streams of tables sorted by key, as one: an earlier group at a time with the
    new rows that sort up to its last key (only those wait in memory)."""
    by_key = [("key", "ascending")]
    pending: list[pa.Table] = []
    for group in earlier:
        if not len(group):
            continue
        last = group["key"][-1]
        while (seen := _last_key(pending)) is None or seen <= last.as_py():
            more = next(new, None)
            if more is None:
                break
            pending.append(more)
        if not pending:
            yield group
            continue
        waiting = pa.concat_tables([group.schema.empty_table(), *pending])
        up_to = pc.less_equal(waiting["key"], last)
        pending = [waiting.filter(pc.invert(up_to))]
        both = pa.concat_tables([group, waiting.filter(up_to)])
        yield both.take(pc.sort_indices(both, sort_keys=by_key))
    yield from pending
    yield from new


def concat_sorted(work: Work, ranges: int, out_url: str,
                  schema: pa.Schema = DUPLICATES_SCHEMA, earlier: str | None = None) -> None:
    """Phase 8b: the sorted key ranges, in order, as one parquet file (a row group or more
    per range: one range in memory at a time). ``earlier``: an earlier run's sorted table
    merged in by key (an append), a row group at a time."""
    fs = work.fs()
    out_fs, out_path = fsspec.core.url_to_fs(out_url, **work.storage_options)
    out_fs.makedirs(posixpath.dirname(out_path), exist_ok=True)
    found = (read_tables(fs, [work.file("sorted", r)], schema) for r in range(ranges))
    if earlier is not None:
        found = merge_sorted(_earlier_groups(earlier, work.storage_options, schema), found)
    with atomic_writer(out_fs, out_path) as handle, \
            pq.ParquetWriter(handle, schema) as writer:
        for table in found:
            if len(table):
                writer.write_table(table)
