"""What preflight asks of the output folder before any work: it can be created (as the run
would) and a probe file written and deleted there, on any fsspec filesystem; a local
folder the probe made is removed again, so a run that stops at preflight leaves nothing."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from pairforge.shards.storage import OutputDir
from pairforge.sources import error_reason


def output_problems(path: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The ``output.path`` problem, if any: created, written and cleaned up, or why not."""
    created: Path | None = None  # local only: object stores have no folders to undo
    try:
        out = OutputDir(path, storage_options)
        created = _first_missing_folder(out.root) if out.local else None
        out.makedirs()
        probe = out.path(f".pairforge-write-probe-{uuid.uuid4().hex}")
        with out.fs.open(probe, "wb") as f:
            f.write(b"probe")
        out.fs.rm(probe)
    except Exception as err:  # noqa: BLE001 - local, S3, GCS ... each raise their own kind
        hint = _local_hint(path, err) if isinstance(err, OSError) else ""
        return [f"output.path: cannot create or write {path} ({error_reason(err)}){hint}"]
    finally:
        if created is not None:
            _remove_empty_folders(Path(out.root), created)
    return []


def _local_hint(path: str, err: OSError) -> str:
    """Which part of a local path is in the way: a file where a folder must be, or a folder
    (such as /proc) that refuses new entries."""
    for folder in Path(path).expanduser().parents:
        if folder.is_file():
            return f": {folder} is a file, not a folder"
        if folder.is_dir():
            refused = isinstance(err, (FileNotFoundError, PermissionError))
            return f": {folder} exists but refuses new folders" if refused else ""
    return ""


def _first_missing_folder(path: str) -> Path | None:
    """The topmost folder of ``path`` that does not exist yet (None: it all exists)."""
    missing = None
    for folder in [Path(path), *Path(path).parents]:
        if folder.exists():
            return missing
        missing = folder
    return missing


def _remove_empty_folders(leaf: Path, top: Path) -> None:
    """Undo the probe's folders, so a run that stops here leaves nothing behind; the run
    makes them again."""
    folder = leaf
    try:
        while True:
            folder.rmdir()  # only ever empty folders: the probe file is gone
            if folder == top:
                return
            folder = folder.parent
    except OSError:
        return
