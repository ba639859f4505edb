"""Raw (stage 1) shards in img2dataset's layout: NNNNN.tar, NNNNN.parquet, NNNNN_stats.json.

The tar holds the ``ok`` samples (KEY.jpg, KEY.txt, KEY.json); the parquet holds every
row, failures included; the stats file is written last and marks the shard complete.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.records import Status, raw_schema
from pairforge.shards.storage import OutputDir
from pairforge.shards.tar import SampleTarWriter


def shard_name(shard_id: int) -> str:
    return f"{shard_id:05d}"


def stats_name(shard_id: int) -> str:
    return f"{shard_name(shard_id)}_stats.json"


def completed_shards(out: OutputDir, folder: str) -> set[int]:
    """Shards whose stats file exists: the only test of completeness a rerun trusts."""
    return {int(name.split("_")[0]) for name in out.glob(f"{folder}/*_stats.json")}


class RawShardWriter:
    """Streams ok samples into the tar as they arrive; parquet and stats on close."""

    def __init__(self, out: OutputDir, folder: str, shard_id: int, extra_columns: list[str]):
        self.out, self.folder, self.shard_id = out, folder, shard_id
        self.extra_columns = extra_columns
        self.rows: list[dict[str, Any]] = []
        self._tar_cm = out.open_atomic(folder, f"{shard_name(shard_id)}.tar")
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
        with self.out.open_atomic(self.folder, f"{shard_name(self.shard_id)}.parquet") as f:
            pq.write_table(table, f)
        counts = Counter(r["status"] for r in self.rows)
        stats = {**stats, "shard": self.shard_id, "count": len(self.rows),
                 "successes": counts.get(Status.OK, 0), "status": dict(sorted(counts.items()))}
        self.out.write_json(stats, self.folder, stats_name(self.shard_id))
        return stats

    def abort(self, exc: BaseException) -> None:
        """Drop the half-written tar: its temporary file is removed, nothing is renamed."""
        self._tar_cm.__exit__(type(exc), exc, exc.__traceback__)
