"""Stage 3's semantic dedup split into tasks: the decision of ``dedup/semantic.py``, with
no process ever holding every embedding (``dedup/reference.semantic_duplicates`` makes it
in one).

A row is known by its position ``pos`` = (shard id << 32) + its place among the shard's
embedded rows, in the one order :class:`RowsReader` gives them. The shards are grouped
into *units* of consecutive shards. Every function here is one task of one phase
(``pipeline/semantic_stage.py`` runs them on Ray, in this order); each reads the
partitioned files of earlier phases (``dedup/shuffle.py``) and writes its own, so a
retried or rerun task writes the same rows again:

1. ``count_unit``: the rows of a unit that take part (the driver adds them up).
2. ``sample_unit``: the unit's rows in the k-means sample (``semantic.sample_mask``, a
   hash of the key); the driver trains k-means on that bounded sample.
3. ``assign_unit``: each row's nearest ``probes`` centroids; one membership (pos,
   cluster, vector) per cluster goes out by *bucket* (cluster mod buckets), and the
   cluster sizes come back, so the driver can balance the pair search.
4. ``pair_group``: the buckets of one group, every cluster searched whole
   (``semantic.cluster_pairs``, exact within the cluster); the pairs are written as the
   edges of ``dedup/components.py``, which finds the components as for stage 2.
5. ``route_labels`` / ``attach``: each node of a component goes back to its unit, which
   adds its key, area and vector and sends it to its component's partition.
6. ``decide``: the survivor of each component (``dedup/decide.survivor_order``, the hash
   dedup's rule) and each dropped row's similarity to it, out by key range; then
   ``dedup/key_ranges.py``'s ``sort_range`` / ``concat_sorted`` write one file sorted by key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.dedup.components import LABEL_SCHEMA, write_edges
from pairforge.dedup.decide import best_of_groups, survivor_order
from pairforge.dedup.key_ranges import key_range_of
from pairforge.dedup.semantic import (
    SEMANTIC_SCHEMA,
    assign,
    cluster_pairs,
    normalise,
    sample_mask,
)
from pairforge.dedup.shuffle import (
    mix64,
    part_of,
    read_part,
    read_tables,
    write_parts,
    write_table,
)
from pairforge.dedup.work import Work
from pairforge.records import Status

# (shard id, with vectors) -> the shard's rows that take part: a table of (key, area),
# and their embeddings (float32, one row each) when asked for, else None.
RowsReader = Callable[[int, bool], tuple[pa.Table, "np.ndarray | None"]]

_ROW_BITS = 32


def vector_type(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


def member_schema(dim: int) -> pa.Schema:
    return pa.schema([pa.field("pos", pa.int64()), pa.field("cluster", pa.int64()),
                      pa.field("vector", vector_type(dim))])


def labelled_schema(dim: int) -> pa.Schema:
    return pa.schema([pa.field("label", pa.int64()), pa.field("pos", pa.int64()),
                      pa.field("key", pa.string()), pa.field("area", pa.int64()),
                      pa.field("vector", vector_type(dim))])


def _vectors(x: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def _matrix(column: pa.ChunkedArray | pa.Array, dim: int) -> np.ndarray:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten().to_numpy().reshape(-1, dim)


@dataclass(frozen=True)
class SemanticWork:
    """What every task of one pass shares: where, how partitioned, and the decision's
    settings."""

    work: Work  # the work folder; work.parts partitions the components and decisions
    rows: RowsReader
    dim: int  # embedding width
    threshold: float
    probes: int
    buckets: int  # membership partitions (clusters mod buckets)
    pair_tasks: int  # the buckets are balanced over this many pair-search tasks


# ----------------------------------------------------------------------- sample, assign


def count_unit(reader: RowsReader, shards: list[int]) -> int:
    """Phase 1: the unit's rows that take part."""
    return sum(reader(shard, False)[0].num_rows for shard in shards)


def sample_unit(reader: RowsReader, shards: list[int], rows: int, size: int, seed: int,
                work: Work, unit: int) -> int:
    """Phase 2: the keys and unit vectors of the unit's rows in the k-means sample of
    about ``size`` of ``rows``, written to the unit's sample file; how many."""
    tables = []
    for shard in shards:
        table, x = reader(shard, True)
        chosen = sample_mask(table["key"], rows, size, seed)
        if chosen.any():
            tables.append(pa.table({"key": table["key"].filter(pa.array(chosen)),
                                    "vector": _vectors(normalise(x[chosen]))}))
    if tables:
        write_table(work.fs(), work.file("sample", unit), pa.concat_tables(tables))
    return sum(len(t) for t in tables)


def read_sample(work: Work, units: int, rows: int) -> tuple[pa.Array, np.ndarray]:
    """The ``rows`` sampled rows' keys and vectors, in unit order, read file by file into
    one array (the driver's: no second copy, nothing through Ray's object store)."""
    fs, keys, x, filled = work.fs(), [], None, 0
    for unit in range(units):
        if not fs.exists(work.file("sample", unit)):
            continue
        with fs.open(work.file("sample", unit), "rb") as handle:
            table = pq.read_table(handle)
        part = _matrix(table["vector"], table.schema.field("vector").type.list_size)
        if x is None:
            x = np.empty((rows, part.shape[1]), np.float32)
        x[filled:filled + len(part)] = part
        filled += len(part)
        keys.append(table["key"].combine_chunks())
    return pa.concat_arrays(keys), x


def assign_unit(sw: SemanticWork, unit: int, shards: list[int], centroids: np.ndarray
                ) -> np.ndarray:
    """Phase 3: every membership of the unit's rows, out by bucket; the size of each
    cluster among them."""
    tables = [member_schema(sw.dim).empty_table()]
    sizes = np.zeros(len(centroids), np.int64)
    for shard in shards:
        table, x = sw.rows(shard, True)
        if not table.num_rows:
            continue
        x = normalise(x)
        labels = assign(x, centroids, sw.probes).reshape(len(x), -1)
        row = np.repeat(np.arange(len(x)), labels.shape[1])
        cluster = labels.reshape(-1)
        sizes += np.bincount(cluster, minlength=len(centroids))
        tables.append(pa.table({"pos": (np.int64(shard) << _ROW_BITS) + row,
                                "cluster": cluster, "vector": _vectors(x[row])},
                               schema=member_schema(sw.dim)))
    members = pa.concat_tables(tables).combine_chunks()
    write_parts(sw.work.fs(), sw.work.file("members", unit), members,
                members["cluster"].to_numpy() % sw.buckets)
    return sizes


# ------------------------------------------------------------------------ pair search


def pair_group(sw: SemanticWork, group: int, buckets: list[int], units: int) -> int:
    """Phase 4: the pairs at or above the threshold inside each cluster of the group's
    buckets, written as edges; returns how many pairs it found (a pair two clusters
    share is found, and written, by each)."""
    fs = sw.work.fs()
    members = read_part(fs, sw.work.files("members", units), buckets, member_schema(sw.dim))
    pos, cluster = members["pos"].to_numpy(), members["cluster"].to_numpy()
    order = np.lexsort((pos, cluster))  # each cluster's rows in the order of their pos
    pos, cluster = pos[order], cluster[order]
    x = _matrix(members["vector"], sw.dim)[order]
    starts = np.flatnonzero(np.diff(cluster, prepend=-1)) if len(cluster) else cluster
    ends = np.append(starts[1:], len(cluster)).astype(np.int64)
    found = [np.zeros((0, 2), np.int64)]
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if end - start >= 2:
            found.append(cluster_pairs(x, np.arange(start, end), sw.threshold)[0])
    pairs = np.concatenate(found)
    write_edges(fs, sw.work.file("edges", group), pos[pairs[:, 0]], pos[pairs[:, 1]],
                sw.work.parts)
    return len(pairs)


# -------------------------------------------------------------------------- decisions


def route_labels(sw: SemanticWork, part: int, labels: str, unit_starts: list[int]) -> int:
    """Phase 5a: the component label of each node of this partition, sent to the unit of
    its shard (``unit_starts``: each unit's first shard id, ascending)."""
    fs = sw.work.fs()
    labelled = read_tables(fs, [sw.work.file(labels, part)], LABEL_SCHEMA)
    shard = labelled["node"].to_numpy() >> _ROW_BITS
    unit = np.searchsorted(np.asarray(unit_starts, np.int64), shard, side="right") - 1
    write_parts(fs, sw.work.file("routed", part), labelled, unit)
    return len(labelled)


def attach(sw: SemanticWork, unit: int, shards: list[int]) -> int:
    """Phase 5b: the unit's rows that are in a component, with their key, area and unit
    vector, sent to the partition of their component."""
    fs = sw.work.fs()
    routed = read_part(fs, sw.work.files("routed", sw.work.parts), unit, LABEL_SCHEMA)
    routed = routed.take(pc.sort_indices(routed["node"]))
    node, label = routed["node"].to_numpy(), routed["label"].to_numpy()
    tables = [labelled_schema(sw.dim).empty_table()]
    shard_of = node >> _ROW_BITS
    for shard in np.unique(shard_of).tolist():
        mine = shard_of == shard
        table, x = sw.rows(shard, True)
        rows = node[mine] & ((1 << _ROW_BITS) - 1)
        taken = table.take(pa.array(rows))
        tables.append(pa.table({"label": label[mine], "pos": node[mine], "key": taken["key"],
                                "area": taken["area"], "vector": _vectors(normalise(x[rows]))},
                               schema=labelled_schema(sw.dim)))
    found = pa.concat_tables(tables).combine_chunks()
    write_parts(fs, sw.work.file("labelled", unit), found,
                part_of(mix64(found["label"].to_numpy()), sw.work.parts))
    return len(found)


def decide(sw: SemanticWork, part: int, units: int, boundaries: list[str]
           ) -> dict[str, Any]:
    """Phase 6: the survivor of each component of this partition and the rows it keeps
    out, with their similarity to it, by key range."""
    fs = sw.work.fs()
    table = read_part(fs, sw.work.files("labelled", units), part, labelled_schema(sw.dim))
    table = table.take(pc.sort_indices(table["pos"]))
    n = len(table)
    _, groups = np.unique(table["label"].to_numpy(), return_inverse=True)
    rank = survivor_order(table["key"], pa.nulls(n, pa.string()), np.zeros(n, bool),
                          pc.fill_null(table["area"], 0).to_numpy())
    kept = best_of_groups(groups, rank) if n else np.zeros(0, np.int64)
    rows = np.flatnonzero(kept != np.arange(n))
    x = _matrix(table["vector"], sw.dim)
    kept_key = table["key"].take(pa.array(kept[rows]))
    found = pa.table({
        "key": table["key"].take(pa.array(rows)),
        "kind": pa.array([Status.DUPLICATE_SEMANTIC.value] * len(rows), pa.string()),
        "cluster_id": kept_key,
        "kept_key": kept_key,
        "kept_source": pa.nulls(len(rows), pa.string()),
        "distance": pa.nulls(len(rows), pa.int32()),
        "similarity": pa.array(np.einsum("ij,ij->i", x[rows], x[kept[rows]]), pa.float32()),
    }, schema=SEMANTIC_SCHEMA)
    write_parts(fs, sw.work.file("duplicates", part), found,
                key_range_of(found["key"], boundaries))
    return {"duplicates": len(rows), "components": len(np.unique(groups))}


def balanced_groups(sizes: np.ndarray, buckets: int, groups: int) -> list[list[int]]:
    """Buckets (cluster mod ``buckets``) split into at most ``groups`` lists of about
    equal pair-search work (a cluster's is about its size squared), largest first."""
    bucket = np.arange(len(sizes)) % buckets
    work = np.where(sizes >= 2, sizes.astype(np.float64) ** 2, 0.0)
    load = np.bincount(bucket, weights=work, minlength=buckets)
    totals = np.zeros(groups)
    out: list[list[int]] = [[] for _ in range(groups)]
    for b in np.argsort(-load, kind="stable"):
        if load[b] == 0:  # no cluster of two or more rows: no pair to find
            continue
        target = int(np.argmin(totals))
        out[target].append(int(b))
        totals[target] += load[b]
    return [sorted(g) for g in out if g]
