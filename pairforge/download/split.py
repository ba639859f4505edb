"""The splitting pass: inputs without usable row groups become parquet files under
``OUT/inputs/``, from which each shard task reads its own rows.

A shard task reads a row range of a parquet file by its row groups (download/inputs.py).
Text tables (txt, csv, tsv, json, jsonl, gzipped or not) have no row groups, WebDataset
tars and image folders have no rows at all until they are walked, and a parquet file
whose row groups are far larger than a shard (one 12M-row group, as older pyarrow wrote
by default) would make every shard task read a whole group for its few rows. Each such
input is streamed, once, by one Ray task (pipeline/download_stage.py) into a parquet file of
normalised columns (``url``, ``caption`` as bytes, ``source``, the extra columns) in row
groups of ``shard_size`` rows, as img2dataset's reader writes its input into shard files
before downloading. The file appears whole or not at all (temp name, then rename), and
its schema metadata records what it was made from (``SplitJob.record``): a rerun reuses
a split whose record matches and makes again one made from another input or settings.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import ConfigError, InputConfig, OutputConfig
from pairforge.shards.storage import OutputDir
from pairforge.shards.tar import iter_samples
from pairforge.tables import iter_table_batches, read_bytes

SPLIT_FOLDER = "inputs"  # under OUT, beside raw/ (DESIGN.md section 4)
SPLIT_VERSION = 1  # bump when a split of the same input would hold other rows
RECORD_KEY = b"pairforge.split"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_BATCH_ROWS = 65536  # rows per batch when walking tars, folders and parquet row groups
# fsspec info fields that change with a file's content, most specific first
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified",
                   "last_modified", "updated", "created")


@dataclass(frozen=True)
class SplitJob:
    source: str  # fsspec URL of the input file or folder
    fmt: str  # txt, csv, tsv, json, jsonl, parquet, webdataset or folder
    target: str  # file name under OUT/inputs
    record: str | None  # what the split is made from (JSON); None: always made again
    size: int | None = None  # the input's bytes, None for a folder


def normalised_schema(extras: list[str]) -> pa.Schema:
    return pa.schema([("url", pa.string()), ("caption", pa.binary()), ("source", pa.string()),
                      *[(extra, pa.string()) for extra in extras]])


def needed_columns(cfg: InputConfig) -> list[str]:
    """The input columns a run reads, each once."""
    return list(dict.fromkeys([cfg.url_col, *([cfg.caption_col] if cfg.caption_col else []),
                               *cfg.save_additional_columns]))


def check_columns(columns: list[str], cfg: InputConfig, path: str) -> None:
    missing = [c for c in needed_columns(cfg) if c not in columns]
    if missing:
        raise ConfigError(
            f"input {path!r} has no column {', '.join(repr(m) for m in missing)} "
            f"(columns: {', '.join(columns)}); set input.url_col / "
            "input.caption_col / input.save_additional_columns")


def _as_binary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_binary(column.type):
        return column
    if pa.types.is_large_binary(column.type):
        return column.cast(pa.binary())
    return column.cast(pa.string()).cast(pa.binary())


def normalise_table(table: pa.Table, cfg: InputConfig, path: str) -> pa.Table:
    """Check the named columns exist and bring the table to the common input shape:
    ``url``, ``caption`` (bytes: it is decoded, and rejected if invalid, per row by the
    download), ``source`` (null: fetched over HTTP), then the extra columns as text."""
    check_columns(table.column_names, cfg, path)
    n = table.num_rows
    caption = (_as_binary(table[cfg.caption_col]) if cfg.caption_col
               else pa.nulls(n, pa.binary()))
    columns = {
        "url": table[cfg.url_col].cast(pa.string()),
        "caption": caption,
        "source": pa.nulls(n, pa.string()),
    }
    for extra in cfg.save_additional_columns:
        columns[extra] = table[extra].cast(pa.string())
    return pa.table(columns)


def _local_rows(urls: list[str], captions: list[bytes | None], sources: list[str],
                extras: list[str]) -> pa.Table:
    """Rows whose image is read from local bytes (a folder, a tar); they have no extras."""
    n = len(urls)
    return pa.Table.from_arrays(
        [pa.array(urls, pa.string()), pa.array(captions, pa.binary()),
         pa.array(sources, pa.string()), *[pa.nulls(n, pa.string()) for _ in extras]],
        schema=normalised_schema(extras))


def _folder_batches(fs: fsspec.AbstractFileSystem, root: str,
                    extras: list[str]) -> Iterator[pa.Table]:
    """Images in a folder tree; the caption is the sidecar ``NAME.txt`` (null if absent)."""
    files = sorted(fs.find(root))
    images = [f for f in files if f.lower().endswith(IMAGE_EXTENSIONS)]
    sidecars = set(files)
    for start in range(0, len(images), _BATCH_ROWS):
        urls, captions = [], []
        for image in images[start:start + _BATCH_ROWS]:
            sidecar = posixpath.splitext(image)[0] + ".txt"
            captions.append(read_bytes(fs, sidecar).strip() if sidecar in sidecars else None)
            urls.append(fs.unstrip_protocol(image))
        yield _local_rows(urls, captions, urls, extras)


def _tar_batches(fs: fsspec.AbstractFileSystem, path: str,
                 extras: list[str]) -> Iterator[pa.Table]:
    """Samples of an existing WebDataset tar: the image is read back from the tar later
    (download/shard.py matches ``KEY.EXT`` the way shards/tar.py groups members)."""
    urls, captions, sources = [], [], []
    location = fs.unstrip_protocol(path)
    with fs.open(path, "rb", compression="infer") as f:
        for key, files in iter_samples(f):
            image_ext = next((e for e in files if "." + e in IMAGE_EXTENSIONS), None)
            if image_ext is None:
                continue
            meta = json.loads(files.get("json") or b"{}")
            urls.append(meta.get("url") or f"{location}#{key}.{image_ext}")
            captions.append(files.get("txt"))
            sources.append(f"tar:{location}#{key}.{image_ext}")
            if len(urls) == _BATCH_ROWS:
                yield _local_rows(urls, captions, sources, extras)
                urls, captions, sources = [], [], []
    yield _local_rows(urls, captions, sources, extras)


def _with_all_columns(table: pa.Table, columns: list[str]) -> pa.Table:
    """A batch of json rows none of which has a column that the file has (its first
    object was checked at planning): null there, as a whole-file read would give."""
    for name in columns:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows))
    return table


def _source_batches(job: SplitJob, cfg: InputConfig) -> Iterator[pa.Table]:
    fs, path = fsspec.core.url_to_fs(job.source, **cfg.storage_options)
    extras = cfg.save_additional_columns
    if job.fmt == "folder":
        yield from _folder_batches(fs, path, extras)
    elif job.fmt == "webdataset":
        yield from _tar_batches(fs, path, extras)
    elif job.fmt == "parquet":
        with fs.open(path, "rb") as f:
            # buffer_size: pages are read as they are decoded, not a whole row group at once
            for batch in pq.ParquetFile(f, buffer_size=1 << 20).iter_batches(
                    batch_size=_BATCH_ROWS, columns=needed_columns(cfg)):
                yield normalise_table(pa.Table.from_batches([batch]), cfg, path)
    else:
        # captions as bytes, so one row with invalid UTF-8 fails alone, in the download
        types = {cfg.url_col: pa.string(), **({cfg.caption_col: pa.binary()}
                                              if cfg.caption_col else {}),
                 **dict.fromkeys(cfg.save_additional_columns, pa.string())}
        for table in iter_table_batches(fs, path, job.fmt, types, txt_column=cfg.url_col):
            if job.fmt in ("json", "jsonl"):
                table = _with_all_columns(table, needed_columns(cfg))
            yield normalise_table(table, cfg, path)


def source_record(source: str, info: dict[str, Any], fmt: str, cfg: InputConfig) -> str:
    """What a split of this input is made from: the input's URL, size and version (mtime,
    ETag, ...; ``info`` is fsspec's) and the settings that decide its rows."""
    version = next((str(info[k]) for k in VERSION_FIELDS if info.get(k) is not None), None)
    return json.dumps({"source": source, "size": info.get("size"), "version": version,
                       "format": fmt, "url_col": cfg.url_col, "caption_col": cfg.caption_col,
                       "save_additional_columns": cfg.save_additional_columns,
                       "split_version": SPLIT_VERSION}, sort_keys=True)


def split_job(fs: fsspec.AbstractFileSystem, path: str, fmt: str,
              cfg: InputConfig) -> SplitJob:
    """The split of one input; its file is named after the input, with a digest of the
    input's full URL so that two inputs of the same name do not meet. A folder's listing
    could change anywhere below it: its split has no record, and every run makes it."""
    source = fs.unstrip_protocol(path)
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    target = f"{posixpath.basename(path.rstrip('/')) or 'input'}.{digest}.parquet"
    if fmt == "folder":
        return SplitJob(source, fmt, target, None)
    info = fs.info(path)
    return SplitJob(source, fmt, target, source_record(source, info, fmt, cfg),
                    info.get("size"))


def split_rows(job: SplitJob, out: OutputDir) -> int | None:
    """The rows of the job's finished split when it was made from the same input and
    settings (a rerun reuses it), else None."""
    if job.record is None or not out.exists(SPLIT_FOLDER, job.target):
        return None
    try:
        with out.fs.open(out.path(SPLIT_FOLDER, job.target), "rb") as f:
            meta = pq.ParquetFile(f).metadata
    except (OSError, pa.ArrowException):
        return None  # unreadable: made again
    recorded = (meta.metadata or {}).get(RECORD_KEY, b"").decode()
    return meta.num_rows if recorded == job.record else None


def write_split(out: OutputDir, target: str, tables: Iterable[pa.Table], extras: list[str],
                rows_per_group: int, record: str | None = None) -> int:
    """Write ``tables`` (normalised) as OUT/inputs/``target`` in row groups of
    ``rows_per_group`` rows; returns the rows written."""
    schema = normalised_schema(extras).with_metadata({RECORD_KEY: record or ""})
    out.makedirs(SPLIT_FOLDER)
    pending: list[pa.Table] = []
    buffered = written = 0
    with (out.open_atomic(SPLIT_FOLDER, target) as f,
          pq.ParquetWriter(f, schema) as writer):
        for table in tables:
            pending.append(table.cast(schema))
            buffered += table.num_rows
            while buffered >= rows_per_group:  # whole groups: a shard reads one or two
                rows = pa.concat_tables(pending)
                writer.write_table(rows.slice(0, rows_per_group))
                pending = [rows.slice(rows_per_group)]
                buffered -= rows_per_group
                written += rows_per_group
        if buffered:
            writer.write_table(pa.concat_tables(pending))
            written += buffered
    return written


def run_split(job: SplitJob, source: InputConfig, output: OutputConfig) -> int:
    """Stream one input into its split file under ``output`` (a Ray task); returns its
    rows. Input that cannot be read or parsed raises ConfigError naming the file, and
    leaves no split."""
    out = OutputDir(output.path, output.storage_options)
    try:
        return write_split(out, job.target, _source_batches(job, source),
                           source.save_additional_columns, source.shard_size, job.record)
    except ConfigError:
        raise
    except OSError as err:
        raise ConfigError(f"cannot read input {job.source!r}: {err}") from None
    except (pa.ArrowException, ValueError) as err:
        raise ConfigError(f"cannot parse input {job.source!r} as {job.fmt}: {err}") from None

