"""Stage 2 algorithm: exact and near-duplicate decisions over hash metadata only.

Three kinds of evidence link two samples into one cluster:

* the same exact hash (``pixel_hash``: identical decoded pixels, so re-encodes and the
  same file under another URL are caught; ``sha256`` only when the pixel hash is missing);
* the same 64-bit perceptual hash (joined in linear time through one node per value);
* perceptual hashes within ``max_distance`` bits, found without comparing all pairs.

Every row brings several perceptual hashes, its *points* (``filters/hashing.py``): the
whole image (``phash``), the whole image mirrored (``phash_mirror``) and centre regions with
their mirrors (``crop_phashes``). All points of all rows go into one pool of distinct
values; a row is linked to each of its points, and two points within ``max_distance`` are
linked. So an image and its mirror are one point to the join (A's mirror hash meets B's
hash), and a copy with its borders cut meets its original through the original's centre
region hash. Each dropped row is then labelled by the direct evidence between it and its
cluster's survivor, strongest first: exact (same pixels), near (whole-image hashes within
the distance), mirror (whole against mirrored), crop (any pair involving a region hash);
a row linked to its survivor only through other members is labelled by its own strongest
link inside the cluster (its distance stays the whole-image bits to the survivor).

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

Clusters are the connected components of all links; in each, the survivor is decided by
:func:`survivor_order`, which depends on row contents only, never on input order or on
how the work was split.

Stage 2 runs these decisions as partition tasks (``filters/dedup_parts.py``): the band
join (:func:`_combo_pairs_local`), the evidence (:func:`duplicates_table`) and the
survivor rule run inside its tasks. :func:`find_duplicates` makes the same decisions in
one process over tables in memory: the reference that the tests compare the stage with
(and what the kinds benches measure), not a code path of the pipeline.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from math import comb

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from pairforge.dedup.grids import (
    POINT_FRACTIONS,
    POINTS,
    GridCheck,
    Grids,
    colour_distance,
    compatible,
    is_legacy,
    legacy_form,
    readable,
    view_grid,
)
from pairforge.dedup.hashing import PIXEL_HASH
from pairforge.records import Status

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
_NO_PAIRS = np.zeros((0, 2), dtype=np.int64)

# A row kept out of the exact join (no pixel hash and no sha256).
_NO_CODE = -1

HASH_LIST = pa.list_(pa.uint64())

ROWS_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("exact", pa.string()),
    pa.field("phash", pa.uint64()),
    pa.field("phash_mirror", pa.uint64()),
    pa.field("crop_phashes", HASH_LIST),
    pa.field("colour_grid", pa.binary()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
])

# An index file names the function of its pixel hashes (``pixel_hash_matches``).
PIXEL_HASH_KEY = b"pairforge.pixel_hash"
INDEX_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("source", pa.string()),
    pa.field("pixel_hash", pa.string()),
    pa.field("phash", pa.uint64()),
    pa.field("phash_mirror", pa.uint64()),
    pa.field("crop_phashes", HASH_LIST),
    pa.field("colour_grid", pa.binary()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
], metadata={PIXEL_HASH_KEY: PIXEL_HASH.encode()})

DUPLICATES_SCHEMA = pa.schema([
    pa.field("key", pa.string()),
    pa.field("kind", pa.string()),
    pa.field("cluster_id", pa.string()),
    pa.field("kept_key", pa.string()),
    pa.field("kept_source", pa.string()),  # null: kept in this build; else the index's source
    pa.field("distance", pa.int32()),  # hash bits of the evidence (null without phash)
])

# Columns of the point matrix (see _points): the whole image, its mirror, then regions.
_WHOLE, _MIRROR, _REGIONS = 0, 1, 2


# --------------------------------------------------------------------------- near pairs


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


@dataclass
class NearPairs:
    """Pairs of hash indices within distance, and hashes found in over-dense buckets."""

    pairs: np.ndarray  # (P, 2) int64, i < j, sorted
    dense: np.ndarray  # sorted indices of hashes treated as degenerate (see _is_dense)


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


def _brute_pairs(hashes: np.ndarray, t: int) -> np.ndarray:
    i, j = np.triu_indices(len(hashes), 1)
    keep = np.bitwise_count(hashes[i] ^ hashes[j]) <= t
    return np.stack([i[keep], j[keep]], axis=1).astype(np.int64)


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


# ------------------------------------------------------------------------------ clusters


def is_degenerate(phash: np.ndarray) -> np.ndarray:
    """True for hashes of images without perceptual structure (see DEGENERATE_MIN_BITS)."""
    bits = np.bitwise_count(np.asarray(phash, dtype=np.uint64))
    return (bits < DEGENERATE_MIN_BITS) | (bits > HASH_BITS - DEGENERATE_MIN_BITS)


def _column(table: pa.Table, name: str, dtype: pa.DataType) -> pa.ChunkedArray | pa.Array:
    """A column cast to ``dtype``, or nulls when the table predates it (older raw shards and
    indexes have no mirror or region hashes: their rows join on the whole-image hash)."""
    if name in table.column_names:
        return table[name].cast(dtype)
    return pa.nulls(len(table), dtype)


def prepare_rows(raw: pa.Table) -> pa.Table:
    """Hash columns of a raw shard table -> ok rows in ROWS_SCHEMA.

    ``exact`` is the pixel hash; a row without one falls back to its sha256 (prefixed so
    the two can never be equal by accident).
    """
    if "status" in raw.column_names:
        raw = raw.filter(pc.equal(raw["status"], Status.OK.value))
    exact = raw["pixel_hash"].cast(pa.string())
    if "sha256" in raw.column_names:
        sha = raw["sha256"].cast(pa.string())
        exact = pc.coalesce(exact, pc.binary_join_element_wise("sha256:", sha, ""))
    return pa.table({
        "key": raw["key"].cast(pa.string()),
        "exact": exact.cast(pa.string()),
        "phash": raw["phash"].cast(pa.uint64()),
        "phash_mirror": _column(raw, "phash_mirror", pa.uint64()),
        "crop_phashes": _column(raw, "crop_phashes", HASH_LIST),
        "colour_grid": _column(raw, "colour_grid", pa.binary()),
        "original_width": raw["original_width"].cast(pa.int32()),
        "original_height": raw["original_height"].cast(pa.int32()),
    }, schema=ROWS_SCHEMA)


def index_rows(index: pa.Table) -> pa.Table:
    """An index table as ROWS_SCHEMA rows plus their source column."""
    return pa.table({
        "key": index["key"].cast(pa.string()),
        "exact": index["pixel_hash"].cast(pa.string()),
        "phash": index["phash"].cast(pa.uint64()),
        "phash_mirror": _column(index, "phash_mirror", pa.uint64()),
        "crop_phashes": _column(index, "crop_phashes", HASH_LIST),
        "colour_grid": _column(index, "colour_grid", pa.binary()),
        "original_width": index["original_width"].cast(pa.int32()),
        "original_height": index["original_height"].cast(pa.int32()),
        "source": index["source"].cast(pa.string()),
    })


def _u64(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Values (nulls as 0) and validity of a uint64 column, without a float detour."""
    valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
    values = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.uint64)
    return values, valid


def points_of(table: pa.Table, mirrors: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(rows, K) matrix of every row's hashes and their validity: whole image, mirror, then
    the region hashes (K - 2 of them: the longest crop_phashes list present; each region's
    hash, then its mirror's). ``mirrors=False``: the mirrors' hashes are invalid, so that
    no mirrored copy links to its original."""
    whole, whole_ok = _u64(table["phash"])
    mirror, mirror_ok = _u64(table["phash_mirror"])
    crops = table["crop_phashes"].combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(crops), 0).to_numpy(zero_copy_only=False)
    width = int(lengths.max(initial=0))
    values = np.zeros((len(table), 2 + width), dtype=np.uint64)
    valid = np.zeros((len(table), 2 + width), dtype=bool)
    values[:, _WHOLE], valid[:, _WHOLE] = whole, whole_ok
    values[:, _MIRROR], valid[:, _MIRROR] = mirror, mirror_ok
    if width:
        flat, flat_ok = _u64(pc.list_flatten(crops))
        rows = np.repeat(np.arange(len(table)), lengths)
        cols = _REGIONS + np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        values[rows, cols], valid[rows, cols] = flat, flat_ok
    if not mirrors:
        valid[:, _MIRROR::2] = False
    return values, valid


def survivor_order(keys: pa.Array, sources: pa.Array, from_index: np.ndarray,
                   area: np.ndarray) -> np.ndarray:
    """Rank of every row as the survivor of its cluster (0 = kept first).

    Rows of earlier builds (the index) always win, since those builds already shipped
    them; then the largest original resolution (the most information); then the lowest
    key, then the lowest source, so the choice never depends on input order or workers.
    """
    table = pa.table({"new": (~from_index).astype(np.int8), "area": area,
                      "key": keys, "source": pc.fill_null(sources, "")})
    order = pc.sort_indices(table, sort_keys=[("new", "ascending"), ("area", "descending"),
                                              ("key", "ascending"), ("source", "ascending")]
                            ).to_numpy()
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


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


def exact_codes(exact: pa.ChunkedArray) -> np.ndarray:
    encoded = pc.dictionary_encode(exact.combine_chunks())
    return pc.fill_null(encoded.indices, _NO_CODE).to_numpy(zero_copy_only=False
                                                            ).astype(np.int64)


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


def _min_distance(a: np.ndarray, a_ok: np.ndarray, b: np.ndarray, b_ok: np.ndarray,
                  pairs: list[tuple[int, int]]) -> np.ndarray:
    """Per row, the fewest bits between point i of ``a`` and point j of ``b`` over
    ``pairs`` (i, j) where both are valid; HASH_BITS + 1 when none is."""
    best = np.full(len(a), HASH_BITS + 1, dtype=np.int64)
    for i, j in pairs:
        if i >= a.shape[1] or j >= b.shape[1]:
            continue
        d = np.bitwise_count(a[:, i] ^ b[:, j]).astype(np.int64)
        best = np.minimum(best, np.where(a_ok[:, i] & b_ok[:, j], d, HASH_BITS + 1))
    return best


def evidence(row_points: np.ndarray, row_ok: np.ndarray, kept_points: np.ndarray,
             kept_ok: np.ndarray, exact: np.ndarray, max_distance: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kind (a Status value) and distance in bits of the direct evidence between each
    dropped row and its survivor, strongest first: exact, near, mirror, crop; and whether
    there was any. A row without (linked through other members) is near, at its
    whole-image distance, until :func:`_chained_kinds` looks at its own links."""
    k = row_points.shape[1]
    near = _min_distance(row_points, row_ok, kept_points, kept_ok, [(_WHOLE, _WHOLE)])
    mirror = _min_distance(row_points, row_ok, kept_points, kept_ok,
                           [(_WHOLE, _MIRROR), (_MIRROR, _WHOLE)])
    crop = _min_distance(row_points, row_ok, kept_points, kept_ok,
                         [(i, j) for i in range(k) for j in range(kept_points.shape[1])
                          if i >= _REGIONS or j >= _REGIONS])
    kind = np.select([exact, near <= max_distance, mirror <= max_distance,
                      crop <= max_distance],
                     [Status.DUPLICATE_EXACT.value, Status.DUPLICATE_NEAR.value,
                      Status.DUPLICATE_MIRROR.value, Status.DUPLICATE_CROP.value],
                     Status.DUPLICATE_NEAR.value)
    distance = np.select([exact | (near <= max_distance), mirror <= max_distance,
                          crop <= max_distance], [near, mirror, crop], near)
    direct = exact | (np.minimum(np.minimum(near, mirror), crop) <= max_distance)
    return kind, distance, direct


# A chained row's own links are looked up among at most this many cluster members.
_CHAIN_MEMBERS = 1000


def _chained_kinds(rows: np.ndarray, labels: np.ndarray, points: np.ndarray,
                   valid: np.ndarray, max_distance: int) -> np.ndarray:
    """Kind of each row's strongest own link inside its cluster (rows linked to their
    survivor only through other members: a crop of a photo whose 2x copy survived)."""
    strength = {Status.DUPLICATE_NEAR.value: 0, Status.DUPLICATE_MIRROR.value: 1,
                Status.DUPLICATE_CROP.value: 2}
    kinds = np.full(len(rows), Status.DUPLICATE_NEAR.value, dtype=object)
    order = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[order], labels[rows], side="left")
    for i, row in enumerate(rows):
        members = order[starts[i]:starts[i] + _CHAIN_MEMBERS + 1]
        members = members[(labels[members] == labels[row]) & (members != row)]
        found, _, linked = evidence(points[[row] * len(members)], valid[[row] * len(members)],
                                    points[members], valid[members],
                                    np.zeros(len(members), bool), max_distance)
        if linked.any():
            kinds[i] = min(found[linked], key=strength.__getitem__)
    return kinds.astype(str)


def duplicates_table(table: pa.Table, dropped: np.ndarray, kept: np.ndarray,
                      exact_losers: np.ndarray, points: np.ndarray, valid: np.ndarray,
                      labels: np.ndarray, max_distance: int) -> pa.Table:
    """One row per dropped sample, sorted by key.

    ``kind`` is exact when the row's pixels also belong to a better-ranked row (exact
    dedup alone would drop it), else the direct evidence to the survivor (see
    :func:`evidence`); ``kept_key`` is always the cluster's survivor and ``distance`` the
    bits of that evidence (null when a hash is missing).
    """
    rows, kept = np.flatnonzero(dropped), kept[dropped]
    kind, distance, direct = evidence(points[rows], valid[rows], points[kept], valid[kept],
                                      exact_losers[rows], max_distance)
    if not direct.all():
        kind[~direct] = _chained_kinds(rows[~direct], labels, points, valid, max_distance)
    kept_key = table["key"].take(kept)
    kept_source = table["source"].take(kept)
    cluster = pc.if_else(pc.is_null(kept_source), kept_key,
                         pc.binary_join_element_wise(kept_source, kept_key, ":"))
    out = pa.table({
        "key": table["key"].take(rows),
        "kind": pa.array(kind, pa.string()),
        "cluster_id": cluster,
        "kept_key": kept_key,
        "kept_source": kept_source,
        "distance": pa.array(distance.astype(np.int32), pa.int32(),
                             mask=distance > HASH_BITS),
    }, schema=DUPLICATES_SCHEMA)
    return out.take(pc.sort_indices(out, sort_keys=[("key", "ascending")]))


def colour_groups(labels: np.ndarray, rank: np.ndarray, grids: pa.ChunkedArray | pa.Array,
                  points: np.ndarray, valid: np.ndarray, max_distance: int,
                  check: GridCheck) -> np.ndarray:
    """The components split by the grid checks (filters/grids.py): labels under which no
    row is merged with one whose colour grid the checks tell apart.

    In each component of two or more, rows are taken in survivor order; a row joins the
    group of the first earlier survivor it is compatible with, or starts its own group as
    its survivor. Compatible: the whole images pass the checks (as given, or mirrored when
    mirrors count), or a pair of their points that involves a region (a crop link) is
    within ``max_distance`` bits and what those points see passes them, or either row has
    no grid (a raw shard or index written before it: as before the check). Depends on
    row contents only, like the survivor rule."""
    if not check.active or len(labels) == 0:
        return labels
    order = np.lexsort((rank, labels))
    sorted_labels = labels[order]
    starts = np.flatnonzero(np.r_[True, sorted_labels[1:] != sorted_labels[:-1]])
    ends = np.r_[starts[1:], len(order)]
    refined = labels.copy()
    next_label = int(labels.max()) + 1
    grid_of = grids.to_pylist()
    for start, end in zip(starts, ends, strict=True):
        if end - start < 2:
            continue
        members = order[start:end]
        groups = _split_component(members, grid_of, points, valid, max_distance, check)
        for group in np.unique(groups)[1:]:  # the first group keeps the component's label
            refined[members[groups == group]], next_label = next_label, next_label + 1
    return refined


def _split_component(members: np.ndarray, grids: list[bytes | None], points: np.ndarray,
                     valid: np.ndarray, max_distance: int, check: GridCheck) -> np.ndarray:
    """Group number of each member (in survivor order): its first compatible survivor's."""
    held = [readable(grids[m]) for m in members]
    if any(g is not None and is_legacy(g) for g in held):  # an older index or raw shard
        return _split_legacy(members, held, points, valid, max_distance, check)
    has_grid = np.array([g is not None for g in held])
    decoded = Grids.of([g for g in held if g is not None]) if has_grid.any() else None
    slot = np.cumsum(has_grid) - 1  # member -> row of ``decoded``
    return _greedy_groups(len(members), lambda i, survivors: _first_compatible(
        i, survivors, members, has_grid, slot, decoded, points, valid, max_distance, check))


def _greedy_groups(count: int, first_match: Callable[[int, list[int]], int | None]
                   ) -> np.ndarray:
    """Group of each of ``count`` members in survivor order: that of the first survivor
    ``first_match`` names, or a new one with the member as its survivor."""
    group = np.zeros(count, dtype=np.int64)
    survivors: list[int] = []
    for i in range(count):
        match = first_match(i, survivors)
        if match is None:
            group[i] = len(survivors)
            survivors.append(i)
        else:
            group[i] = group[match]
    return group


def _first_compatible(i: int, survivors: list[int], members: np.ndarray,
                      has_grid: np.ndarray, slot: np.ndarray, decoded: Grids | None,
                      points: np.ndarray, valid: np.ndarray, max_distance: int,
                      check: GridCheck) -> int | None:
    """The earliest survivor member ``i`` may merge with, or None."""
    if not survivors:
        return None
    if not has_grid[i] or decoded is None:
        return survivors[0]
    held = np.array(survivors)
    ok = ~has_grid[held]
    graded = held[has_grid[held]]
    row, others = slot[i], slot[graded]
    passed = compatible(decoded, row, _WHOLE, others, _WHOLE, check)
    if check.mirrors and not passed.all():
        passed[~passed] = compatible(decoded, row, _WHOLE, others[~passed], _MIRROR, check)
    limit = min(points.shape[1], POINTS)
    for a in range(limit):
        for b in range(limit):
            # two points framed alike (both whole, or the same region) see what the whole
            # images' check saw: a crop link is between two framings
            if POINT_FRACTIONS[a] == POINT_FRACTIONS[b] or passed.all():
                continue
            linked = (~passed & valid[members[i], a] & valid[members[graded], b]
                      & (np.bitwise_count(points[members[i], a] ^ points[members[graded], b])
                         <= max_distance))
            if linked.any():
                passed[linked] = compatible(decoded, row, a, others[linked], b, check)
    ok[has_grid[held]] = passed
    first = np.flatnonzero(ok)
    return survivors[first[0]] if len(first) else None


def _split_legacy(members: np.ndarray, held: list[bytes | None], points: np.ndarray,
                  valid: np.ndarray, max_distance: int, check: GridCheck) -> np.ndarray:
    """The colour check alone, on grids in the layout written before the structure check
    (filters/grids.legacy_form), pair by pair as it ran then."""
    legacy = [None if g is None else legacy_form(g) for g in held]
    return _greedy_groups(len(members), lambda i, survivors: next(
        (s for s in survivors if _legacy_compatible(
            i, s, members, legacy, points, valid, max_distance, check)), None))


def _legacy_compatible(i: int, s: int, members: np.ndarray, grids: list[bytes | None],
                       points: np.ndarray, valid: np.ndarray, max_distance: int,
                       check: GridCheck) -> bool:
    """Either has no grid, or the whole grids are within the colour bound, or a crop link's
    two 4x4 views are within half of it (a 4x4 cell averages a recoloured object over more
    background: true crops, mirrors, resizes and re-encodes of 300 COCO photos: at most
    15; the recoloured scenes of tests/test_colour_check.py: 26 and more)."""
    a, b = grids[i], grids[s]
    bound = check.max_colour_distance
    if a is None or b is None or bound is None or colour_distance(a, b, check.mirrors) <= bound:
        return True
    row, survivor = members[i], members[s]
    limit = min(points.shape[1], POINTS)
    for p in range(limit):
        for q in range(limit):
            if (p < _REGIONS and q < _REGIONS) or not (valid[row, p] and valid[survivor, q]):
                continue
            if int(np.bitwise_count(points[row, p] ^ points[survivor, q])) > max_distance:
                continue
            if np.abs(view_grid(a, p) - view_grid(b, q)).max() <= bound // 2:
                return True
    return False


def survivor_rank(table: pa.Table, from_index: np.ndarray) -> np.ndarray:
    width = pc.fill_null(table["original_width"], 0).to_numpy().astype(np.int64)
    height = pc.fill_null(table["original_height"], 0).to_numpy().astype(np.int64)
    return survivor_order(table["key"], table["source"], from_index, width * height)


def best_of_groups(groups: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Row with the lowest rank in each row's group (groups: non-negative labels)."""
    best = np.full(groups.max(initial=-1) + 1, len(rank), dtype=np.int64)
    np.minimum.at(best, groups, rank)
    return np.argsort(rank)[best[groups]]


def _exact_losers(exact_codes: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Rows pixel-identical to a better-ranked row: what exact dedup alone would drop."""
    losers = np.zeros(len(rank), dtype=bool)
    rows = np.flatnonzero(exact_codes >= 0)
    # best_of_groups answers in positions among the rows it gets, from ranks 0..n-1 of
    # those rows (index rows without a pixel hash have no code)
    ranks = np.argsort(np.argsort(rank[rows]))
    losers[rows] = best_of_groups(exact_codes[rows], ranks) != np.arange(len(rows))
    return losers


def colour_splits(components: np.ndarray, labels: np.ndarray, from_index: np.ndarray) -> int:
    """New rows kept because the grid checks split their component: the groups beyond
    one per component, over the rows of this build."""
    new = ~from_index
    return int(len(np.unique(labels[new])) - len(np.unique(components[new])))


HASH_KINDS = (Status.DUPLICATE_EXACT, Status.DUPLICATE_NEAR, Status.DUPLICATE_MIRROR,
              Status.DUPLICATE_CROP)


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
    the single-process reference of stage 2 (see the module docstring).

    ``index`` (INDEX_SCHEMA) holds rows of earlier builds: they take part in every join
    and always survive, so a new row that matches one is dropped in its favour. Hashes
    that are missing, degenerate or dense stay out of the perceptual join (a row whose
    hashes all are only takes part in the exact join). ``mapper`` runs the band
    combinations (locally by default; the stage passes a Ray one);
    ``check``: the grid checks and whether mirrors count (:func:`colour_groups`);
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


def pixel_hash_matches(schema: pa.Schema) -> bool:
    """Whether an index file's pixel hashes come from this version's function: files
    written before it was named hold sha256 ones, which no row of this build can equal
    (their rows still join on the perceptual hashes)."""
    return (schema.metadata or {}).get(PIXEL_HASH_KEY) == PIXEL_HASH.encode()


def as_index(table: pa.Table) -> pa.Table:
    """An index of any pairforge version in INDEX_SCHEMA (missing hash columns as nulls)."""
    return pa.table({f.name: _column(table, f.name, f.type) for f in INDEX_SCHEMA},
                    schema=INDEX_SCHEMA)


def drop_repeated_rows(index: pa.Table) -> pa.Table:
    order = pc.sort_indices(index, sort_keys=[("source", "ascending"), ("key", "ascending")])
    ordered = index.take(order)
    if len(ordered) < 2:
        return ordered
    src, key = ordered["source"], ordered["key"]
    same = pc.and_(pc.equal(src.slice(1), src.slice(0, len(ordered) - 1)),
                   pc.equal(key.slice(1), key.slice(0, len(ordered) - 1)))
    keep = np.concatenate([[True], ~pc.fill_null(same, False).to_numpy(zero_copy_only=False)])
    return ordered.filter(pa.array(keep))
