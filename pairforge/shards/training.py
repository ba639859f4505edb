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

from pairforge.config import TasksConfig
from pairforge.records import Status, json_safe
from pairforge.shards.labels import IMG, assign_tasks, share_report, start_offset
from pairforge.shards.raw import shard_name, stats_name
from pairforge.shards.storage import EMBEDDINGS_FOLDER, RAW_FOLDER, SHARDS_FOLDER, OutputDir
from pairforge.shards.tar import SampleTarWriter, read_samples

IMAGE_EXTENSIONS = ("jpg", "webp", "png")
SPECIALS_PER_SEQUENCE = 4  # leading EOS, SOV, EOV, final EOS


def read_raw_images(out: OutputDir, shard_id: int,
                    keys: set[str]) -> dict[str, tuple[str, bytes | memoryview]]:
    """key -> (extension, bytes) for the wanted keys of one raw tar."""
    found: dict[str, tuple[str, bytes | memoryview]] = {}
    if not keys:
        return found
    path = out.path(RAW_FOLDER, f"{shard_name(shard_id)}.tar")
    with out.fs.open(path, "rb") as f:
        archive = f.read()  # its images are all wanted; they stay views into it
    for key, files in read_samples(archive):
        if key in keys:
            ext = next(e for e in IMAGE_EXTENSIONS if e in files)
            found[key] = (ext, files[ext])
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
    return json_safe({f: row.get(f) for f in fields})


def _npy(values: list[int], shape: list[int] | None = None) -> bytes:
    buffer = io.BytesIO()
    array = np.asarray(values, dtype=np.int32)
    np.save(buffer, array.reshape(shape) if shape else array)
    return buffer.getvalue()


def _sample(row: dict[str, Any], image: tuple[str, bytes | memoryview],
            fields: list[str]) -> dict[str, Any]:
    """The files of one training sample, by extension."""
    ext, data = image
    sample = {ext: data, "txt": row.get("train_caption") or "", "json": _sample_json(row, fields)}
    if row.get("image_tokens") is not None:
        sample["vq.npy"] = _npy(row["image_tokens"], row["token_grid"])
        sample["tok.npy"] = _npy(row["caption_tokens"] or [])
    return sample


def label_tasks(ok: list[dict[str, Any]], shard_id: int, tasks: TasksConfig) -> dict[str, Any]:
    """Set ``task`` on the ok rows (when they have image tokens); return the budget stats."""
    if not ok or ok[0].get("n_image_tokens") is None:
        return {}
    tokens = [r["n_image_tokens"] for r in ok]
    captioned = [bool(r.get("caption_tokens")) for r in ok]
    labels = assign_tasks(tokens, captioned, tasks.p_drop, start_offset(tasks.seed, shard_id))
    for row, label in zip(ok, labels, strict=True):
        row["task"] = label
    report = share_report(tokens, labels, tasks.p_drop)
    return {"budget": {"p_drop": tasks.p_drop, "realized": report.realized,
                       "max_prefix_deviation": report.max_prefix_deviation,
                       "max_image_tokens": report.max_image_tokens},
            "tasks": task_totals(ok)}


def task_totals(ok: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Samples, image, caption and sequence tokens per task. A sequence is [EOS] + payload
    with SOV, EOV and a final EOS (DESIGN.md section 5): 4 specials each."""
    totals: dict[str, dict[str, int]] = {}
    for row in ok:
        t = totals.setdefault(row["task"], {"samples": 0, "image_tokens": 0,
                                            "caption_tokens": 0, "sequence_tokens": 0})
        caption = row["n_caption_tokens"] if row["task"] != IMG else 0
        t["samples"] += 1
        t["image_tokens"] += row["n_image_tokens"]
        t["caption_tokens"] += caption
        t["sequence_tokens"] += row["n_image_tokens"] + caption + SPECIALS_PER_SEQUENCE
    return dict(sorted(totals.items()))


def write_training_shard(out: OutputDir, shard_id: int, rows: list[dict[str, Any]],
                         schema: pa.Schema, meta_fields: list[str],
                         stats_extra: dict[str, Any], tasks: TasksConfig,
                         save_embeddings: bool = True,
                         images: dict[str, tuple[str, bytes | memoryview]] | None = None
                         ) -> dict[str, Any]:
    """Tar of the ok samples, parquet of every row, the rows' CLIP embeddings (when
    ``save_embeddings``), then the stats file (last). ``images``: key -> (extension,
    bytes) of the ok rows, as the steps carried them; None: read from the raw tar."""
    out.makedirs(SHARDS_FOLDER)
    ok = [r for r in rows if r["status"] == Status.OK]
    budget = label_tasks(ok, shard_id, tasks)
    if images is None:
        images = read_raw_images(out, shard_id, {r["key"] for r in ok})
    name = shard_name(shard_id)
    with out.open_atomic(SHARDS_FOLDER, f"{name}.tar") as f, SampleTarWriter(f) as writer:
        for row in ok:
            writer.write(row["key"], _sample(row, images[row["key"]], meta_fields))
    embeddings = [r.pop("clip_embedding", None) for r in rows]
    if save_embeddings:
        write_embeddings(out, shard_id, [r["key"] for r in rows], embeddings)
    # One schema for every shard, so readers can open them all as one dataset.
    table = pa.Table.from_pylist(rows, schema=schema)
    with out.open_atomic(SHARDS_FOLDER, f"{name}.parquet") as f:
        pq.write_table(table, f)
    counts = Counter(r["status"] for r in rows)
    stats = {**stats_extra, **budget, "shard": shard_id, "count": len(rows),
             "successes": len(ok), "status": dict(sorted(counts.items()))}
    out.write_json(stats, SHARDS_FOLDER, stats_name(shard_id))
    return stats


def read_embeddings(out: OutputDir, shard_id: int) -> tuple[list[str], np.ndarray] | None:
    """A shard's saved image embeddings (keys, float32 matrix), or None when it has none."""
    name = shard_name(shard_id)
    if not out.exists(EMBEDDINGS_FOLDER, f"{name}.npy"):
        return None
    with out.fs.open(out.path(EMBEDDINGS_FOLDER, f"{name}.npy"), "rb") as f:
        vectors = np.load(f)
    return out.read_json(EMBEDDINGS_FOLDER, f"{name}_keys.json"), vectors


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
