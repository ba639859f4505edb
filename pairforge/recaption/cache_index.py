"""The caption cache's index: the log folded into partitions that are read by lookup.

Each output shard's writer appends a log part (``CACHE/IDENTITY/BUILD-SHARD.parquet``,
recaption/cache.py's ``write_part``). A *compaction* folds the log parts that the newest
index generation does not hold into a new generation under ``CACHE/IDENTITY/index/``:

- ``gen-NNNNNN-TOKEN/exact/part-P.parquet``: by prefix ``P`` of the pixel hash's
  ``string_hash``, the entry that answers an exact lookup of each pixel hash (the last in
  log order);
- ``gen-NNNNNN-TOKEN/bands/part-P.parquet``: every entry the near tier may serve, once
  per pigeonhole band of its perceptual hash (``phash_distance + 1`` bands), by prefix of
  the band's hash, in log order;
- ``gen-NNNNNN-TOKEN/vectors/part-C.parquet``: the stored vectors of entries the
  embedding tier may serve, by cluster ``C`` (the nearest of ``centroids.npy``: spherical
  k-means, ``dedup/semantic.py``'s, about ``VECTOR_ROWS_PER_CLUSTER`` vectors a cluster,
  at most ``MAX_CLUSTERS``),
  in log order; a lookup searches the clusters nearest its vector (an inverted-file
  layout), so its cost follows the probes, not the vectors stored. The centroids are
  trained at a rebuild on a bounded sample and kept by the generations that extend it,
  until the vectors have grown ``RECLUSTER_GROWTH`` times: then the compaction rebuilds;
- ``gen-NNNNNN-TOKEN.json``: the generation's marker, written last and atomically. It
  names the folder, the prefix bits, the ``phash_distance`` the bands were made for, the
  clusters, and every log part the generation holds, with its size. Generations are
  immutable.

*Log order* is ``CaptionCache.load``'s: parts by name, rows in order. Each index row
carries its ``log`` and ``row``, so merges and lookups keep that order however the parts
were folded in (a new build's parts may sort before older ones).

A compaction is a plan (the driver lists and counts, never reads rows), scatter tasks
over groups of log parts writing partitioned files (``dedup/shuffle.py``'s
``write_parts``: one file per task, one row group per partition) into
``work-NNNNNN-TOKEN/``, merge tasks per group of partitions (the previous generation's
partition plus the new rows), and the commit. A log part that changed or vanished, or
another ``phash_distance``, rebuilds from every log part. A stopped compaction leaves a
work folder and an unmarked generation folder; a later commit deletes them once their pin
has lapsed.

**Pins.** A commit keeps the newest ``KEEP_GENERATIONS`` generations and whatever is
*pinned*: ``index/pin-NAME-HOLDER.json`` says that NAME (a generation or work folder) is in
use until a time. A recaption actor pins the generation it reads (``PIN_S``, renewed at
half its life while it looks up), so a long build keeps its generation however many
builds sharing the folder commit meanwhile; a compaction pins its work, its new
generation and the generation it merges from (``COMPACTION_PIN_S``) until its commit, so
two builds compacting one folder at once never delete each other's work. Markers are
named by generation and token (``gen-NNNNNN-TOKEN.json``): two compactions planned from
the same generation both commit, and the next one plans from the newest by name. A pin
that lapses (its holder died) frees what it named at the next commit; a reader whose
generation is gone after all reads the newest one (``cache_lookup.py``).
"""

from __future__ import annotations

import posixpath
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.dedup.index_writing import index_part_name, index_prefix_bits
from pairforge.dedup.semantic import (
    assign,
    default_clusters,
    kmeans,
    normalise,
    sample_mask,
    sample_size,
)
from pairforge.dedup.shuffle import (
    mix64,
    read_part,
    read_tables,
    string_hash,
    write_parts,
    write_table,
)
from pairforge.recaption.cache import CACHE_SCHEMA, mentions_text
from pairforge.recaption.cache_pins import COMPACTION_PIN_S, INDEX_FOLDER, pin, pinned, unpin
from pairforge.shards.storage import OutputDir, atomic_writer

EXACT_ROWS_PER_PART = 1 << 13
BAND_ROWS_PER_PART = 1 << 14
VECTOR_CHUNK_ROWS = 1 << 12  # rows a legacy generation's vectors.parquet is read by
VECTOR_ROWS_PER_CLUSTER = 1 << 10  # a probe reads ~1 MiB of 256-d vectors
MAX_CLUSTERS = 1 << 12  # the k-means of a rebuild stays minutes at 10^7 vectors
CENTROID_SAMPLE = 1 << 16  # vectors the k-means of a rebuild trains on, at most
RECLUSTER_GROWTH = 4  # vectors grown this many times since their clustering: rebuild
CLUSTERS_PER_MERGE = 64  # vector clusters a merge task writes
LOG_ROWS_PER_TASK = 1 << 18  # rows a scatter task reads (whole log parts)
PARTS_PER_MERGE = 64  # partitions a merge task writes
KEEP_GENERATIONS = 2  # the newest and the one before, besides what is pinned

ORDER = [("log", "ascending"), ("row", "ascending")]
_ENTRY = [pa.field("recaption", pa.string()), pa.field("flags", pa.list_(pa.string())),
          pa.field("log", pa.string()), pa.field("row", pa.int32())]
EXACT_SCHEMA = pa.schema([pa.field("pixel_hash", pa.string()), *_ENTRY])
BAND_SCHEMA = pa.schema([pa.field("band", pa.int16()), pa.field("bits", pa.uint64()),
                         pa.field("phash", pa.uint64()), *_ENTRY])
VECTOR_SCHEMA = pa.schema([pa.field("embedding", pa.list_(pa.float32())), *_ENTRY])


@dataclass(frozen=True)
class Compaction:
    """One compaction's plan: what the driver decides; tasks do the rest."""

    url: str  # the identity folder (CACHE/IDENTITY)
    storage_options: dict[str, Any]
    generation: int
    token: str
    phash_distance: int
    logs: dict[str, int]  # every log part the new generation holds, with its size
    units: list[list[str]]  # the new log parts each scatter task reads
    previous: dict[str, Any] | None  # the marker this one extends (None: a rebuild)
    exact_bits: int = 0
    bands_bits: int = 0
    new_rows: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    clusters: int = 1  # of the stored vectors (the previous generation's, or a new k-means)
    clustered_for: int = 0  # the vectors there were when those centroids were trained

    def folder(self) -> OutputDir:
        return OutputDir(self.url, self.storage_options)

    @property
    def name(self) -> str:
        return f"gen-{self.generation:06d}-{self.token}"

    @property
    def work(self) -> str:
        return f"work-{self.generation:06d}-{self.token}"

    def work_file(self, kind: str, unit: int) -> str:
        return self.folder().path(INDEX_FOLDER, self.work, f"{kind}-{unit:05d}.parquet")

    def work_files(self, kind: str) -> list[str]:
        return [self.work_file(kind, u) for u in range(len(self.units))]

    @property
    def trains(self) -> bool:
        """Whether this generation trains its vectors' centroids (a rebuild, or a previous
        generation that stored no vector) rather than keeping the previous ones."""
        return self.previous is None or not self.previous.get("clusters")


# ------------------------------------------------------------------------- generations


def list_logs(folder: OutputDir) -> dict[str, int]:
    """The log parts of an identity folder, by name, with their sizes."""
    if not folder.exists():
        return {}
    found = folder.fs.ls(folder.path(), detail=True)
    return {posixpath.basename(e["name"]): int(e["size"]) for e in found
            if e["type"] == "file" and e["name"].endswith(".parquet")}


def _markers(folder: OutputDir) -> list[str]:
    """The committed generations' markers, newest first."""
    return sorted(folder.glob(f"{INDEX_FOLDER}/gen-*.json"), reverse=True)


def newest_marker(folder: OutputDir, phash_distance: int | None = None
                  ) -> dict[str, Any] | None:
    """The newest committed generation (built for ``phash_distance``, when given)."""
    for name in _markers(folder):
        marker = folder.read_json(INDEX_FOLDER, name)
        if phash_distance is None or marker["phash_distance"] == phash_distance:
            return marker
    return None


def part_path(folder: OutputDir, marker: dict[str, Any], kind: str, prefix: int) -> str:
    bits = marker[f"{kind}_bits"]
    return folder.path(INDEX_FOLDER, marker["folder"], kind, index_part_name(prefix, bits))


def vectors_path(folder: OutputDir, marker: dict[str, Any]) -> str:
    """A generation from before the clusters: every vector in one file."""
    return folder.path(INDEX_FOLDER, marker["folder"], "vectors.parquet")


def cluster_path(folder: OutputDir, marker: dict[str, Any], cluster: int) -> str:
    return folder.path(INDEX_FOLDER, marker["folder"], "vectors",
                       index_part_name(cluster, _cluster_digits(marker["clusters"])))


def centroids_path(folder: OutputDir, marker: dict[str, Any]) -> str:
    return folder.path(INDEX_FOLDER, marker["folder"], "centroids.npy")


def _cluster_digits(clusters: int) -> int:
    return max(1, (clusters - 1).bit_length())


def read_centroids(folder: OutputDir, marker: dict[str, Any]) -> np.ndarray:
    with folder.fs.open(centroids_path(folder, marker), "rb") as f:
        return np.load(f)


def _write_centroids(plan: Compaction, centroids: np.ndarray) -> None:
    folder = plan.folder()
    path = centroids_path(folder, {"folder": plan.name})
    folder.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with atomic_writer(folder.fs, path) as handle:
        np.save(handle, centroids.astype(np.float32))


def plan_compaction(folder: OutputDir, storage_options: dict[str, Any],
                    phash_distance: int, rebuild: bool = False) -> Compaction | None:
    """What the next generation folds in; None when the newest holds every log part.
    ``storage_options``: the ones ``folder`` was opened with (the tasks open it again);
    ``rebuild``: from every log part (``outgrown``: the vectors need new clusters)."""
    logs = list_logs(folder)
    markers = _markers(folder)
    newest = folder.read_json(INDEX_FOLDER, markers[0]) if markers else None
    held = newest["logs"] if newest else {}
    if newest and newest["phash_distance"] == phash_distance and held == logs and not rebuild:
        return None
    if not logs and not newest:
        return None
    rebuild = (rebuild or newest is None or newest["phash_distance"] != phash_distance
               or "clusters" not in newest  # a generation from before the clusters
               or any(logs.get(name) != size for name, size in held.items()))
    new = sorted(logs) if rebuild else sorted(set(logs) - set(held))
    return Compaction(folder.url, storage_options, (newest["generation"] + 1) if newest else 1,
                      uuid.uuid4().hex[:8], phash_distance, logs, [[n] for n in new],
                      None if rebuild else newest)


def count_rows(plan: Compaction, names: list[str]) -> list[int]:
    """Rows of each log part, from its footer."""
    folder = plan.folder()
    counts = []
    for name in names:
        with folder.fs.open(folder.path(name), "rb") as f:
            counts.append(pq.ParquetFile(f).metadata.num_rows)
    return counts


def with_layout(plan: Compaction, rows: dict[str, int]) -> Compaction:
    """The plan with its prefix bits and scatter units, given each new log part's rows:
    never fewer bits than the previous generation's (its partitions are split, not
    joined)."""
    new_rows = sum(rows.values())
    previous = plan.previous or {}
    entries = previous.get("counts", {}).get("exact", 0) + new_rows
    bands = previous.get("counts", {}).get("bands", 0) + new_rows * (plan.phash_distance + 1)
    exact_bits = max(index_prefix_bits(entries, EXACT_ROWS_PER_PART),
                     previous.get("exact_bits", 0))
    bands_bits = max(index_prefix_bits(bands, BAND_ROWS_PER_PART), previous.get("bands_bits", 0))
    units: list[list[str]] = []
    size = LOG_ROWS_PER_TASK
    for name in [n for unit in plan.units for n in unit]:
        if size + rows[name] > LOG_ROWS_PER_TASK:
            units.append([])
            size = 0
        units[-1].append(name)
        size += rows[name]
    trained = default_clusters(new_rows, VECTOR_ROWS_PER_CLUSTER, MAX_CLUSTERS)
    clusters, clustered_for = ((trained, new_rows) if plan.trains
                               else (previous["clusters"], previous["clustered_for"]))
    return replace(plan, units=units, exact_bits=exact_bits, bands_bits=bands_bits,
                   new_rows=new_rows, clusters=clusters, clustered_for=clustered_for)


def outgrown(plan: Compaction) -> bool:
    """Whether the vectors have grown ``RECLUSTER_GROWTH`` times since their clusters were
    trained (then a rebuild trains new ones: clusters too large make lookups scan more)."""
    if plan.trains:
        return False
    vectors = plan.previous.get("counts", {}).get("vectors", 0) + plan.new_rows
    return vectors > RECLUSTER_GROWTH * max(plan.clustered_for, VECTOR_ROWS_PER_CLUSTER)


def cluster_groups(clusters: int) -> list[list[int]]:
    """The vector clusters in groups of ``CLUSTERS_PER_MERGE``: one merge task each."""
    ids = list(range(clusters))
    return [ids[i:i + CLUSTERS_PER_MERGE] for i in range(0, clusters, CLUSTERS_PER_MERGE)]


def merge_groups(bits: int) -> list[list[int]]:
    """The partitions of ``bits`` in groups of ``PARTS_PER_MERGE``: one merge task each."""
    parts = list(range(1 << bits))
    return [parts[i:i + PARTS_PER_MERGE] for i in range(0, len(parts), PARTS_PER_MERGE)]


def commit(plan: Compaction, counts: dict[str, int]) -> dict[str, Any]:
    """Write the generation's marker (last, atomically), then delete what neither a kept
    generation nor a pin needs: older generations, stopped compactions' folders, this
    compaction's work folder."""
    folder = plan.folder()
    marker = {"generation": plan.generation, "folder": plan.name, "logs": plan.logs,
              "phash_distance": plan.phash_distance, "exact_bits": plan.exact_bits,
              "bands_bits": plan.bands_bits, "clusters": plan.clusters,
              "clustered_for": plan.clustered_for, "counts": counts}
    folder.write_json(marker, INDEX_FOLDER, f"{plan.name}.json")
    unpin_compaction(plan)
    kept = _markers(folder)[:KEEP_GENERATIONS]
    keep = {folder.read_json(INDEX_FOLDER, m)["folder"] for m in kept} | set(kept)
    keep |= pinned(folder)
    for name in folder.glob(f"{INDEX_FOLDER}/*"):
        if name.startswith("pin-"):
            continue
        number = int(name.split("-")[1].split(".")[0]) if name.count("-") else 0
        if name not in keep and number <= plan.generation:
            folder.fs.rm(folder.path(INDEX_FOLDER, name), recursive=True)
    return marker


# ------------------------------------------------------------------------------ pins


def _compaction_names(plan: Compaction) -> list[str]:
    return [plan.work, plan.name] + ([plan.previous["folder"]] if plan.previous else [])


def pin_compaction(plan: Compaction) -> None:
    """What a compaction writes and the generation it merges from, until it commits."""
    for name in _compaction_names(plan):
        pin(plan.folder(), name, f"compaction{plan.token}", COMPACTION_PIN_S)


def unpin_compaction(plan: Compaction) -> None:
    for name in _compaction_names(plan):
        unpin(plan.folder(), name, f"compaction{plan.token}")


# ----------------------------------------------------------------------------- rows


def read_log(folder: OutputDir, name: str) -> pa.Table:
    """One log part as written, with an empty embedding column where it has none (a part
    written before the tier)."""
    with folder.fs.open(folder.path(name), "rb") as f:
        table = pq.read_table(f)
    if "embedding" not in table.column_names:
        table = table.append_column("embedding", pa.nulls(table.num_rows,
                                                          CACHE_SCHEMA.field("embedding").type))
    return table.select(CACHE_SCHEMA.names).cast(CACHE_SCHEMA)


def index_rows(table: pa.Table, log: str, phash_distance: int
               ) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(exact, band, vector) rows of one log part, each with its log order."""
    n = table.num_rows
    entry = {"recaption": table["recaption"], "flags": table["flags"],
             "log": pa.array([log] * n, pa.string()), "row": pa.array(np.arange(n, dtype=np.int32))}
    exact = pa.table({"pixel_hash": table["pixel_hash"], **entry}, schema=EXACT_SCHEMA)
    reusable = np.array([c is not None and not mentions_text(c)
                         for c in table["recaption"].to_pylist()], dtype=bool)
    has_vector = table["embedding"].is_valid().to_numpy()
    vectors = pa.table({"embedding": table["embedding"], **entry}, schema=VECTOR_SCHEMA
                       ).filter(pa.array(reusable & has_vector))
    return exact, _band_rows(table, entry, reusable, phash_distance), vectors


def band_values(phash: np.ndarray, distance: int) -> list[np.ndarray]:
    """Each pigeonhole band's bits of every hash, in band order (``cache._bands``)."""
    count = distance + 1
    width = 64 // count
    bands = []
    for i in range(count):
        bits = 64 - i * width if i == count - 1 else width
        mask = np.uint64((1 << bits) - 1)
        bands.append((phash >> np.uint64(i * width)) & mask)
    return bands


def _band_rows(table: pa.Table, entry: dict[str, Any], reusable: np.ndarray,
               distance: int) -> pa.Table:
    if not distance:
        return BAND_SCHEMA.empty_table()
    keep = reusable & table["phash"].is_valid().to_numpy()
    rows = np.flatnonzero(keep)
    phash = table["phash"].take(rows).to_numpy().astype(np.uint64)
    chosen = pa.table(entry).take(rows)
    tables = [pa.table({"band": pa.array(np.full(len(rows), i, np.int16)), "bits": bits,
                        "phash": phash, **{k: chosen[k] for k in chosen.column_names}},
                       schema=BAND_SCHEMA)
              for i, bits in enumerate(band_values(phash, distance))]
    return pa.concat_tables(tables).sort_by(ORDER)


def prefix_of(hashes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(len(hashes), np.int64)
    return (hashes >> np.uint64(64 - bits)).astype(np.int64)


def exact_prefix(pixel_hashes: pa.Array | pa.ChunkedArray, bits: int) -> np.ndarray:
    return prefix_of(string_hash(pixel_hashes), bits)


def band_prefix(band: np.ndarray, bits_values: np.ndarray, bits: int) -> np.ndarray:
    return prefix_of(mix64(bits_values.astype(np.uint64) ^ mix64(band.astype(np.uint64))),
                     bits)


# ------------------------------------------------------------------------------ tasks


def scatter(plan: Compaction, unit: int) -> dict[str, int]:
    """Read one group of log parts; write their exact and band rows partitioned by
    prefix, and their vectors, into the work folder."""
    folder = plan.folder()
    found = [index_rows(read_log(folder, name), name, plan.phash_distance)
             for name in plan.units[unit]]
    exact = pa.concat_tables([EXACT_SCHEMA.empty_table(), *(f[0] for f in found)])
    bands = pa.concat_tables([BAND_SCHEMA.empty_table(), *(f[1] for f in found)])
    vectors = pa.concat_tables([VECTOR_SCHEMA.empty_table(), *(f[2] for f in found)])
    write_parts(folder.fs, plan.work_file("exact", unit), exact,
                exact_prefix(exact["pixel_hash"], plan.exact_bits))
    write_parts(folder.fs, plan.work_file("bands", unit), bands,
                band_prefix(bands["band"].to_numpy(), bands["bits"].to_numpy(), plan.bands_bits))
    write_parts(folder.fs, plan.work_file("vectors", unit), vectors,
                _clusters_of(plan, vectors))
    return {"exact": len(exact), "bands": len(bands), "vectors": len(vectors)}


def _matrix(vectors: pa.Table) -> np.ndarray:
    flat = pc.list_flatten(vectors["embedding"]).to_numpy()
    return normalise(flat.reshape(len(vectors), -1)) if len(vectors) else np.zeros((0, 0), "f4")


def _clusters_of(plan: Compaction, vectors: pa.Table) -> np.ndarray:
    """Each vector's cluster: the nearest of the new generation's centroids."""
    if not len(vectors):
        return np.zeros(0, np.int64)
    centroids = read_centroids(plan.folder(), {"folder": plan.name})
    return assign(_matrix(vectors), centroids)


# ------------------------------------------------------------------- vector clusters


def sample_vectors(plan: Compaction, unit: int) -> int:
    """A seeded sample of one scatter unit's vectors for the k-means (a rebuild): each
    row is in by a hash of its place in the log, so the tasks together draw about
    ``sample_size`` of all, whatever their units."""
    folder = plan.folder()
    size = sample_size(plan.new_rows, plan.clusters, CENTROID_SAMPLE)
    found = [index_rows(read_log(folder, name), name, 0)[2] for name in plan.units[unit]]
    vectors = pa.concat_tables([VECTOR_SCHEMA.empty_table(), *found])
    place = pc.binary_join_element_wise(vectors["log"], pc.cast(vectors["row"], pa.string()),
                                        ":")
    sample = vectors.filter(pa.array(sample_mask(place, plan.new_rows, size, seed=0)))
    write_table(folder.fs, plan.work_file("sample", unit), sample.select(["embedding"]))
    return len(sample)


def train_centroids(plan: Compaction) -> int:
    """The k-means of the units' samples, saved in the new generation; its clusters (at
    most the sample's rows; 0 where no vector is stored)."""
    folder = plan.folder()
    sample = read_tables(folder.fs, plan.work_files("sample"),
                         pa.schema([VECTOR_SCHEMA.field("embedding")]))
    if not len(sample):
        return 0
    centroids = kmeans(_matrix(sample), plan.clusters)
    _write_centroids(plan, centroids)
    return len(centroids)


def keep_centroids(plan: Compaction) -> int:
    """The previous generation's centroids, copied into the new one."""
    centroids = read_centroids(plan.folder(), plan.previous)
    _write_centroids(plan, centroids)
    return len(centroids)


def _previous_part(plan: Compaction, kind: str, prefix: int, schema: pa.Schema) -> pa.Table:
    """The previous generation's rows of ``prefix`` (its partition, split when it had
    fewer bits)."""
    if plan.previous is None:
        return schema.empty_table()
    folder = plan.folder()
    bits = getattr(plan, f"{kind}_bits")
    old_bits = plan.previous[f"{kind}_bits"]
    path = part_path(folder, plan.previous, kind, prefix >> (bits - old_bits))
    with folder.fs.open(path, "rb") as f:
        table = pq.read_table(f).replace_schema_metadata(None).cast(schema)
    if bits == old_bits:
        return table
    own = (exact_prefix(table["pixel_hash"], bits) if kind == "exact" else
           band_prefix(table["band"].to_numpy(), table["bits"].to_numpy(), bits))
    return table.filter(pa.array(own == prefix))


def last_per_hash(table: pa.Table) -> pa.Table:
    """Each pixel hash's last row in log order: the entry its exact lookups get."""
    table = table.sort_by(ORDER)
    indexed = table.append_column("i", pa.array(np.arange(len(table), dtype=np.int64)))
    last = indexed.group_by("pixel_hash").aggregate([("i", "max")])["i_max"].to_numpy()
    return table.take(np.sort(last))


def merge(plan: Compaction, kind: str, prefixes: list[int]) -> int:
    """Write partitions ``prefixes`` of ``kind`` ("exact" or "bands") of the new
    generation: the previous generation's rows and the new ones, in log order."""
    folder = plan.folder()
    schema = EXACT_SCHEMA if kind == "exact" else BAND_SCHEMA
    bits = getattr(plan, f"{kind}_bits")
    new = read_part(folder.fs, plan.work_files(kind), prefixes, schema)
    own = (exact_prefix(new["pixel_hash"], bits) if kind == "exact" else
           band_prefix(new["band"].to_numpy(), new["bits"].to_numpy(), bits))
    written = 0
    for prefix in prefixes:
        table = pa.concat_tables([_previous_part(plan, kind, prefix, schema),
                                  new.filter(pa.array(own == prefix))])
        table = last_per_hash(table) if kind == "exact" else table.sort_by(ORDER)
        write_table(folder.fs, folder.path(INDEX_FOLDER, plan.name, kind,
                                           index_part_name(prefix, bits)), table)
        written += len(table)
    return written


def merge_vectors(plan: Compaction, clusters: list[int]) -> int:
    """Write clusters ``clusters`` of the new generation's vectors: the previous
    generation's rows of each (same centroids) and the new ones, in log order. Every
    cluster gets its file, empty or not."""
    folder = plan.folder()
    written = 0
    for cluster in clusters:
        tables = [read_part(folder.fs, plan.work_files("vectors"), cluster, VECTOR_SCHEMA)]
        if not plan.trains:
            with folder.fs.open(cluster_path(folder, plan.previous, cluster), "rb") as f:
                tables.append(pq.read_table(f).replace_schema_metadata(None).cast(VECTOR_SCHEMA))
        table = pa.concat_tables(tables).sort_by(ORDER)
        write_table(folder.fs, cluster_path(folder, {"folder": plan.name,
                                                     "clusters": plan.clusters}, cluster), table)
        written += len(table)
    return written


def compact(folder: OutputDir, storage_options: dict[str, Any],
            phash_distance: int) -> dict[str, Any] | None:
    """A whole compaction in this process (``pipeline/caption_index.py`` runs the same
    steps as Ray tasks); returns the new marker, or None when there was nothing to do."""
    plan = laid_out(plan_compaction(folder, storage_options, phash_distance))
    if plan is not None and outgrown(plan):
        plan = laid_out(plan_compaction(folder, storage_options, phash_distance, True))
    if plan is None:
        return None
    pin_compaction(plan)
    try:
        plan, counts = fold(plan)
    except BaseException:
        unpin_compaction(plan)
        raise
    return commit(plan, counts)


def fold(plan: Compaction) -> tuple[Compaction, dict[str, int]]:
    """A laid-out compaction's tasks in this process, up to its commit: the plan with its
    clusters, and the index rows of each kind."""
    plan = with_centroids(plan)
    for unit in range(len(plan.units)):
        scatter(plan, unit)
    return plan, {"exact": sum(merge(plan, "exact", g) for g in merge_groups(plan.exact_bits)),
                  "bands": sum(merge(plan, "bands", g) for g in merge_groups(plan.bands_bits)),
                  "vectors": sum(merge_vectors(plan, g) for g in cluster_groups(plan.clusters))}


def with_centroids(plan: Compaction) -> Compaction:
    """The vectors' centroids in the new generation, in this process (trained, or the
    previous generation's), before any scatter; the plan with its clusters."""
    if plan.trains:
        for unit in range(len(plan.units)):
            sample_vectors(plan, unit)
        return replace(plan, clusters=train_centroids(plan))
    keep_centroids(plan)
    return plan


def laid_out(plan: Compaction | None) -> Compaction | None:
    """The plan with its layout, from its new log parts' row counts (their footers)."""
    if plan is None:
        return None
    names = [n for unit in plan.units for n in unit]
    return with_layout(plan, dict(zip(names, count_rows(plan, names), strict=True)))
