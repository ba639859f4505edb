"""Stage 2's append: what a finished dedup covered, and how a later run adds to it.

A finished run records each raw shard it read in ``OUT/dedup/covered.parquet`` (name,
size, the ``--retry-failed`` runs its stats file counted, its rows per status as JSON).
A later run with the same config and index files is an *append* when the raw shards it
finds are those, in order, plus new ones after them, and the only ones rewritten since
are rewritten by ``--retry-failed``. It reads the new shards and, of the rewritten ones,
the rows the finished run holds no decision for (those the retry made ok), against the
finished run's own index: its rows win, as rows already shipped, and its decisions stay
as they are (``pipeline/dedup_stage.run_dedup``). Anything else is a full run.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.dedup.decide import HASH_KINDS
from pairforge.dedup.partitions import retry_runs
from pairforge.shards.storage import atomic_writer

COVERED_FILE = "covered.parquet"
INDEX_FILE = "index.parquet"  # a folder of parts
COVERED_SCHEMA = pa.schema([pa.field("name", pa.string()), pa.field("size", pa.int64()),
                            pa.field("retry_runs", pa.int64()),
                            pa.field("status", pa.string())])

# counts an append adds to the finished run's; the run's own diagnostics are replaced
ADDED = ("ok_rows", "duplicates", *(k.value for k in HASH_KINDS), "dropped_for_index",
         "clusters", "colour_splits", "kept", "degenerate_hashes", "missing_phash")


@dataclass(frozen=True)
class Append:
    covered: int  # leading raw shards the finished run read
    rewritten: list[int]  # of those, the ones --retry-failed rewrote since
    earlier: pa.Table  # the finished run's covered.parquet

    def positions(self, raw_files: int) -> list[int]:
        """The raw shards this run reads, as positions among all, in reading order."""
        return [*self.rewritten, *range(self.covered, raw_files)]

    def replaced_status(self) -> Counter[str]:
        """Rows per status the rewritten shards held when the finished run read them."""
        found: Counter[str] = Counter()
        for position in self.rewritten:
            found.update(json.loads(self.earlier["status"][position].as_py()))
        return found


def read_covered(fs: fsspec.AbstractFileSystem, root: str) -> pa.Table | None:
    path = posixpath.join(root, COVERED_FILE)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as handle:
        return pq.read_table(handle)


def plan_append(finished: dict[str, Any] | None, raw: list[tuple[str, int]],
                files: list[str], settings_digest: str, fs: fsspec.AbstractFileSystem,
                root: str, storage_options: dict[str, Any]) -> Append | None:
    """The append this run can make to a finished run, or None for a full run."""
    if not finished or not finished.get("enabled") or not finished.get("index_written"):
        return None
    if finished.get("settings_digest") != settings_digest:
        return None
    earlier = read_covered(fs, root)
    if earlier is None or not fs.exists(posixpath.join(root, INDEX_FILE)):
        return None
    names, sizes = earlier["name"].to_pylist(), earlier["size"].to_pylist()
    covered = len(names)
    if [name for name, _ in raw[:covered]] != names:
        return None
    changed = [i for i in range(covered) if raw[i][1] != sizes[i]]
    runs = earlier["retry_runs"].to_pylist()
    if any(retry_runs(files[i], storage_options) <= runs[i] for i in changed):
        return None  # rewritten, but not by --retry-failed: its ok rows may differ
    if not changed and len(raw) == covered:
        return None
    return Append(covered, changed, earlier)


def covered_table(raw: list[tuple[str, int]], read: list[int],
                  described: dict[int, dict[str, Any]], earlier: pa.Table | None
                  ) -> pa.Table:
    """covered.parquet after a run that read raw shards ``read`` (positions, in reading
    order: ``described`` is by reading number); the others as ``earlier`` had them."""
    by_position = {position: described[number] for number, position in enumerate(read)}
    runs, status = [], []
    for position in range(len(raw)):
        if position in by_position:
            runs.append(by_position[position]["retry_runs"])
            status.append(json.dumps(by_position[position]["status"], sort_keys=True))
        else:
            assert earlier is not None
            runs.append(earlier["retry_runs"][position].as_py())
            status.append(earlier["status"][position].as_py())
    return pa.table({"name": [name for name, _ in raw], "size": [size for _, size in raw],
                     "retry_runs": runs, "status": status}, schema=COVERED_SCHEMA)


def write_covered(fs: fsspec.AbstractFileSystem, root: str, table: pa.Table) -> None:
    with atomic_writer(fs, posixpath.join(root, COVERED_FILE)) as handle:
        pq.write_table(table, handle)


def added_to(previous: dict[str, Any], stats: dict[str, Any], replaced: Counter[str]
             ) -> dict[str, Any]:
    """An append's stats: the finished run's counts plus this run's. Rewritten shards'
    rows count with their statuses now, not then; the index rows this run read are the
    build's own survivors, so the index counts stay those of earlier builds' index."""
    status = Counter(previous["status_counts"])
    status.subtract(replaced)
    status.update(stats["status_counts"])
    status_counts = {k: v for k, v in sorted(status.items()) if v}
    return {**stats, **{k: previous[k] + stats[k] for k in ADDED},
            "status_counts": status_counts, "rows_in": sum(status_counts.values()),
            **{k: previous[k] for k in ("index_files", "index_rows",
                                        "index_rows_without_pixel_hash")}}
