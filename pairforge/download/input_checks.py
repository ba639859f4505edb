"""What preflight asks of a download's inputs, before any work: the paths exist, their
format is known, and the first table file has the named columns (its header only: the
whole input is read once, by the download)."""

from __future__ import annotations

import csv
import json

import fsspec
import pyarrow.parquet as pq

from pairforge.config import ConfigError, InputConfig
from pairforge.download.inputs import BUNDLED_SAMPLE, _expand_paths
from pairforge.sources import error_reason
from pairforge.tables import detect_format


def input_problems(cfg: InputConfig) -> list[str]:
    """Every problem with the ``input`` section's files, each naming its key."""
    if cfg.path == BUNDLED_SAMPLE:
        return []

    def format_of(fs: fsspec.AbstractFileSystem, path: str) -> str:  # as the plan decides it
        if cfg.format != "auto" or fs.isdir(path):
            return cfg.format
        return detect_format(path)

    try:
        files = [(fs, path, format_of(fs, path)) for fs, path in _expand_paths(cfg)]
        return _column_problems(cfg, *files[0]) if files else []
    except ConfigError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - any filesystem error is the user's to fix
        return [f"input.path: cannot read {cfg.path!r} ({error_reason(err)})"]


def _column_problems(cfg: InputConfig, fs: fsspec.AbstractFileSystem, path: str,
                     fmt: str) -> list[str]:
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            columns = pq.read_schema(f).names
    elif fmt in ("csv", "tsv", "jsonl"):
        with fs.open(path, "rt", compression="infer", encoding="utf-8", errors="replace") as f:
            first = f.readline()
        columns = (list(json.loads(first or "{}")) if fmt == "jsonl" else
                   next(csv.reader([first], delimiter="\t" if fmt == "tsv" else ","), []))
    else:
        return []  # folders, tars, txt and json lists: the download reads them whole
    wanted = [cfg.url_col, cfg.caption_col, *cfg.save_additional_columns]
    missing = [c for c in wanted if c and c not in columns]
    if not missing:
        return []
    return [f"input {path!r} has no column {', '.join(repr(m) for m in missing)} (columns: "
            f"{', '.join(columns)}); set input.url_col / input.caption_col / "
            "input.save_additional_columns"]
