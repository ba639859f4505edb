"""Stage 3's optional semantic dedup pass (``dedup.semantic``) on Ray.

It needs every row's image embedding before any training shard is written, so it runs
between the scoring pass of the chain's scoring step (CLIP's, the one its ``top_fraction``
mode uses: steps up to it, scores in ``OUT/clip``, embeddings in ``OUT/embeddings``) and
the writing pass. It asks that step (pairforge/stage.py's ``ScoringStep``) for the pass,
its columns and the score it keeps rows at:

1. the scoring pass runs over the shards that have no score file or no embeddings yet;
2. one Ray task per shard reads its embeddings, keeps the rows the step would keep (score
   at or above its cut, when it filters: a survivor dropped later for its score would
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

from pairforge.config import ConfigError, PairforgeConfig
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
from pairforge.stage import ScoringStep, Step, scoring_step

SEMANTIC_FILE = "semantic.parquet"
SEMANTIC_STATS = "semantic_stats.json"
_READ_CPUS = 0.5
_PAIR_CPUS = 1


def embedded_rows(out_url: str, storage_options: dict, shard_id: int, score: str,
                  threshold: float | None) -> tuple[pa.Table, np.ndarray]:
    """(key, area) of a shard's embedded rows that the scoring step keeps (its ``score``
    column at or above ``threshold``), and their embeddings."""
    out = OutputDir(out_url, storage_options)
    name = shard_name(shard_id)
    saved = read_embeddings(out, shard_id)
    if saved is None:
        return pa.table({"key": pa.array([], pa.string()), "area": pa.array([], pa.int64())}
                        ), np.zeros((0, 0), np.float32)
    keys, vectors = saved
    with out.fs.open(out.path(SCORES_FOLDER, f"{name}.parquet"), "rb") as f:
        scores = pq.read_table(f, columns=["key", "status", score]).to_pylist()
    kept = {r["key"] for r in scores if r["status"] == Status.OK and (
        threshold is None or (r[score] is not None and r[score] >= threshold))}
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


def _embedding_step(steps: list[type[Step]]) -> type[ScoringStep]:
    """The chain's step whose scoring pass keeps image embeddings."""
    scorer = scoring_step(steps)
    if scorer is None or scorer.embedding_column is None:
        raise ConfigError("dedup.semantic compares image embeddings, and no step of this "
                          "chain makes them: set process.clip.enabled")
    return scorer


def _inputs_digest(out: OutputDir, cfg: PairforgeConfig, shard_ids: list[int],
                   cut: float | None) -> str:
    files = []
    for shard_id in shard_ids:
        name = f"{shard_name(shard_id)}.npy"
        if out.exists(EMBEDDINGS_FOLDER, name):
            files.append((name, int(out.fs.info(out.path(EMBEDDINGS_FOLDER, name))["size"])))
    # the stage's settings (CLIP model files included): new embeddings of the same size
    blob = json.dumps({"settings": settings_digest(stage_settings(cfg, "process")),
                       "config": cfg.dedup.semantic.model_dump(mode="json"),
                       "score_threshold": cut, "embeddings": files},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _scored_shards(out: OutputDir) -> set[int]:
    """Shards with a score file (the scoring pass's completion marker) and embeddings."""
    scored = {int(name[:-len(".parquet")]) for name in out.glob(f"{SCORES_FOLDER}/*.parquet")}
    return {s for s in scored if out.exists(EMBEDDINGS_FOLDER, f"{shard_name(s)}.npy")}


def _embed_missing(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]],
                   scorer: type[ScoringStep]) -> None:
    """The scoring pass (embeddings kept) over the shards without scores or embeddings.

    A score file without embeddings goes first: the scoring step does not encode a row
    whose score is cached, so its embedding would never be written."""
    missing = completed_shards(out, RAW_FOLDER) - _scored_shards(out)
    if not missing:
        return
    plans = [p for p in plan_shards(out, cfg, SCORES_FOLDER) if p.shard_id in missing]
    for plan in plans:
        out.remove(SCORES_FOLDER, f"{shard_name(plan.shard_id)}.parquet")
    stream_shards(scorer.scoring_config(cfg, for_embeddings=True), out, plans,
                  steps[:steps.index(scorer) + 1], write_scores_task, {}, None)


def run_semantic_dedup(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]]
                       ) -> dict[str, Any]:
    """Embed what is missing, decide the semantic duplicates, write them; the stats."""
    semantic = cfg.dedup.semantic
    scorer = _embedding_step(steps)
    cut = scorer.score_cut(cfg)
    out.makedirs(SCORES_FOLDER)
    _embed_missing(cfg, out, steps, scorer)
    shard_ids = sorted(_scored_shards(out))
    digest = _inputs_digest(out, cfg, shard_ids, cut)
    if out.exists(DEDUP_FOLDER, SEMANTIC_STATS):
        finished = out.read_json(DEDUP_FOLDER, SEMANTIC_STATS)
        if finished.get("inputs_digest") == digest:
            return finished
    started = time.perf_counter()
    import ray

    read = ray.remote(num_cpus=_READ_CPUS, max_retries=cfg.ray.max_task_retries)(embedded_rows)
    parts = ray.get([read.remote(out.url, cfg.output.storage_options, s, scorer.score_column,
                                 cut) for s in shard_ids])
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
    stats = {"stage": "semantic_dedup", **stats, "score_threshold": cut,
             "inputs_digest": digest,
             "seconds": {**stats.get("seconds", {}), "read": round(read_s, 3),
                         "total": round(time.perf_counter() - started, 3)}}
    out.write_json(stats, DEDUP_FOLDER, SEMANTIC_STATS)  # last: the completion marker
    return stats

