"""Stage 2 on Ray: the duplicate decisions of ``filters/dedup.py`` as partition tasks.

Only ``records.HASH_COLUMNS`` are read (never the images). The phases are the functions
of ``filters/dedup_parts.py``, each a wave of Ray tasks that read and write partitioned
files under ``out_dir/work/`` (removed when the stage is done, wiped when a run starts);
the driver only plans the partitions and adds up the counts the tasks return, so its
memory does not grow with the number of rows. A task lost with its worker or node is
retried by Ray and writes the same files again; a rerun starts the work over and writes
the same output. An append (raw shards added after those a finished run covered, all
else the same) reads only the new shards, against the finished run's own index, and
adds to its outputs (``run_dedup``). Outputs, under ``out_dir``:

* ``duplicates.parquet``  key, kind, cluster_id, kept_key, kept_source, distance
* ``index.parquet/``      (``dedup.write_index``) earlier index rows + this build's
  survivors, as parts ``part-PREFIX.parquet`` by a hash prefix of each row's source
  and key
* ``dedup_stats.json``    written last: its presence marks the stage complete
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import DedupConfig, PairforgeConfig, RayConfig
from pairforge.dedup import partitions as parts
from pairforge.dedup.append import (
    INDEX_FILE,
    added_to,
    covered_table,
    plan_append,
    write_covered,
)
from pairforge.dedup.decide import DUPLICATES_SCHEMA, HASH_BITS, HASH_KINDS, plan_bands
from pairforge.dedup.grids import GridCheck
from pairforge.dedup.partitions import InputFile, Work
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.waves import READ_CPUS, Waves, cluster_cpus, components
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir, atomic_writer

DUPLICATES_FILE = "duplicates.parquet"
STATS_FILE = "dedup_stats.json"
WORK_FOLDER = "work"

# Partition sizes. Each partition task holds about this many rows (or 6x as many hash
# values: whole, mirror and four regions per row); small runs still get a few partitions
# per CPU so that both cores work.
ROWS_PER_PART = 1_000_000
ROWS_PER_SCATTER = 1_000_000  # rows a reading task takes from consecutive input files
VALUES_PER_BAND_TASK = 4_000_000
INDEX_ROWS_PER_PART = 1_000_000



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


def _raw_files(raw_dir: str, storage_options: dict[str, Any]) -> list[str]:
    fs, root = fsspec.core.url_to_fs(raw_dir, **storage_options)
    fs.invalidate_cache()  # object stores: the shards were written by other processes
    files = sorted(fs.unstrip_protocol(p) for p in fs.glob(posixpath.join(root, "*.parquet")))
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


def partition_count(rows: int, cpus: int) -> int:
    """Partitions for ``rows`` rows: ROWS_PER_PART each, or two per CPU while every
    partition keeps a tenth of that."""
    return max(1, math.ceil(rows / ROWS_PER_PART),
               min(2 * cpus, math.ceil(rows / max(1, ROWS_PER_PART // 10))))


def _units(inputs: list[InputFile], counts: list[int]) -> list[list[InputFile]]:
    """Consecutive inputs grouped into reading tasks of about ROWS_PER_SCATTER rows."""
    units: list[list[InputFile]] = [[]]
    rows = 0
    for file, count in zip(inputs, counts, strict=True):
        if units[-1] and rows + count > ROWS_PER_SCATTER:
            units.append([])
            rows = 0
        units[-1].append(file)
        rows += count
    return units


def _count_rows(tasks: Waves, urls: list[str], opts: dict[str, Any]) -> list[int]:
    batch = 256
    calls = [(urls[i:i + batch], opts) for i in range(0, len(urls), batch)]
    return [n for counts in tasks.run(parts.count_rows, calls, READ_CPUS) for n in counts]


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


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _described(paths: list[str], storage_options: dict[str, Any]) -> list[tuple[str, int]]:
    out = []
    for path in paths:
        fs, stripped = fsspec.core.url_to_fs(path, **storage_options)
        out.append((posixpath.basename(stripped), int(fs.info(stripped)["size"])))
    return out


@dataclass(frozen=True)
class Inputs:
    """What a dedup is computed from: its config and the raw/index files (name and size),
    so new or rewritten raw shards or another config make a finished run stale."""

    files: list[str]
    indexes: list[str]
    raw: list[tuple[str, int]]
    index: list[tuple[str, int]]
    config: dict[str, Any]

    @classmethod
    def describe(cls, files: list[str], indexes: list[str], cfg: DedupConfig,
                 storage_options: dict[str, Any]) -> Inputs:
        # semantic dedup is stage 3's pass: its settings do not make this stage stale
        return cls(files, indexes, _described(files, storage_options),
                   _described(indexes, storage_options),
                   cfg.model_dump(mode="json", exclude={"semantic"}))

    def digest(self) -> str:
        return _digest({"config": self.config, "raw": self.raw, "index": self.index})

    def settings_digest(self) -> str:
        """The config and index files alone: recorded in the stats (covered.parquet has
        each raw shard) so that a later run can tell an append from any other change."""
        return _digest({"config": self.config, "index": self.index})


def inputs_digest(files: list[str], indexes: list[str], cfg: DedupConfig,
                  storage_options: dict[str, Any]) -> str:
    return Inputs.describe(files, indexes, cfg, storage_options).digest()


def _read_phase(tasks: Waves, work: Work, units: list[list[InputFile]]
                ) -> dict[str, Any]:
    """Phase 1: every input read once, by its unit's task; the counts added up."""
    found = tasks.run(parts.scatter, [(work, i, unit) for i, unit in enumerate(units)],
                      READ_CPUS, name="read_hash_columns")
    status: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    samples: list[str] = []
    described: dict[int, dict[str, Any]] = {}
    for result in found:
        status.update(result.pop("status"))
        samples += result.pop("key_sample")
        described.update(result.pop("files"))
        totals.update(result)
    return {"status": status, "samples": sorted(samples), "files": described, **totals}


def key_boundaries(samples: list[str], ranges: int) -> list[str]:
    """Keys that cut the sampled keys into ``ranges`` ranges of about equal size."""
    if ranges <= 1 or not samples:
        return []
    picks = {samples[len(samples) * i // ranges] for i in range(1, ranges)}
    return sorted(picks)


def _near_join(tasks: Waves, work: Work, n_values: int) -> tuple[int, str]:
    """Phase 4: the band join (or all pairs, for few values); returns its producers."""
    plan = plan_bands(n_values, HASH_BITS, work.max_distance)
    if plan is None:
        tasks.run(parts.brute_join, [(work, work.parts)])
        return 1, "all pairs"
    band_parts = max(1, math.ceil(n_values / VALUES_PER_BAND_TASK))
    tasks.run(parts.band_scatter, [(work, p, plan, band_parts) for p in range(work.parts)])
    leads = parts.lead_bands(plan)
    tasks.run(parts.band_join, [(work, lead, q, band_parts, plan, work.parts)
                                for lead in leads for q in range(band_parts)])
    return len(leads) * band_parts, plan.describe()


def _decide(tasks: Waves, work: Work, units: int, samples: list[str], out_url: str,
            earlier: str | None = None) -> dict[str, int]:
    """Phases 2-8: links, components, decisions; writes duplicates.parquet."""
    P = work.parts  # noqa: N806 - the partition count, as in the docs
    checked = tasks.run(parts.exact_groups, [(work, p, units) for p in range(P)])
    repeated = sorted(k for r in checked for k in r["repeated"])
    if repeated:
        raise ValueError(f"duplicate keys among ok rows (stage 1 broke its contract): "
                         f"{repeated[:5]}")
    n_values = sum(tasks.run(parts.unique_values, [(work, p, units) for p in range(P)]))
    pair_producers, band_plan = 0, "all pairs"
    if work.max_distance > 0 and n_values >= 2:
        pair_producers, band_plan = _near_join(tasks, work, n_values)
    linked = tasks.run(parts.value_links, [(work, p, pair_producers) for p in range(P)])
    near_pairs = 0
    if pair_producers:
        near_pairs = sum(tasks.run(parts.near_links,
                                   [(work, p, pair_producers) for p in range(P)]))
    sources = [("edges-exact", P), ("edges-values", P)]
    if pair_producers:
        sources.append(("edges-near", P))
    labels, _ = components(tasks, work, sources)
    tasks.run(parts.label_members, [(work, p, labels, units) for p in range(P)])
    boundaries = key_boundaries(samples, P)
    decided = tasks.run(parts.decide, [(work, p, boundaries) for p in range(P)])
    ranges = len(boundaries) + 1
    tasks.run(parts.sort_range, [(work, r) for r in range(ranges)])
    tasks.run(parts.concat_sorted, [(work, ranges, out_url, DUPLICATES_SCHEMA, earlier)])
    totals: Counter[str] = Counter()
    for result in decided:
        totals.update(result)
    return {**totals, "distinct_phashes": n_values,
            "dense_phashes": sum(r["dense"] for r in linked),
            "dense_whole": sum(r["dense_whole"] for r in linked),
            "near_pairs": near_pairs, "band_plan": band_plan}


def _write_index(tasks: Waves, work: Work, units: int, rows: int, source: str,
                 fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Phase 9: the next index, written into the work folder, then put in place."""
    bits = parts.index_prefix_bits(rows, INDEX_ROWS_PER_PART)
    tasks.run(parts.index_rows_out, [(work, p, units, source, bits)
                                     for p in range(work.parts)])
    names = [parts.index_part_name(i, bits) for i in range(1 << bits)]
    out = posixpath.join(root, WORK_FOLDER, "index-out")
    tasks.run(parts.index_part, [(work, i, bits, fs.unstrip_protocol(
        posixpath.join(out, name))) for i, name in enumerate(names)])
    final = posixpath.join(root, INDEX_FILE)
    if fs.exists(final):
        fs.rm(final, recursive=True)
    fs.makedirs(final, exist_ok=True)
    for name in names:
        fs.mv(posixpath.join(out, name), posixpath.join(final, name))


def _stats(decided: dict[str, Any], read: dict[str, Any], max_distance: int
           ) -> dict[str, Any]:
    """The counts of ``find_duplicates``'s stats, from the tasks' counts."""
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


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    fs.invalidate_cache()
    if fs.exists(path):
        fs.rm(path, recursive=True)


def run_dedup(raw_dir: str, out_dir: str, cfg: DedupConfig, ray_cfg: RayConfig,
              storage_options: dict | None = None, *, source: str | None = None,
              force: bool = False, say: Callable[[str], None] = lambda _: None) -> dict:
    """Stage 2: write ``out_dir/duplicates.parquet`` (+ index) and return the stats.

    A finished run (its stats file exists) is reused when it was computed from the same
    config and raw/index files. When the only changes are raw shards added after the last
    and raw shards rewritten by ``--retry-failed`` (an append, ``dedup_append.py``), only
    their new rows are read, against the finished run's own index: its rows win, as rows
    already shipped, and its decisions stay as they are. Otherwise, or with ``force``, it
    is redone. ``source`` labels this build's rows in the index it writes
    (default: the parent of out_dir). ``say`` gets a line as each phase starts.
    """
    opts = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(out_dir, **opts)
    fs.invalidate_cache()
    stats_path = posixpath.join(root, STATS_FILE)
    finished = None if force or not fs.exists(stats_path) else _load_stats(fs, stats_path)
    fs.makedirs(root, exist_ok=True)
    if not cfg.enabled:
        return finished if finished and not finished["enabled"] else _disabled(fs, root)
    inputs = Inputs.describe(_raw_files(raw_dir, opts), _index_files(cfg.index, opts), cfg,
                             opts)
    digest = inputs.digest()
    if finished and finished.get("inputs_digest") == digest:
        say("dedup: the finished run matches the raw shards, index files and config: reused")
        return finished
    source = source or _default_source(out_dir)
    append = None if force else plan_append(finished, inputs.raw, inputs.files,
                                            inputs.settings_digest(), fs, root, opts)
    read = list(range(len(inputs.files)))  # the raw shards read, as positions
    indexes = inputs.indexes
    if append:
        read = append.positions(len(inputs.files))
        indexes = _index_files([fs.unstrip_protocol(posixpath.join(root, INDEX_FILE))], opts)
        say(f"dedup: {len(inputs.files) - append.covered} raw shards added after the "
            f"{append.covered} this dedup covered, {len(append.rewritten)} rewritten by "
            "--retry-failed: only their new rows are read, against its index")
    files = [inputs.files[p] for p in read]
    if not append and fs.exists(stats_path):  # a full run replaces every file: no marker
        fs.rm(stats_path)                      # may vouch for them while it does
    started = time.perf_counter()
    say(f"dedup: reading the hashes of {len(files)} raw shards and {len(indexes)} index "
        "files; starting Ray…")
    init_ray(ray_cfg)
    tasks = Waves(ray_cfg.max_task_retries)
    rewritten = set(append.rewritten) if append else set()
    work_inputs = [InputFile(i, url, i >= len(files), i < len(files) and read[i] in rewritten)
                   for i, url in enumerate(files + indexes)]
    counts = _count_rows(tasks, files + indexes, opts)
    work_path = posixpath.join(root, WORK_FOLDER)
    _remove(fs, work_path)  # what an interrupted run left: this run redoes all of it
    work = Work(fs.unstrip_protocol(work_path), opts,
                partition_count(sum(counts), cluster_cpus()), cfg.max_distance,
                GridCheck.of(cfg), cfg.perceptual, source if append else None,
                (fs.unstrip_protocol(posixpath.join(root, DUPLICATES_FILE)),
                 fs.unstrip_protocol(posixpath.join(root, INDEX_FILE))) if append else None)
    units = _units(work_inputs, counts)
    found = _read_phase(tasks, work, units)
    read_s = time.perf_counter() - started
    unhashed = found["unhashed_index_rows"]
    if unhashed and not append:
        say(f"dedup: {unhashed:,} index rows have no pixel hash of this version (an index "
            "written before it): they match on perceptual hashes only")
    say(f"dedup: joining {found['ok_rows']:,} rows' hashes (exact, "
        f"then near within {cfg.max_distance} bits, as banded Ray tasks; read in "
        f"{read_s:.1f} s)…")
    final_duplicates = posixpath.join(root, DUPLICATES_FILE)
    # an append writes beside the finished run's files, then swaps them in
    written = posixpath.join(work_path, DUPLICATES_FILE) if append else final_duplicates
    decided = _decide(tasks, work, len(units), found["samples"], fs.unstrip_protocol(written),
                      fs.unstrip_protocol(final_duplicates) if append else None)
    decide_s = time.perf_counter() - started - read_s
    say(f"dedup: {decided['duplicates']:,} duplicates found in {decide_s:.1f} s; "
        "writing duplicates" + (" and index" if cfg.write_index else ""))
    if append:  # no completion marker while the finished run's files are replaced
        fs.rm(stats_path)
        fs.mv(written, final_duplicates)
    if cfg.write_index:
        _write_index(tasks, work, len(units), found["ok_rows"] + found["index_rows"],
                     source, fs, root)
    _remove(fs, work_path)
    status = found["status"]
    stats = {
        "stage": "dedup",
        "enabled": True,
        "raw_files": len(inputs.files),
        "index_files": len(indexes),
        "rows_in": sum(status.values()),
        "status_counts": dict(sorted(status.items())),
        **_stats(decided, found, cfg.max_distance),
        "index_rows_without_pixel_hash": unhashed,
        "index_written": cfg.write_index,
        "inputs_digest": digest,
        "settings_digest": inputs.settings_digest(),
        "last_run": {"mode": "append" if append else "full", "raw_files_read": len(files),
                     "rewritten_raw_files": len(append.rewritten) if append else 0,
                     "index_rows_read": found["index_rows"]},
        "seconds": {"read": round(read_s, 3), "decide": round(decide_s, 3),
                    "total": round(time.perf_counter() - started, 3),
                    "phases": {k: round(v, 3) for k, v in tasks.seconds.items()}},
    }
    if append:
        stats = added_to(finished, stats, append.replaced_status())
    write_covered(fs, root, covered_table(inputs.raw, read, found["files"],
                                          append.earlier if append else None))
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
