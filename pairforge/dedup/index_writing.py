"""Phase 9 of stage 2: the next index (earlier index rows + this build's survivors).

Two waves of tasks over the run's work folder: :func:`index_rows_out` sends the rows that
go into the index to the part of a prefix of the hash of their source and key, and
:func:`index_part` writes one part (``OUT/dedup/index.parquet/part-PREFIX.parquet``).
"""

from __future__ import annotations

import math

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pairforge.dedup.bands import HASH_BITS
from pairforge.dedup.index import INDEX_SCHEMA, drop_repeated_rows
from pairforge.dedup.partitions import POS_SCHEMA, ROW_SCHEMA
from pairforge.dedup.shuffle import read_part, string_hash, write_parts, write_table
from pairforge.dedup.work import Work

INDEX_ROW_SCHEMA = pa.schema([*INDEX_SCHEMA, pa.field("new", pa.bool_()),
                              pa.field("pos", pa.int64())])
INDEX_BITS_KEY = b"pairforge.index_prefix_bits"


def index_prefix_bits(rows: int, rows_per_part: int) -> int:
    """Bits of hash prefix that split ``rows`` index rows into parts of at most about
    ``rows_per_part``."""
    return max(0, math.ceil(math.log2(max(1, rows) / rows_per_part))) if rows else 0


def index_part_name(prefix: int, bits: int) -> str:
    return f"part-{prefix:0{max(1, math.ceil(bits / 4))}x}.parquet"


def _index_prefix(table: pa.Table, bits: int) -> np.ndarray:
    """Prefix of the hash of each row's source and key: a row repeated in several index
    files (its pixel hash left out of an older one, say) always lands in one part, where
    it is kept once."""
    if bits == 0:
        return np.zeros(len(table), np.int64)
    identity = pc.binary_join_element_wise(pc.fill_null(table["source"], ""),
                                           table["key"], "\x00")
    return (string_hash(identity) >> np.uint64(HASH_BITS - bits)).astype(np.int64)


def index_rows_out(work: Work, part: int, scatter_units: int, source: str,
                   bits: int) -> int:
    """Phase 9a: the rows of this partition that go into the next index: every index row
    and every new row that was not dropped."""
    fs = work.fs()
    rows = read_part(fs, work.files("rows", scatter_units), part, ROW_SCHEMA)
    gone = read_part(fs, work.files("dropped", work.parts), part, POS_SCHEMA)["pos"]
    from_index = rows["from_index"].to_numpy(zero_copy_only=False)
    keep = from_index | ~np.isin(rows["pos"].to_numpy(), gone.to_numpy())
    kept = rows.filter(pa.array(keep))
    sources = pc.coalesce(kept["source"], pa.scalar(source))  # new rows and own index rows
    table = pa.table({
        "key": kept["key"], "source": sources, "pixel_hash": kept["exact"],
        "phash": kept["phash"], "phash_mirror": kept["phash_mirror"],
        "crop_phashes": kept["crop_phashes"], "colour_grid": kept["colour_grid"],
        "original_width": kept["original_width"],
        "original_height": kept["original_height"],
        "new": pc.invert(kept["from_index"]), "pos": kept["pos"],
    }, schema=INDEX_ROW_SCHEMA)
    write_parts(fs, work.file("index", part), table, _index_prefix(table, bits))
    return len(table)


def index_part(work: Work, prefix: int, bits: int, out_url: str) -> int:
    """Phase 9b: one part of the next index: its rows in the single process's order
    (earlier index rows first), each (source, key) once, sorted by source and key."""
    fs = work.fs()
    table = read_part(fs, work.files("index", work.parts), prefix, INDEX_ROW_SCHEMA)
    table = table.take(pc.sort_indices(table, sort_keys=[("new", "ascending"),
                                                         ("pos", "ascending")]))
    index = drop_repeated_rows(table.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA))
    metadata = {**INDEX_SCHEMA.metadata, INDEX_BITS_KEY: str(bits).encode()}
    index = index.replace_schema_metadata(metadata)
    out_fs, out_path = fsspec.core.url_to_fs(out_url, **work.storage_options)
    write_table(out_fs, out_path, index)
    return len(index)
