"""Stage 3's optional semantic dedup pass (``dedup.semantic``) on Ray.

It needs every row's image embedding before any training shard is written, so it runs
between the scoring pass of the chain's scoring step (CLIP's, the one its ``top_fraction``
mode uses: steps up to it, scores in ``OUT/clip``, embeddings in ``OUT/embeddings``) and
the writing pass. It asks that step (pairforge/stage.py's ``ScoringStep``) for the pass,
its columns and the score it keeps rows at:

1. the scoring pass runs over the shards that have no score file or no embeddings yet;
2. the decision runs as waves of Ray tasks (``dedup/semantic_partitions.py``, over
   ``OUT/dedup/semantic-work/``, removed when done): each unit of shards reads its
   embeddings and keeps the rows the step would keep (score at or above its cut, when it
   filters: a survivor dropped later for its score would take its duplicates with it);
   k-means is trained on the driver on a sample of at most ``dedup.semantic.sample_rows``
   rows chosen by a hash of the key; assignment, the pair search, the components (stage
   2's ``dedup/components.py``) and the survivors are tasks. The driver holds the
   sample, the centroids and counts, never every row;
3. ``OUT/dedup/semantic.parquet`` (the duplicates table plus ``similarity``) is written, then
   ``semantic_stats.json`` last, as the completion marker.

The writing pass reads ``semantic.parquet`` with the hash duplicates (``pipeline/plan``):
those rows skip every later step and end as ``duplicate_semantic``. A finished pass is
reused while its inputs (embedding files, threshold, settings) are unchanged. Shards that
were complete before a rerun keep the decisions they were written with.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import ConfigError, PairforgeConfig, SemanticDedupConfig
from pairforge.dedup.inputs import embedding_files
from pairforge.dedup.key_ranges import concat_sorted, key_boundaries, sort_range
from pairforge.dedup.semantic import SEMANTIC_SCHEMA, default_clusters, kmeans, sample_size
from pairforge.dedup.semantic_partitions import (
    SemanticWork,
    assign_unit,
    attach,
    balanced_groups,
    count_unit,
    decide,
    pair_group,
    read_sample,
    route_labels,
    sample_unit,
)
from pairforge.dedup.work import Work
from pairforge.pipeline.contract import READ_CPUS, SEMANTIC, step_config, with_step_config
from pairforge.pipeline.dedup_stage import partition_count
from pairforge.pipeline.executors import Waves, cluster_cpus
from pairforge.pipeline.plan import plan_shards
from pairforge.pipeline.settings import inputs_digest, settings_digest, stage_settings
from pairforge.pipeline.stream import read_raw, stream_shards
from pairforge.pipeline.waves import components
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
from pairforge.stage import ScoringStep, Step, scoring_step

SEMANTIC_FILE = "semantic.parquet"
SEMANTIC_STATS = "semantic_stats.json"
WORK_FOLDER = "semantic-work"  # under OUT/dedup, removed when the pass is done

ROWS_PER_UNIT = 50_000  # rows an assignment task reads (200 MB of 1,024-d vectors)
GROUP_BYTES = 256 << 20  # memberships a pair-search task holds, about
_NO_ROWS = pa.table({"key": pa.array([], pa.string()), "area": pa.array([], pa.int64())})


@dataclass(frozen=True)
class EmbeddedRows:
    """A shard's embedded rows that the scoring step keeps (its ``score`` column at or
    above ``threshold``: a survivor dropped later for its score would take its copies
    with it), as (key, area) and their embeddings, in the embeddings file's order.
    Called inside the tasks (``dedup/semantic_partitions.RowsReader``)."""

    out_url: str
    storage_options: dict
    score: str
    threshold: float | None

    def __call__(self, shard_id: int, vectors: bool) -> tuple[pa.Table, np.ndarray | None]:
        out = OutputDir(self.out_url, self.storage_options)
        name = shard_name(shard_id)
        if not out.exists(EMBEDDINGS_FOLDER, f"{name}.npy"):
            return _NO_ROWS, np.zeros((0, 0), np.float32) if vectors else None
        keys = pa.array(out.read_json(EMBEDDINGS_FOLDER, f"{name}_keys.json"), pa.string())
        with out.fs.open(out.path(SCORES_FOLDER, f"{name}.parquet"), "rb") as f:
            scores = pq.read_table(f, columns=["key", "status", self.score])
        kept = pc.equal(scores["status"], Status.OK.value)
        if self.threshold is not None:
            kept = pc.and_(kept, pc.greater_equal(scores[self.score], self.threshold))
        kept_keys = scores["key"].filter(pc.fill_null(kept, False))
        rows = np.flatnonzero(pc.is_in(keys, value_set=kept_keys.combine_chunks()
                                       ).to_numpy(zero_copy_only=False))
        raw = read_raw(out, shard_id, ["key", "original_width", "original_height"])
        area = pc.multiply(pc.fill_null(raw["original_width"], 0),
                           pc.fill_null(raw["original_height"], 0)).cast(pa.int64())
        at = pc.index_in(keys.take(pa.array(rows)), value_set=raw["key"].combine_chunks())
        table = pa.table({"key": keys.take(pa.array(rows)),
                          "area": pc.fill_null(area.combine_chunks().take(at), 0)},
                         schema=_NO_ROWS.schema)
        if not vectors:
            return table, None
        with out.fs.open(out.path(EMBEDDINGS_FOLDER, f"{name}.npy"), "rb") as f:
            return table, np.load(f)[rows].astype(np.float32)


def _embedding_step(steps: list[type[Step]]) -> type[ScoringStep]:
    """The chain's step whose scoring pass keeps image embeddings."""
    scorer = scoring_step(steps)
    if scorer is None or scorer.embedding_column is None:
        raise ConfigError("dedup.semantic compares image embeddings, and no step of this "
                          "chain makes them: set process.clip.enabled")
    return scorer


def _inputs_digest(out: OutputDir, cfg: PairforgeConfig, shard_ids: list[int],
                   cut: float | None) -> str:
    """The one staleness rule (``settings.inputs_digest``) over this pass's config and inputs:
    embedding files, the score it keeps rows at and stage 3's settings (CLIP model files
    included: new embeddings of the same size)."""
    return inputs_digest(cfg.dedup.semantic.model_dump(mode="json"),
                         settings=settings_digest(stage_settings(cfg, "process")),
                         score_threshold=cut, embeddings=embedding_files(out, shard_ids))


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
    scoring = scorer.scoring_config(step_config(cfg), for_embeddings=True)
    stream_shards(with_step_config(cfg, scoring), out, plans,
                  steps[:steps.index(scorer) + 1], write_scores_task, {}, None)


def _units(shard_ids: list[int], shard_size: int, cpus: int) -> list[list[int]]:
    """Consecutive shards grouped into units of about ROWS_PER_UNIT rows, two or more per
    CPU while there are shards enough."""
    per_unit = max(1, min(ROWS_PER_UNIT // max(1, shard_size),
                          math.ceil(len(shard_ids) / (2 * cpus))))
    return [shard_ids[i:i + per_unit] for i in range(0, len(shard_ids), per_unit)]


def _train(waves: Waves, reader: EmbeddedRows, work: Work, units: list[list[int]], rows: int,
           cfg: SemanticDedupConfig) -> tuple[np.ndarray, list[str]]:
    """k-means centroids trained on the hashed sample, and the sample's keys in order."""
    clusters = default_clusters(rows, cfg.rows_per_cluster, cfg.max_clusters)
    size = sample_size(rows, clusters, cfg.sample_rows)
    sampled = sum(waves.run(sample_unit, [(reader, u, rows, size, cfg.seed, work, i)
                                          for i, u in enumerate(units)], READ_CPUS))
    keys, x = read_sample(work, len(units), sampled)
    # key order, as one process given the rows in any order sees them; shards are read in
    # order and keys follow it, so this is seldom a copy
    if not _ascending(keys):
        order = pc.sort_indices(keys)
        keys, x = keys.take(order), x[order.to_numpy()]
    return kmeans(x, clusters, cfg.iterations, cfg.seed), keys.to_pylist()


def _ascending(keys: pa.Array) -> bool:
    return len(keys) < 2 or pc.all(pc.less(keys[:-1], keys[1:])).as_py()


def _decide(waves: Waves, sw: SemanticWork, units: list[list[int]], centroids: np.ndarray,
            sample_keys: list[str], out_url: str) -> dict[str, Any]:
    """Assignment, pair search, components and survivors as waves; writes the file."""
    import ray

    shared = ray.put(centroids)
    sizes = waves.fold(assign_unit, [(sw, i, u, shared) for i, u in enumerate(units)],
                       np.add, np.zeros(len(centroids), np.int64))
    groups = balanced_groups(sizes, sw.buckets, sw.pair_tasks)
    waves.run(pair_group, [(sw, g, buckets, len(units)) for g, buckets in enumerate(groups)])
    labels, directed = components(waves, sw.work, [("edges", len(groups))])
    P = sw.work.parts  # noqa: N806 - the partition count, as in the docs
    waves.run(route_labels, [(sw, p, labels, [u[0] for u in units]) for p in range(P)])
    waves.run(attach, [(sw, i, u) for i, u in enumerate(units)], READ_CPUS)
    boundaries = key_boundaries(sample_keys, P)
    decided = waves.run(decide, [(sw, p, len(units), boundaries) for p in range(P)])
    ranges = len(boundaries) + 1
    waves.run(sort_range, [(sw.work, r, SEMANTIC_SCHEMA) for r in range(ranges)],
              name="sort_semantic_range")
    waves.run(concat_sorted, [(sw.work, ranges, out_url, SEMANTIC_SCHEMA)],
              name="concat_semantic")
    return {"clusters": len(centroids), "largest_cluster": int(sizes.max(initial=0)),
            "pairs": directed // 2,
            Status.DUPLICATE_SEMANTIC.value: sum(d["duplicates"] for d in decided)}


def _pair_tasks(rows: int, dim: int, probes: int, clusters: int, cpus: int
                ) -> tuple[int, int]:
    """Pair-search tasks and buckets of memberships: a task holds about GROUP_BYTES of
    them (two tasks a CPU at least), in four buckets, so that the tasks can be balanced."""
    tasks = max(2 * cpus, math.ceil(rows * probes * (4 * dim + 16) / GROUP_BYTES))
    buckets = max(1, min(clusters, 4 * tasks))
    return min(tasks, buckets), buckets


def run_semantic_dedup(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]]
                       ) -> dict[str, Any]:
    """Embed what is missing, decide the semantic duplicates, write them; the stats."""
    semantic = cfg.dedup.semantic
    scorer = _embedding_step(steps)
    cut = scorer.score_cut(step_config(cfg))
    out.makedirs(SCORES_FOLDER)
    _embed_missing(cfg, out, steps, scorer)
    shard_ids = sorted(_scored_shards(out))
    digest = _inputs_digest(out, cfg, shard_ids, cut)
    if out.exists(DEDUP_FOLDER, SEMANTIC_STATS):
        finished = out.read_json(DEDUP_FOLDER, SEMANTIC_STATS)
        if finished.get("inputs_digest") == digest:
            return finished
    started = time.perf_counter()
    waves = Waves(cfg.ray.max_task_retries, SEMANTIC.resources.task_cpus)
    reader = EmbeddedRows(out.url, cfg.output.storage_options, scorer.score_column, cut)
    cpus = cluster_cpus()
    units = _units(shard_ids, cfg.input.shard_size, cpus)
    rows = sum(waves.run(count_unit, [(reader, u) for u in units], READ_CPUS))
    out.makedirs(DEDUP_FOLDER)
    work_url = out.uri(DEDUP_FOLDER, WORK_FOLDER)
    _remove(out)  # what an interrupted run left: this run redoes all of it
    if rows < 2:
        with out.open_atomic(DEDUP_FOLDER, SEMANTIC_FILE) as f:
            pq.write_table(SEMANTIC_SCHEMA.empty_table(), f)
        stats = {"embeddings": rows, Status.DUPLICATE_SEMANTIC.value: 0}
    else:
        work = Work(work_url, cfg.output.storage_options, partition_count(rows, cpus), 0)
        centroids, sample_keys = _train(waves, reader, work, units, rows, semantic)
        trained = time.perf_counter()
        dim = centroids.shape[1]
        tasks, buckets = _pair_tasks(rows, dim, semantic.probes, len(centroids), cpus)
        sw = SemanticWork(work, reader, dim, semantic.threshold, semantic.probes, buckets,
                          tasks)
        decided = _decide(waves, sw, units, centroids, sample_keys,
                          out.uri(DEDUP_FOLDER, SEMANTIC_FILE))
        _remove(out)
        stats = {"embeddings": rows, "probes": semantic.probes, "threshold": semantic.threshold,
                 "sample_rows": len(sample_keys), "units": len(units),
                 "partitions": sw.work.parts, **decided,
                 "seconds": {"kmeans": round(trained - started, 3),
                             "phases": {k: round(v, 3) for k, v in waves.seconds.items()}}}
    stats = {"stage": "semantic_dedup", **stats, "score_threshold": cut,
             "inputs_digest": digest,
             "seconds": {**stats.get("seconds", {}),
                         "total": round(time.perf_counter() - started, 3)}}
    out.write_json(stats, DEDUP_FOLDER, SEMANTIC_STATS)  # last: the completion marker
    return stats


def _remove(out: OutputDir) -> None:
    out.fs.invalidate_cache()
    if out.exists(DEDUP_FOLDER, WORK_FOLDER):
        out.fs.rm(out.path(DEDUP_FOLDER, WORK_FOLDER), recursive=True)
