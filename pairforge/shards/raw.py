"""Raw (stage 1) shards in img2dataset's layout: NNNNN.tar, NNNNN.parquet, NNNNN_stats.json.

The tar holds the ``ok`` samples (KEY.jpg, KEY.txt, KEY.json); the parquet holds every
row, failures included; the stats file is written last and marks the shard complete.

A shard split over several tasks (the run's tail, ``pipeline.inputs.tail_parts``) is
written as parts, NNNNN.partIofK.tar and .parquet without a stats file, and
``merge_parts`` joins them into the one shard in row order once all are written.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.records import Status, raw_schema
from pairforge.shards.storage import OutputDir
from pairforge.shards.tar import SampleTarWriter, archive_end, copy_members


def shard_name(shard_id: int) -> str:
    return f"{shard_id:05d}"


def stats_name(shard_id: int) -> str:
    return f"{shard_name(shard_id)}_stats.json"


def part_name(shard_id: int, part: int, parts: int) -> str:
    return f"{shard_name(shard_id)}.part{part}of{parts}"


def completed_shards(out: OutputDir, folder: str) -> set[int]:
    """Shards whose stats file exists: the only test of completeness a rerun trusts."""
    return {int(name.split("_")[0]) for name in out.glob(f"{folder}/*_stats.json")}


def remove_parts(out: OutputDir, folder: str) -> int:
    """Delete the parts a stopped run left unmerged (their shard has no stats file, so it
    is redone whole or in new parts); returns how many files."""
    stale = out.glob(f"{folder}/*.part*of*.*")
    for name in stale:
        out.remove(folder, name)
    return len(stale)


class RawShardWriter:
    """Streams ok samples into the tar as they arrive; parquet and stats on close. A part
    (``part``: index and count) writes no stats: ``merge_parts`` does, for the shard."""

    def __init__(self, out: OutputDir, folder: str, shard_id: int, extra_columns: list[str],
                 part: tuple[int, int] | None = None):
        self.out, self.folder, self.shard_id = out, folder, shard_id
        self.extra_columns = extra_columns
        self.name = part_name(shard_id, *part) if part else shard_name(shard_id)
        self.part = part
        self.rows: list[dict[str, Any]] = []
        self._tar_cm = out.open_atomic(folder, f"{self.name}.tar")
        self._tar = SampleTarWriter(self._tar_cm.__enter__())

    def add(self, row: dict[str, Any], image: bytes | None, extension: str | None,
            meta: dict[str, Any] | None) -> None:
        self.rows.append(row)
        if row["status"] == Status.OK:
            self._tar.write(row["key"], {extension: image, "txt": row["caption"] or "",
                                         "json": meta})

    def close(self, stats: dict[str, Any]) -> dict[str, Any]:
        self._tar.close()
        self._tar_cm.__exit__(None, None, None)
        table = pa.Table.from_pylist(self.rows, schema=raw_schema(self.extra_columns))
        with self.out.open_atomic(self.folder, f"{self.name}.parquet") as f:
            pq.write_table(table, f)
        stats = {**stats, "shard": self.shard_id, **row_counts(r["status"] for r in self.rows)}
        if self.part:
            return {**stats, "part": list(self.part)}
        self.out.write_json(stats, self.folder, stats_name(self.shard_id))
        return stats

    def abort(self, exc: BaseException) -> None:
        """Drop the half-written tar: its temporary file is removed, nothing is renamed."""
        self._tar_cm.__exit__(type(exc), exc, exc.__traceback__)


def merge_parts(out: OutputDir, folder: str, parts: list[dict[str, Any]],
                sections: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """Join a shard's written parts (their ``close`` stats, any order) into the shard: the
    tar's members and the parquet's rows in part order, then the stats, counted from the
    merged rows, written last; then the part files go. ``sections``: the stage's own
    sections of the stats, added up over the parts (``download/parts.py``: the stage
    knows its sections, this layer only the files). Returns the shard's stats."""
    parts = sorted(parts, key=lambda p: p["part"][0])
    shard_id, count = parts[0]["shard"], parts[0]["part"][1]
    names = [part_name(shard_id, i, count) for i in range(count)]
    with out.open_atomic(folder, f"{shard_name(shard_id)}.tar") as f:
        written = 0
        for name in names:
            with out.fs.open(out.path(folder, f"{name}.tar"), "rb") as part:
                written += copy_members(part, f)
        f.write(archive_end(written))
    table = pa.concat_tables(pq.read_table(io.BytesIO(out.read_bytes(folder, f"{n}.parquet")))
                             for n in names)
    with out.open_atomic(folder, f"{shard_name(shard_id)}.parquet") as f:
        pq.write_table(table, f)
    start, end = min(p["start_time"] for p in parts), max(p["end_time"] for p in parts)
    stats = {**{k: v for k, v in parts[0].items() if k != "part"},
             "start_time": start, "end_time": end, "duration_s": round(end - start, 3),
             "parts": count, **row_counts(table["status"].to_pylist())}
    if sections is not None:
        stats.update(sections(parts))
    out.write_json(stats, folder, stats_name(shard_id))
    for name in names:
        out.remove(folder, f"{name}.tar")
        out.remove(folder, f"{name}.parquet")
    return stats


def row_counts(statuses: Any) -> dict[str, Any]:
    """A shard's row counts in its stats: rows, ok rows, rows per status."""
    counts = Counter(statuses)
    return {"count": sum(counts.values()), "successes": counts.get(Status.OK, 0),
            "status": dict(sorted(counts.items()))}
