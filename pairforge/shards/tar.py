"""WebDataset tar files read and written with the standard library's ``tarfile``.

The layout is webdataset's: one member per file of a sample, named ``KEY.EXT``, a sample's
members next to each other in extension order, read back grouped by key. The pipeline's
reading and writing workers use this module instead of webdataset itself, because
``import webdataset`` imports torch when it is installed: 1.6 s of CPU and ~300 MB in every
Ray worker that only moves bytes, paid again each time Ray starts a worker.

Headers carry a whole-second mtime. webdataset's ``TarWriter`` stamps a float, which makes
``tarfile`` add a pax header before every member: twice the headers to write and to parse.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any

# webdataset's split of a member name into sample key and extension (its base_plus_ext)
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def _encode(extension: str, value: Any) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict | list) and extension == "json":
        return json.dumps(value).encode("utf-8")
    raise TypeError(f"sample file .{extension} must be bytes, str or (for json) a dict, "
                    f"not {type(value).__name__}")


class SampleTarWriter:
    """Writes samples to a binary stream; ``close`` ends the archive (the stream stays open)."""

    def __init__(self, stream: IO[bytes], mtime: int | None = None) -> None:
        self._tar = tarfile.open(fileobj=stream, mode="w|")  # noqa: SIM115 - close() ends it
        self._mtime = int(time.time()) if mtime is None else int(mtime)

    def write(self, key: str, files: dict[str, Any]) -> int:
        """One sample: ``files`` maps extension to bytes, str or (json) a dict. Returns bytes."""
        total = 0
        for extension in sorted(files):
            data = _encode(extension, files[extension])
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode = len(data), self._mtime, 0o444
            info.uname = info.gname = "bigdata"  # as webdataset's TarWriter
            self._tar.addfile(info, io.BytesIO(data))
            total += len(data)
        return total

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> SampleTarWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def split_member_name(name: str) -> tuple[str | None, str | None]:
    """``("dir/KEY", "EXT.EXT")`` of a member name; ``(None, None)`` if it has no extension."""
    match = _KEY_AND_EXTENSION.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


def iter_samples(stream: IO[bytes]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` per sample, in file order; members without an
    extension (directories, stray files) are skipped."""
    key: str | None = None
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            if not info.isfile():
                continue
            member_key, extension = split_member_name(info.name)
            if member_key is None:
                continue
            if member_key != key:
                if key is not None:
                    yield key, files
                key, files = member_key, {}
            files[extension.lower()] = tar.extractfile(info).read()
    if key is not None:
        yield key, files
