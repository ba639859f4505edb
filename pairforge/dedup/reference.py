"""The reference: stage 2's and the semantic pass's decisions, each in one process.

The stages run their decisions as partitioned Ray tasks (``dedup/partitions.py``,
``dedup/semantic_partitions.py``), so that no process holds every row. The functions
here make the same decisions over tables in memory: they are the oracles the tests
compare the stages with (and what the kinds and scale benches measure), not a code path
of the pipeline.

* :func:`find_duplicates`: stage 2 (``dedup/decide.py`` has the rules), with
  :func:`near_pairs` for the band join and :func:`next_index` for the next index;
* :func:`semantic_duplicates`: the semantic pass (``dedup/semantic.py`` has the rules).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from pairforge.dedup.bands import (
    _NONE,
    HASH_BITS,
    BandPlan,
    _brute_pairs,
    _combo_pairs_local,
    is_degenerate,
    plan_bands,
)
from pairforge.dedup.decide import (
    _WHOLE,
    HASH_KINDS,
    best_of_groups,
    colour_groups,
    colour_splits,
    duplicates_table,
    exact_codes,
    points_of,
    survivor_rank,
)
from pairforge.dedup.grids import GridCheck
from pairforge.dedup.index import INDEX_SCHEMA, as_index, drop_repeated_rows, index_rows
from pairforge.dedup.semantic import (
    assign,
    duplicates_from_pairs,
    group_pairs,
    kmeans,
    normalise,
    sample_mask,
    sample_size,
)
from pairforge.records import Status

_NO_PAIRS = np.zeros((0, 2), dtype=np.int64)


# ----------------------------------------------------------------------------- stage 2


@dataclass
class NearPairs:
    """Pairs of hash indices within distance, and hashes found in over-dense buckets."""

    pairs: np.ndarray  # (P, 2) int64, i < j, sorted
    dense: np.ndarray  # sorted indices of hashes treated as degenerate (see _is_dense)


def combo_pairs(hashes: np.ndarray, plan: BandPlan, combo: tuple[int, ...]) -> NearPairs:
    """Pairs of distinct hashes within distance first found by one band combination.

    One unit of distributable work: combos are independent and their pairs disjoint.
    """
    a, b, dense = _combo_pairs_local(hashes, hashes, plan, combo)
    pairs = np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1).astype(np.int64)
    return NearPairs(pairs, np.unique(dense))


CombosMapper = Callable[[np.ndarray, BandPlan], list[NearPairs]]


def local_mapper(workers: int = 1) -> CombosMapper:
    """Run the band combinations in this process (threads: numpy sorts release the GIL)."""

    def run(hashes: np.ndarray, plan: BandPlan) -> list[NearPairs]:
        if workers <= 1:
            return [combo_pairs(hashes, plan, c) for c in plan.combos]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda c: combo_pairs(hashes, plan, c), plan.combos))

    return run


def _sorted_pairs(pairs: np.ndarray) -> np.ndarray:
    order = np.lexsort((pairs[:, 1], pairs[:, 0]))
    return pairs[order]


def _merge(parts: list[NearPairs]) -> NearPairs:
    """Union of combo results; pairs touching a dense hash go, whichever combo found them."""
    dense = np.unique(np.concatenate([_NONE, *(p.dense for p in parts)]))
    pairs = np.concatenate([_NO_PAIRS, *(p.pairs for p in parts)])
    if len(dense):
        pairs = pairs[~np.isin(pairs, dense).any(axis=1)]
    return NearPairs(_sorted_pairs(pairs), dense)


def near_pairs(hashes: np.ndarray, max_distance: int,
               mapper: CombosMapper | None = None) -> NearPairs:
    """Every pair (i < j) of the distinct ``hashes`` within ``max_distance`` bits, once.

    ``hashes`` must hold distinct uint64 values: identical values would form buckets
    that no band split can shrink, so callers join those separately (in linear time).
    """
    hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
    if max_distance <= 0 or len(hashes) < 2:
        return NearPairs(_NO_PAIRS, _NONE)
    ordered = np.sort(hashes)
    if (ordered[1:] == ordered[:-1]).any():
        raise ValueError("near_pairs needs distinct hash values")
    plan = plan_bands(len(hashes), HASH_BITS, max_distance)
    if plan is None:
        return NearPairs(_sorted_pairs(_brute_pairs(hashes, max_distance)), _NONE)
    return _merge((mapper or local_mapper())(hashes, plan))


@dataclass
class _Graph:
    """Rows, one node per exact hash, one node per distinct usable hash value, and links."""

    rows: int
    exact_codes: np.ndarray  # per row, _NO_CODE when the row has no exact hash
    hash_values: np.ndarray  # distinct usable hash values (all points of all rows)
    hash_node: np.ndarray  # (rows, K): per point, index into hash_values or -1
    near: np.ndarray  # (P, 2) pairs of indices into hash_values

    def components(self) -> np.ndarray:
        n_exact = int(self.exact_codes.max(initial=-1)) + 1
        exact_base, hash_base = self.rows, self.rows + n_exact
        total = hash_base + len(self.hash_values)
        row_ids = np.arange(self.rows)
        has_exact = self.exact_codes >= 0
        point_rows, point_cols = np.nonzero(self.hash_node >= 0)
        src = np.concatenate([row_ids[has_exact], point_rows, hash_base + self.near[:, 0]])
        dst = np.concatenate([exact_base + self.exact_codes[has_exact],
                              hash_base + self.hash_node[point_rows, point_cols],
                              hash_base + self.near[:, 1]])
        adjacency = coo_matrix((np.ones(len(src), dtype=np.int8), (src, dst)),
                               shape=(total, total)).tocsr()
        _, labels = connected_components(adjacency, directed=False)
        return labels[:self.rows]


def _hash_nodes(points: np.ndarray, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, inverse = np.unique(points[usable], return_inverse=True)
    node = np.full(points.shape, -1, dtype=np.int64)
    node[usable] = inverse.reshape(-1)
    return values, node


@dataclass
class DedupResult:
    duplicates: pa.Table  # DUPLICATES_SCHEMA, sorted by key
    stats: dict[str, int | str]


def _check_unique_keys(keys: pa.ChunkedArray) -> None:
    if pc.count_distinct(keys).as_py() != len(keys):
        counts = pc.value_counts(keys)
        repeated = [v["values"] for v in counts.to_pylist() if v["counts"] > 1][:5]
        raise ValueError(f"duplicate keys among ok rows (stage 1 broke its contract): "
                         f"{repeated}")


def _combined(rows: pa.Table, index: pa.Table | None) -> tuple[pa.Table, np.ndarray]:
    new = rows.append_column("source", pa.nulls(len(rows), pa.string()))
    if index is None or len(index) == 0:
        return new, np.zeros(len(new), dtype=bool)
    old = index_rows(index).cast(new.schema)
    from_index = np.concatenate([np.zeros(len(new), bool), np.ones(len(old), bool)])
    return pa.concat_tables([new, old]).combine_chunks(), from_index


def _exact_losers(exact_codes: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Rows pixel-identical to a better-ranked row: what exact dedup alone would drop."""
    losers = np.zeros(len(rank), dtype=bool)
    rows = np.flatnonzero(exact_codes >= 0)
    # best_of_groups answers in positions among the rows it gets, from ranks 0..n-1 of
    # those rows (index rows without a pixel hash have no code)
    ranks = np.argsort(np.argsort(rank[rows]))
    losers[rows] = best_of_groups(exact_codes[rows], ranks) != np.arange(len(rows))
    return losers


def _stats(duplicates: pa.Table, from_index: np.ndarray, labels: np.ndarray,
           dropped: np.ndarray, uninformative: np.ndarray, phash_ok: np.ndarray,
           near: NearPairs, n_values: int, max_distance: int) -> dict[str, int | str]:
    new = ~from_index
    kinds = Counter(duplicates["kind"].to_pylist())
    plan = plan_bands(n_values, HASH_BITS, max_distance) if max_distance > 0 else None
    return {
        "ok_rows": int(new.sum()),
        "index_rows": int(from_index.sum()),
        "duplicates": len(duplicates),
        **{kind.value: kinds.get(kind.value, 0) for kind in HASH_KINDS},
        "dropped_for_index": int(pc.sum(pc.is_valid(duplicates["kept_source"])).as_py() or 0),
        "clusters": len(np.unique(labels[dropped])),
        "kept": int(new.sum()) - len(duplicates),
        "degenerate_hashes": int((uninformative & new).sum()),
        "missing_phash": int((~phash_ok & new).sum()),
        "distinct_phashes": n_values,  # distinct values over all points (whole, mirror, crop)
        "dense_phashes": len(near.dense),
        "near_pairs": len(near.pairs),
        "max_distance": max_distance,
        "band_plan": plan.describe() if plan else "all pairs",
    }


def find_duplicates(rows: pa.Table, max_distance: int, index: pa.Table | None = None,
                    mapper: CombosMapper | None = None,
                    check: GridCheck = GridCheck(),
                    perceptual: bool = True) -> DedupResult:
    """Decide which of ``rows`` (ROWS_SCHEMA, ok rows) are duplicates, in this process:
    the single-process reference of stage 2 (the rules: ``dedup/decide.py``).

    ``index`` (INDEX_SCHEMA) holds rows of earlier builds: they take part in every join
    and always survive, so a new row that matches one is dropped in its favour. Hashes
    that are missing, degenerate or dense stay out of the perceptual join (a row whose
    hashes all are only takes part in the exact join). ``mapper`` runs the band
    combinations (locally by default);
    ``check``: the grid checks and whether mirrors count (``decide.colour_groups``);
    ``perceptual``: False leaves every row out of the perceptual join (exact only).
    """
    _check_unique_keys(rows["key"])
    table, from_index = _combined(rows, index)
    points, valid = points_of(table, check.mirrors)
    informative = valid & ~is_degenerate(points)
    values, node = _hash_nodes(points, informative & perceptual)
    near = near_pairs(values, max_distance, mapper)
    node[np.isin(node, near.dense)] = -1  # dense hashes leave the perceptual join too
    uninformative = valid[:, _WHOLE] & (node[:, _WHOLE] < 0 if perceptual
                                        else ~informative[:, _WHOLE])
    graph = _Graph(len(table), exact_codes(table["exact"]), values, node, near.pairs)
    rank = survivor_rank(table, from_index)
    components = graph.components()
    labels = colour_groups(components, rank, table["colour_grid"], points, valid,
                           max_distance, check)
    kept = best_of_groups(labels, rank)
    dropped = (kept != np.arange(len(table))) & ~from_index
    exact = _exact_losers(graph.exact_codes, rank)
    duplicates = duplicates_table(table, dropped, kept, exact, points, valid, labels,
                                   max_distance)
    stats = _stats(duplicates, from_index, labels, dropped, uninformative, valid[:, _WHOLE],
                   near, len(values), max_distance)
    stats["colour_splits"] = colour_splits(components, labels, from_index)
    return DedupResult(duplicates, stats)


def next_index(rows: pa.Table, duplicates: pa.Table, source: str,
               previous: pa.Table | None = None) -> pa.Table:
    """The index for later builds: earlier index rows plus this build's survivors.

    Only survivors go in: an index stands for what a build ships, so a later match
    points at a sample that exists. Rows repeated across given indexes appear once.
    """
    kept = rows.filter(pc.invert(pc.is_in(rows["key"], value_set=duplicates["key"])))
    new = pa.table({
        "key": kept["key"],
        "source": pa.array([source] * len(kept), pa.string()),
        "pixel_hash": kept["exact"],
        "phash": kept["phash"],
        "phash_mirror": kept["phash_mirror"],
        "crop_phashes": kept["crop_phashes"],
        "colour_grid": kept["colour_grid"],
        "original_width": kept["original_width"],
        "original_height": kept["original_height"],
    }, schema=INDEX_SCHEMA)
    parts = [] if previous is None else [as_index(previous)]
    merged = pa.concat_tables([*parts, new]).combine_chunks()
    return drop_repeated_rows(merged)


# ------------------------------------------------------------------------ semantic pass


@dataclass
class SemanticResult:
    duplicates: pa.Table  # SEMANTIC_SCHEMA, sorted by key
    stats: dict[str, Any]


def semantic_duplicates(keys: pa.Array, embeddings: np.ndarray, area: np.ndarray,
                        threshold: float, clusters: int, iterations: int = 10,
                        seed: int = 0, probes: int = 1,
                        sample_rows: int = 131_072) -> SemanticResult:
    """The rows to drop as ``duplicate_semantic``, in one process (the rules:
    ``dedup/semantic.py``).

    ``area`` (original width x height) and ``keys`` decide survivors. ``probes`` > 1
    searches each row in its nearest ``probes`` clusters: pairs split by a cluster
    boundary are found too, for about probes^2 times the pair-search work. The stage runs
    the same decision as Ray tasks (``dedup/semantic_partitions.py``); this is its oracle.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    keys = keys if isinstance(keys, pa.Array) else pa.array(keys, pa.string())
    # the sample is kept in key order: the centroids do not depend on the reading order
    order = pc.sort_indices(keys).to_numpy()
    keys, area = keys.take(pa.array(order)), np.asarray(area)[order]
    x = normalise(np.asarray(embeddings)[order])
    started = time.perf_counter()
    size = sample_size(len(x), clusters, sample_rows)
    centroids = kmeans(x[sample_mask(keys, len(x), size, seed)], clusters, iterations, seed)
    labels = assign(x, centroids, probes)
    clustered = time.perf_counter()
    pairs, _ = group_pairs(x, labels, list(range(len(centroids))), threshold)
    searched = time.perf_counter()
    table = duplicates_from_pairs(keys, x, area, pairs)
    sizes = np.bincount(labels.reshape(-1), minlength=len(centroids))
    stats = {"embeddings": len(x), "clusters": len(centroids), "probes": probes,
             "largest_cluster": int(sizes.max(initial=0)), "threshold": threshold,
             "pairs": len(pairs), Status.DUPLICATE_SEMANTIC.value: len(table),
             "seconds": {"kmeans": round(clustered - started, 3),
                         "pairs": round(searched - clustered, 3),
                         "survivors": round(time.perf_counter() - searched, 3)}}
    return SemanticResult(table, stats)
