"""Stage 2 on Ray: the phases of ``dedup/partitions.py`` as waves of tasks.

Only ``records.HASH_COLUMNS`` are read (never the images). Each phase is a wave of Ray
tasks that read and write partitioned files under ``out_dir/work/`` (removed when the
stage is done, wiped when a run starts); the driver only plans the partitions and adds up
the counts the tasks return, so its memory does not grow with the number of rows. A task
lost with its worker or node is retried by Ray and writes the same files again; a rerun
starts the work over and writes the same output. An append (raw shards added after those
a finished run covered, all else the same: ``dedup/append.py``) reads only the new
shards, against the finished run's own index, and adds to its outputs (``run_dedup``).
The outputs are ``dedup/outputs.py``'s; whether a finished run is reused is
``settings.inputs_digest`` of ``dedup/inputs.py``'s declared inputs.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from pairforge.config import DedupConfig, PairforgeConfig, RayConfig
from pairforge.dedup import index_writing
from pairforge.dedup import partitions as parts
from pairforge.dedup.append import (
    INDEX_FILE,
    Append,
    added_to,
    covered_table,
    plan_append,
    write_covered,
)
from pairforge.dedup.bands import HASH_BITS, plan_bands
from pairforge.dedup.decide import DUPLICATES_SCHEMA
from pairforge.dedup.grids import GridCheck
from pairforge.dedup.index import index_files
from pairforge.dedup.inputs import Inputs, raw_files
from pairforge.dedup.key_ranges import concat_sorted, key_boundaries, sort_range
from pairforge.dedup.outputs import (
    DUPLICATES_FILE,
    STATS_FILE,
    default_source,
    load_stats,
    stage_stats,
    write_atomic,
    write_disabled,
)
from pairforge.dedup.work import InputFile, Work
from pairforge.pipeline.contract import DEDUP, READ_CPUS
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.executors import Waves, cluster_cpus
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.settings import inputs_digest
from pairforge.pipeline.waves import components
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir

WORK_FOLDER = "work"

# Partition sizes. Each partition task holds about this many rows (or 6x as many hash
# values: whole, mirror and four regions per row); small runs still get a few partitions
# per CPU so that both cores work.
ROWS_PER_PART = 1_000_000
ROWS_PER_SCATTER = 1_000_000  # rows a reading task takes from consecutive input files
VALUES_PER_BAND_TASK = 4_000_000
INDEX_ROWS_PER_PART = 1_000_000


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
    tasks.run(sort_range, [(work, r) for r in range(ranges)])
    tasks.run(concat_sorted, [(work, ranges, out_url, DUPLICATES_SCHEMA, earlier)])
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
    bits = index_writing.index_prefix_bits(rows, INDEX_ROWS_PER_PART)
    tasks.run(index_writing.index_rows_out, [(work, p, units, source, bits)
                                             for p in range(work.parts)])
    names = [index_writing.index_part_name(i, bits) for i in range(1 << bits)]
    out = posixpath.join(root, WORK_FOLDER, "index-out")
    tasks.run(index_writing.index_part, [(work, i, bits, fs.unstrip_protocol(
        posixpath.join(out, name))) for i, name in enumerate(names)])
    final = posixpath.join(root, INDEX_FILE)
    if fs.exists(final):
        fs.rm(final, recursive=True)
    fs.makedirs(final, exist_ok=True)
    for name in names:
        fs.mv(posixpath.join(out, name), posixpath.join(final, name))


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    fs.invalidate_cache()
    if fs.exists(path):
        fs.rm(path, recursive=True)


@dataclass(frozen=True)
class _Plan:
    """What one run reads, and where it writes."""

    inputs: Inputs
    append: Append | None
    read: list[int]  # the raw shards read, as positions among inputs.files
    indexes: list[str]  # the index files read: dedup.index's, or an append's own index
    source: str  # this build's label in the index it writes
    fs: fsspec.AbstractFileSystem
    root: str  # out_dir, as a path of fs
    opts: dict[str, Any]

    @property
    def files(self) -> list[str]:
        return [self.inputs.files[p] for p in self.read]

    def path(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def url(self, *names: str) -> str:
        return self.fs.unstrip_protocol(self.path(*names))

    def last_run(self, index_rows: int) -> dict[str, Any]:
        return {"mode": "append" if self.append else "full",
                "raw_files_read": len(self.read),
                "rewritten_raw_files": len(self.append.rewritten) if self.append else 0,
                "index_rows_read": index_rows}


def _plan(inputs: Inputs, append: Append | None, fs: fsspec.AbstractFileSystem, root: str,
          opts: dict[str, Any], source: str, say: Callable[[str], None]) -> _Plan:
    """A full run reads every raw shard against dedup.index's files; an append its new and
    rewritten shards against the finished run's own index."""
    if not append:
        return _Plan(inputs, None, list(range(len(inputs.files))), inputs.indexes, source,
                     fs, root, opts)
    say(f"dedup: {len(inputs.files) - append.covered} raw shards added after the "
        f"{append.covered} this dedup covered, {len(append.rewritten)} rewritten by "
        "--retry-failed: only their new rows are read, against its index")
    own_index = index_files([fs.unstrip_protocol(posixpath.join(root, INDEX_FILE))], opts)
    return _Plan(inputs, append, append.positions(len(inputs.files)), own_index, source,
                 fs, root, opts)


def _work(plan: _Plan, tasks: Waves, cfg: DedupConfig) -> tuple[Work, list[list[InputFile]]]:
    """The run's work folder, emptied of what an interrupted run left (this run redoes all
    of it), and its reading units."""
    files, append = plan.files, plan.append
    rewritten = set(append.rewritten) if append else set()
    inputs = [InputFile(i, url, i >= len(files), i < len(files) and plan.read[i] in rewritten)
              for i, url in enumerate(files + plan.indexes)]
    counts = _count_rows(tasks, files + plan.indexes, plan.opts)
    _remove(plan.fs, plan.path(WORK_FOLDER))
    work = Work(plan.url(WORK_FOLDER), plan.opts, partition_count(sum(counts), cluster_cpus()),
                cfg.max_distance, GridCheck.of(cfg), cfg.perceptual,
                plan.source if append else None,
                (plan.url(DUPLICATES_FILE), plan.url(INDEX_FILE)) if append else None)
    return work, _units(inputs, counts)


def _run_waves(plan: _Plan, cfg: DedupConfig, ray_cfg: RayConfig, say: Callable[[str], None]
               ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every phase on Ray: writes duplicates.parquet (and the index); returns what the
    reading and deciding waves counted, and the seconds."""
    started = time.perf_counter()
    say(f"dedup: reading the hashes of {len(plan.read)} raw shards and {len(plan.indexes)} "
        "index files; starting Ray…")
    init_ray(ray_cfg)
    tasks = Waves(ray_cfg.max_task_retries, DEDUP.resources.task_cpus)
    work, units = _work(plan, tasks, cfg)
    found = _read_phase(tasks, work, units)
    read_s = time.perf_counter() - started
    if found["unhashed_index_rows"] and not plan.append:
        say(f"dedup: {found['unhashed_index_rows']:,} index rows have no pixel hash of this "
            "version (an index written before it): they match on perceptual hashes only")
    say(f"dedup: joining {found['ok_rows']:,} rows' hashes (exact, "
        f"then near within {cfg.max_distance} bits, as banded Ray tasks; read in "
        f"{read_s:.1f} s)…")
    final = plan.path(DUPLICATES_FILE)
    # an append writes beside the finished run's files, then swaps them in
    written = plan.path(WORK_FOLDER, DUPLICATES_FILE) if plan.append else final
    decided = _decide(tasks, work, len(units), found["samples"], plan.fs.unstrip_protocol(written),
                      plan.url(DUPLICATES_FILE) if plan.append else None)
    decide_s = time.perf_counter() - started - read_s
    say(f"dedup: {decided['duplicates']:,} duplicates found in {decide_s:.1f} s; "
        "writing duplicates" + (" and index" if cfg.write_index else ""))
    if plan.append:  # no completion marker while the finished run's files are replaced
        plan.fs.rm(plan.path(STATS_FILE))
        plan.fs.mv(written, final)
    if cfg.write_index:
        _write_index(tasks, work, len(units), found["ok_rows"] + found["index_rows"],
                     plan.source, plan.fs, plan.root)
    _remove(plan.fs, plan.path(WORK_FOLDER))
    return found, decided, {"read": round(read_s, 3), "decide": round(decide_s, 3),
                            "total": round(time.perf_counter() - started, 3),
                            "phases": {k: round(v, 3) for k, v in tasks.seconds.items()}}


def run_dedup(raw_dir: str, out_dir: str, cfg: DedupConfig, ray_cfg: RayConfig,
              storage_options: dict | None = None, *, source: str | None = None,
              force: bool = False, say: Callable[[str], None] = lambda _: None) -> dict:
    """Stage 2: write ``out_dir/duplicates.parquet`` (+ index) and return the stats.

    A finished run (its stats file exists) is reused when it was computed from the same
    config and raw/index files. When the only changes are raw shards added after the last
    and raw shards rewritten by ``--retry-failed`` (an append, ``dedup/append.py``), only
    their new rows are read, against the finished run's own index: its rows win, as rows
    already shipped, and its decisions stay as they are. Otherwise, or with ``force``, it
    is redone. ``source`` labels this build's rows in the index it writes
    (default: the parent of out_dir). ``say`` gets a line as each phase starts.
    """
    opts = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(out_dir, **opts)
    fs.invalidate_cache()
    stats_path = posixpath.join(root, STATS_FILE)
    finished = None if force or not fs.exists(stats_path) else load_stats(fs, stats_path)
    fs.makedirs(root, exist_ok=True)
    if not cfg.enabled:
        return finished if finished and not finished["enabled"] else write_disabled(fs, root)
    inputs = Inputs.describe(raw_files(raw_dir, opts), index_files(cfg.index, opts), cfg, opts)
    digest = inputs_digest(inputs.config, **inputs.declared())
    if finished and finished.get("inputs_digest") == digest:
        say("dedup: the finished run matches the raw shards, index files and config: reused")
        return finished
    settings = inputs_digest(inputs.config, **inputs.settings())
    append = None if force else plan_append(finished, inputs.raw, inputs.files, settings, fs,
                                            root, opts)
    plan = _plan(inputs, append, fs, root, opts, source or default_source(out_dir), say)
    if not append and fs.exists(stats_path):  # a full run replaces every file: no marker
        fs.rm(stats_path)                      # may vouch for them while it does
    found, decided, seconds = _run_waves(plan, cfg, ray_cfg, say)
    stats = {**stage_stats(found, decided, raw_files=len(inputs.files),
                           index_files=len(plan.indexes), max_distance=cfg.max_distance,
                           index_written=cfg.write_index),
             "inputs_digest": digest, "settings_digest": settings,
             "last_run": plan.last_run(found["index_rows"]), "seconds": seconds}
    if append:
        stats = added_to(finished, stats, append.replaced_status())
    write_covered(fs, root, covered_table(inputs.raw, plan.read, found["files"],
                                          append.earlier if append else None))
    # Written last: the stats file is the completion marker.
    write_atomic(fs, stats_path, json.dumps(stats, indent=2).encode())
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
