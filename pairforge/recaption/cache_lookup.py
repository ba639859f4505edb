"""Lookups in the caption cache's index (recaption/cache_index.py), a batch at a time.

What a recaption actor holds of the cache: the newest generation's marker, the
partitions the latest batches touched (an LRU bounded by bytes, ``max_bytes``), and the
*tail*: log parts that generation does not hold, read whole when they are few (a direct
use of the step, or an actor restarted while its build wrote shards; stage 3 compacts
before its actors start, so normally there is none). The answers are those of
``CaptionCache.load`` over every log part (recaption/cache.py):

- exact pixel hash: the last entry in log order;
- perceptual hash within ``phash_distance``: the first match in band order, then in log
  order (the bands of the generation built for this distance);
- the embedding tier: the highest cosine, the first in log order among equals, when it
  reaches ``embedding_threshold``, over the stored vectors of the ``probes`` clusters
  nearest the image's vector (an inverted file: cache_index.py clusters the vectors), so
  a lookup's cost follows the probes, not the vectors stored; with every cluster probed
  it is the exact search. A generation from before the clusters is scanned whole, in
  chunks.

A batch's hashes are grouped by partition, and each partition is read once per batch
(and held one at a time beyond the LRU). A band partition is held as its keys only; its
captions are read for the rows that match.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.dedup.semantic import assign, normalise
from pairforge.recaption.cache import CachedCaption
from pairforge.recaption.cache_index import (
    BAND_SCHEMA,
    EXACT_SCHEMA,
    ORDER,
    VECTOR_SCHEMA,
    band_prefix,
    band_values,
    cluster_path,
    exact_prefix,
    index_rows,
    last_per_hash,
    list_logs,
    newest_marker,
    part_path,
    read_centroids,
    read_log,
    vectors_path,
)
from pairforge.recaption.cache_pins import PIN_S, pin
from pairforge.shards.storage import OutputDir

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 32 << 20  # partitions an actor keeps between batches
ENTRY_COLUMNS = ["recaption", "flags", "log", "row"]
TAIL_ROWS = 1 << 16  # more unheld log rows than this: the tail is left out (a warning)

Order = tuple[str, int]  # (log part, row): log order
Hit = tuple[CachedCaption, str]


class PartitionLRU:
    """Partitions by key, the least recently used dropped beyond ``max_bytes`` (one
    partition larger than that is still held, alone)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.reads = 0

    def get(self, key: Any, load: Callable[[], tuple[Any, int]]) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key][0]
        value, size = load()
        self.reads += 1
        self.items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self.items) > 1:
            _, (_, dropped) = self.items.popitem(last=False)
            self.bytes -= dropped
        return value


@dataclass
class Rows:
    """Index rows in log order, with what each tier compares held as arrays."""

    table: pa.Table

    def entry(self, i: int) -> tuple[Order, CachedCaption]:
        flags = self.table["flags"][i].as_py() or ()
        return ((self.table["log"][i].as_py(), self.table["row"][i].as_py()),
                CachedCaption(self.table["recaption"][i].as_py(), tuple(flags)))


class ExactRows(Rows):
    def find(self, hashes: list[str]) -> list[int | None]:
        """The row of each hash (one row per hash: the last in log order)."""
        return pc.index_in(pa.array(hashes, pa.string()),
                           value_set=self.table["pixel_hash"]).to_pylist()


class BandRows:
    """A band partition's keys as arrays; its entries (captions) are read only for the
    rows that match, since most near lookups miss (``entries``: the table, or how to
    read it)."""

    def __init__(self, keys: pa.Table, entries: pa.Table | Callable[[], pa.Table]) -> None:
        self.band = keys["band"].to_numpy()
        self.bits = keys["bits"].to_numpy()
        self.phash = keys["phash"].to_numpy()
        self.entries = entries

    def entries_at(self, rows: list[int]) -> list[tuple[Order, CachedCaption]]:
        table = self.entries if isinstance(self.entries, pa.Table) else self.entries()
        found = Rows(table.take(rows))
        return [found.entry(i) for i in range(len(rows))]

    def first_near(self, band: int, bits: int, phash: int, distance: int) -> int | None:
        """The first row of band ``band`` holding ``bits`` within ``distance`` of ``phash``."""
        rows = np.flatnonzero((self.band == band) & (self.bits == np.uint64(bits)))
        close = rows[np.bitwise_count(self.phash[rows] ^ np.uint64(phash)) <= distance]
        return int(close[0]) if len(close) else None


class VectorRows(Rows):
    def __init__(self, table: pa.Table) -> None:
        super().__init__(table)
        flat = pc.list_flatten(table["embedding"]).to_numpy()
        self.matrix = flat.reshape(len(table), -1) if len(table) else np.zeros((0, 0), "f4")


def _nbytes(rows: Rows | BandRows) -> int:
    arrays = [getattr(rows, a) for a in ("band", "bits", "phash", "matrix") if hasattr(rows, a)]
    table = rows.table if isinstance(rows, Rows) else None
    return (table.nbytes if table is not None else 0) + sum(a.nbytes for a in arrays)


def _parquet(handle: Any) -> pq.ParquetFile:
    """An index file read in the calling thread: no pre-buffering (arrow's I/O threads),
    and the callers decode with ``use_threads=False`` (arrow's CPU threads). A buffer
    decoded in a worker thread and freed in this one leaves pages in that thread's
    allocator heap: over ~10^4 reads of ~1 MiB clusters that kept growing the actor's RSS
    (+190 MiB with 8 arrow threads at 10^6 vectors) while the partitions it held stayed
    at 32 MiB (bench/RESULTS.md)."""
    return pq.ParquetFile(handle, pre_buffer=False, read_dictionary=["log"])


def _read(folder: OutputDir, path: str, columns: list[str]) -> pa.Table:
    """Some columns of an index file; the log part's name as a dictionary (a partition's
    rows come from few parts)."""
    with folder.fs.open(path, "rb") as f:
        return _parquet(f).read(columns=columns, use_threads=False
                                ).replace_schema_metadata(None)


def _take_best(chunk: VectorRows, queries: np.ndarray, asking: np.ndarray,
               best: list[tuple[float, Order, CachedCaption] | None]) -> None:
    """Update each asking query's best (highest cosine, the first in log order among
    equals) with the chunk's vectors."""
    cosines = chunk.matrix @ queries[asking].T  # (stored, asking)
    top = np.argmax(cosines, axis=0)  # the first of equals
    for column, (q, at) in enumerate(zip(asking.tolist(), top.tolist(), strict=True)):
        score = float(cosines[at, column])
        order, entry = chunk.entry(at)
        held = best[q]
        if held is None or score > held[0] or (score == held[0] and order < held[1]):
            best[q] = (score, order, entry)


class IndexedCaptionCache:
    """The recaption step's view of one identity's cache (see the module doc)."""

    def __init__(self, folder: OutputDir | None, phash_distance: int = 0,
                 embedding_threshold: float | None = None,
                 max_bytes: int = DEFAULT_CACHE_BYTES, probes: int = 8) -> None:
        """``folder``: the identity's folder (None: the cache is off, nothing is found);
        ``probes``: the vector clusters the embedding tier searches per image."""
        self.folder = folder
        self.phash_distance = phash_distance
        self.embedding_threshold = embedding_threshold
        self.probes = probes
        self.centroids: tuple[str, np.ndarray] | None = None  # (generation, centroids)
        there = folder is not None and folder.exists()
        self.marker = newest_marker(folder, phash_distance) if there else None
        self.partitions = PartitionLRU(max_bytes)
        self.holder = uuid.uuid4().hex[:12]
        self.pinned_until = 0.0
        self._renew_pin()
        self.tail = self._read_tail() if there else None

    def _renew_pin(self) -> None:
        """Keep this generation from other builds' cleanup while lookups go on (the pin
        lapses PIN_S after the last renewal: an actor that stopped frees it)."""
        if self.marker is not None and time.time() > self.pinned_until - PIN_S / 2:
            self.pinned_until = pin(self.folder, self.marker["folder"], self.holder)

    def _answered(self, lookup: Callable[[], dict[int, Hit]]) -> dict[int, Hit]:
        """``lookup()``, after renewing the pin; if the generation is gone all the same
        (its pin lapsed while this actor was idle, or a cleanup ran between reading the
        marker and the first pin), once more on the newest generation."""
        self._renew_pin()
        try:
            return lookup()
        except FileNotFoundError:
            if self.marker is None:
                raise
            gone = self.marker["folder"]
            self.marker = newest_marker(self.folder, self.phash_distance)
            self.partitions = PartitionLRU(self.partitions.max_bytes)
            self.pinned_until = 0.0
            self._renew_pin()
            log.warning("caption cache %s: index generation %s is gone; reading %s",
                        self.folder.url, gone, self.marker and self.marker["folder"])
            return lookup()

    def _read_tail(self) -> tuple[ExactRows, BandRows, VectorRows] | None:
        held = self.marker["logs"] if self.marker else {}
        logs = list_logs(self.folder)
        unheld = [n for n in sorted(logs) if held.get(n) != logs[n]]
        if not unheld:
            return None
        rows = 0
        for name in unheld:
            with self.folder.fs.open(self.folder.path(name), "rb") as f:
                rows += pq.ParquetFile(f).metadata.num_rows
        if rows > TAIL_ROWS:
            log.warning("caption cache %s: %d rows not in its index yet; left out until the "
                        "next compaction", self.folder.url, rows)
            return None
        found = [index_rows(read_log(self.folder, n), n, self.phash_distance) for n in unheld]
        exact = pa.concat_tables([EXACT_SCHEMA.empty_table(), *(f[0] for f in found)])
        bands = pa.concat_tables([BAND_SCHEMA.empty_table(), *(f[1] for f in found)])
        vectors = pa.concat_tables([VECTOR_SCHEMA.empty_table(), *(f[2] for f in found)])
        bands = bands.sort_by(ORDER)
        return ExactRows(last_per_hash(exact)), BandRows(bands, bands), VectorRows(vectors)

    def _partition(self, kind: str, prefix: int) -> ExactRows | BandRows:
        path = part_path(self.folder, self.marker, kind, prefix)

        def load() -> tuple[ExactRows | BandRows, int]:
            if kind == "exact":
                rows = ExactRows(_read(self.folder, path, EXACT_SCHEMA.names))
            else:
                rows = BandRows(_read(self.folder, path, ["band", "bits", "phash"]),
                                lambda: _read(self.folder, path, ENTRY_COLUMNS))
            return rows, _nbytes(rows)

        return self.partitions.get((kind, prefix), load)

    @property
    def wants_embeddings(self) -> bool:
        stored = (self.marker or {}).get("counts", {}).get("vectors", 0)
        tail = len(self.tail[2].table) if self.tail else 0
        return self.embedding_threshold is not None and bool(stored or tail)

    # -- exact and near tiers ---------------------------------------------------------

    def lookup_batch(self, hashes: list[str], phashes: list[int | None]) -> dict[int, Hit]:
        """The exact and perceptual-hash hits of a batch, by row."""
        return self._answered(lambda: self._lookup_batch(hashes, phashes))

    def _lookup_batch(self, hashes: list[str], phashes: list[int | None]) -> dict[int, Hit]:
        found = {i: (entry, "cache") for i, (_, entry) in self._exact(hashes).items()}
        if self.phash_distance:
            near = [(i, p) for i, p in enumerate(phashes) if i not in found and p is not None]
            found.update((i, (entry, "cache_phash")) for i, entry in self._near(near).items())
        return found

    def _exact(self, hashes: list[str]) -> dict[int, tuple[Order, CachedCaption]]:
        best: dict[int, tuple[Order, CachedCaption]] = {}

        def take(rows: ExactRows, wanted: list[int]) -> None:
            for i, at in zip(wanted, rows.find([hashes[i] for i in wanted]), strict=True):
                if at is not None:
                    order, entry = rows.entry(at)
                    if i not in best or order > best[i][0]:  # the last in log order
                        best[i] = (order, entry)

        if self.marker is not None and hashes:
            prefixes = exact_prefix(pa.array(hashes, pa.string()), self.marker["exact_bits"])
            for prefix in np.unique(prefixes).tolist():  # one partition held at a time
                take(self._partition("exact", prefix),
                     np.flatnonzero(prefixes == prefix).tolist())
        if self.tail is not None:
            take(self.tail[0], list(range(len(hashes))))
        return best

    def _near(self, queries: list[tuple[int, int]]) -> dict[int, CachedCaption]:
        """First match in band order, then in log order, for each (row, phash)."""
        if not queries:
            return {}
        distance = self.phash_distance
        values = band_values(np.array([p for _, p in queries], np.uint64), distance)
        firsts: dict[tuple[int, int], tuple[Order, CachedCaption]] = {}
        if self.marker is not None:
            self._near_in_index(queries, values, firsts)
        found: dict[int, CachedCaption] = {}
        for q, (i, phash) in enumerate(queries):
            for band in range(distance + 1):
                candidates = [firsts[(q, band)]] if (q, band) in firsts else []
                if self.tail is not None:
                    at = self.tail[1].first_near(band, int(values[band][q]), phash, distance)
                    if at is not None:
                        candidates.extend(self.tail[1].entries_at([at]))
                if candidates:
                    found[i] = min(candidates, key=lambda c: c[0])[1]
                    break
        return found

    def _near_in_index(self, queries: list[tuple[int, int]], values: list[np.ndarray],
                       firsts: dict[tuple[int, int], tuple[Order, CachedCaption]]) -> None:
        bits = self.marker["bands_bits"]
        prefixes = [band_prefix(np.full(len(queries), band), v, bits)
                    for band, v in enumerate(values)]
        for prefix in np.unique(np.concatenate(prefixes)).tolist():
            rows = self._partition("bands", prefix)
            matched: dict[tuple[int, int], int] = {}
            for band, of_band in enumerate(prefixes):
                for q in np.flatnonzero(of_band == prefix).tolist():
                    at = rows.first_near(band, int(values[band][q]), queries[q][1],
                                         self.phash_distance)
                    if at is not None:
                        matched[(q, band)] = at
            if matched:
                firsts.update(zip(matched, rows.entries_at(list(matched.values())),
                                  strict=True))

    # -- embedding tier ---------------------------------------------------------------

    def lookup_embeddings(self, vectors: dict[int, Any]) -> dict[int, Hit]:
        """The embedding tier's hits of the rows whose vectors are given."""
        if not vectors or not self.wants_embeddings:
            return {}
        return self._answered(lambda: self._lookup_embeddings(vectors))

    def _lookup_embeddings(self, vectors: dict[int, Any]) -> dict[int, Hit]:
        rows = list(vectors)
        queries = np.stack([np.asarray(vectors[i], dtype=np.float32) for i in rows])
        best: list[tuple[float, Order, CachedCaption] | None] = [None] * len(rows)
        everyone = np.arange(len(rows))
        for chunk, asking in self._vector_chunks(queries):
            if len(chunk.table) and len(asking):
                _take_best(chunk, queries, asking, best)
        if self.tail is not None:
            _take_best(self.tail[2], queries, everyone, best)
        return {i: (b[2], "cache_embedding") for i, b in zip(rows, best, strict=True)
                if b is not None and b[0] >= self.embedding_threshold}

    def _vector_chunks(self, queries: np.ndarray) -> Iterator[tuple[VectorRows, np.ndarray]]:
        """The stored vectors each query is compared with: the clusters nearest it
        (``probes`` of them), each read once for the queries that probe it; in a generation
        from before the clusters, every vector, chunk by chunk."""
        clusters = (self.marker or {}).get("clusters", 0)
        if clusters:
            centroids = self._centroids()
            probes = min(self.probes, clusters)
            probed = assign(normalise(queries), centroids, probes=probes).reshape(
                len(queries), probes)
            for cluster in np.unique(probed).tolist():
                asking = np.flatnonzero((probed == cluster).any(axis=1))
                yield self._cluster(cluster), asking
        elif (self.marker or {}).get("counts", {}).get("vectors", 0):
            path = vectors_path(self.folder, self.marker)
            with self.folder.fs.open(path, "rb") as f:
                groups = pq.ParquetFile(f).num_row_groups
            for group in range(groups):
                yield self._vector_chunk(path, group), np.arange(len(queries))

    def _centroids(self) -> np.ndarray:
        if self.centroids is None or self.centroids[0] != self.marker["folder"]:
            self.centroids = (self.marker["folder"], read_centroids(self.folder, self.marker))
        return self.centroids[1]

    def _cluster(self, cluster: int) -> VectorRows:
        path = cluster_path(self.folder, self.marker, cluster)

        def load() -> tuple[VectorRows, int]:
            rows = VectorRows(_read(self.folder, path, VECTOR_SCHEMA.names))
            return rows, _nbytes(rows)

        return self.partitions.get(("vectors", self.marker["folder"], cluster), load)

    def _vector_chunk(self, path: str, group: int) -> VectorRows:
        def load() -> tuple[VectorRows, int]:
            with self.folder.fs.open(path, "rb") as f:
                table = _parquet(f).read_row_group(group, VECTOR_SCHEMA.names,
                                                   use_threads=False)
            rows = VectorRows(table.replace_schema_metadata(None))
            return rows, _nbytes(rows)

        return self.partitions.get(("vectors", group), load)

    # -- one row ----------------------------------------------------------------------

    def lookup(self, pixel_hash: str, phash: int | None, embedding: Any = None) -> Hit | None:
        """(entry, tier) for the first tier that answers, as ``CaptionCache.lookup``."""
        hit = self.lookup_batch([pixel_hash], [phash]).get(0)
        if hit is None and embedding is not None:
            hit = self.lookup_embeddings({0: embedding}).get(0)
        return hit
