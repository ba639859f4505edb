"""Reading one table file: txt, csv, tsv, json, jsonl (each optionally gzipped) or parquet,
local or any fsspec URL, with pyarrow.

The build's input lists (download/split.py, in batches: an input file can be larger than
a task's memory) and ``pairforge recaption-eval``'s reference tables (recaption/evaluate.py,
whole) read through here, so both take the same formats. ``read_key_range`` reads a key
range of a parquet table sorted by key (the dedup tables and index parts).
"""

from __future__ import annotations

import csv
import functools
import io
import json
from collections.abc import Iterator

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pairforge.config import ConfigError

TABLE_FORMATS = ("txt", "csv", "tsv", "json", "jsonl", "parquet")


def _strip_compression(path: str) -> str:
    return path[:-3] if path.endswith(".gz") else path


def detect_format(path: str) -> str:
    name = _strip_compression(path.lower())
    if name.endswith(".tar"):
        return "webdataset"
    for fmt in TABLE_FORMATS:
        if name.endswith("." + fmt):
            return fmt
    raise ConfigError(f"cannot tell the format of input {path!r}: set input.format")


def read_key_range(url: str, storage_options: dict, columns: list[str],
                   ranges: list[tuple[str, str]], source: str | None = None) -> pa.Table:
    """The rows with ``low <= key <= high`` for any (low, high) of ``ranges`` of a parquet
    table sorted by key (row groups outside them are skipped by their statistics), of one
    ``source`` when given: one read of the file for all the ranges, in the file's order.

    Through ``ParquetFile``, not ``pq.read_table(filters=...)``: that scans with
    pyarrow.dataset, whose reader threads on a Python file object made a process abort
    as it exited now and then ("terminate called without an active exception": 6 of 36
    runs of a driver that read one shard's range, 0 of 200 that only iterated batches)."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    wanted = list(dict.fromkeys([*columns, "key", *(["source"] if source is not None else [])]))
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        groups = _row_groups_in(parquet.metadata, ranges)
        table = (parquet.read_row_groups(groups, columns=wanted) if groups
                 else parquet.schema_arrow.empty_table().select(wanted))
    keys = table["key"]
    inside = [pc.and_(pc.greater_equal(keys, low), pc.less_equal(keys, high))
              for low, high in ranges]
    mask = functools.reduce(pc.or_, inside) if inside else pa.array([False] * len(table))
    if source is not None:
        mask = pc.and_(mask, pc.equal(table["source"], source))
    return table.filter(pc.fill_null(mask, False)).select(columns)


def _row_groups_in(metadata: pq.FileMetaData, ranges: list[tuple[str, str]]) -> list[int]:
    """The row groups whose key statistics overlap any range (all, without statistics)."""
    column = metadata.schema.to_arrow_schema().get_field_index("key")
    groups = []
    for i in range(metadata.num_row_groups):
        stats = metadata.row_group(i).column(column).statistics
        if stats is None or not stats.has_min_max or any(
                low <= stats.max and stats.min <= high for low, high in ranges):
            groups.append(i)
    return groups


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    try:
        with fs.open(path, "rb", compression="infer") as f:
            return f.read()
    except OSError as err:
        raise ConfigError(f"cannot read input {path!r}: {err}") from None


def read_table_file(fs: fsspec.AbstractFileSystem, path: str, fmt: str,
                    column_types: dict[str, pa.DataType] | None = None,
                    empty_is_null: bool = False, txt_column: str = "url") -> pa.Table:
    """One table file (``fmt`` of TABLE_FORMATS) as read; ``column_types`` and
    ``empty_is_null`` apply to csv/tsv, ``txt_column`` names a .txt file's one column."""
    if fmt == "parquet":
        # ParquetFile, not pq.read_table: the same table without importing pyarrow.dataset
        # and pandas, 0.1 s of every run's start before Ray can begin
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).read()
    data = read_bytes(fs, path)
    if fmt == "txt":
        lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines()]
        return pa.table({txt_column: [line for line in lines if line]})
    if fmt in ("csv", "tsv"):
        return pacsv.read_csv(
            io.BytesIO(data),
            parse_options=pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",",
                                             newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types=column_types or {},
                                                 strings_can_be_null=empty_is_null),
        )
    if fmt == "jsonl":
        return pajson.read_json(io.BytesIO(data))
    rows = json.loads(data)
    if not isinstance(rows, list):
        raise ConfigError(f"input {path!r}: a .json input must hold a list of objects")
    return pa.Table.from_pylist(rows)


# Bytes of text parsed at a time when a file is read in batches: big enough that pyarrow's
# per-call cost vanishes, small enough that a batch is a few MiB of Arrow columns.
BATCH_BYTES = 8 << 20


def peek_columns(fs: fsspec.AbstractFileSystem, path: str, fmt: str,
                 txt_column: str = "url") -> list[str]:
    """The column names of a table file from its start only (a parquet footer, a csv
    header, the first json object), so that a missing column is named before any work."""
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            return pq.read_schema(f).names
    if fmt == "txt":
        return [txt_column]
    try:
        with fs.open(path, "rb", compression="infer") as f:
            if fmt in ("csv", "tsv"):
                first = f.readline().decode("utf-8", "replace")
                return next(csv.reader([first], delimiter="\t" if fmt == "tsv" else ","), [])
            if fmt == "jsonl":
                line = next((line for line in f if line.strip()), b"{}")
                return list(json.loads(line))
            return list(_first_json_object(f))
    except OSError as err:
        raise ConfigError(f"cannot read input {path!r}: {err}") from None
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"cannot parse input {path!r} as {fmt}: {err}") from None


def _first_json_object(f) -> dict:  # noqa: ANN001 - a binary file object
    """The first object of a .json list, reading only as much of the file as it takes."""
    text, decoder = "", json.JSONDecoder()
    while chunk := f.read(1 << 16):
        text += chunk.decode("utf-8", "replace")
        start = text.lstrip().removeprefix("[").lstrip()
        if start.startswith("]"):
            return {}
        try:
            first, _ = decoder.raw_decode(start)
        except json.JSONDecodeError:
            continue  # the object goes on past what has been read
        if not isinstance(first, dict):
            raise ValueError("a .json input must hold a list of objects")
        return first
    return {}


def iter_table_batches(fs: fsspec.AbstractFileSystem, path: str, fmt: str,
                       column_types: dict[str, pa.DataType] | None = None,
                       txt_column: str = "url") -> Iterator[pa.Table]:
    """A txt, csv, tsv, json or jsonl file (gzipped or not) as consecutive tables of a few
    MiB each, never the whole file at once (but a .json list, which is one JSON value).
    ``column_types`` (csv/tsv) also picks the columns read; a csv column is typed from
    them, not inferred, since a later batch could contradict an earlier inference."""
    with fs.open(path, "rb", compression="infer") as f:
        if fmt == "txt":
            yield from _txt_batches(f, txt_column)
        elif fmt in ("csv", "tsv"):
            yield from _csv_batches(f, fmt, column_types or {})
        elif fmt == "jsonl":
            yield from _jsonl_batches(f)
        elif fmt == "json":
            rows = json.loads(f.read())
            if not isinstance(rows, list):
                raise ConfigError(f"input {path!r}: a .json input must hold a list of objects")
            step = 65536
            for start in range(0, len(rows), step):
                yield pa.Table.from_pylist(rows[start:start + step])
        else:
            raise ValueError(f"{fmt} is not a text table format")


def _txt_batches(f, column: str) -> Iterator[pa.Table]:  # noqa: ANN001
    """One url per line (str.splitlines' line ends), stripped, blank lines left out."""
    text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
    carry = ""
    while chunk := text.read(BATCH_BYTES):
        lines = (carry + chunk).splitlines()
        # the chunk's last line may go on in the next chunk (unless a line end closes it)
        carry = "" if not lines or chunk[-1] in "\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029" \
            else lines.pop()
        yield pa.table({column: [s for line in lines if (s := line.strip())]})
    if carry.strip():
        yield pa.table({column: [carry.strip()]})


def _csv_batches(f, fmt: str, column_types: dict[str, pa.DataType]) -> Iterator[pa.Table]:  # noqa: ANN001
    reader = pacsv.open_csv(
        f, read_options=pacsv.ReadOptions(block_size=BATCH_BYTES),
        parse_options=pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",",
                                         newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types=column_types,
                                             include_columns=list(column_types)))
    for batch in reader:
        yield pa.Table.from_batches([batch])


def _jsonl_batches(f) -> Iterator[pa.Table]:  # noqa: ANN001
    lines: list[bytes] = []
    size = 0
    for line in f:
        lines.append(line)
        size += len(line)
        if size >= BATCH_BYTES:
            yield from _jsonl_table(lines)
            lines, size = [], 0
    yield from _jsonl_table(lines)


def _jsonl_table(lines: list[bytes]) -> Iterator[pa.Table]:
    if any(line.strip() for line in lines):
        yield pajson.read_json(io.BytesIO(b"".join(lines)))
