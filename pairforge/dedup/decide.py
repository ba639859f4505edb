"""Stage 2's decisions: exact and near-duplicate clusters over hash metadata only.

Three kinds of evidence link two samples into one cluster:

* the same exact hash (``pixel_hash``: identical decoded pixels, so re-encodes and the
  same file under another URL are caught; ``sha256`` only when the pixel hash is missing);
* the same 64-bit perceptual hash (joined in linear time through one node per value);
* perceptual hashes within ``max_distance`` bits, found without comparing all pairs
  (``dedup/bands.py``).

Every row brings several perceptual hashes, its *points* (``dedup/hashing.py``): the
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

Clusters are the connected components of all links; in each, the survivor is decided by
:func:`survivor_order`, which depends on row contents only, never on input order or on
how the work was split, and the grid checks (:func:`colour_groups`, over
``dedup/grids.py``) split a cluster whose members' colours or structure tell them apart.

Stage 2 runs these decisions as partition tasks (``dedup/partitions.py``): the evidence
(:func:`duplicates_table`), the grid checks and the survivor rule run inside its tasks.
``dedup/reference.py``'s ``find_duplicates`` makes the same decisions in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairforge.dedup.bands import HASH_BITS
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
from pairforge.records import Status

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


def column_or_nulls(table: pa.Table, name: str, dtype: pa.DataType) -> pa.ChunkedArray | pa.Array:
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
        "phash_mirror": column_or_nulls(raw, "phash_mirror", pa.uint64()),
        "crop_phashes": column_or_nulls(raw, "crop_phashes", HASH_LIST),
        "colour_grid": column_or_nulls(raw, "colour_grid", pa.binary()),
        "original_width": raw["original_width"].cast(pa.int32()),
        "original_height": raw["original_height"].cast(pa.int32()),
    }, schema=ROWS_SCHEMA)


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


def exact_codes(exact: pa.ChunkedArray) -> np.ndarray:
    encoded = pc.dictionary_encode(exact.combine_chunks())
    return pc.fill_null(encoded.indices, _NO_CODE).to_numpy(zero_copy_only=False
                                                            ).astype(np.int64)


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
    """The components split by the grid checks (dedup/grids.py): labels under which no
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
    (dedup/grids.legacy_form), pair by pair as it ran then."""
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


def colour_splits(components: np.ndarray, labels: np.ndarray, from_index: np.ndarray) -> int:
    """New rows kept because the grid checks split their component: the groups beyond
    one per component, over the rows of this build."""
    new = ~from_index
    return int(len(np.unique(labels[new])) - len(np.unique(components[new])))


HASH_KINDS = (Status.DUPLICATE_EXACT, Status.DUPLICATE_NEAR, Status.DUPLICATE_MIRROR,
              Status.DUPLICATE_CROP)
