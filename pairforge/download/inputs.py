"""Planning a run's input into shards with stable keys, and reading one shard's rows.

Sources: url lists (txt, csv, tsv, json, jsonl — each optionally gzipped — and parquet,
local or any fsspec URL), a folder of images with ``.txt`` sidecars, and existing
WebDataset tars. The driver reads metadata only (the file list, parquet footers, the
first line of a text file), never the rows: a shard is a list of row ranges of parquet
files, and its task reads them itself (``read_shard_rows``). Inputs without usable row
groups are first written as parquet by the splitting pass (download/split.py), which
pipeline/download_stage.py places on Ray. Shard ``k`` holds rows ``k·shard_size`` up to
the next shard's of all inputs in order, across file ends, so its id and keys depend only
on the rows before it. Problems that make the whole input unusable (a path that matches
nothing, a missing column, a parquet footer that cannot be read) raise ``ConfigError``
before any work starts; a file that cannot be read later fails its task with a message
naming it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import ConfigError, InputConfig, OutputConfig
from pairforge.download.input_plan import planned_shards
from pairforge.download.split import (
    SPLIT_FOLDER,
    SplitJob,
    check_columns,
    needed_columns,
    normalise_table,
    normalised_schema,
    split_job,
    split_rows,
)
from pairforge.shards.storage import OutputDir
from pairforge.tables import detect_format, peek_columns

BUNDLED_SAMPLE = "bundled-sample"
# A parquet input is split (rewritten in shard-sized row groups) when a row group holds
# more than this many shards' rows, and more rows than a task decodes in a blink: else
# each shard task would decode and read up to a whole group for its own few rows.
_GROUP_SHARDS, _GROUP_ROWS_READ_WHOLE = 4, 65536
_METADATA_THREADS = 16  # footers and headers are read side by side (object stores)


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of one parquet file."""

    path: str  # fsspec URL
    start: int
    stop: int
    file_rows: int  # the file's rows at planning: a file changed since is refused
    split: bool  # written by the splitting pass (under OUT, normalised columns)


@dataclass(frozen=True)
class InputShard:
    shard_id: int
    ranges: tuple[RowRange, ...]  # row i of them gets key make_key(id, first_row + i)
    # A part of a shard whose rows are split over several tasks (the run's tail): its rows
    # start at first_row of the shard, and the parts are merged into the one shard.
    first_row: int = 0
    part: int = 0
    parts: int = 1

    @property
    def num_rows(self) -> int:
        return sum(r.stop - r.start for r in self.ranges)

    def split(self, parts: int) -> list[InputShard]:
        """The shard as ``parts`` tasks of consecutive rows (never an empty one)."""
        parts = max(1, min(parts, self.num_rows))
        if parts == 1:
            return [self]
        bounds = [round(i * self.num_rows / parts) for i in range(parts + 1)]
        return [InputShard(self.shard_id, _cut(self.ranges, lo, hi), lo, i, parts)
                for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]


def _cut(ranges: tuple[RowRange, ...], lo: int, hi: int) -> tuple[RowRange, ...]:
    """Rows [lo, hi) of the rows the ranges hold one after another."""
    cut, at = [], 0
    for r in ranges:
        start, stop = max(lo - at, 0), min(hi - at, r.stop - r.start)
        if stop > start:
            cut.append(replace(r, start=r.start + start, stop=r.start + stop))
        at += r.stop - r.start
    return tuple(cut)


@dataclass(frozen=True)
class InputFile:
    """A parquet file a shard task reads rows of, in input order."""

    path: str  # fsspec URL
    rows: int
    split: bool


def _expand_paths(cfg: InputConfig) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    """Every input file (globs and folders expanded), sorted so shards are stable."""
    specs = cfg.path if isinstance(cfg.path, list) else [cfg.path]
    found: list[tuple[fsspec.AbstractFileSystem, str]] = []
    for spec in specs:
        fs, root = fsspec.core.url_to_fs(spec, **cfg.storage_options)
        matches = sorted(fs.glob(root)) if any(c in root for c in "*?[") else [root]
        if not matches or not all(fs.exists(m) for m in matches):
            raise ConfigError(f"input.path {spec!r} does not exist or cannot be read")
        found += [(fs, m) for m in matches]
    return found


def _groups_too_big(meta: pq.FileMetaData, shard_size: int) -> bool:
    largest = max((meta.row_group(i).num_rows for i in range(meta.num_row_groups)), default=0)
    return largest > max(_GROUP_SHARDS * shard_size, _GROUP_ROWS_READ_WHOLE)


def _plan_one(fs: fsspec.AbstractFileSystem, path: str,
              cfg: InputConfig) -> InputFile | SplitJob:
    """One input from its metadata: a parquet file read in place, or the split it needs."""
    fmt = cfg.format
    if fmt == "auto":
        fmt = "folder" if fs.isdir(path) else detect_format(path)
    if fmt in ("folder", "webdataset"):
        return split_job(fs, path, fmt, cfg)
    if fmt != "parquet":
        check_columns(peek_columns(fs, path, fmt, cfg.url_col), cfg, path)
        return split_job(fs, path, fmt, cfg)
    try:
        with fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            columns, meta = parquet.schema_arrow.names, parquet.metadata
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"cannot read input {path!r} as parquet: {err}") from None
    check_columns(columns, cfg, path)
    if _groups_too_big(meta, cfg.shard_size):
        return split_job(fs, path, fmt, cfg)
    return InputFile(fs.unstrip_protocol(path), meta.num_rows, split=False)


SplitRunner = Callable[[list[SplitJob]], list[int]]  # the jobs' rows, in order


def plan_input(source: InputConfig, output: OutputConfig,
               run_splits: SplitRunner) -> list[InputShard]:
    """The run's shards, from the inputs' metadata; inputs that need the splitting pass
    are split by ``run_splits`` (download_stage: Ray tasks) unless a rerun finds them done."""
    if source.path == BUNDLED_SAMPLE:
        raise ConfigError("the bundled sample is served by the build "
                          "(pipeline/download_stage.input_shards)")
    paths = _expand_paths(source)
    if not paths:
        raise ConfigError("input.path matched no files")
    with ThreadPoolExecutor(min(_METADATA_THREADS, len(paths))) as pool:
        planned = list(pool.map(lambda p: _plan_one(*p, source), paths))
        jobs = [p for p in planned if isinstance(p, SplitJob)]
        out = OutputDir(output.path, output.storage_options)
        if jobs and out.exists(SPLIT_FOLDER):
            out.remove_temporaries(SPLIT_FOLDER)  # a killed split leaves its temporary
        done = list(pool.map(lambda job: split_rows(job, out), jobs))
    rows_of = {job: rows for job, rows in zip(jobs, done, strict=True) if rows is not None}
    todo = [job for job in dict.fromkeys(jobs) if job not in rows_of]  # an input named twice
    if todo:
        rows_of.update(zip(todo, run_splits(todo), strict=True))
    files = [p if isinstance(p, InputFile) else
             InputFile(out.uri(SPLIT_FOLDER, p.target), rows_of[p], split=True)
             for p in planned]
    return list(planned_shards(out, files, source.shard_size, shards_of))


def shards_of(files: list[InputFile], shard_size: int,
              first_id: int = 0) -> Iterator[InputShard]:
    """Shards of ``shard_size`` rows of the files one after another (the last shorter),
    numbered from ``first_id``."""
    shard_id, ranges, filled = first_id, [], 0
    for file in files:
        start = 0
        while start < file.rows:
            take = min(shard_size - filled, file.rows - start)
            ranges.append(RowRange(file.path, start, start + take, file.rows, file.split))
            start, filled = start + take, filled + take
            if filled == shard_size:
                yield InputShard(shard_id, tuple(ranges))
                shard_id, ranges, filled = shard_id + 1, [], 0
    if ranges:
        yield InputShard(shard_id, tuple(ranges))


def _rows_between(parquet: pq.ParquetFile, start: int, stop: int,
                  columns: list[str]) -> pa.Table:
    """Rows [start, stop) of a parquet file, reading only the row groups they lie in and
    decoding no further than ``stop``."""
    groups, first, offset = [], 0, 0
    for i in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(i).num_rows
        if offset < stop and offset + rows > start:
            first = offset if not groups else first
            groups.append(i)
        offset += rows
    batches, at = [], first
    for batch in parquet.iter_batches(batch_size=min(stop - start, 65536), row_groups=groups,
                                      columns=columns):
        lo, hi = max(start - at, 0), min(stop - at, batch.num_rows)
        if hi > lo:
            batches.append(batch.slice(lo, hi - lo))
        at += batch.num_rows
        if at >= stop:
            break
    return pa.Table.from_batches(batches)


def _read_range(r: RowRange, source: InputConfig, output: OutputConfig) -> pa.Table:
    options = output.storage_options if r.split else source.storage_options
    extras = source.save_additional_columns
    columns = list(normalised_schema(extras).names) if r.split else needed_columns(source)
    where = f"rows {r.start}-{r.stop - 1} of input {r.path!r}"
    try:
        with fsspec.open(r.path, "rb", **options) as f:
            # buffer_size: pages are read as they are decoded, not a whole row group at once
            parquet = pq.ParquetFile(f, buffer_size=1 << 20)
            if parquet.metadata.num_rows != r.file_rows:
                raise ConfigError(f"cannot read {where}: it has {parquet.metadata.num_rows} "
                                  f"rows, {r.file_rows} when the run was planned; rerun to "
                                  "plan again")
            table = _rows_between(parquet, r.start, r.stop, columns)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"cannot read {where}: {type(err).__name__}: {err}") from None
    if table.num_rows != r.stop - r.start:
        raise ConfigError(f"cannot read {where}: only {table.num_rows} rows found")
    return table.cast(normalised_schema(extras)) if r.split else \
        normalise_table(table, source, r.path)


def read_shard_rows(shard: InputShard, source: InputConfig,
                    output: OutputConfig) -> pa.Table:
    """The shard's rows (url, caption as bytes, source, extras), read by its task (a split
    input's from ``output``); a file that is gone, changed or corrupt raises ConfigError
    naming it."""
    return pa.concat_tables([_read_range(r, source, output) for r in shard.ranges])


def tail_parts(shards: list[InputShard], slots: int) -> list[InputShard]:
    """The shards as tasks for ``slots`` task slots: when the last round has fewer shards
    than slots, each of its shards is split so that every slot gets a part (5 shards on 2
    slots: 4 whole, then the fifth in halves side by side, not alone on one slot)."""
    last = len(shards) % slots
    if not last or slots // last < 2:
        return shards
    return shards[:-last] + [part for shard in shards[-last:]
                             for part in shard.split(slots // last)]
