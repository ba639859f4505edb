"""Stage 2's files under ``OUT/dedup`` and its stats file, the completion marker.

* ``duplicates.parquet``: key, kind, cluster_id, kept_key, kept_source, distance;
* ``index.parquet/`` (``dedup.write_index``): the next cross-build index, in parts
  (``dedup/index_writing.py``);
* ``covered.parquet``: the raw shards the run covered (``dedup/append.py``);
* ``dedup_stats.json``: written last, so its presence marks the stage complete.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.dedup.decide import DUPLICATES_SCHEMA, HASH_KINDS
from pairforge.shards.storage import atomic_writer

DUPLICATES_FILE = "duplicates.parquet"
STATS_FILE = "dedup_stats.json"


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """A reader never sees a half-written file: rename on disk, whole upload on S3."""
    with atomic_writer(fs, path) as handle:
        handle.write(data)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def default_source(out_dir: str) -> str:
    """Label of this build in the index: its output root (the parent of dedup/)."""
    parent = posixpath.dirname(out_dir.rstrip("/"))
    return parent or out_dir


def load_stats(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    with fs.open(path, "r") as handle:
        return json.load(handle)


def write_disabled(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any]:
    """A disabled stage's outputs: no duplicates, and stats that say so."""
    write_atomic(fs, posixpath.join(root, DUPLICATES_FILE),
                 _parquet_bytes(DUPLICATES_SCHEMA.empty_table()))
    stats = {"stage": "dedup", "enabled": False}
    write_atomic(fs, posixpath.join(root, STATS_FILE), json.dumps(stats).encode())
    return stats


def _counts(decided: dict[str, Any], read: dict[str, Any], max_distance: int
            ) -> dict[str, Any]:
    """The counts of ``reference.find_duplicates``'s stats, from the tasks' counts."""
    ok_rows = read["ok_rows"]
    return {
        "ok_rows": ok_rows,
        "index_rows": read["index_rows"],
        "duplicates": decided["duplicates"],
        **{kind.value: decided[kind.value] for kind in HASH_KINDS},
        "dropped_for_index": decided["dropped_for_index"],
        "clusters": decided["clusters"],
        "colour_splits": decided["colour_splits"],
        "kept": ok_rows - decided["duplicates"],
        "degenerate_hashes": read["degenerate_whole"] + decided["dense_whole"],
        "missing_phash": read["missing_phash"],
        "distinct_phashes": decided["distinct_phashes"],
        "dense_phashes": decided["dense_phashes"],
        "near_pairs": decided["near_pairs"],
        "max_distance": max_distance,
        "band_plan": decided["band_plan"],
    }


def stage_stats(read: dict[str, Any], decided: dict[str, Any], *, raw_files: int,
                index_files: int, max_distance: int, index_written: bool) -> dict[str, Any]:
    """The stats file's counts: what the reading tasks (``read``) and the deciding waves
    (``decided``) returned, added up."""
    status: Counter[str] = read["status"]
    return {
        "stage": "dedup",
        "enabled": True,
        "raw_files": raw_files,
        "index_files": index_files,
        "rows_in": sum(status.values()),
        "status_counts": dict(sorted(status.items())),
        **_counts(decided, read, max_distance),
        "index_rows_without_pixel_hash": read["unhashed_index_rows"],
        "index_written": index_written,
    }
