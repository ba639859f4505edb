"""Opt-out lists and block lists (``download.opt_out_lists``, ``download.block_lists``).

An opt-out list refuses a row before any request is made (status ``opted_out``, reason
``list``); a block list refuses an image by its hash after decoding, before anything of it
is written (status ``blocked``).

Opt-out list files, one entry a line (blank lines and ``#`` comments skipped):

* ``example.com``: a domain; the host and every subdomain of it;
* ``https://example.com/a/b.jpg``: one URL, exactly;
* ``https://example.com/private/*``: every URL that starts with the part before ``*``;
* ``https://example.com/private/``: a URL whose path ends in ``/`` is a folder: it and
  every URL under it, as robots.txt reads a path (``https://example.com/`` is the whole
  site). Before issue 52 such a line was one exact URL, so nothing under it was out.

Scheme and host are compared lower-cased. Block list files hold one hash a line in hex:
``sha256`` (64 digits: of the downloaded bytes), ``pixel_hash`` (32: of the decoded
pixels) or ``phash`` (16: the perceptual hash, matched within ``max_distance`` bits).

Memory stays near the entries' own size whatever the list's length: an entry is a fixed
number of bytes (a 128-bit BLAKE2b fingerprint of a domain, URL or prefix, or the hash
itself), held as a sorted array of its first 8 bytes plus the rest for the exact check.
Perceptual hashes within ``d`` bits use the pigeonhole rule: of d + 1 bands of the 64
bits, a hash within d bits of an entry equals it exactly in at least one, so each band is
a sorted array, and its candidates are checked by popcount.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import fsspec
import numpy as np

from pairforge.config import BlockListConfig, ConfigError, DownloadConfig

HEX_WIDTH = {"sha256": 64, "pixel_hash": 32, "phash": 16}
_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
                     r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_FINGERPRINT = 16  # bytes: a chance collision among 10^7 entries is ~10^-31


def fingerprint(kind: str, text: str) -> bytes:
    """128 bits of BLAKE2b of an entry of one kind (kinds never collide: the kind is the
    hash's personalisation)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=_FINGERPRINT,
                           person=kind.encode()).digest()


class FixedSet:
    """Values of one width (8 bytes or more), sorted by their first 8 bytes."""

    def __init__(self, values: bytes | bytearray, width: int):
        rows = np.frombuffer(values, np.uint8).reshape(-1, width)  # no copy of the buffer
        head = rows[:, :8].copy().view(">u8").ravel().astype(np.uint64)
        order = np.argsort(head, kind="stable")
        self.head = head[order]
        self.rest = rows[order, 8:]
        self.width = width

    def __len__(self) -> int:
        return len(self.head)

    def __contains__(self, value: bytes) -> bool:
        return self.any_of([value])

    def any_of(self, values: list[bytes]) -> bool:
        """Whether any of ``values`` is in the set: one search for all of them (a row's
        candidates), since each numpy call costs microseconds of its own."""
        if not len(self.head) or not values:
            return False
        rows = np.frombuffer(b"".join(values), np.uint8).reshape(len(values), self.width)
        heads = rows[:, :8].copy().view(">u8").ravel().astype(np.uint64)
        lo = np.searchsorted(self.head, heads, "left")
        hi = np.searchsorted(self.head, heads, "right")
        for i in np.flatnonzero(hi > lo).tolist():
            if self.width == 8 or (self.rest[lo[i]:hi[i]] == rows[i, 8:]).all(axis=1).any():
                return True
        return False

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.rest.nbytes


class PhashSet:
    """64-bit perceptual hashes, matched within ``distance`` bits (pigeonhole bands)."""

    def __init__(self, hashes: np.ndarray, distance: int):
        self.hashes = np.sort(np.asarray(hashes, np.uint64))
        self.distance = distance
        bands = distance + 1
        edges = [64 * i // bands for i in range(bands + 1)]
        self.bands: list[tuple[int, np.uint64, np.ndarray, np.ndarray]] = []
        if distance == 0:
            return
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            mask = np.uint64((1 << (hi - lo)) - 1)
            keys = ((self.hashes >> np.uint64(lo)) & mask).astype(np.uint32)
            order = np.argsort(keys, kind="stable").astype(np.uint32)
            self.bands.append((lo, mask, keys[order], order))

    def __len__(self) -> int:
        return len(self.hashes)

    def __contains__(self, phash: int) -> bool:
        value = np.uint64(phash)
        if self.distance == 0:
            at = int(np.searchsorted(self.hashes, value))
            return at < len(self.hashes) and self.hashes[at] == value
        for lo, mask, keys, order in self.bands:
            key = np.uint32((value >> np.uint64(lo)) & mask)
            start = int(np.searchsorted(keys, key, "left"))
            end = int(np.searchsorted(keys, key, "right"))
            if start < end:
                near = np.bitwise_count(self.hashes[order[start:end]] ^ value)
                if int(near.min()) <= self.distance:
                    return True
        return False

    @property
    def nbytes(self) -> int:
        return self.hashes.nbytes + sum(k.nbytes + o.nbytes for _, _, k, o in self.bands)


def _lines(path: str, storage_options: dict[str, Any]) -> Iterator[tuple[int, str]]:
    """(line number, entry) of a list file, comments and blank lines skipped."""
    try:
        with fsspec.open(path, "rt", encoding="utf-8", compression="infer",
                         **storage_options) as handle:
            for number, line in enumerate(handle, start=1):
                entry = line.split("#", 1)[0].strip()
                if entry:
                    yield number, entry
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the list file {path}: {err}") from None


def _url_form(url: str) -> str | None:
    """A URL with its scheme and host lower-cased, or None when it has no host."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    head = f"{parts.scheme}://{parts.netloc.lower()}"
    return head + url[len(head):]


def _is_folder(form: str) -> bool:
    """A URL naming a folder (a path ending in ``/``, no query): opted out with all under it."""
    parts = urlsplit(form)
    return parts.path.endswith("/") and not parts.query and not parts.fragment


# In the opt-out lists' settings fingerprint: how a line reads. A rule that changes what a
# line opts out changes the fingerprint, so a rerun redoes (or, without --redo-changed,
# refuses) the shards made under the old reading.
_OPT_OUT_RULES = b"folder-lines-are-prefixes"


@dataclass
class OptOutList:
    # every entry as fingerprint(kind, text), kind d(omain), u(rl) or p(refix): one sorted
    # set, so a URL's candidates (its host's suffixes, itself, its prefixes of the listed
    # lengths) are looked up in one search
    entries: FixedSet
    prefix_lengths: list[int]  # distinct lengths of the prefixes, ascending

    @classmethod
    def load(cls, paths: list[str], storage_options: dict[str, Any]) -> OptOutList:
        entries = bytearray()
        lengths: set[int] = set()
        for path in paths:
            for number, entry in _lines(path, storage_options):
                if "://" not in entry:
                    domain = entry.lower().rstrip(".")
                    if not _DOMAIN.match(domain):
                        raise ConfigError(f"{path}:{number}: {entry!r} is neither a domain "
                                          "nor an http(s) URL")
                    entries += fingerprint("d", domain)
                    continue
                form = _url_form(entry[:-1] if entry.endswith("*") else entry)
                if form is None or " " in entry:
                    raise ConfigError(f"{path}:{number}: {entry!r} is not an http(s) URL "
                                      "with a host")
                if entry.endswith("*") or _is_folder(form):
                    entries += fingerprint("p", form)
                    lengths.add(len(form))
                else:
                    entries += fingerprint("u", form)
        return cls(FixedSet(entries, _FINGERPRINT), sorted(lengths))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def matches(self, url: str) -> bool:
        form = _url_form(url)
        if form is None:
            return False
        labels = (urlsplit(form).hostname or "").rstrip(".").split(".")
        candidates = [fingerprint("d", ".".join(labels[i:])) for i in range(len(labels))]
        candidates.append(fingerprint("u", form))
        candidates += [fingerprint("p", form[:n]) for n in self.prefix_lengths
                       if n <= len(form)]
        return self.entries.any_of(candidates)


@dataclass
class BlockList:
    exact: dict[str, FixedSet] = field(default_factory=dict)  # sha256, pixel_hash
    phashes: list[PhashSet] = field(default_factory=list)

    @classmethod
    def load(cls, lists: list[BlockListConfig], storage_options: dict[str, Any]
             ) -> BlockList:
        values: dict[str, bytearray] = {}
        phashes: dict[int, list[int]] = {}
        for entry in lists:
            width = HEX_WIDTH[entry.kind]
            for number, text in _lines(entry.path, storage_options):
                if len(text) != width or not re.fullmatch(r"[0-9a-fA-F]+", text):
                    raise ConfigError(f"{entry.path}:{number}: a {entry.kind} is {width} hex "
                                      f"digits; found {text[:80]!r}")
                if entry.kind == "phash":
                    phashes.setdefault(entry.max_distance, []).append(int(text, 16))
                else:
                    values.setdefault(entry.kind, bytearray()).extend(bytes.fromhex(text))
        return cls({kind: FixedSet(data, HEX_WIDTH[kind] // 2) for kind, data in values.items()},
                   [PhashSet(np.array(h, np.uint64), d) for d, h in sorted(phashes.items())])

    def __len__(self) -> int:
        return sum(len(s) for s in self.exact.values()) + sum(len(s) for s in self.phashes)

    def match(self, sha256: str, pixel_hash: str, phash: int) -> str | None:
        """The kind of hash that is on a list, or None."""
        for kind, value in (("sha256", sha256), ("pixel_hash", pixel_hash)):
            if kind in self.exact and bytes.fromhex(value) in self.exact[kind]:
                return kind
        if any(phash in s for s in self.phashes):
            return "phash"
        return None


@dataclass
class Lists:
    """Both kinds of list of one run; ``None`` parts when none is configured."""

    opt_out: OptOutList | None
    block: BlockList | None

    def opted_out(self, url: str | None) -> bool:
        return bool(self.opt_out and url and self.opt_out.matches(url))

    def blocked(self, sha256: str, pixel_hash: str, phash: int) -> str | None:
        return self.block.match(sha256, pixel_hash, phash) if self.block else None


def load_lists(cfg: DownloadConfig, storage_options: dict[str, Any]) -> Lists | None:
    """The run's lists, or None when it has none; ConfigError naming the file and line of
    the first entry that does not parse."""
    if not cfg.opt_out_lists and not cfg.block_lists:
        return None
    return Lists(OptOutList.load(cfg.opt_out_lists, storage_options)
                 if cfg.opt_out_lists else None,
                 BlockList.load(cfg.block_lists, storage_options) if cfg.block_lists else None)


def list_fingerprints(cfg: DownloadConfig, storage_options: dict[str, Any]) -> dict[str, str]:
    """``{download.LIST#files: fingerprint}`` of each list file (its size and both ends, as
    model files are fingerprinted): a list that changes makes reruns redo the shards."""
    rules = {path: _OPT_OUT_RULES for path in cfg.opt_out_lists}
    paths = [*cfg.opt_out_lists, *(b.path for b in cfg.block_lists)]
    found = {}
    for path in paths:
        fs, stripped = fsspec.core.url_to_fs(path, **storage_options)
        try:
            size = int(fs.info(stripped)["size"])
            with fs.open(stripped, "rb") as handle:
                head = handle.read(1 << 20)
                handle.seek(max(0, size - (1 << 20)))
                tail = handle.read()
        except OSError as err:
            raise ConfigError(f"cannot read the list file {path}: {err}") from None
        digest = hashlib.sha256(rules.get(path, b"") + f"{size}\0".encode() + head + b"\0"
                                + tail).hexdigest()[:16]
        found[f"download.lists.{path}#files"] = digest
    return found
