"""WebDataset tar files written and read without webdataset, at the speed stage 3 needs.

The layout is webdataset's: one member per file of a sample, named ``KEY.EXT``, a sample's
members next to each other in extension order, read back grouped by key. The pipeline's
reading and writing workers use this module instead of webdataset itself, because
``import webdataset`` imports torch when it is installed: 1.6 s of CPU and ~300 MB in every
Ray worker that only moves bytes, paid again each time Ray starts a worker.

Why not ``tarfile`` alone: building and parsing a header in ``tarfile`` costs 25-60 us of
Python, and a training sample has five members. For a tiny tokenizer that is more than a
tenth of the model's time. So the writer fills one prebuilt ustar header per member (the
bytes ``tarfile`` writes for the same member, a test checks), and ``read_samples`` walks
plain ustar headers of an archive in memory; anything else (pax or GNU long-name headers,
names over 100 bytes, old v7 archives) goes through ``tarfile``. Headers carry a
whole-second mtime: webdataset's ``TarWriter`` stamps a float, which makes ``tarfile`` add
a pax header before every member.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import IO, Any

BLOCK = tarfile.BLOCKSIZE
_ZEROS = bytes(tarfile.RECORDSIZE)
_ZERO_BLOCK = _ZEROS[:BLOCK]  # two of them end an archive
_PLAIN_FILE, _DIRECTORY = (b"0", b"\0"), b"5"

# webdataset's split of a member name into sample key and extension (its base_plus_ext)
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def _encode(extension: str, value: Any) -> bytes | memoryview:
    if isinstance(value, bytes) or (isinstance(value, memoryview) and value.format == "B"):
        return value  # a view (read_samples hands those out) is written without a copy
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict | list) and extension == "json":
        return json.dumps(value).encode("utf-8")
    raise TypeError(f"sample file .{extension} must be bytes, str or (for json) a dict, "
                    f"not {type(value).__name__}")


def _member_info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o444
    info.uname = info.gname = "bigdata"  # as webdataset's TarWriter
    return info


class _HeaderTemplate:
    """ustar headers of read-only files with one mtime: only name, size and checksum vary."""

    def __init__(self, mtime: int) -> None:
        self.mtime = mtime
        self._blank = bytearray(_member_info("", 0, mtime).tobuf(tarfile.USTAR_FORMAT))
        self._blank[148:156] = b" " * 8  # the checksum counts its own field as spaces
        self._sum = sum(self._blank) - sum(self._blank[124:136])  # without the size field

    def header(self, name: str, size: int) -> bytes:
        encoded = name.encode("utf-8", "surrogateescape")
        if len(encoded) > 100 or size >= 8 ** 11 or not encoded.isascii():
            return _member_info(name, size, self.mtime).tobuf(
                tarfile.PAX_FORMAT, "utf-8", "surrogateescape")  # long names: a pax header
        size_field = b"%011o\0" % size
        header = self._blank.copy()
        header[:len(encoded)] = encoded
        header[124:136] = size_field
        checksum = self._sum + sum(encoded) + sum(size_field)
        header[148:155] = b"%06o\0" % checksum
        return bytes(header)


def archive_end(written: int) -> bytes:
    """What ends an archive of ``written`` bytes of members: two zero blocks, padded to a
    whole record as ``tarfile`` does."""
    end = 2 * BLOCK
    return bytes(end + -(written + end) % tarfile.RECORDSIZE)


class SampleTarWriter:
    """Writes samples to a binary stream; ``close`` ends the archive (the stream stays open)."""

    def __init__(self, stream: IO[bytes], mtime: int | None = None) -> None:
        self._stream = stream
        self._headers = _HeaderTemplate(int(time.time()) if mtime is None else int(mtime))
        self._offset = 0
        self._closed = False

    def write(self, key: str, files: dict[str, Any]) -> int:
        """One sample: ``files`` maps extension to bytes, str or (json) a dict. Returns bytes."""
        total = 0
        for extension in sorted(files):
            data = _encode(extension, files[extension])
            header = self._headers.header(f"{key}.{extension}", len(data))
            padding = -len(data) % BLOCK
            self._stream.write(header)
            self._stream.write(data)
            self._stream.write(_ZEROS[:padding])
            self._offset += len(header) + len(data) + padding
            total += len(data)
        return total

    def close(self) -> None:
        """End the archive (``archive_end``)."""
        if self._closed:
            return
        self._stream.write(archive_end(self._offset))
        self._closed = True

    def __enter__(self) -> SampleTarWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def split_member_name(name: str) -> tuple[str | None, str | None]:
    """``("dir/KEY", "EXT.EXT")`` of a member name; ``(None, None)`` if it has no extension."""
    match = _KEY_AND_EXTENSION.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


def _group_by_key(members: Iterable[tuple[str, bytes | memoryview]]
                  ) -> Iterator[tuple[str, dict[str, bytes | memoryview]]]:
    key: str | None = None
    files: dict[str, bytes | memoryview] = {}
    for name, data in members:
        member_key, extension = split_member_name(name)
        if member_key is None:
            continue
        if member_key != key:
            if key is not None:
                yield key, files
            key, files = member_key, {}
        files[extension.lower()] = data
    if key is not None:
        yield key, files


def tar_mtime(stream: IO[bytes]) -> int | None:
    """The header time of an archive's first member (None: an empty archive)."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        first = next(iter(tar), None)
        return int(first.mtime) if first is not None else None


def _tarfile_members(stream: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            if info.isfile():
                yield info.name, tar.extractfile(info).read()


def iter_samples(stream: IO[bytes]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` per sample, in file order, streaming; members without
    an extension (directories, stray files) are skipped."""
    return _group_by_key(_tarfile_members(stream))


def read_samples(archive: bytes) -> Iterator[tuple[str, dict[str, bytes | memoryview]]]:
    """What ``iter_samples`` gives, from a whole archive in memory (as views into it for
    the plain ustar archives this module writes, ~3x faster; through tarfile otherwise)."""
    members = _plain_members(archive)
    if members is None:
        return iter_samples(io.BytesIO(archive))
    return _group_by_key(members)


class _NotPlain(Exception):
    """An archive with other headers than plain ustar ones: ``tarfile`` reads it."""


class _Damaged(tarfile.ReadError):
    """A header whose checksum fails, or a header or member cut short."""


def _plain_headers(stream: IO[bytes]) -> Iterator[tuple[str | None, int, int]]:
    """``(name, data offset, data size)`` of each member of a plain ustar archive, in file
    order, up to its end (the first zero block, or the end of the stream); a directory's
    name is None. Seeks over the data, so an archive on disk is never read whole. Raises
    ``_NotPlain`` at any other header (pax or GNU, a name with a prefix, v7), ``_Damaged``
    at a checksum that fails or a header or member cut short."""
    length = stream.seek(0, io.SEEK_END)
    position = stream.seek(0)
    while position < length:
        header = stream.read(BLOCK)
        if header == _ZERO_BLOCK:
            return
        if len(header) < BLOCK:
            raise _Damaged(f"a header cut short at byte {position}")
        if not _checksum_holds(header):
            raise _Damaged(f"the header at byte {position} fails its checksum")
        kind = header[156:157]
        if kind not in (*_PLAIN_FILE, _DIRECTORY) or header[257:262] != b"ustar" or header[345]:
            raise _NotPlain  # pax / GNU headers, a name with a prefix, a v7 archive
        size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        start = position + BLOCK
        end = start + size + (-size % BLOCK)
        if end > length:
            raise _Damaged(f"the member at byte {position} is cut short")
        name = (None if kind == _DIRECTORY
                else header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
        yield name, start, size
        position = stream.seek(end)


def _plain_members(archive: bytes) -> list[tuple[str, memoryview]] | None:
    """``(name, data)`` of each file of a plain ustar archive; None when ``tarfile`` must
    read it (``_plain_headers``; for a damaged one it raises as it does when streaming).
    The data are views into ``archive``, not copies: a shard's images are not held twice."""
    view = memoryview(archive)
    try:
        return [(name, view[start:start + size])
                for name, start, size in _plain_headers(io.BytesIO(archive))
                if name is not None]
    except (_NotPlain, _Damaged):
        return None


def members_end(stream: IO[bytes]) -> int:
    """Where an archive's members end and its end-of-archive blocks begin (through
    ``tarfile`` for an archive that is not plain ustar); ``tarfile.ReadError`` for a damaged
    one. Leaves the stream anywhere."""
    try:
        end = 0
        for _, start, size in _plain_headers(stream):
            end = start + size + (-size % BLOCK)  # the member's data, padded to a block
        return end
    except _NotPlain:
        stream.seek(0)
        with tarfile.open(fileobj=stream) as archive:  # reads the headers, seeks over data
            members = archive.getmembers()
        return members[-1].offset_data + -(-members[-1].size // BLOCK) * BLOCK if members else 0


def copy_members(source: IO[bytes], sink: IO[bytes], chunk: int = 1 << 22) -> int:
    """Copy an archive's members, without its end-of-archive blocks, into ``sink`` a chunk
    at a time (an archive can be large); returns how many bytes. Archives copied one after
    another and then ``archive_end`` are one archive."""
    left = end = members_end(source)
    source.seek(0)
    while left:
        data = source.read(min(chunk, left))
        if not data:
            raise tarfile.ReadError("the archive ended inside its members")
        sink.write(data)
        left -= len(data)
    return end


def _checksum_holds(header: bytes) -> bool:
    try:
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(header) - sum(header[148:156]) + 8 * ord(" ")
