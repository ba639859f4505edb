"""Duplicates of a built dataset, per kind, and each dropped row beside the row it lost to.

Used by ``pairforge inspect``/``report`` (counts per kind, from the manifest's funnel) and
``pairforge show --duplicates`` (pairs for the contact sheet, images from the raw tars).
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

from pairforge.records import Status, index_digits, shard_of_key
from pairforge.shards.storage import DEDUP_FOLDER, MANIFEST, RAW_FOLDER, SHARDS_FOLDER, OutputDir
from pairforge.shards.training import read_raw_images

# Every kind of duplicate, in the order the hash join checks its evidence, then stage 3's.
DUPLICATE_KINDS = (Status.DUPLICATE_EXACT, Status.DUPLICATE_NEAR, Status.DUPLICATE_MIRROR,
                   Status.DUPLICATE_CROP, Status.DUPLICATE_SEMANTIC)


def counts_by_kind(final: dict[str, int]) -> dict[str, int]:
    """Rows per duplicate kind (short names: exact, near, ...) from a funnel's final counts."""
    return {kind.value.removeprefix("duplicate_"): int(final.get(kind.value, 0))
            for kind in DUPLICATE_KINDS}


def describe_counts(final: dict[str, int]) -> str:
    counts = counts_by_kind(final)
    return (f"duplicates: {sum(counts.values()):,} "
            f"({', '.join(f'{kind} {n:,}' for kind, n in counts.items())})")


def _evidence(out: OutputDir) -> dict[str, dict[str, Any]]:
    """key -> its decision row (kept_source, distance, similarity) from the dedup tables."""
    found: dict[str, dict[str, Any]] = {}
    for name in ("duplicates.parquet", "semantic.parquet"):
        if out.exists(DEDUP_FOLDER, name):
            with out.fs.open(out.path(DEDUP_FOLDER, name), "rb") as f:
                found.update({r["key"]: r for r in pq.read_table(f).to_pylist()})
    return found


def _detail(decision: dict[str, Any] | None) -> str:
    if not decision:
        return ""
    if decision.get("similarity") is not None:
        return f", cosine {decision['similarity']:.3f}"
    return f", {decision['distance']} bits" if decision.get("distance") is not None else ""


def _kept_rows(out: OutputDir, keys: set[str], digits: int) -> dict[str, dict[str, Any]]:
    """key -> sample dict (image, caption) of kept rows, read from their raw shards."""
    by_shard: dict[int, set[str]] = {}
    for key in keys:
        by_shard.setdefault(shard_of_key(key, digits), set()).add(key)
    found = {}
    for shard_id, wanted in by_shard.items():
        name = f"{shard_id:05d}.parquet"
        if not out.exists(RAW_FOLDER, name):
            continue
        with out.fs.open(out.path(RAW_FOLDER, name), "rb") as f:
            captions = {r["key"]: r["caption"] for r in
                        pq.read_table(f, columns=["key", "caption"]).to_pylist()}
        for key, (ext, data) in read_raw_images(out, shard_id, wanted).items():
            found[key] = {"image": Image.open(io.BytesIO(bytes(data))).convert("RGB"),
                          "caption": captions.get(key) or "", "ext": ext}
    return found


def duplicate_pairs(out: OutputDir, kind: str | None, grep: str | None, n: int
                    ) -> list[tuple[dict[str, Any], Image.Image | None]]:
    """The first ``n`` dropped duplicates (of ``kind``, or of every kind) as contact-sheet
    samples, each with the image of the row it was dropped for (None when that row was
    shipped by an earlier build: the index keeps hashes, not images)."""
    manifest = out.read_json(MANIFEST)
    kinds = {kind} if kind else {k.value for k in DUPLICATE_KINDS}
    digits = index_digits(manifest["config"]["input"]["shard_size"])
    decisions = _evidence(out)
    dropped: list[dict[str, Any]] = []
    for shard in manifest["shards"]:
        if len(dropped) >= n:
            break
        if not any(shard["status"].get(k) for k in kinds):
            continue
        with out.fs.open(out.path(SHARDS_FOLDER, shard["name"].replace(".tar", ".parquet")),
                         "rb") as f:
            rows = [r for r in pq.read_table(f).to_pylist() if r["status"] in kinds
                    and (not grep or grep.lower() in (r["caption"] or "").lower())]
        images = read_raw_images(out, int(shard["name"][:-4]), {r["key"] for r in rows})
        for row in rows[:n - len(dropped)]:
            ext, data = images[row["key"]]
            dropped.append({ext: bytes(data), "__key__": row["key"],
                            "txt": row["caption"] or "", "row": row})
    local = {r["row"]["duplicate_of"] for r in dropped
             if not (decisions.get(r["__key__"]) or {}).get("kept_source")}
    kept = _kept_rows(out, local, digits)
    pairs = []
    for sample in dropped:
        row = sample.pop("row")
        decision = decisions.get(row["key"])
        source = (decision or {}).get("kept_source")
        other = None if source else kept.get(row["duplicate_of"])
        where = f"kept {row['duplicate_of']}" + (f" in {source}" if source else " (right)")
        sample["json"] = {"status": row["status"], "error": where + _detail(decision)}
        if other:
            sample["txt"] = f"{sample['txt']} | kept: {other['caption']}"
        pairs.append((sample, other["image"] if other else None))
    return pairs


def summary_lines(out: OutputDir, final: dict[str, int]) -> list[str]:
    """Duplicates per kind, and what stage 3's semantic pass did when it ran."""
    lines = [describe_counts(final)]
    if out.exists(DEDUP_FOLDER, "semantic_stats.json"):
        stats = out.read_json(DEDUP_FOLDER, "semantic_stats.json")
        lines.append(f"semantic dedup: {stats.get('embeddings', 0):,} CLIP embeddings in "
                     f"{stats.get('clusters', 0):,} k-means clusters, cosine >= "
                     f"{stats.get('threshold', '-')}: "
                     f"{stats.get(Status.DUPLICATE_SEMANTIC.value, 0):,} dropped")
    return lines
