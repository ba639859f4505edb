"""The k-th largest of a score spread over many files, exactly, in bounded memory.

CLIP's ``top_fraction`` mode keeps the ``k`` best-scoring rows of the whole stage, so its
threshold is the k-th largest score. Collecting every score in one process grows with the
dataset; a radix selection does not: each float32 maps to a uint32 key that sorts in the
same order, a first pass counts keys by their high 16 bits (65,536 counters per shard,
added up as shards report), which names the bucket holding the k-th largest and its rank
inside it, and a second pass counts the low 16 bits of that bucket's keys alone. The
result is the same value a full sort gives, with two reads of each score file and no state
beyond two histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

BUCKETS = 1 << 16
_SIGN = np.uint32(0x80000000)


def sortable_keys(values: np.ndarray) -> np.ndarray:
    """uint32 keys ordered as the float32 values are (NaN excluded by the caller)."""
    bits = (np.asarray(values, np.float32) + np.float32(0.0)).view(np.uint32)  # -0.0 -> 0.0
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def value_of(key: int) -> float:
    """The float32 value whose sortable key is ``key``."""
    key = np.uint32(key)
    bits = key & ~_SIGN if key & _SIGN else ~key
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def high_histogram(values: np.ndarray) -> np.ndarray:
    """Counts of the values by the high 16 bits of their keys (the first pass)."""
    return np.bincount(sortable_keys(values) >> 16, minlength=BUCKETS).astype(np.int64)


def low_histogram(values: np.ndarray, bucket: int) -> np.ndarray:
    """Counts of the values in ``bucket`` by the low 16 bits of their keys (the second)."""
    keys = sortable_keys(values)
    inside = keys[(keys >> 16) == bucket]
    return np.bincount(inside & 0xFFFF, minlength=BUCKETS).astype(np.int64)


def rank_in(histogram: np.ndarray, k: int) -> tuple[int, int]:
    """(bucket, rank inside it) of the k-th largest (1-based) counted in ``histogram``."""
    above = np.cumsum(histogram[::-1])  # above[i]: values in the top i+1 buckets
    i = int(np.searchsorted(above, k))
    bucket = BUCKETS - 1 - i
    return bucket, k - (int(above[i - 1]) if i else 0)


Histograms = Callable[[Callable[[np.ndarray], np.ndarray]], Iterable[np.ndarray]]


def kth_largest(histograms: Histograms, fraction: float) -> float:
    """The score that keeps ``fraction`` of all scores (ties at it all kept): the k-th
    largest, ``k = max(1, round(fraction * n))``; ``-inf`` when there is no score.

    ``histograms(fn)`` applies ``fn`` to each shard's scores (anywhere: in Ray tasks) and
    yields the results, which are added up as they come."""
    first = _total(histograms(high_histogram))
    n = int(first.sum())
    if not n:
        return float("-inf")
    k = max(1, int(round(fraction * n)))
    bucket, rank = rank_in(first, k)
    second = _total(histograms(lambda values: low_histogram(values, bucket)))
    low, _ = rank_in(second, rank)
    return value_of((bucket << 16) | low)


def _total(parts: Iterable[np.ndarray]) -> np.ndarray:
    total = np.zeros(BUCKETS, np.int64)
    for part in parts:
        total += part
    return total
