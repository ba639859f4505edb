"""Stage 3, planning: which raw shards to process, how many rows each must return, and
each shard's own duplicates. Reads stats files and the dedup table, never a raw shard.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.pipeline.settings import process_expected
from pairforge.records import Status, index_digits, shard_of_key
from pairforge.shards.raw import completed_shards, stats_name
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir

Duplicates = dict[str, tuple[str, str]]  # key -> (status, kept key)


@dataclass(frozen=True)
class ShardPlan:
    shard_id: int
    to_process: int  # rows the steps must return before the shard can be written
    duplicates: Duplicates = field(default_factory=dict)  # this shard's rows only
    settings: dict = field(default_factory=dict)  # recorded in the shard's stats file


def read_duplicates(out: OutputDir, cfg: PairforgeConfig) -> dict[int, Duplicates]:
    """The dedup decisions (stage 2's, and stage 3's semantic pass once it has run),
    grouped by the shard their key belongs to."""
    tables = []
    if cfg.dedup.enabled:
        if not out.exists(DEDUP_FOLDER, "dedup_stats.json"):
            raise RuntimeError("dedup is enabled but OUT/dedup is not complete: run "
                               "`pairforge dedup` (or `build`) first, or set "
                               "dedup.enabled=false")
        with out.fs.open(out.path(DEDUP_FOLDER, "duplicates.parquet"), "rb") as f:
            tables.append(pq.read_table(f, columns=["key", "kind", "kept_key"]))
    if cfg.dedup.semantic.enabled and out.exists(DEDUP_FOLDER, "semantic_stats.json"):
        with out.fs.open(out.path(DEDUP_FOLDER, "semantic.parquet"), "rb") as f:
            tables.append(pq.read_table(f, columns=["key", "kind", "kept_key"]))
    if not tables:
        return {}
    table = pa.concat_tables(tables)
    digits = index_digits(cfg.input.shard_size)
    by_shard: dict[int, Duplicates] = defaultdict(dict)
    for key, kind, kept in zip(table["key"].to_pylist(), table["kind"].to_pylist(),
                               table["kept_key"].to_pylist(), strict=True):
        by_shard[shard_of_key(key, digits)][key] = (kind, kept)
    return dict(by_shard)


def plan_shards(out: OutputDir, cfg: PairforgeConfig, folder: str) -> list[ShardPlan]:
    """Complete raw shards not yet complete in ``folder``, with the rows to process: the
    raw shard's ok rows (from its stats file) less its duplicates (all of them ok rows)."""
    duplicates = read_duplicates(out, cfg)
    pending = sorted(completed_shards(out, RAW_FOLDER) - completed_shards(out, folder))
    settings = process_expected(out, cfg, set(pending))
    plans = []
    for shard_id in pending:
        ok = out.read_json(RAW_FOLDER, stats_name(shard_id))["status"].get(Status.OK, 0)
        dups = duplicates.get(shard_id, {})
        plans.append(ShardPlan(shard_id, ok - len(dups), dups, settings[shard_id]))
    return plans
