"""Output folders on any fsspec filesystem, with writes a reader never sees half-done.

Local disk: write under a unique temporary name in the same folder, then rename (atomic
on POSIX). Object stores (S3, GCS, ...) have no rename, but an object appears whole only
when its upload completes (a one-shot PUT, or CompleteMultipartUpload for big ones), so
the final name is written directly and the upload happens on close. A writer that fails
aborts its upload instead of closing, and a killed writer never completes it, so no
object is ever half there. Either way a shard counts as complete only once its
``*_stats.json`` exists, and that file is always written last: a whole tar without its
stats file (a writer killed between the two) is redone by the next run.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec.spec import AbstractBufferedFile

TEMP_MARK = ".tmp-"
# The folders under OUT (DESIGN.md section 4), named once here.
RAW_FOLDER = "raw"  # stage 1
DEDUP_FOLDER = "dedup"  # stage 2
SCORES_FOLDER = "clip"  # stage 3, CLIP scores of top_fraction mode
EMBEDDINGS_FOLDER = "embeddings"  # stage 3, optional image embeddings
SHARDS_FOLDER = "shards"  # stage 3, training shards
# stage 3 while it runs: each shard's rows as the chain's last tasks wrote them (with their
# images), until the shard's writer joins them (pipeline/stream.py)
FRAGMENTS_FOLDER = "process-work"
MANIFEST = "manifest.json"  # the dataset's manifest, at the top of OUT


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
        self._forget_listings()
        return self.fs.exists(self.path(*parts))

    def glob(self, pattern: str) -> list[str]:
        self._forget_listings()
        return sorted(posixpath.basename(p) for p in self.fs.glob(self.path(pattern)))

    def _forget_listings(self) -> None:
        # Object-store filesystems cache listings per process; other processes (Ray
        # workers on any node) add shards all the time, so completeness is always asked
        # of the store itself.
        if not self.local:
            self.fs.invalidate_cache()

    def remove(self, *parts: str) -> None:
        if self.exists(*parts):
            self.fs.rm(self.path(*parts))

    def remove_temporaries(self, *parts: str) -> int:
        """Delete temporary files a killed run left behind; returns how many."""
        folder = self.path(*parts)
        if not self.exists(*parts):
            return 0
        leftovers = [p for p in self.fs.ls(folder, detail=False)
                     if TEMP_MARK in posixpath.basename(p)]
        for p in leftovers:
            self.fs.rm(p)
        return len(leftovers)

    @contextmanager
    def open_atomic(self, *parts: str) -> Iterator[IO[bytes]]:
        """Open for writing; the file shows up under its name only if the block succeeds."""
        with atomic_writer(self.fs, self.path(*parts), self.local) as f:
            yield f

    def write_json(self, data: Any, *parts: str) -> None:
        with self.open_atomic(*parts) as f:
            f.write(json.dumps(data, indent=2, sort_keys=True, default=str).encode())

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open(self.path(*parts), "rb") as f:
            return f.read()


@contextmanager
def atomic_writer(fs: fsspec.AbstractFileSystem, path: str,
                  local: bool | None = None) -> Iterator[IO[bytes]]:
    """Write ``path`` so that it exists whole or not at all (see the module docstring)."""
    if local is None:
        local = "file" in _protocols(fs)
    if not local:
        with _whole_object(fs, path) as f:
            yield f
        return
    temp = f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(temp, "wb") as f:
            yield f
        fs.mv(temp, path)
    finally:
        if fs.exists(temp):
            fs.rm(temp)


@contextmanager
def _whole_object(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[IO[bytes]]:
    """The object is uploaded on close, so close only when the block succeeded: fsspec's
    own ``with`` would close, and so publish, a half-written object after an error."""
    f = fs.open(path, "wb")
    try:
        yield f
    except BaseException:
        _abandon(fs, path, f)
        raise
    f.close()


def _abandon(fs: fsspec.AbstractFileSystem, path: str, f: IO[bytes]) -> None:
    if isinstance(f, AbstractBufferedFile):
        f.discard()  # s3fs/gcsfs: aborts a started multipart upload; nothing was PUT
        f.closed = True  # skip close(): it would flush, i.e. upload what we have
        return
    # A file class we do not know: it may publish on close, so remove what it published.
    try:
        f.close()
    finally:
        if fs.exists(path):
            fs.rm(path)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
