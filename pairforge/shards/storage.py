"""Output folders on any fsspec filesystem, with writes a reader never sees half-done.

Local disk: write under a unique temporary name in the same folder, then rename (atomic
on POSIX). Object stores: an object appears whole only when its upload completes, so the
final name is written directly. Either way a shard counts as complete only once its
``*_stats.json`` exists, and that file is always written last.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

TEMP_MARK = ".tmp-"
# The folders under OUT (DESIGN.md section 4), named once here.
RAW_FOLDER = "raw"  # stage 1
DEDUP_FOLDER = "dedup"  # stage 2
SCORES_FOLDER = "clip"  # stage 3, CLIP scores of top_fraction mode
EMBEDDINGS_FOLDER = "embeddings"  # stage 3, optional image embeddings
SHARDS_FOLDER = "shards"  # stage 3, training shards


class OutputDir:
    def __init__(self, path: str, storage_options: dict[str, Any] | None = None):
        self.fs, self.root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        self.url = path
        self.local = "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def uri(self, *parts: str) -> str:
        """A location other libraries (webdataset, pyarrow) can open."""
        return self.fs.unstrip_protocol(self.path(*parts))

    def makedirs(self, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts), exist_ok=True)

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def glob(self, pattern: str) -> list[str]:
        return sorted(posixpath.basename(p) for p in self.fs.glob(self.path(pattern)))

    def remove(self, *parts: str) -> None:
        if self.exists(*parts):
            self.fs.rm(self.path(*parts))

    def remove_temporaries(self, *parts: str) -> int:
        """Delete temporary files a killed run left behind; returns how many."""
        folder = self.path(*parts)
        if not self.fs.exists(folder):
            return 0
        leftovers = [p for p in self.fs.ls(folder, detail=False)
                     if TEMP_MARK in posixpath.basename(p)]
        for p in leftovers:
            self.fs.rm(p)
        return len(leftovers)

    @contextmanager
    def open_atomic(self, *parts: str) -> Iterator[IO[bytes]]:
        """Open for writing; the file shows up under its name only if the block succeeds."""
        final = self.path(*parts)
        if not self.local:
            with self.fs.open(final, "wb") as f:
                yield f
            return
        temp = f"{final}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open(temp, "wb") as f:
                yield f
            self.fs.mv(temp, final)
        finally:
            if self.fs.exists(temp):
                self.fs.rm(temp)

    def write_json(self, data: Any, *parts: str) -> None:
        with self.open_atomic(*parts) as f:
            f.write(json.dumps(data, indent=2, sort_keys=True, default=str).encode())

    def read_json(self, *parts: str) -> Any:
        with self.fs.open(self.path(*parts), "rb") as f:
            return json.loads(f.read())


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
