"""Reading input lists and splitting them into shards with stable keys.

Sources: url lists (txt, csv, tsv, json, jsonl — each optionally gzipped — and parquet,
local or any fsspec URL), a folder of images with ``.txt`` sidecars, and existing
WebDataset tars. Every source becomes one Arrow table with the columns ``url``,
``caption`` (binary: it is decoded, and rejected if invalid, per row by the download
stage), ``source`` (where to read local bytes, null for HTTP) and the user's extra
columns. Problems that make the whole input unusable raise ``ConfigError`` before any
work starts.
"""

from __future__ import annotations

import itertools
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa

from pairforge.config import ConfigError, InputConfig
from pairforge.shards.tar import iter_samples
from pairforge.tables import detect_format, read_bytes, read_table_file

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
BUNDLED_SAMPLE = "bundled-sample"


@dataclass(frozen=True)
class InputShard:
    shard_id: int
    rows: pa.Table  # url, caption (binary), source, extras; row i gets key make_key(id, i)
    # A part of a shard whose rows are split over several tasks (the run's tail): its rows
    # start at first_row of the shard, and the parts are merged into the one shard.
    first_row: int = 0
    part: int = 0
    parts: int = 1

    def split(self, parts: int) -> list[InputShard]:
        """The shard as ``parts`` tasks of consecutive rows (never an empty one)."""
        parts = max(1, min(parts, self.rows.num_rows))
        if parts == 1:
            return [self]
        bounds = [round(i * self.rows.num_rows / parts) for i in range(parts + 1)]
        return [InputShard(self.shard_id, self.rows.slice(lo, hi - lo), lo, i, parts)
                for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]


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


def _as_binary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_binary(column.type):
        return column
    if pa.types.is_large_binary(column.type):
        return column.cast(pa.binary())
    return column.cast(pa.string()).cast(pa.binary())


def normalise_table(table: pa.Table, cfg: InputConfig, path: str) -> pa.Table:
    """Check the named columns exist and bring the table to the common input shape."""
    needed = [cfg.url_col, *([cfg.caption_col] if cfg.caption_col else []),
              *cfg.save_additional_columns]
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"input {path!r} has no column {', '.join(repr(m) for m in missing)} "
            f"(columns: {', '.join(table.column_names)}); set input.url_col / "
            "input.caption_col / input.save_additional_columns")
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


def _folder_rows(fs: fsspec.AbstractFileSystem, root: str, cfg: InputConfig) -> pa.Table:
    """Images in a folder tree; the caption is the sidecar ``NAME.txt`` (null if absent)."""
    files = sorted(fs.find(root))
    images = [f for f in files if f.lower().endswith(IMAGE_EXTENSIONS)]
    sidecars = set(files)
    urls, captions = [], []
    for image in images:
        sidecar = posixpath.splitext(image)[0] + ".txt"
        captions.append(read_bytes(fs, sidecar).strip() if sidecar in sidecars else None)
        urls.append(fs.unstrip_protocol(image))
    return pa.table({"url": pa.array(urls, pa.string()),
                     "caption": pa.array(captions, pa.binary()),
                     "source": pa.array(urls, pa.string())})


def _tar_rows(fs: fsspec.AbstractFileSystem, path: str, cfg: InputConfig) -> pa.Table:
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
    return pa.table({"url": pa.array(urls, pa.string()),
                     "caption": pa.array(captions, pa.binary()),
                     "source": pa.array(sources, pa.string())})


def read_input_table(cfg: InputConfig) -> pa.Table:
    """All input rows as one table in a stable order; ConfigError on any unusable input."""
    if cfg.path == BUNDLED_SAMPLE:
        raise ConfigError("the bundled sample is served by the build; call bundled_input()")
    tables = []
    for fs, path in _expand_paths(cfg):
        fmt = cfg.format
        if fmt == "auto":
            fmt = "folder" if fs.isdir(path) else detect_format(path)
        if fmt == "folder":
            tables.append(_folder_rows(fs, path, cfg))
        elif fmt == "webdataset":
            tables.append(_tar_rows(fs, path, cfg))
        else:
            try:
                # captions as bytes, so one row with invalid UTF-8 fails alone, later
                raw = read_table_file(fs, path, fmt, {cfg.caption_col: pa.binary()}
                                      if cfg.caption_col else {}, txt_column=cfg.url_col)
            except (pa.ArrowInvalid, ValueError) as err:
                raise ConfigError(f"cannot parse input {path!r} as {fmt}: {err}") from None
            tables.append(normalise_table(raw, cfg, path))
    if not tables:
        raise ConfigError("input.path matched no files")
    return pa.concat_tables(tables, promote_options="permissive")


def split_shards(table: pa.Table, shard_size: int) -> Iterator[InputShard]:
    for shard_id, start in enumerate(range(0, table.num_rows, shard_size)):
        yield InputShard(shard_id, table.slice(start, shard_size))


def tail_parts(shards: list[InputShard], slots: int) -> list[InputShard]:
    """The shards as tasks for ``slots`` task slots: when the last round has fewer shards
    than slots, each of its shards is split so that every slot gets a part (5 shards on 2
    slots: 4 whole, then the fifth in halves side by side, not alone on one slot)."""
    last = len(shards) % slots
    if not last or slots // last < 2:
        return shards
    return shards[:-last] + [part for shard in shards[-last:]
                             for part in shard.split(slots // last)]
