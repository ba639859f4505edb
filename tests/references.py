"""Quadratic reference implementations the tests and benchmarks check the fast paths of
stage 2 and semantic dedup against (bench/dedup.py and bench/dedup_kinds.py import this
with tests/ on sys.path)."""

from __future__ import annotations

import numpy as np

from pairforge.dedup.semantic import cluster_pairs, normalise


def all_pairs_count(hashes: np.ndarray, max_distance: int, chunk: int = 2048) -> int:
    """Reference all-pairs comparison (quadratic): the number of pairs within distance."""
    hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
    found = 0
    for start in range(0, len(hashes), chunk):
        block = hashes[start:start + chunk]
        dist = np.bitwise_count(block[:, None] ^ hashes[None, start:])
        upper = np.triu(np.ones_like(dist, dtype=bool), 1)
        found += int(((dist <= max_distance) & upper).sum())
    return found


def brute_force_pairs(embeddings: np.ndarray, threshold: float) -> np.ndarray:
    """Reference: every pair (i < j) of all rows at cosine >= threshold (quadratic)."""
    x = normalise(embeddings)
    pairs, _ = cluster_pairs(x, np.arange(len(x)), threshold)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
