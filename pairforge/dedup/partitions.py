"""Stage 2 split into partition tasks: the decisions of ``dedup/decide.py``, with no
process ever holding every row (``dedup/reference.find_duplicates`` makes them in one).

Every function here is one task of one phase (``pipeline/dedup_stage.py`` runs them on
Ray, in this order); each reads the partitioned files of earlier phases
(``dedup/shuffle.py``) and writes its own under the stage's work folder
(``dedup/work.py``), so a retried or rerun task writes the same rows again. A row is known
everywhere by its *position* ``pos`` = (input file number << 32) + row number: raw shards
first, then index files, in the order the single-process algorithm concatenates them, so
ties are broken as there.

1. ``scatter``: read the hash columns of some raw shards or index files; write the rows
   (by position), the new rows' keys (by key), the exact hashes (by exact hash) and every
   usable perceptual hash (by value).
2. ``exact_groups``: per exact-hash partition, the rows sharing pixels: links from each
   to the group's first row, and the rows that lose to a better one (``exact`` evidence);
   repeated keys are refused here.
3. ``unique_values``: per value partition, the distinct values, each with its first row
   (its *representative*), and the other rows sharing it. The driver sums the counts and
   plans the band join (``dedup/bands.plan_bands``) on the total, as the single process
   does.
4. ``band_scatter`` / ``band_join``: the values again, partitioned by the bits of one band;
   a task runs every band combination whose lowest band that is, so each bucket of equal
   keys is whole in one task and is split, paired out and judged dense exactly as in the
   single process. Pairs go out by the value partition of their first value.
5. ``value_links`` / ``near_links``: dense values leave the join (as there); each value's
   rows are linked to its representative, and each near pair links two representatives.
6. ``dedup/components.py``: the connected components of those links.
7. ``label_members`` / ``decide``: the rows of each component meet in one task, which
   picks the survivor and writes the evidence with ``dedup/decide.py``'s functions.
8. ``dedup/key_ranges.py``: duplicates by key range, then one file.
9. ``dedup/index_writing.py``: the next index (earlier index rows + survivors), in parts
   by a prefix of the hash of each row's source and key.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.dedup.bands import BandPlan, _brute_pairs, _combo_pairs_local, is_degenerate
from pairforge.dedup.components import (
    LABEL_SCHEMA,
    StepResult,
    large_star,
    small_star,
    write_edges,
)
from pairforge.dedup.decide import (
    HASH_KINDS,
    ROWS_SCHEMA,
    best_of_groups,
    colour_groups,
    colour_splits,
    duplicates_table,
    exact_codes,
    points_of,
    prepare_rows,
    survivor_order,
    survivor_rank,
)
from pairforge.dedup.index import INDEX_SCHEMA, as_index, index_rows, pixel_hash_matches
from pairforge.dedup.key_ranges import key_range_of
from pairforge.dedup.shuffle import (
    mix64,
    part_of,
    read_part,
    read_tables,
    string_hash,
    write_parts,
    write_table,
)
from pairforge.dedup.work import InputFile, Work
from pairforge.records import HASH_COLUMNS
from pairforge.tables import read_key_range

_WHOLE = 0
_FILE_SHIFT = 32  # pos = file number << 32 | row number

ROW_SCHEMA = pa.schema([*ROWS_SCHEMA, pa.field("source", pa.string()),
                        pa.field("from_index", pa.bool_()), pa.field("pos", pa.int64())])
KEY_SCHEMA = pa.schema([pa.field("key", pa.string())])
EXACT_SCHEMA = pa.schema([pa.field("exact", pa.string()), pa.field("pos", pa.int64()),
                          pa.field("from_index", pa.bool_()), pa.field("area", pa.int64()),
                          pa.field("key", pa.string()), pa.field("source", pa.string())])
VALUE_SCHEMA = pa.schema([pa.field("value", pa.uint64()), pa.field("pos", pa.int64()),
                          pa.field("new_whole", pa.bool_())])
UNIQUE_SCHEMA = pa.schema([pa.field("value", pa.uint64()), pa.field("rep", pa.int64()),
                           pa.field("new_wholes", pa.int64())])
STAR_SCHEMA = pa.schema([pa.field("value", pa.uint64()), pa.field("pos", pa.int64())])
BAND_SCHEMA = pa.schema([pa.field("value", pa.uint64())])
PAIR_SCHEMA = pa.schema([pa.field("a", pa.uint64()), pa.field("b", pa.uint64())])
HALF_SCHEMA = pa.schema([pa.field("b", pa.uint64()), pa.field("rep_a", pa.int64())])
POS_SCHEMA = pa.schema([pa.field("pos", pa.int64())])
MEMBER_SCHEMA = pa.schema([*ROW_SCHEMA, pa.field("label", pa.int64()),
                           pa.field("exact_loser", pa.bool_())])

# Keys each scatter task samples from its rows, for the key ranges of the output sort.
KEY_SAMPLES = 64


def count_rows(urls: list[str], storage_options: dict[str, Any]) -> list[int]:
    """Rows of each parquet file, from its footer."""
    counts = []
    for url in urls:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        with fs.open(path, "rb") as handle:
            counts.append(pq.ParquetFile(handle).metadata.num_rows)
    return counts


def _by_pos(pos: np.ndarray, parts: int) -> np.ndarray:
    return part_of(mix64(pos), parts)


def _by_value(values: np.ndarray, parts: int) -> np.ndarray:
    return part_of(mix64(values), parts)


# ----------------------------------------------------------------------------- reading


def _schema(handle: Any) -> pa.Schema:
    """A parquet file's schema, the handle left at the start for reading the table."""
    schema = pq.read_schema(handle)
    handle.seek(0)
    return schema


def _present(schema: pa.Schema, wanted: list[str]) -> list[str]:
    """The wanted columns a parquet file has: files of older versions lack the mirror and
    region hashes (their rows then join on the whole-image hash only)."""
    return [c for c in wanted if c in schema.names]


def read_hash_columns(url: str, storage_options: dict[str, Any]
                      ) -> tuple[pa.Table, dict[str, int]]:
    """The ok rows of one raw shard parquet (ROWS_SCHEMA) and its rows per status."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    with fs.open(path, "rb") as handle:
        table = pq.read_table(handle, columns=_present(_schema(handle), HASH_COLUMNS))
    counts = {row["values"]: row["counts"] for row in
              pc.value_counts(table["status"]).to_pylist()}
    return prepare_rows(table), counts


def read_index(url: str, storage_options: dict[str, Any]) -> pa.Table:
    """One dedup index file of an earlier build (INDEX_SCHEMA); pixel hashes made by
    another function are left out (null), so they neither match nor pass into the index
    this build writes."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    with fs.open(path, "rb") as handle:
        schema = _schema(handle)
        columns = _present(schema, INDEX_SCHEMA.names)
        if not pixel_hash_matches(schema):
            columns = [c for c in columns if c != "pixel_hash"]
        table = pq.read_table(handle, columns=columns)
    return as_index(table)


def _input_rows(file: InputFile, storage_options: dict[str, Any], own_source: str | None
                ) -> tuple[pa.Table, dict[str, int], int]:
    """ROW_SCHEMA rows of one input, its status counts and index rows without pixel hash."""
    if file.index:
        index = read_index(file.url, storage_options)
        rows = index_rows(index).cast(ROWS_SCHEMA.append(pa.field("source", pa.string())))
        if own_source is not None:
            mine = pc.equal(rows["source"], pa.scalar(own_source))
            rows = rows.set_column(rows.schema.get_field_index("source"), "source",
                                   pc.if_else(mine, pa.scalar(None, pa.string()),
                                              rows["source"]))
        status, unhashed = {}, index["pixel_hash"].null_count
    else:
        rows, status = read_hash_columns(file.url, storage_options)
        rows = rows.append_column("source", pa.nulls(len(rows), pa.string()))
        unhashed = 0
    pos = (np.int64(file.number) << np.int64(_FILE_SHIFT)) + np.arange(len(rows))
    rows = rows.append_column("from_index", pa.array(np.full(len(rows), file.index)))
    return rows.append_column("pos", pa.array(pos, pa.int64())), status, unhashed


def _area(table: pa.Table) -> np.ndarray:
    width = pc.fill_null(table["original_width"], 0).to_numpy().astype(np.int64)
    height = pc.fill_null(table["original_height"], 0).to_numpy().astype(np.int64)
    return width * height


def _key_sample(keys: pa.ChunkedArray) -> list[str]:
    ordered = pc.sort_indices(keys)
    if len(ordered) <= KEY_SAMPLES:
        picks = np.arange(len(ordered))
    else:
        picks = np.linspace(0, len(ordered) - 1, KEY_SAMPLES).astype(np.int64)
    return keys.take(ordered.take(pa.array(picks))).to_pylist()


def decided_keys(work: Work, ranges: list[tuple[str, str]]) -> pa.Array:
    """Keys in any (low, high) of ``ranges`` the finished run of an append decided: its
    duplicates and its own survivors (its index rows of this build); one read of each file
    for all the ranges."""
    assert work.earlier is not None and work.own_source is not None
    duplicates, index = work.earlier
    fs, folder = fsspec.core.url_to_fs(index, **work.storage_options)
    urls = [duplicates, *(fs.unstrip_protocol(part)
                          for part in sorted(fs.glob(posixpath.join(folder, "*.parquet"))))]
    return pa.concat_arrays([
        read_key_range(url, work.storage_options, ["key"], ranges,
                       None if url == duplicates else work.own_source)["key"]
        .combine_chunks().cast(pa.string()) for url in urls])


def retry_runs(url: str, storage_options: dict[str, Any]) -> int:
    """How often ``--retry-failed`` rewrote a raw shard (its stats file says)."""
    fs, path = fsspec.core.url_to_fs(url.removesuffix(".parquet") + "_stats.json",
                                     **storage_options)
    if not fs.exists(path):  # a raw folder not written by stage 1 (tests, other tools)
        return 0
    with fs.open(path, "rb") as handle:
        return int((json.load(handle).get("retried") or {}).get("runs", 0))


def _drop_decided(work: Work, tables: list[pa.Table], rewritten: list[int]) -> None:
    """Of each ``tables[i]`` (``rewritten``: a raw shard rewritten by --retry-failed), keep
    the rows the finished run decided nothing for: the rows the retry made ok since. The
    unit's shards are looked up together, so each index part is read once per task, not
    once per shard."""
    ranges = [(pc.min(tables[i]["key"]).as_py(), pc.max(tables[i]["key"]).as_py())
              for i in rewritten]
    known = decided_keys(work, ranges)
    for i in rewritten:
        tables[i] = tables[i].filter(pc.invert(pc.is_in(tables[i]["key"], value_set=known)))


def scatter(work: Work, unit: int, files: list[InputFile]) -> dict[str, Any]:
    """Phase 1: read inputs, write rows, keys, exact hashes and usable values by partition;
    returns the counts, and per raw shard its statuses and retry runs (``files``)."""
    fs, parts = work.fs(), work.parts
    tables, status, unhashed = [ROW_SCHEMA.empty_table()], Counter(), 0
    described: dict[int, dict[str, Any]] = {}
    rewritten: list[int] = []  # tables' rows of raw shards --retry-failed rewrote
    for file in files:
        rows, counts, missing = _input_rows(file, work.storage_options, work.own_source)
        if file.rewritten and len(rows):
            rewritten.append(len(tables))
        if not file.index:
            described[file.number] = {"status": counts,
                                      "retry_runs": retry_runs(file.url, work.storage_options)}
        tables.append(rows.cast(ROW_SCHEMA))
        status.update(counts)
        unhashed += missing
    if rewritten:
        _drop_decided(work, tables, rewritten)
    table = pa.concat_tables(tables).combine_chunks()
    pos = table["pos"].to_numpy()
    new = ~table["from_index"].to_numpy(zero_copy_only=False)
    write_parts(fs, work.file("rows", unit), table, _by_pos(pos, parts))
    keys = table["key"].filter(pa.array(new))
    write_parts(fs, work.file("keys", unit), pa.table({"key": keys}, schema=KEY_SCHEMA),
                part_of(string_hash(keys), parts))
    _write_exact(fs, work.file("exact", unit), table, parts)
    points, valid = points_of(table, work.check.mirrors)
    usable = valid & ~is_degenerate(points)
    degenerate_whole = valid[:, _WHOLE] & ~usable[:, _WHOLE] & new
    usable &= work.perceptual
    rows, cols = np.nonzero(usable)
    values = pa.table({"value": points[rows, cols], "pos": pos[rows],
                       "new_whole": (cols == _WHOLE) & new[rows]}, schema=VALUE_SCHEMA)
    write_parts(fs, work.file("values", unit), values, _by_value(points[rows, cols], parts))
    whole_ok = valid[:, _WHOLE]
    return {"status": dict(status), "ok_rows": int(new.sum()),
            "index_rows": int((~new).sum()), "unhashed_index_rows": unhashed,
            "missing_phash": int((~whole_ok & new).sum()),
            "degenerate_whole": int(degenerate_whole.sum()),
            "key_sample": _key_sample(keys), "files": described}


def _write_exact(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table,
                 parts: int) -> None:
    has = table.filter(pc.is_valid(table["exact"]))
    exact = pa.table({"exact": has["exact"], "pos": has["pos"],
                      "from_index": has["from_index"], "area": _area(has),
                      "key": has["key"], "source": has["source"]}, schema=EXACT_SCHEMA)
    write_parts(fs, path, exact, part_of(string_hash(has["exact"]), parts))


# --------------------------------------------------------------------- exact and keys


def exact_groups(work: Work, part: int, scatter_units: int) -> dict[str, Any]:
    """Phase 2: repeated keys, exact-hash links and the rows that lose on exact pixels."""
    fs = work.fs()
    keys = read_part(fs, work.files("keys", scatter_units), part, KEY_SCHEMA)["key"]
    repeated: list[str] = []
    if pc.count_distinct(keys).as_py() != len(keys):
        counts = pc.value_counts(keys)
        repeated = sorted(v["values"] for v in counts.to_pylist() if v["counts"] > 1)
    table = read_part(fs, work.files("exact", scatter_units), part, EXACT_SCHEMA)
    table = table.take(pc.sort_indices(table["pos"]))  # ties go to the earlier row
    pos = table["pos"].to_numpy()
    codes = exact_codes(table["exact"])
    _, first = np.unique(codes, return_index=True)  # codes are 0..groups-1
    group_first = pos[first[codes]]
    write_edges(fs, work.file("edges-exact", part), group_first, pos, work.parts)
    from_index = table["from_index"].to_numpy(zero_copy_only=False)
    rank = survivor_order(table["key"], table["source"], from_index,
                          table["area"].to_numpy())
    losers = pos[best_of_groups(codes, rank) != np.arange(len(pos))] if len(pos) else pos
    write_parts(fs, work.file("losers", part), pa.table({"pos": losers}, schema=POS_SCHEMA),
                _by_pos(losers, work.parts))
    return {"repeated": repeated[:5], "repeated_count": len(repeated)}


# ------------------------------------------------------------------------------ values


def unique_values(work: Work, part: int, scatter_units: int) -> int:
    """Phase 3: the distinct usable values of one partition, each with its first row."""
    fs = work.fs()
    table = read_part(fs, work.files("values", scatter_units), part, VALUE_SCHEMA)
    value, pos = table["value"].to_numpy(), table["pos"].to_numpy()
    new_whole = table["new_whole"].to_numpy(zero_copy_only=False)
    order = np.lexsort((pos, value))
    value, pos, new_whole = value[order], pos[order], new_whole[order]
    starts = np.flatnonzero(np.concatenate([[True], value[1:] != value[:-1]])) \
        if len(value) else np.zeros(0, np.int64)
    lengths = np.diff(np.append(starts, len(value)))
    rep = pos[starts]
    wholes = np.add.reduceat(new_whole.astype(np.int64), starts) if len(value) else rep
    write_table(fs, work.file("unique", part), pa.table(
        {"value": value[starts], "rep": rep, "new_wholes": wholes}, schema=UNIQUE_SCHEMA))
    # the other rows holding each value (a row holding it twice, once)
    other = pos != np.repeat(rep, lengths)
    if len(value):
        other &= np.concatenate([[True], (value[1:] != value[:-1]) | (pos[1:] != pos[:-1])])
    write_table(fs, work.file("stars", part), pa.table(
        {"value": value[other], "pos": pos[other]}, schema=STAR_SCHEMA))
    return len(starts)


def _unique(work: Work, fs: fsspec.AbstractFileSystem, part: int) -> pa.Table:
    return read_tables(fs, [work.file("unique", part)], UNIQUE_SCHEMA)


# ------------------------------------------------------------------------------- bands


def lead_bands(plan: BandPlan) -> list[int]:
    """Bands that are the lowest band of some combination: one partitioning each."""
    return sorted({combo[0] for combo in plan.combos})


def _band_bits(values: np.ndarray, plan: BandPlan, band: int) -> np.ndarray:
    shift, width = plan.bands[band]
    return (values >> np.uint64(shift)) & np.uint64((1 << width) - 1)


def band_scatter(work: Work, part: int, plan: BandPlan, band_parts: int) -> None:
    """Phase 4a: each distinct value once per lead band, partitioned by that band's bits
    (so every bucket of a combination led by the band is in one partition)."""
    fs = work.fs()
    values = _unique(work, fs, part)["value"].to_numpy()
    leads = lead_bands(plan)
    ids = [leads.index(b) * band_parts + part_of(mix64(_band_bits(values, plan, b)),
                                                 band_parts) for b in leads]
    table = pa.table({"value": np.tile(values, len(leads))}, schema=BAND_SCHEMA)
    write_parts(fs, work.file("bands", part), table,
                np.concatenate([np.zeros(0, np.int64), *ids]))


def _write_pairs(work: Work, fs: fsspec.AbstractFileSystem, producer: int, a: np.ndarray,
                 b: np.ndarray, dense: np.ndarray) -> None:
    write_parts(fs, work.file("pairs", producer),
                pa.table({"a": a, "b": b}, schema=PAIR_SCHEMA), _by_value(a, work.parts))
    dense = np.unique(dense)
    write_parts(fs, work.file("dense", producer), pa.table({"value": dense},
                                                           schema=BAND_SCHEMA),
                _by_value(dense, work.parts))


def band_join(work: Work, lead: int, band_part: int, band_parts: int, plan: BandPlan,
              value_parts: int) -> dict[str, int]:
    """Phase 4b: every combination led by band ``lead`` over one band partition: the
    verified pairs (as values) and the values found in dense buckets."""
    fs = work.fs()
    leads = lead_bands(plan)
    partition = leads.index(lead) * band_parts + band_part
    values = np.sort(read_part(fs, work.files("bands", value_parts), partition,
                               BAND_SCHEMA)["value"].to_numpy())
    found_a, found_b, dense = [np.zeros(0, np.uint64)], [np.zeros(0, np.uint64)], []
    for combo in plan.combos:
        if combo[0] != lead:
            continue
        a, b, d = _combo_pairs_local(values, values, plan, combo)
        found_a.append(values[a])
        found_b.append(values[b])
        dense.append(values[d])
    a, b = np.concatenate(found_a), np.concatenate(found_b)
    producer = leads.index(lead) * band_parts + band_part
    _write_pairs(work, fs, producer, a, b, np.concatenate([np.zeros(0, np.uint64), *dense]))
    return {"pairs": len(a)}


def brute_join(work: Work, value_parts: int) -> dict[str, int]:
    """Phase 4, few values: all pairs (as the single process does below the band plan)."""
    fs = work.fs()
    paths = [work.file("unique", p) for p in range(value_parts)]
    values = np.sort(read_tables(fs, paths, UNIQUE_SCHEMA)["value"].to_numpy())
    pairs = _brute_pairs(values, work.max_distance)
    _write_pairs(work, fs, 0, values[pairs[:, 0]], values[pairs[:, 1]],
                 np.zeros(0, np.uint64))
    return {"pairs": len(pairs)}


# ------------------------------------------------------------------------------- links


def _dense(work: Work, fs: fsspec.AbstractFileSystem, part: int, producers: int
           ) -> np.ndarray:
    return np.unique(read_part(fs, work.files("dense", producers), part,
                               BAND_SCHEMA)["value"].to_numpy())


def value_links(work: Work, part: int, pair_producers: int) -> dict[str, int]:
    """Phase 5a: links from each row to its values' representatives (dense values left
    out), and each near pair's first representative sent to its second value."""
    fs = work.fs()
    unique = _unique(work, fs, part)
    values, rep = unique["value"].to_numpy(), unique["rep"].to_numpy()
    dense = _dense(work, fs, part, pair_producers)
    stars = read_tables(fs, [work.file("stars", part)], STAR_SCHEMA)
    star_value = stars["value"].to_numpy()
    keep = ~np.isin(star_value, dense)
    write_edges(fs, work.file("edges-values", part),
                rep[np.searchsorted(values, star_value[keep])],
                stars["pos"].to_numpy()[keep], work.parts)
    pairs = read_part(fs, work.files("pairs", pair_producers), part, PAIR_SCHEMA)
    a, b = pairs["a"].to_numpy(), pairs["b"].to_numpy()
    live = ~np.isin(a, dense)
    half = pa.table({"b": b[live], "rep_a": rep[np.searchsorted(values, a[live])]},
                    schema=HALF_SCHEMA)
    write_parts(fs, work.file("half", part), half, _by_value(b[live], work.parts))
    is_dense = np.isin(values, dense)
    return {"dense": len(dense),
            "dense_whole": int(unique["new_wholes"].to_numpy()[is_dense].sum())}


def near_links(work: Work, part: int, pair_producers: int) -> int:
    """Phase 5b: a link between the representatives of each near pair whose second value
    is not dense either; returns the number of such pairs."""
    fs = work.fs()
    unique = _unique(work, fs, part)
    values, rep = unique["value"].to_numpy(), unique["rep"].to_numpy()
    dense = _dense(work, fs, part, pair_producers)
    half = read_part(fs, work.files("half", work.parts), part, HALF_SCHEMA)
    b, rep_a = half["b"].to_numpy(), half["rep_a"].to_numpy()
    live = ~np.isin(b, dense)
    write_edges(fs, work.file("edges-near", part), rep_a[live],
                rep[np.searchsorted(values, b[live])], work.parts)
    return int(live.sum())


# ------------------------------------------------------------------------- decisions


def label_members(work: Work, part: int, labels: str, scatter_units: int) -> int:
    """Phase 7a: the rows of this partition that belong to a component of two or more,
    with their component and exact evidence, sent to their component's partition."""
    fs = work.fs()
    labelled = read_tables(fs, [work.file(labels, part)], LABEL_SCHEMA)
    rows = read_part(fs, work.files("rows", scatter_units), part, ROW_SCHEMA)
    pos = rows["pos"].to_numpy()
    nodes, label = labelled["node"].to_numpy(), labelled["label"].to_numpy()
    order = np.argsort(nodes)
    nodes, label = nodes[order], label[order]
    found = np.isin(pos, nodes)
    members = rows.filter(pa.array(found))
    member_label = label[np.searchsorted(nodes, pos[found])]
    losers = read_part(fs, work.files("losers", work.parts), part, POS_SCHEMA)
    members = members.append_column("label", pa.array(member_label, pa.int64()))
    members = members.append_column("exact_loser", pa.array(
        np.isin(pos[found], losers["pos"].to_numpy())))
    write_parts(fs, work.file("members", part), members.cast(MEMBER_SCHEMA),
                _by_pos(member_label, work.parts))
    return len(members)


def decide(work: Work, part: int, boundaries: list[str]) -> dict[str, int]:
    """Phase 7b: survivors and evidence of the components of one partition."""
    fs = work.fs()
    table = read_part(fs, work.files("members", work.parts), part, MEMBER_SCHEMA)
    table = table.take(pc.sort_indices(table["pos"]))  # the single process's row order
    from_index = table["from_index"].to_numpy(zero_copy_only=False)
    _, components = np.unique(table["label"].to_numpy(), return_inverse=True)
    rank = survivor_rank(table, from_index)
    points, valid = points_of(table, work.check.mirrors)
    labels = colour_groups(components, rank, table["colour_grid"], points, valid,
                           work.max_distance, work.check)
    kept = best_of_groups(labels, rank) if len(table) else np.zeros(0, np.int64)
    dropped = (kept != np.arange(len(table))) & ~from_index
    found = duplicates_table(table, dropped, kept,
                             table["exact_loser"].to_numpy(zero_copy_only=False),
                             points, valid, labels, work.max_distance)
    write_parts(fs, work.file("duplicates", part), found,
                key_range_of(found["key"], boundaries))
    gone = table["pos"].to_numpy()[dropped]
    write_parts(fs, work.file("dropped", part), pa.table({"pos": gone}, schema=POS_SCHEMA),
                _by_pos(gone, work.parts))
    kinds = Counter(found["kind"].to_pylist())
    return {"duplicates": len(found), "clusters": len(np.unique(labels[dropped])),
            "colour_splits": colour_splits(components, labels, from_index),
            "dropped_for_index": int(pc.sum(pc.is_valid(found["kept_source"])).as_py() or 0),
            **{kind.value: kinds.get(kind.value, 0) for kind in HASH_KINDS}}


# -------------------------------------------------------------------------- components


def large_star_step(work: Work, sources: list[tuple[str, int]], part: int, step: int
                    ) -> StepResult:
    """Phase 6, a large-star step over one partition (``dedup/components.py``)."""
    return large_star(work.fs(), work.expand(sources), part, work.file(f"small-{step}", part),
                      work.file(f"labels-{step}", part), work.parts)


def small_star_step(work: Work, part: int, step: int) -> StepResult:
    """Phase 6, the small-star step after large-star step ``step``."""
    return small_star(work.fs(), work.files(f"small-{step}", work.parts), part,
                      work.file(f"large-{step}", part), work.parts)
