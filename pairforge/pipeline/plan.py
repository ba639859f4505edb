"""Stage 3, planning: which raw shards to process, how many rows each must return, and
where each shard's duplicates are. Reads stats files and counts the dedup tables' rows
per shard, never a raw shard; the driver holds no row's key.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.pipeline.settings import process_expected
from pairforge.records import Status, index_digits, make_key
from pairforge.shards.raw import completed_shards, stats_name
from pairforge.shards.storage import DEDUP_FOLDER, RAW_FOLDER, OutputDir
from pairforge.tables import read_key_range

Duplicates = dict[str, tuple[str, str]]  # key -> (status, kept key)
DECISION_FILES = ("duplicates.parquet", "semantic.parquet")  # hash dedup, then semantic


@dataclass(frozen=True)
class Decisions:
    """The dedup tables that drop rows (stage 2's, and stage 3's semantic pass once it has
    run), each sorted by key. The driver only counts their rows per shard; each shard's
    task reads its own key range."""

    urls: tuple[str, ...]
    storage_options: dict = field(default_factory=dict)
    digits: int = 4  # records.index_digits of the build's shard size

    def _shards(self, keys: pa.Array) -> pa.Array:
        return pc.cast(pc.utf8_slice_codeunits(keys, 0, -self.digits), pa.int64())

    def counts(self) -> Counter[int]:
        """Rows dropped per shard, a row group at a time (a count per shard, no keys)."""
        found: Counter[int] = Counter()
        for url in self.urls:
            fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
            with fs.open(path, "rb") as handle:
                for batch in pq.ParquetFile(handle).iter_batches(columns=["key"]):
                    found.update({v["values"]: v["counts"] for v in
                                  pc.value_counts(self._shards(batch["key"])).to_pylist()})
        return found

    def of_shard(self, shard_id: int) -> Duplicates:
        """One shard's decisions: its key range of each table, later tables' decisions over
        earlier ones'."""
        low = make_key(shard_id, 0, self.digits)
        high = make_key(shard_id, 10 ** self.digits - 1, self.digits)
        found: Duplicates = {}
        for url in self.urls:
            table = read_key_range(url, self.storage_options, ["key", "kind", "kept_key"],
                                   [(low, high)])
            # a longer shard id can sort inside the range: keep this shard's keys only
            table = table.filter(pc.equal(self._shards(table["key"]), shard_id))
            found.update(zip(table["key"].to_pylist(), zip(
                table["kind"].to_pylist(), table["kept_key"].to_pylist(), strict=True),
                strict=True))
        return found


@dataclass(frozen=True)
class ShardPlan:
    shard_id: int
    to_process: int  # rows the steps must return before the shard can be written
    decisions: Decisions = field(default_factory=lambda: Decisions(()))  # read by its task
    settings: dict = field(default_factory=dict)  # recorded in the shard's stats file

    def duplicates(self) -> Duplicates:
        return self.decisions.of_shard(self.shard_id)


def decisions(out: OutputDir, cfg: PairforgeConfig) -> Decisions:
    """The dedup tables that hold decisions for this build now."""
    names = []
    if cfg.dedup.enabled:
        if not out.exists(DEDUP_FOLDER, "dedup_stats.json"):
            raise RuntimeError("dedup is enabled but OUT/dedup is not complete: run "
                               "`pairforge dedup` (or `build`) first, or set "
                               "dedup.enabled=false")
        names.append(DECISION_FILES[0])
    if cfg.dedup.semantic.enabled and out.exists(DEDUP_FOLDER, "semantic_stats.json"):
        names.append(DECISION_FILES[1])
    return Decisions(tuple(out.uri(DEDUP_FOLDER, name) for name in names),
                     dict(cfg.output.storage_options), index_digits(cfg.input.shard_size))


def plan_shards(out: OutputDir, cfg: PairforgeConfig, folder: str) -> list[ShardPlan]:
    """Complete raw shards not yet complete in ``folder``, with the rows to process: the
    raw shard's ok rows (from its stats file) less its duplicates (all of them ok rows)."""
    found = decisions(out, cfg)
    dropped = found.counts()
    pending = sorted(completed_shards(out, RAW_FOLDER) - completed_shards(out, folder))
    settings = process_expected(out, cfg, set(pending))
    plans = []
    for shard_id in pending:
        ok = out.read_json(RAW_FOLDER, stats_name(shard_id))["status"].get(Status.OK, 0)
        plans.append(ShardPlan(shard_id, ok - dropped[shard_id], found, settings[shard_id]))
    return plans
