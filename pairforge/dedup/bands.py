"""Near pairs: perceptual hashes within ``max_distance`` bits, without comparing all pairs.

Near pairs come from the pigeonhole principle. Split the hash into ``m`` bands: two
hashes at Hamming distance ``<= t`` differ in at most ``t`` bands, so they agree exactly
on at least ``k = m - t`` bands. Sorting by every combination of ``k`` bands and pairing
rows with equal keys therefore finds every pair within ``t`` (``m = t + 1``, ``k = 1`` is
the textbook case; a larger ``m`` gives longer keys and far fewer false candidates at
10^6 hashes, see :func:`plan_bands`). Each candidate is verified with a popcount, and a
pair is only reported by the first combination it matches, so no pair is seen twice.

A bucket that is too large to pair out (many distinct hashes sharing the key bits) is
split again on its remaining bits with the same rule, so skewed data costs time in
proportion to the pairs it really contains. Hashes with very few or very many set bits
(blank, single-colour or pure-gradient images) carry no perceptual information and are
kept out of the near-duplicate search entirely (see :func:`is_degenerate`); so are the
hashes of a bucket packed too densely for the phash to tell its images apart
(see :func:`_is_dense`). Those rows still take part in the exact join.

Stage 2's band-join tasks (``dedup/partitions.py``) run :func:`_combo_pairs_local` per
band combination; ``dedup/reference.py``'s ``near_pairs`` runs them all in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from math import comb

import numpy as np

HASH_BITS = 64

# imagehash.phash sets a bit when a DCT coefficient is strictly above the median of the
# 64, so a natural image has exactly 32 bits set (all 399 COCO sample photos do). Fewer
# means most coefficients tie at the median: a flat, single-colour or gradient image
# (all give 0x0 or 0x8000000000000000). Such hashes say nothing about the content.
DEGENERATE_MIN_BITS = 16

# Cost model of the band join, in units of "one candidate pair generated and verified"
# (measured roughly with numpy on one core). It only decides how to split the work;
# every plan finds exactly the same pairs.
_ROW_COST = 3.0  # building a band key and sorting one row, for one band combination
_PASS_COST = 5000.0  # fixed numpy overhead of one band-combination pass
_MAX_COMBOS = 128

# Key lengths up to this use a counting pass (an int64 count per possible key: 32 MiB).
_COUNTING_MAX_BITS = 22

# A bucket of at least this many distinct hashes whose members expect at least
# DENSE_NEIGHBOURS neighbours each is "dense" (see _is_dense).
DENSE_MIN_ROWS = 1024
DENSE_NEIGHBOURS = 32

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class BandPlan:
    """How to split ``nbits``-bit values into bands for distance ``max_distance``."""

    nbits: int
    max_distance: int
    bands: tuple[tuple[int, int], ...]  # (shift, width), contiguous, together all nbits
    k: int  # bands any pair within max_distance shares exactly: len(bands) - max_distance

    @property
    def combos(self) -> list[tuple[int, ...]]:
        return list(combinations(range(len(self.bands)), self.k))

    def describe(self) -> str:
        widths = "/".join(str(w) for _, w in self.bands)
        return f"{len(self.bands)} bands ({widths} bits), {len(self.combos)} keys of {self.k}"


def _split_bits(nbits: int, m: int) -> tuple[tuple[int, int], ...]:
    base, extra = divmod(nbits, m)
    widths = [base + (1 if i < extra else 0) for i in range(m)]
    shifts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    return tuple((int(s), w) for s, w in zip(shifts, widths, strict=True))


def _plan_cost(n: int, nbits: int, t: int, m: int) -> float:
    k = m - t
    bands = _split_bits(nbits, m)
    key_bits = sum(sorted(w for _, w in bands)[:k])  # the worst (shortest) key
    expected_pairs = n * n / 2.0 / 2.0**key_bits  # if values were spread uniformly
    return comb(m, k) * (_PASS_COST + n * _ROW_COST + expected_pairs)


def plan_bands(n: int, nbits: int, max_distance: int) -> BandPlan | None:
    """The cheapest pigeonhole split for ``n`` values, or None when all pairs is cheaper."""
    best_cost, best_m = n * (n - 1) / 2.0, None
    for m in range(max_distance + 1, nbits + 1):
        if comb(m, m - max_distance) > _MAX_COMBOS:
            break
        cost = _plan_cost(n, nbits, max_distance, m)
        if cost < best_cost:
            best_cost, best_m = cost, m
    if best_m is None:
        return None
    return BandPlan(nbits, max_distance, _split_bits(nbits, best_m), best_m - max_distance)


def _gather_bits(values: np.ndarray, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Concatenate the bit ranges ``(shift, width)`` of each value into one integer."""
    out = np.zeros(len(values), dtype=np.uint64)
    for shift, width in ranges:
        part = (values >> np.uint64(shift)) & np.uint64((1 << width) - 1)
        out = (out << np.uint64(width)) | part
    return out


def _radix_argsort(key: np.ndarray, key_bits: int) -> np.ndarray:
    """Stable argsort of keys below 2**key_bits: numpy's radix sort, 16 bits a pass."""
    if key_bits > 48:
        return np.argsort(key, kind="stable")
    order = np.arange(len(key))
    for shift in range(0, key_bits, 16):
        digit = ((key[order] >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
    return order


def _shared_key_order(key: np.ndarray, key_bits: int) -> np.ndarray:
    """Positions whose key occurs more than once, sorted by key.

    Most keys are unique at the key lengths the planner picks, so a counting pass first
    drops them and only the rest is sorted.
    """
    if key_bits <= _COUNTING_MAX_BITS:
        as_index = key.astype(np.intp)
        counts = np.bincount(as_index, minlength=1 << key_bits)
        candidates = np.flatnonzero(counts[as_index] >= 2)
        return candidates[_radix_argsort(key[candidates], key_bits)]
    return _radix_argsort(key, key_bits)


def _runs(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each run of equal values in a sorted array."""
    if len(sorted_keys) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [len(sorted_keys)]]))
    return starts, lengths


def _pairs_within_runs(n: int, starts: np.ndarray, lengths: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """All position pairs (p < q) inside the given runs of a sorted array of length n."""
    remaining = np.zeros(n, dtype=np.int64)  # later positions in the same run
    if len(starts):
        positions = _expand_runs(starts, lengths)
        remaining[positions] = np.repeat(starts + lengths, lengths) - positions - 1
    active = np.flatnonzero(remaining >= 1)
    left, right = [], []
    offset = 1
    # Offset d pairs each position with the one d further on; the active set shrinks to
    # the positions that still have a partner, so the work equals the number of pairs.
    while len(active):
        left.append(active)
        right.append(active + offset)
        offset += 1
        active = active[remaining[active] >= offset]
    if not left:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(left), np.concatenate(right)


def _expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Positions covered by the runs, vectorised: start of each run plus 0..length-1."""
    total = int(lengths.sum())
    run_of = np.repeat(np.arange(len(starts)), lengths)
    first = np.cumsum(lengths) - lengths
    return starts[run_of] + (np.arange(total) - first[run_of])


def _verify(full: np.ndarray, a: np.ndarray, b: np.ndarray, t: int
            ) -> tuple[np.ndarray, np.ndarray]:
    keep = np.bitwise_count(full[a] ^ full[b]) <= t
    return a[keep], b[keep]


def _first_combo_only(values: np.ndarray, plan: BandPlan, combo: tuple[int, ...],
                      a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep pairs for which ``combo`` is the first combination of bands they share.

    A pair within distance shares some set E of bands; it is reported only by the
    combination made of the k lowest bands of E, so every pair is reported exactly once.
    """
    keep = np.ones(len(a), dtype=bool)
    for band in range(combo[-1]):
        if band in combo:
            continue
        shift, width = plan.bands[band]
        mask = np.uint64((1 << width) - 1)
        diff = ((values[a] ^ values[b]) >> np.uint64(shift)) & mask
        keep &= diff != 0
    return a[keep], b[keep]


def _varying_ranges(values: np.ndarray, nbits: int) -> list[tuple[int, int]]:
    """Contiguous bit ranges, high to low, in which not all values agree."""
    varying = int(np.bitwise_or.reduce(values) ^ np.bitwise_and.reduce(values))
    ranges: list[tuple[int, int]] = []
    bit = nbits - 1
    while bit >= 0:
        if varying >> bit & 1:
            top = bit
            while bit >= 0 and varying >> bit & 1:
                bit -= 1
            ranges.append((bit + 1, top - bit))
        else:
            bit -= 1
    return ranges


@lru_cache(maxsize=1024)
def _split_threshold(nbits: int, max_distance: int) -> int:
    """Smallest bucket for which another band join beats pairing it all out."""
    low, high = 2, 1 << 40
    if plan_bands(high, nbits, max_distance) is None:
        return high
    while low < high:
        mid = (low + high) // 2
        if plan_bands(mid, nbits, max_distance) is None:
            low = mid + 1
        else:
            high = mid
    return low


def _is_dense(length: int, varying_bits: int, max_distance: int) -> bool:
    """A bucket of distinct hashes packed so tightly that the phash cannot tell them apart.

    Its expected number of neighbours per hash (uniform within the bits that vary) is
    large: pairing it out would be quadratic, and linking it would chain thousands of
    distinct images into one cluster. Such hashes are treated like blank-image hashes.
    """
    if length < DENSE_MIN_ROWS:
        return False
    ball = sum(comb(varying_bits, d) for d in range(max_distance + 1))
    return length * ball / 2.0**varying_bits >= DENSE_NEIGHBOURS


_Found = tuple[np.ndarray, np.ndarray, np.ndarray]  # left, right, dense positions


def _split_giant_run(values: np.ndarray, full: np.ndarray, plan: BandPlan,
                     combo: tuple[int, ...], members: np.ndarray) -> _Found | None:
    """Pairs inside one oversized bucket: band-join again on the bits not in the key.

    Bits on which the whole bucket agrees are dropped first: they cannot contribute to a
    distance, and keeping them would recreate the same giant bucket one level down.
    Returns None when pairing the bucket out directly is cheaper.
    """
    rest = [plan.bands[i] for i in range(len(plan.bands)) if i not in combo]
    rest_values = _gather_bits(values[members], rest)
    varying = _varying_ranges(rest_values, sum(w for _, w in rest))
    varying_bits = sum(w for _, w in varying)
    if _is_dense(len(members), varying_bits, plan.max_distance):
        return _NONE, _NONE, members
    sub = plan_bands(len(members), varying_bits, plan.max_distance)
    if sub is None:
        return None
    rest_values = _gather_bits(rest_values, varying)
    found = [_combo_pairs_local(rest_values, full[members], sub, c) for c in sub.combos]
    return tuple(members[np.concatenate(part)] for part in zip(*found, strict=True))


def _combo_pairs_local(values: np.ndarray, full: np.ndarray, plan: BandPlan,
                       combo: tuple[int, ...]) -> _Found:
    """Verified pairs (positions into values) first found by ``combo``, and dense ones."""
    key_bits = sum(plan.bands[i][1] for i in combo)
    key = _gather_bits(values, [plan.bands[i] for i in combo])
    order = _shared_key_order(key, key_bits)
    starts, lengths = _runs(key[order])
    multi = lengths >= 2
    starts, lengths = starts[multi], lengths[multi]
    threshold = _split_threshold(plan.nbits - key_bits, plan.max_distance)
    found: list[_Found] = []
    small = np.ones(len(starts), dtype=bool)
    for r in np.flatnonzero(lengths >= threshold):
        members = order[starts[r]:starts[r] + lengths[r]]
        split = _split_giant_run(values, full, plan, combo, members)
        if split is not None:
            small[r] = False
            found.append(split)
    p, q = _pairs_within_runs(len(order), starts[small], lengths[small])
    a, b = _verify(full, order[p], order[q], plan.max_distance)
    found.append((a, b, _NONE))
    a, b, dense = (np.concatenate(part) for part in zip(*found, strict=True))
    a, b = _first_combo_only(values, plan, combo, a, b)
    return a, b, dense


def _brute_pairs(hashes: np.ndarray, t: int) -> np.ndarray:
    i, j = np.triu_indices(len(hashes), 1)
    keep = np.bitwise_count(hashes[i] ^ hashes[j]) <= t
    return np.stack([i[keep], j[keep]], axis=1).astype(np.int64)


def is_degenerate(phash: np.ndarray) -> np.ndarray:
    """True for hashes of images without perceptual structure (see DEGENERATE_MIN_BITS)."""
    bits = np.bitwise_count(np.asarray(phash, dtype=np.uint64))
    return (bits < DEGENERATE_MIN_BITS) | (bits > HASH_BITS - DEGENERATE_MIN_BITS)
