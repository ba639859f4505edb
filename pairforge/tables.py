"""Reading one table file: txt, csv, tsv, json, jsonl (each optionally gzipped) or parquet,
local or any fsspec URL, with pyarrow.

The build's input lists (download/inputs.py) and ``pairforge recaption-eval``'s reference
tables (recaption/evaluate.py) read through here, so both take the same formats.
"""

from __future__ import annotations

import io
import json

import fsspec
import pyarrow as pa
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
