"""The ``semantic`` stage of bench/scale.py: stage 3's semantic dedup pass
(``pipeline/semantic_stage.run_semantic_dedup``, local Ray on 2 CPUs) over synthetic CLIP
embeddings written to disk as the scoring pass leaves them (OUT/raw, OUT/clip,
OUT/embeddings, shards of 10^4 rows).

The vectors are 512-d float32 around 1,000 topic centres (a topic's rows at cosine ~0.5
to each other, random pairs ~0), and 1 % of each shard are planted near copies of another
row of the shard (cosine ~0.99). Default settings: 1,000 rows a cluster, 2 probes,
k-means on at most 131,072 sampled rows. The driver is a fresh process
(``python bench/scale_semantic.py --child OUT``) that reports its own peak RSS (VmHWM).
With ``check``, another (``--oracle OUT CLUSTERS``) runs the one-process decision on all
the rows and compares the output and the counts.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import json_from_child, peak_rss_mib

SHARD_ROWS = 10_000
DIM = 512
TOPICS = 1_000


def write_shards(out: Path, rows: int, seed: int = 0) -> int:
    """The scored shards of ``rows`` rows; returns the planted copies."""
    from pairforge.records import make_key, raw_schema

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((TOPICS, DIM)).astype(np.float32)
    for name in ("raw", "clip", "embeddings"):
        (out / name).mkdir(parents=True, exist_ok=True)
    planted = 0
    for shard, start in enumerate(range(0, rows, SHARD_ROWS)):
        n = min(SHARD_ROWS, rows - start)
        x = centres[rng.integers(0, TOPICS, n)] + rng.standard_normal((n, DIM)).astype(
            np.float32)
        copies = rng.choice(n, n // 100, replace=False)
        x[copies] = x[rng.integers(0, n, len(copies))] + 0.1 * rng.standard_normal(
            (len(copies), DIM)).astype(np.float32)
        planted += len(copies)
        keys = [make_key(shard, i) for i in range(n)]
        columns = {c: pa.nulls(n, f.type) for c, f in zip(raw_schema().names, raw_schema(),
                                                          strict=True)}
        columns.update(key=pa.array(keys), status=pa.array(["ok"] * n),
                       original_width=pa.array(rng.integers(200, 800, n).astype(np.int32)),
                       original_height=pa.array(np.full(n, 400, np.int32)))
        name = f"{shard:05d}"
        pq.write_table(pa.table(columns, schema=raw_schema()), out / "raw" / f"{name}.parquet")
        (out / "raw" / f"{name}_stats.json").write_text(json.dumps(
            {"count": n, "status": {"ok": n}}))
        pq.write_table(pa.table({"key": keys, "status": ["ok"] * n,
                                 "clip_score": pa.array(np.ones(n, np.float32))}),
                       out / "clip" / f"{name}.parquet")
        np.save(out / "embeddings" / f"{name}.npy", x)
        (out / "embeddings" / f"{name}_keys.json").write_text(json.dumps(keys))
    return planted


def _child(out: str) -> None:
    from pairforge.config import parse_config
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.ray_runtime import init_ray
    from pairforge.pipeline.semantic_stage import run_semantic_dedup
    from pairforge.shards.storage import OutputDir

    cfg = parse_config({"input": {"path": "unused", "shard_size": SHARD_ROWS},
                        "output": {"path": out}, "ray": {"num_cpus": 2},
                        "dedup": {"enabled": False, "semantic": {"enabled": True}},
                        "process": {"clip": {"enabled": True, "threshold": 0.2}}})
    init_ray(cfg.ray)
    started = time.perf_counter()
    stats = run_semantic_dedup(cfg, OutputDir(out), [ClipStep])
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "driver_peak_rss_mib": peak_rss_mib(),
                      "stats": stats}))


def _oracle(out: str, clusters: str) -> None:
    """The one-process decision (semantic.semantic_duplicates) on the same rows: is the
    pass's output the same?"""
    from pairforge.dedup.reference import semantic_duplicates

    folder = Path(out)
    keys, vectors, area = [], [], []
    for path in sorted((folder / "embeddings").glob("*.npy")):
        keys += json.loads(path.with_name(path.stem + "_keys.json").read_text())
        vectors.append(np.load(path))
        raw = pq.read_table(folder / "raw" / f"{path.stem}.parquet",
                            columns=["original_width", "original_height"])
        area.append(raw["original_width"].to_numpy().astype(np.int64)
                    * raw["original_height"].to_numpy())  # raw rows in embeddings' order
    started = time.perf_counter()
    result = semantic_duplicates(pa.array(keys), np.concatenate(vectors),
                                 np.concatenate(area), 0.95, int(clusters), probes=2)
    seconds = time.perf_counter() - started
    same = pq.read_table(folder / "dedup" / "semantic.parquet").equals(result.duplicates)
    print(json.dumps({"same_rows": same, "seconds": seconds, "stats": result.stats}))


def measure_semantic(rows: int, work: Path, check: bool = False) -> dict[str, Any]:
    out = work / f"semantic-{rows}"
    started = time.perf_counter()
    planted = write_shards(out, rows)
    print(f"  semantic {rows:,}: wrote {rows:,} x {DIM} embeddings in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    found = json_from_child([__file__, "--child", str(out)], "the semantic pass")
    stats = found.pop("stats")
    checked = {}
    if check:
        oracle = json_from_child([__file__, "--oracle", str(out), str(stats["clusters"])],
                                 "the single-process decision")
        same = oracle["same_rows"] and all(
            oracle["stats"][k] == stats[k] for k in ("pairs", "largest_cluster",
                                                     "duplicate_semantic"))
        checked = {"identical_to_single_process": same,
                   "single_process_seconds": oracle["seconds"]}
    shutil.rmtree(out)
    return {**found, **checked, "planted_copies": planted,
            **{k: stats[k] for k in ("duplicate_semantic", "pairs", "clusters",
                                     "largest_cluster", "sample_rows", "units",
                                     "partitions")},
            "phases": stats["seconds"]["phases"], "kmeans_s": stats["seconds"]["kmeans"]}


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2])
elif __name__ == "__main__" and sys.argv[1:2] == ["--oracle"]:
    _oracle(*sys.argv[2:4])
