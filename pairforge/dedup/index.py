"""The cross-build index: the survivors of earlier builds, which a build dedups against.

An index file holds INDEX_SCHEMA rows: each survivor's key, the build it came from
(``source``) and its hashes. ``dedup.index`` names the files of earlier builds
(:func:`index_files`); stage 2 reads them beside the raw shards (their rows always
survive: those builds shipped them) and writes the next index, those rows plus this
build's survivors (``dedup/index_writing.py``).
"""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairforge.dedup.decide import HASH_LIST, column_or_nulls
from pairforge.dedup.hashing import PIXEL_HASH

# An index file names the function of its pixel hashes (``pixel_hash_matches``).
PIXEL_HASH_KEY = b"pairforge.pixel_hash"
INDEX_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("source", pa.string()),
    pa.field("pixel_hash", pa.string()),
    pa.field("phash", pa.uint64()),
    pa.field("phash_mirror", pa.uint64()),
    pa.field("crop_phashes", HASH_LIST),
    pa.field("colour_grid", pa.binary()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
], metadata={PIXEL_HASH_KEY: PIXEL_HASH.encode()})


def index_rows(index: pa.Table) -> pa.Table:
    """An index table as ROWS_SCHEMA rows plus their source column."""
    return pa.table({
        "key": index["key"].cast(pa.string()),
        "exact": index["pixel_hash"].cast(pa.string()),
        "phash": index["phash"].cast(pa.uint64()),
        "phash_mirror": column_or_nulls(index, "phash_mirror", pa.uint64()),
        "crop_phashes": column_or_nulls(index, "crop_phashes", HASH_LIST),
        "colour_grid": column_or_nulls(index, "colour_grid", pa.binary()),
        "original_width": index["original_width"].cast(pa.int32()),
        "original_height": index["original_height"].cast(pa.int32()),
        "source": index["source"].cast(pa.string()),
    })


def pixel_hash_matches(schema: pa.Schema) -> bool:
    """Whether an index file's pixel hashes come from this version's function: files
    written before it was named hold sha256 ones, which no row of this build can equal
    (their rows still join on the perceptual hashes)."""
    return (schema.metadata or {}).get(PIXEL_HASH_KEY) == PIXEL_HASH.encode()


def as_index(table: pa.Table) -> pa.Table:
    """An index of any pairforge version in INDEX_SCHEMA (missing hash columns as nulls)."""
    return pa.table({f.name: column_or_nulls(table, f.name, f.type) for f in INDEX_SCHEMA},
                    schema=INDEX_SCHEMA)


def drop_repeated_rows(index: pa.Table) -> pa.Table:
    order = pc.sort_indices(index, sort_keys=[("source", "ascending"), ("key", "ascending")])
    ordered = index.take(order)
    if len(ordered) < 2:
        return ordered
    src, key = ordered["source"], ordered["key"]
    same = pc.and_(pc.equal(src.slice(1), src.slice(0, len(ordered) - 1)),
                   pc.equal(key.slice(1), key.slice(0, len(ordered) - 1)))
    keep = np.concatenate([[True], ~pc.fill_null(same, False).to_numpy(zero_copy_only=False)])
    return ordered.filter(pa.array(keep))


def _expand(fs: fsspec.AbstractFileSystem, pattern: str) -> list[str]:
    """URLs of the files a path or glob names (a folder: its parquet files), sorted so
    runs see them in one order."""
    paths = fs.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
    found = []
    for path in sorted(paths):
        if fs.isdir(path):
            found += sorted(p for p in fs.glob(posixpath.join(path, "*.parquet")))
        else:
            found.append(path)
    return [fs.unstrip_protocol(p) for p in found]


def index_files(patterns: list[str], storage_options: dict[str, Any]) -> list[str]:
    """The index files that ``patterns`` (``dedup.index``: paths, folders, globs) name."""
    files: list[str] = []
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
        found = _expand(fs, path)
        if not found or not all(fs.exists(f) for f in found):
            raise FileNotFoundError(f"dedup index not found: {pattern}")
        files += found
    return files
