"""Stage 2 on Ray: read the hash columns of the raw shards, decide duplicates, write them.

Only ``records.HASH_COLUMNS`` are read (never the images), one Ray task per parquet file.
The band join runs as one Ray task per band combination (their results are disjoint);
components and survivors are decided on the driver, whose memory grows with the number
of hashes only. Outputs, under ``out_dir``:

* ``duplicates.parquet``  key, kind, cluster_id, kept_key, kept_source, distance
* ``index.parquet``       (``dedup.write_index``) earlier index rows + this build's survivors
* ``dedup_stats.json``    written last: its presence marks the stage complete
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import DedupConfig, PairforgeConfig, RayConfig
from pairforge.filters.dedup import (
    DUPLICATES_SCHEMA,
    INDEX_SCHEMA,
    ROWS_SCHEMA,
    BandPlan,
    NearPairs,
    as_index,
    combo_pairs,
    find_duplicates,
    next_index,
    pixel_hash_matches,
    prepare_rows,
)
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.records import HASH_COLUMNS
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir, atomic_writer

DUPLICATES_FILE = "duplicates.parquet"
STATS_FILE = "dedup_stats.json"
INDEX_FILE = "index.parquet"

# A band-combination task is pure numpy on one core; reading a parquet is mostly I/O.
# Neither waits on other tasks, so these cannot deadlock even a 1-CPU Ray instance.
_JOIN_CPUS = 1
_READ_CPUS = 0.5


def read_hash_columns(url: str, storage_options: dict[str, Any]
                      ) -> tuple[pa.Table, dict[str, int]]:
    """The ok rows of one raw shard parquet (ROWS_SCHEMA) and its rows per status."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    with fs.open(path, "rb") as handle:
        table = pq.read_table(handle, columns=_present(_schema(handle), HASH_COLUMNS))
    counts = {row["values"]: row["counts"] for row in
              pc.value_counts(table["status"]).to_pylist()}
    return prepare_rows(table), counts


def read_index(url: str, storage_options: dict[str, Any]) -> pa.Table:
    """One dedup index file of an earlier build (INDEX_SCHEMA); pixel hashes made by
    another function are left out (null), so they neither match nor pass into the index
    this build writes."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    with fs.open(path, "rb") as handle:
        schema = _schema(handle)
        columns = _present(schema, INDEX_SCHEMA.names)
        if not pixel_hash_matches(schema):
            columns = [c for c in columns if c != "pixel_hash"]
        table = pq.read_table(handle, columns=columns)
    return as_index(table)


def _schema(handle: Any) -> pa.Schema:
    """A parquet file's schema, the handle left at the start for reading the table."""
    schema = pq.read_schema(handle)
    handle.seek(0)
    return schema


def _present(schema: pa.Schema, wanted: list[str]) -> list[str]:
    """The wanted columns a parquet file has: files of older versions lack the mirror and
    region hashes (their rows then join on the whole-image hash only)."""
    return [c for c in wanted if c in schema.names]


def _expand(fs: fsspec.AbstractFileSystem, pattern: str) -> list[str]:
    """URLs of the files a path or glob names, sorted so runs see them in one order."""
    paths = fs.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
    return sorted(fs.unstrip_protocol(p) for p in paths)


def _raw_files(raw_dir: str, storage_options: dict[str, Any]) -> list[str]:
    fs, root = fsspec.core.url_to_fs(raw_dir, **storage_options)
    fs.invalidate_cache()  # object stores: the shards were written by other processes
    files = _expand(fs, posixpath.join(root, "*.parquet"))
    if not files:
        raise FileNotFoundError(f"no raw shard parquet files in {raw_dir}")
    return files


def _index_files(patterns: list[str], storage_options: dict[str, Any]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
        found = _expand(fs, path)
        if not found or not all(fs.exists(f) for f in found):
            raise FileNotFoundError(f"dedup index not found: {pattern}")
        files += found
    return files


def _ray_get(refs: list[Any]) -> list[Any]:
    import ray

    return ray.get(refs)


def _read_all(files: list[str], indexes: list[str], storage_options: dict[str, Any],
              retries: int) -> tuple[pa.Table, Counter[str], pa.Table | None]:
    import ray

    read = ray.remote(num_cpus=_READ_CPUS, max_retries=retries)(read_hash_columns)
    read_idx = ray.remote(num_cpus=_READ_CPUS, max_retries=retries)(read_index)
    shard_refs = [read.remote(f, storage_options) for f in files]
    index_refs = [read_idx.remote(f, storage_options) for f in indexes]
    shards, index_parts = _ray_get(shard_refs), _ray_get(index_refs)
    status: Counter[str] = Counter()
    for _, counts in shards:
        status.update(counts)
    rows = pa.concat_tables([ROWS_SCHEMA.empty_table(), *(t for t, _ in shards)])
    index = pa.concat_tables(index_parts).combine_chunks() if index_parts else None
    return rows.combine_chunks(), status, index


def ray_mapper(retries: int) -> Callable[[np.ndarray, BandPlan], list[NearPairs]]:
    """Run each band combination as a Ray task over one shared copy of the hashes."""

    def run(hashes: np.ndarray, plan: BandPlan) -> list[NearPairs]:
        import ray

        task = ray.remote(num_cpus=_JOIN_CPUS, max_retries=retries)(combo_pairs)
        shared = ray.put(hashes)
        return _ray_get([task.remote(shared, plan, combo) for combo in plan.combos])

    return run


def _write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """A reader never sees a half-written file: rename on disk, whole upload on S3."""
    with atomic_writer(fs, path) as handle:
        handle.write(data)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _default_source(out_dir: str) -> str:
    """Label of this build in the index: its output root (the parent of dedup/)."""
    parent = posixpath.dirname(out_dir.rstrip("/"))
    return parent or out_dir


def _load_stats(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    with fs.open(path, "r") as handle:
        return json.load(handle)


def _disabled(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any]:
    _write_atomic(fs, posixpath.join(root, DUPLICATES_FILE),
                  _parquet_bytes(DUPLICATES_SCHEMA.empty_table()))
    stats = {"stage": "dedup", "enabled": False}
    _write_atomic(fs, posixpath.join(root, STATS_FILE), json.dumps(stats).encode())
    return stats


def inputs_digest(files: list[str], indexes: list[str], cfg: DedupConfig,
                  storage_options: dict[str, Any]) -> str:
    """What a finished dedup was computed from: its config and the raw/index files (name
    and size), so new or rewritten raw shards or another config make it stale."""
    def described(paths: list[str]) -> list[tuple[str, int]]:
        out = []
        for path in paths:
            fs, stripped = fsspec.core.url_to_fs(path, **storage_options)
            out.append((posixpath.basename(stripped), int(fs.info(stripped)["size"])))
        return out

    # semantic dedup is stage 3's pass: its settings do not make this stage stale
    config = cfg.model_dump(mode="json", exclude={"semantic"})
    blob = json.dumps({"config": config, "raw": described(files),
                       "index": described(indexes)}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_dedup(raw_dir: str, out_dir: str, cfg: DedupConfig, ray_cfg: RayConfig,
              storage_options: dict | None = None, *, source: str | None = None,
              force: bool = False, say: Callable[[str], None] = lambda _: None) -> dict:
    """Stage 2: write ``out_dir/duplicates.parquet`` (+ index) and return the stats.

    A finished run (its stats file exists) is reused when it was computed from the same
    config and raw/index files; otherwise, or with ``force``, it is redone. ``source``
    labels this build's rows in the index it writes (default: the parent of out_dir).
    ``say`` gets a line as each phase starts (read, join, write).
    """
    opts = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(out_dir, **opts)
    fs.invalidate_cache()
    stats_path = posixpath.join(root, STATS_FILE)
    finished = None if force or not fs.exists(stats_path) else _load_stats(fs, stats_path)
    fs.makedirs(root, exist_ok=True)
    if not cfg.enabled:
        return finished if finished and not finished["enabled"] else _disabled(fs, root)
    files = _raw_files(raw_dir, opts)
    indexes = _index_files(cfg.index, opts)
    digest = inputs_digest(files, indexes, cfg, opts)
    if finished and finished.get("inputs_digest") == digest:
        say("dedup: the finished run matches the raw shards, index files and config: reused")
        return finished
    started = time.perf_counter()
    say(f"dedup: reading the hashes of {len(files)} raw shards and {len(indexes)} index "
        "files; starting Ray…")
    init_ray(ray_cfg)
    rows, status, index = _read_all(files, indexes, opts, ray_cfg.max_task_retries)
    read_s = time.perf_counter() - started
    unhashed = index["pixel_hash"].null_count if index is not None else 0
    if unhashed:
        say(f"dedup: {unhashed:,} index rows have no pixel hash of this version (an index "
            "written before it): they match on perceptual hashes only")
    say(f"dedup: joining {rows.num_rows:,} rows' hashes (exact, then near within "
        f"{cfg.max_distance} bits, as banded Ray tasks; read in {read_s:.1f} s)…")
    result = find_duplicates(rows, cfg.max_distance, index,
                             ray_mapper(ray_cfg.max_task_retries))
    decide_s = time.perf_counter() - started - read_s
    say(f"dedup: {result.duplicates.num_rows:,} duplicates found in {decide_s:.1f} s; "
        "writing duplicates" + (" and index" if cfg.write_index else ""))
    _write_atomic(fs, posixpath.join(root, DUPLICATES_FILE),
                  _parquet_bytes(result.duplicates))
    if cfg.write_index:
        new_index = next_index(rows, result.duplicates, source or _default_source(out_dir),
                               index)
        _write_atomic(fs, posixpath.join(root, INDEX_FILE), _parquet_bytes(new_index))
    stats = {
        "stage": "dedup",
        "enabled": True,
        "raw_files": len(files),
        "index_files": len(indexes),
        "rows_in": sum(status.values()),
        "status_counts": dict(sorted(status.items())),
        **result.stats,
        "index_rows_without_pixel_hash": unhashed,
        "index_written": cfg.write_index,
        "inputs_digest": digest,
        "seconds": {"read": round(read_s, 3), "decide": round(decide_s, 3),
                    "total": round(time.perf_counter() - started, 3)},
    }
    # Written last: the stats file is the completion marker.
    _write_atomic(fs, stats_path, json.dumps(stats, indent=2).encode())
    return stats


def run_dedup_stage(cfg: PairforgeConfig, run: RunOptions) -> dict[str, Any]:
    """Stage 2 over the complete raw shards (only their hash columns are read); ``run.force``
    redoes a finished dedup even when it matches its inputs. Its rerun check is its inputs'
    digest, not ``settings.check_settings``."""
    # the driver's alone: the Ray workers that import this module for its tasks skip them
    from pairforge.pipeline import progress
    from pairforge.pipeline.runlog import run_log

    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    with run_log(cfg, "dedup") as log:
        stats = run_dedup(out.uri(RAW_FOLDER), out.uri(DEDUP_FOLDER), cfg.dedup, cfg.ray,
                          cfg.output.storage_options, force=run.force,
                          say=progress.say if run.show_progress else progress.LOG.info)
        progress.LOG.info("dedup: %s", {k: v for k, v in stats.items() if not isinstance(v, dict)})
    return {**stats, "log": log}
