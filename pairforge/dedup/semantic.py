"""Semantic dedup over CLIP image embeddings, in the SemDeDup style (Abbas et al., 2023).

Hashes see pixels; two photos of the same thing from another angle, or a copy with a
caption burned in, hash far apart but embed close together. The decision:

1. every embedding is normalised to unit length (cosine similarity is then a dot product);
2. spherical k-means (:func:`kmeans`) splits them into clusters, trained on a bounded
   sample (:func:`sample_mask`: a hash of the key, so any task can tell its own rows'
   membership) and assigned in chunks;
3. inside each cluster, every pair at cosine ``>= threshold`` is found by chunked matrix
   products (:func:`cluster_pairs`: exact within the cluster, no approximation);
4. clusters are the connected components of those pairs, and the survivor of each is the
   row ``dedup/decide.survivor_order`` ranks first (largest original, then lowest key):
   the rule of the hash dedup, so a row and its copies keep the same survivor whichever
   kind of evidence linked them.

Unlike SemDeDup, which drops a row when any better-ranked row is similar even if that
row is dropped in turn, every dropped row here names a survivor that is kept, so the
contact sheet can show the two side by side. Pairs that k-means puts in different
clusters are not compared: that is the approximation, measured against all pairs in the
tests and the bench. Everything is numpy (BLAS matrix products). The stage runs the
decision as partitioned Ray tasks (``dedup/semantic_partitions.py``,
``pipeline/semantic_stage.py``); ``dedup/reference.semantic_duplicates`` makes it in one
process, the tests' oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from pairforge.dedup.decide import survivor_order
from pairforge.dedup.shuffle import mix64, string_hash
from pairforge.records import Status

SEMANTIC_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("kind", pa.string()),
    pa.field("cluster_id", pa.string()),
    pa.field("kept_key", pa.string()),
    pa.field("kept_source", pa.string()),  # always null: no index of earlier builds here
    pa.field("distance", pa.int32()),  # always null: no hash evidence
    pa.field("similarity", pa.float32()),  # cosine to the kept row
])

# Rows per block of a similarity matrix: 4,096 x 4,096 float32 is 64 MiB.
_BLOCK = 4096
_NO_PAIRS = np.zeros((0, 2), dtype=np.int64)


def normalise(embeddings: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float32); all-zero rows stay zero."""
    x = np.asarray(embeddings, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, np.float32(1e-12))


def default_clusters(n: int, rows_per_cluster: int, max_clusters: int | None = None) -> int:
    """About ``rows_per_cluster`` rows per cluster, at least one, at most ``max_clusters``."""
    clusters = max(1, min(n, round(n / rows_per_cluster)))
    return clusters if max_clusters is None else min(clusters, max_clusters)


def sample_size(n: int, clusters: int, max_rows: int, per_cluster: int = 256) -> int:
    """Rows k-means trains on: ``per_cluster`` a cluster (faiss's default), at most
    ``max_rows``, so the process that trains it holds a bounded sample."""
    return min(n, per_cluster * clusters, max_rows)


def sample_mask(keys: pa.Array | pa.ChunkedArray, n: int, size: int, seed: int
                ) -> np.ndarray:
    """Which of ``keys`` are in the k-means sample of about ``size`` of ``n`` rows.

    A row is in when a seeded hash of its key falls below size/n of the hash range, so
    any task decides for its own rows, in any order, and all agree with one process."""
    if size >= n:
        return np.ones(len(keys), dtype=bool)
    cut = np.uint64(min(2**64 - 1, int(size / n * 2.0**64)))
    return mix64(string_hash(keys) ^ np.uint64(seed % 2**64)) < cut


def _assign_block(clusters: int) -> int:
    """Rows per block of an assignment: a block's similarities stay near 64 MiB."""
    return max(256, min(_BLOCK, 2**24 // max(1, clusters)))


def assign(x: np.ndarray, centroids: np.ndarray, probes: int = 1) -> np.ndarray:
    """Index of the most similar centroid for each (unit) row, in blocks; with ``probes``
    > 1, the ``probes`` most similar ones, as an (n, probes) array."""
    block = _assign_block(len(centroids))
    if probes > 1:
        probes = min(probes, len(centroids))
        labels = np.empty((len(x), probes), dtype=np.int64)
        for start in range(0, len(x), block):
            sims = x[start:start + block] @ centroids.T
            labels[start:start + block] = np.argpartition(-sims, probes - 1, axis=1
                                                          )[:, :probes]
        return labels
    labels = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), block):
        labels[start:start + block] = np.argmax(x[start:start + block] @ centroids.T, axis=1)
    return labels


def kmeans(sample: np.ndarray, k: int, iterations: int = 10, seed: int = 0) -> np.ndarray:
    """Spherical k-means centroids (unit rows) trained on the unit rows ``sample``.

    Started from k distinct sample rows; an emptied cluster is restarted at the sample row
    worst served by its centroid. Deterministic for a given seed and sample order.
    """
    rng = np.random.default_rng(seed)
    k = max(1, min(k, len(sample)))
    centroids = sample[rng.choice(len(sample), k, replace=False)].copy()
    for _ in range(iterations):
        labels = assign(sample, centroids)
        # sums per cluster as one sparse product (np.add.at is ~50x slower on rows)
        one_hot = coo_matrix((np.ones(len(labels), np.float32), (labels, np.arange(len(labels)))),
                             shape=(k, len(labels))).tocsr()
        sums = np.asarray(one_hot @ sample, dtype=np.float32)
        counts = np.bincount(labels, minlength=k)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            sums[empty] = sample[np.argsort(_fit(sample, centroids, labels))[:len(empty)]]
        centroids = normalise(sums)
    return centroids


def _fit(x: np.ndarray, centroids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each row's similarity to its centroid, in blocks (no copy of the rows' size)."""
    fit = np.empty(len(x), np.float32)
    for start in range(0, len(x), _BLOCK):
        end = start + _BLOCK
        fit[start:end] = np.einsum("ij,ij->i", x[start:end], centroids[labels[start:end]])
    return fit


def cluster_pairs(x: np.ndarray, members: np.ndarray, threshold: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i < j, indices into ``x``) among ``members`` with cosine >= ``threshold``,
    and their similarities: every pair of the cluster compared, block by block."""
    members = np.sort(members)
    vectors = x[members]
    found, sims = [_NO_PAIRS], [np.zeros(0, np.float32)]
    for row in range(0, len(members), _BLOCK):
        for col in range(row, len(members), _BLOCK):
            block = vectors[row:row + _BLOCK] @ vectors[col:col + _BLOCK].T
            rows, cols = np.nonzero(block >= threshold)
            keep = col + cols > row + rows  # the upper triangle: each pair once
            rows, cols = rows[keep], cols[keep]
            found.append(np.stack([members[row + rows], members[col + cols]], axis=1))
            sims.append(block[rows, cols])
    return np.concatenate(found).astype(np.int64), np.concatenate(sims).astype(np.float32)


def group_pairs(x: np.ndarray, labels: np.ndarray, clusters: Sequence[int], threshold: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of every listed cluster: one unit of work (a Ray task in the stage).

    ``labels`` is a cluster per row, or (n, probes) clusters per row: a row is then a
    member of each, and a pair sharing two clusters is reported once."""
    rows, flat = _members(labels)
    order = np.argsort(flat, kind="stable")
    starts = np.searchsorted(flat[order], clusters, side="left")
    ends = np.searchsorted(flat[order], clusters, side="right")
    parts = [cluster_pairs(x, rows[order[s:e]], threshold)
             for s, e in zip(starts, ends, strict=True) if e - s >= 2]
    if not parts:
        return _NO_PAIRS, np.zeros(0, np.float32)
    pairs, sims = np.concatenate([p for p, _ in parts]), np.concatenate([s for _, s in parts])
    if labels.ndim > 1:
        pairs, first = np.unique(pairs, axis=0, return_index=True)
        sims = sims[first]
    return pairs, sims


def _members(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, cluster) of every membership, flat."""
    if labels.ndim == 1:
        return np.arange(len(labels)), labels
    return np.repeat(np.arange(len(labels)), labels.shape[1]), labels.reshape(-1)


def duplicates_from_pairs(keys: pa.Array, x: np.ndarray, area: np.ndarray,
                          pairs: np.ndarray) -> pa.Table:
    """Components of the pairs, one survivor each (the hash dedup's rule), as a table."""
    n = len(keys)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])),
                       shape=(n, n)).tocsr()
    _, labels = connected_components(graph, directed=False)
    rank = survivor_order(keys, pa.nulls(n, pa.string()), np.zeros(n, bool),
                          np.asarray(area, dtype=np.int64))
    best = np.full(labels.max(initial=-1) + 1, n, dtype=np.int64)
    np.minimum.at(best, labels, rank)
    kept = np.argsort(rank)[best[labels]]
    rows = np.flatnonzero(kept != np.arange(n))
    similarity = np.einsum("ij,ij->i", x[rows], x[kept[rows]])
    kept_key = keys.take(pa.array(kept[rows]))
    out = pa.table({
        "key": keys.take(pa.array(rows)),
        "kind": pa.array([Status.DUPLICATE_SEMANTIC.value] * len(rows), pa.string()),
        "cluster_id": kept_key,
        "kept_key": kept_key,
        "kept_source": pa.nulls(len(rows), pa.string()),
        "distance": pa.nulls(len(rows), pa.int32()),
        "similarity": pa.array(similarity, pa.float32()),
    }, schema=SEMANTIC_SCHEMA)
    return out.take(pc.sort_indices(out, sort_keys=[("key", "ascending")]))
