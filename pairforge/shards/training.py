"""Stage-3 output shards: the raw shard's rows with their final status, ok samples in a tar.

The writer joins three things per shard: the raw parquet (every input row), the dedup
decisions, and what the stage-3 steps computed for the rows they processed. Images come
back from the raw tar, so the steps' results never carry image bytes to the driver.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from pairforge.records import Status
from pairforge.shards.raw import shard_name, stats_name
from pairforge.shards.storage import OutputDir

RAW_FOLDER = "raw"
SHARDS_FOLDER = "shards"
EMBEDDINGS_FOLDER = "embeddings"
IMAGE_EXTENSIONS = ("jpg", "webp", "png")


def read_raw_images(out: OutputDir, shard_id: int, keys: set[str]) -> dict[str, tuple[str, bytes]]:
    """key -> (extension, bytes) for the wanted keys of one raw tar."""
    found: dict[str, tuple[str, bytes]] = {}
    if not keys:
        return found
    path = out.path(RAW_FOLDER, f"{shard_name(shard_id)}.tar")
    with out.fs.open(path, "rb") as f:
        for sample in group_by_keys(tar_file_expander([{"stream": f, "url": path}])):
            key = sample["__key__"]
            if key in keys:
                ext = next(e for e in IMAGE_EXTENSIONS if e in sample)
                found[key] = (ext, sample[ext])
    return found


def final_rows(raw: pa.Table, duplicates: dict[str, tuple[str, str]],
               results: pa.Table) -> list[dict[str, Any]]:
    """Every raw row with its final status: raw failure, duplicate, or the steps' verdict."""
    computed = {r["key"]: r for r in results.to_pylist()}
    rows = []
    for row in raw.to_pylist():
        key = row["key"]
        if row["status"] == Status.OK and key in duplicates:
            kind, kept = duplicates[key]
            row.update(status=kind, error=f"duplicate of {kept}", duplicate_of=kept)
        elif row["status"] == Status.OK:
            step_row = computed.pop(key)
            row.update({k: v for k, v in step_row.items() if k != "key"})
        rows.append(row)
    if computed:
        raise RuntimeError(f"steps returned keys the raw shard does not have: {list(computed)[:5]}")
    return rows


def _sample_json(row: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    # Every sample carries the same fields (null when unknown): HF datasets needs that.
    return {f: row.get(f) for f in fields}


def write_training_shard(out: OutputDir, shard_id: int, rows: list[dict[str, Any]],
                         schema: pa.Schema, meta_fields: list[str],
                         stats_extra: dict[str, Any]) -> dict[str, Any]:
    """Tar of the ok samples, parquet of every row, then the stats file (last)."""
    out.makedirs(SHARDS_FOLDER)
    ok = [r for r in rows if r["status"] == Status.OK]
    images = read_raw_images(out, shard_id, {r["key"] for r in ok})
    name = shard_name(shard_id)
    with out.open_atomic(SHARDS_FOLDER, f"{name}.tar") as f:
        writer = wds.TarWriter(f)
        for row in ok:
            ext, data = images[row["key"]]
            writer.write({"__key__": row["key"], ext: data, "txt": row.get("caption") or "",
                          "json": _sample_json(row, meta_fields)})
        writer.close()
    embeddings = [r.pop("clip_embedding", None) for r in rows]
    write_embeddings(out, shard_id, [r["key"] for r in rows], embeddings)
    # One schema for every shard, so readers can open them all as one dataset.
    table = pa.Table.from_pylist(rows, schema=schema)
    with out.open_atomic(SHARDS_FOLDER, f"{name}.parquet") as f:
        pq.write_table(table, f)
    counts = Counter(r["status"] for r in rows)
    stats = {**stats_extra, "shard": shard_id, "count": len(rows), "successes": len(ok),
             "status": dict(sorted(counts.items()))}
    out.write_json(stats, SHARDS_FOLDER, stats_name(shard_id))
    return stats


def write_embeddings(out: OutputDir, shard_id: int, keys: list[str],
                     embeddings: list[list[float] | None]) -> None:
    """Image embeddings of the scored rows as NNNNN.npy, their keys as NNNNN_keys.json."""
    have = [(k, e) for k, e in zip(keys, embeddings, strict=True) if e is not None]
    if not have:
        return
    out.makedirs(EMBEDDINGS_FOLDER)
    buffer = io.BytesIO()
    np.save(buffer, np.asarray([e for _, e in have], dtype=np.float32))
    with out.open_atomic(EMBEDDINGS_FOLDER, f"{shard_name(shard_id)}.npy") as f:
        f.write(buffer.getvalue())
    with out.open_atomic(EMBEDDINGS_FOLDER, f"{shard_name(shard_id)}_keys.json") as f:
        f.write(json.dumps([k for k, _ in have]).encode())
