"""Stage 3's optional semantic dedup pass (``dedup.semantic``) on Ray.

It needs every row's CLIP image embedding before any training shard is written, so it
runs between CLIP's scoring pass (the one ``top_fraction`` mode uses: steps up to CLIP,
scores in ``OUT/clip``, embeddings in ``OUT/embeddings``) and the writing pass:

1. the scoring pass runs over the shards that have no score file or no embeddings yet;
2. one Ray task per shard reads its embeddings, keeps the rows CLIP would keep (score at or
   above the threshold, when CLIP filters: a survivor dropped later for its score would
   take its duplicates with it) and their original sizes (the survivor rule's input);
3. k-means runs on the driver (BLAS), then the pair search runs as Ray tasks over
   balanced groups of clusters, sharing one copy of the embeddings (``filters/semantic``);
4. ``OUT/dedup/semantic.parquet`` (the duplicates table plus ``similarity``) is written, then
   ``semantic_stats.json`` last, as the completion marker.

The writing pass reads ``semantic.parquet`` with the hash duplicates (``pipeline/plan``):
those rows skip every later step and end as ``duplicate_semantic``. A finished pass is
reused while its inputs (embedding files, threshold, settings) are unchanged. Shards that
were complete before a rerun keep the decisions they were written with.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.filters.clip import ClipStep
from pairforge.filters.semantic import (
    SEMANTIC_SCHEMA,
    PairsMapper,
    default_clusters,
    semantic_duplicates,
)
from pairforge.pipeline.plan import plan_shards
from pairforge.pipeline.settings import settings_digest, stage_settings
from pairforge.pipeline.stream import read_raw, stream_shards
from pairforge.pipeline.write import write_scores_task
from pairforge.records import Status
from pairforge.shards.raw import completed_shards, shard_name
from pairforge.shards.storage import (
    DEDUP_FOLDER,
    EMBEDDINGS_FOLDER,
    RAW_FOLDER,
    SCORES_FOLDER,
    OutputDir,
)
from pairforge.shards.training import read_embeddings
from pairforge.stage import Step

SEMANTIC_FILE = "semantic.parquet"
SEMANTIC_STATS = "semantic_stats.json"
_READ_CPUS = 0.5
_PAIR_CPUS = 1


def embedded_rows(out_url: str, storage_options: dict, shard_id: int,
                  threshold: float | None) -> tuple[pa.Table, np.ndarray]:
    """(key, area) of a shard's embedded rows that CLIP keeps, and their embeddings."""
    out = OutputDir(out_url, storage_options)
    name = shard_name(shard_id)
    saved = read_embeddings(out, shard_id)
    if saved is None:
        return pa.table({"key": pa.array([], pa.string()), "area": pa.array([], pa.int64())}
                        ), np.zeros((0, 0), np.float32)
    keys, vectors = saved
    with out.fs.open(out.path(SCORES_FOLDER, f"{name}.parquet"), "rb") as f:
        scores = pq.read_table(f, columns=["key", "status", "clip_score"]).to_pylist()
    kept = {r["key"] for r in scores if r["status"] == Status.OK and (
        threshold is None or (r["clip_score"] is not None and r["clip_score"] >= threshold))}
    raw = read_raw(out, shard_id, ["key", "original_width", "original_height"]).to_pylist()
    area = {r["key"]: (r["original_width"] or 0) * (r["original_height"] or 0) for r in raw}
    rows = [i for i, k in enumerate(keys) if k in kept]
    table = pa.table({"key": pa.array([keys[i] for i in rows], pa.string()),
                      "area": pa.array([area.get(keys[i], 0) for i in rows], pa.int64())})
    return table, vectors[rows].astype(np.float32)


def ray_pairs_mapper(retries: int) -> PairsMapper:
    """One Ray task per group of clusters over one shared copy of the embeddings."""

    def run(x: np.ndarray, labels: np.ndarray, groups: list[list[int]], threshold: float
            ) -> list[tuple[np.ndarray, np.ndarray]]:
        import ray

        from pairforge.filters.semantic import group_pairs

        task = ray.remote(num_cpus=_PAIR_CPUS, max_retries=retries)(group_pairs)
        shared_x, shared_labels = ray.put(x), ray.put(labels)
        return ray.get([task.remote(shared_x, shared_labels, g, threshold) for g in groups])

    return run


def _score_threshold(cfg: PairforgeConfig) -> float | None:
    clip = cfg.process.clip
    return clip.threshold if clip.mode == "threshold" else None


def _inputs_digest(out: OutputDir, cfg: PairforgeConfig, shard_ids: list[int]) -> str:
    files = []
    for shard_id in shard_ids:
        name = f"{shard_name(shard_id)}.npy"
        if out.exists(EMBEDDINGS_FOLDER, name):
            files.append((name, int(out.fs.info(out.path(EMBEDDINGS_FOLDER, name))["size"])))
    # the stage's settings (CLIP model files included): new embeddings of the same size
    blob = json.dumps({"settings": settings_digest(stage_settings(cfg, "process")),
                       "config": cfg.dedup.semantic.model_dump(mode="json"),
                       "score_threshold": _score_threshold(cfg), "embeddings": files},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _scored_shards(out: OutputDir) -> set[int]:
    """Shards with a score file (the scoring pass's completion marker) and embeddings."""
    scored = {int(name[:-len(".parquet")]) for name in out.glob(f"{SCORES_FOLDER}/*.parquet")}
    return {s for s in scored if out.exists(EMBEDDINGS_FOLDER, f"{shard_name(s)}.npy")}


def _embed_missing(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]]) -> None:
    """CLIP's scoring pass (embeddings kept) over the shards without scores or embeddings.

    A score file without embeddings goes first: the CLIP step does not encode a row whose
    score is cached, so its embedding would never be written."""
    missing = completed_shards(out, RAW_FOLDER) - _scored_shards(out)
    if not missing:
        return
    plans = [p for p in plan_shards(out, cfg, SCORES_FOLDER) if p.shard_id in missing]
    for plan in plans:
        out.remove(SCORES_FOLDER, f"{shard_name(plan.shard_id)}.parquet")
    scoring = cfg.model_copy(deep=True)
    scoring.process.clip.mode = "score_only"
    scoring.process.clip.save_embeddings = True
    score_steps = steps[:steps.index(ClipStep) + 1]
    stream_shards(scoring, out, plans, score_steps, write_scores_task, {}, None)


def run_semantic_dedup(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]]
                       ) -> dict[str, Any]:
    """Embed what is missing, decide the semantic duplicates, write them; the stats."""
    semantic = cfg.dedup.semantic
    out.makedirs(SCORES_FOLDER)
    _embed_missing(cfg, out, steps)
    shard_ids = sorted(_scored_shards(out))
    digest = _inputs_digest(out, cfg, shard_ids)
    if out.exists(DEDUP_FOLDER, SEMANTIC_STATS):
        finished = out.read_json(DEDUP_FOLDER, SEMANTIC_STATS)
        if finished.get("inputs_digest") == digest:
            return finished
    started = time.perf_counter()
    import ray

    read = ray.remote(num_cpus=_READ_CPUS, max_retries=cfg.ray.max_task_retries)(embedded_rows)
    parts = ray.get([read.remote(out.url, cfg.output.storage_options, s, _score_threshold(cfg))
                     for s in shard_ids])
    parts = [(t, v) for t, v in parts if t.num_rows]
    rows = pa.concat_tables([pa.table({"key": pa.array([], pa.string()),
                                       "area": pa.array([], pa.int64())}),
                             *(t for t, _ in parts)])
    read_s = time.perf_counter() - started
    if rows.num_rows < 2:
        table = SEMANTIC_SCHEMA.empty_table()
        stats = {"embeddings": rows.num_rows, Status.DUPLICATE_SEMANTIC.value: 0}
    else:
        result = semantic_duplicates(
            rows["key"], np.concatenate([v for _, v in parts]),
            pc.fill_null(rows["area"], 0).to_numpy(), semantic.threshold,
            default_clusters(rows.num_rows, semantic.rows_per_cluster), semantic.iterations,
            semantic.seed, ray_pairs_mapper(cfg.ray.max_task_retries),
            groups=2 * max(1, int(ray.cluster_resources().get("CPU", 1))),
            probes=semantic.probes)
        table, stats = result.duplicates, result.stats
    out.makedirs(DEDUP_FOLDER)
    with out.open_atomic(DEDUP_FOLDER, SEMANTIC_FILE) as f:
        pq.write_table(table, f)
    stats = {"stage": "semantic_dedup", **stats, "score_threshold": _score_threshold(cfg),
             "inputs_digest": digest,
             "seconds": {**stats.get("seconds", {}), "read": round(read_s, 3),
                         "total": round(time.perf_counter() - started, 3)}}
    out.write_json(stats, DEDUP_FOLDER, SEMANTIC_STATS)  # last: the completion marker
    return stats

