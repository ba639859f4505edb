"""Stage 3, streaming: raw rows through the step chain on Ray Data, each finished shard
handed to a writer task.

Rows to process (ok after download and dedup) stream from the raw shards through the
steps with Ray Data's backpressure; model steps are actor pools. Only small result columns
come back to the driver (never images): the writer task re-reads the images from the raw
tar, so results do not cross the cluster twice. A shard a scoring pass scored comes with
the scoring step's cached columns (pairforge/stage.py's ``ScoringStep``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.pipeline.placement import TASK_CPUS, add_steps, fit_actor_cpus
from pairforge.pipeline.plan import Decisions, ShardPlan
from pairforge.pipeline.progress import StageDisplay
from pairforge.pipeline.ray_runtime import quiet_ray_data
from pairforge.records import RAW_COLUMNS, STEP_INPUT_COLUMNS, Status
from pairforge.shards.raw import shard_name
from pairforge.shards.storage import RAW_FOLDER, SCORES_FOLDER, OutputDir
from pairforge.shards.training import read_embeddings, read_raw_images
from pairforge.stage import SECONDS_PREFIX, ScoreMap, Step, scoring_step

# (config, plan, the steps' results for the shard, stats for every shard, the step chain)
Writer = Callable[[PairforgeConfig, ShardPlan, pa.Table, dict[str, Any], list[type[Step]]],
                  dict[str, Any]]


def read_raw(out: OutputDir, shard_id: int, columns: list[str] | None = None) -> pa.Table:
    """A raw shard's parquet (``columns``: those only); a raw column added after the shard
    was written comes as nulls."""
    with out.fs.open(out.path(RAW_FOLDER, f"{shard_name(shard_id)}.parquet"), "rb") as f:
        parquet = pq.ParquetFile(f)
        present = set(parquet.schema_arrow.names)
        table = parquet.read(columns=None if columns is None
                             else [c for c in columns if c in present])
    for field in RAW_COLUMNS:
        if field.name not in table.column_names and (columns is None or field.name in columns):
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table if columns is None else table.select(columns)


def scored_shards(out: OutputDir) -> list[int]:
    """The shards a scoring pass has scored: those with a score file."""
    return sorted(int(name.split(".")[0]) for name in out.glob(f"{SCORES_FOLDER}/*.parquet"))


# Shards per task of a map over score files: a few MB of scores, one task's start-up.
_SHARDS_PER_SCORE_TASK = 16


def _apply_to_scores(out_url: str, storage_options: dict, shard_ids: list[int], column: str,
                     fn: Callable[[np.ndarray], Any]) -> Any:
    out = OutputDir(out_url, storage_options)
    parts = [read_scores(out, s, [column]) for s in shard_ids]
    values = [p[column].drop_null().to_numpy() for p in parts if p is not None]
    return fn(np.concatenate(values) if values else np.zeros(0, np.float32))


def map_scores(out: OutputDir, storage_options: dict, column: str, retries: int) -> ScoreMap:
    """``over_scores`` for a scoring step's ``learn``: ``fn`` runs in Ray tasks over groups
    of score files, at most two tasks per CPU in flight, and its results are yielded as
    the tasks finish, so the driver never holds the scores."""

    def run(fn: Callable[[np.ndarray], Any]) -> Iterator[Any]:
        import ray

        task = ray.remote(num_cpus=1, max_retries=retries)(_apply_to_scores)
        ids = scored_shards(out)
        groups = [ids[i:i + _SHARDS_PER_SCORE_TASK]
                  for i in range(0, len(ids), _SHARDS_PER_SCORE_TASK)]
        limit = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
        pending: list[Any] = []
        for group in groups:
            if len(pending) >= limit:
                done, pending = ray.wait(pending, num_returns=1)
                yield ray.get(done[0])
            pending.append(task.remote(out.url, storage_options, group, column, fn))
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])

    return run


def read_scores(out: OutputDir, shard_id: int, columns: list[str]) -> pa.Table | None:
    """A shard's score file (the scoring pass's), or None when it has none."""
    name = f"{shard_name(shard_id)}.parquet"
    if not out.exists(SCORES_FOLDER, name):
        return None
    with out.fs.open(out.path(SCORES_FOLDER, name), "rb") as f:
        return pq.read_table(f, columns=columns)


def _cached_embeddings(out: OutputDir, shard_id: int, keys: list[str]) -> pa.Array:
    """The scoring pass's saved embeddings of ``keys`` (null where a row has none)."""
    saved = read_embeddings(out, shard_id)
    at = {k: i for i, k in enumerate(saved[0])} if saved else {}
    vectors = [saved[1][at[k]].tolist() if k in at else None for k in keys]
    return pa.array(vectors, pa.list_(pa.float32()))


def load_rows(batch: pa.Table, out_url: str, storage_options: dict, found: Decisions,
              score: str | None = None, embedding: str | None = None) -> pa.Table:
    """Ray Data map: shard ids in, the rows the steps must process out (with images): ok
    rows less the shard's duplicates, which ``found`` reads for this shard alone. Each
    shard's parquet and tar are read once here. A shard the scoring
    pass scored comes with its cached ``score`` column and, when a step reads it, the
    ``embedding`` column of its saved embeddings: no image is encoded twice."""
    out = OutputDir(out_url, storage_options)
    tables = []
    for shard_id in batch["shard"].to_pylist():
        raw = read_raw(out, shard_id, STEP_INPUT_COLUMNS)
        skip = found.of_shard(shard_id)
        keep = [s == Status.OK and k not in skip for k, s in zip(
            raw["key"].to_pylist(), raw["status"].to_pylist(), strict=True)]
        rows = raw.filter(pa.array(keep, pa.bool_()))
        images = read_raw_images(out, shard_id, set(rows["key"].to_pylist()))
        rows = rows.append_column("image", pa.array(
            [images[k][1] for k in rows["key"].to_pylist()], pa.binary()))
        rows = rows.append_column("shard", pa.array([shard_id] * rows.num_rows, pa.int32()))
        scores = read_scores(out, shard_id, ["key", score]) if score else None
        if scores is not None:
            lookup = dict(zip(scores["key"].to_pylist(), scores[score].to_pylist(),
                              strict=True))
            rows = rows.append_column(score, pa.array(
                [lookup.get(k) for k in rows["key"].to_pylist()], pa.float32()))
            if embedding:
                rows = rows.append_column(embedding, _cached_embeddings(
                    out, shard_id, rows["key"].to_pylist()))
        tables.append(rows)
    return pa.concat_tables(tables, promote_options="permissive")


def _cached_columns(steps: list[type[Step]]) -> tuple[str | None, str | None]:
    """(score, embedding): the scoring step's columns to read back; its embedding only
    where a later step reads it."""
    scorer = scoring_step(steps)
    if scorer is None:
        return None, None
    embedding = scorer.embedding_column
    read = embedding is not None and any(embedding in s.requires for s in steps)
    return scorer.score_column, embedding if read else None


def stream_shards(cfg: PairforgeConfig, out: OutputDir, plans: list[ShardPlan],
                  steps: list[type[Step]], writer: Writer, stats_extra: dict[str, Any],
                  display: StageDisplay | None, drop: tuple[str, ...] = ("image",)) -> None:
    """Run the step chain over the planned shards, handing each full shard to ``writer``;
    ``drop``: the columns the last step drops (the writer re-reads the image)."""
    import ray

    quiet_ray_data()
    write = ray.remote(num_cpus=TASK_CPUS, max_retries=cfg.ray.max_task_retries)(writer)
    by_id = {p.shard_id: p for p in plans}
    buffers: dict[int, list[pa.Table]] = defaultdict(list)
    received: Counter = Counter()
    counts: Counter = Counter()
    writes: list = []
    already_done = (display.shards_done if display else 0)
    through: Counter = Counter()  # rows each step has passed (its seconds column is set)

    def finish(shard_id: int) -> None:
        parts = buffers.pop(shard_id, [])
        results = (pa.concat_tables(parts, promote_options="permissive") if parts
                   else pa.table({"key": pa.array([], pa.string())}))
        writes.append(write.remote(cfg, by_id[shard_id], results, stats_extra, steps))

    for plan in plans:
        if plan.to_process == 0:
            finish(plan.shard_id)
    todo = [p for p in plans if p.to_process]
    if todo:
        # each reading task reads its own shard's duplicates, the driver none
        ds = ray.data.from_items([{"shard": p.shard_id} for p in todo],
                                 override_num_blocks=len(todo))
        ds = ds.map_batches(load_rows, batch_size=1, batch_format="pyarrow", num_cpus=TASK_CPUS,
                            fn_args=(out.url, cfg.output.storage_options, todo[0].decisions,
                                     *_cached_columns(steps)))
        actor_cpus = fit_actor_cpus(steps, cfg, ray.cluster_resources().get("CPU", 1.0))
        ds = add_steps(ds, steps, cfg, actor_cpus, drop_after=drop)
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for step in steps:
                column = SECONDS_PREFIX + step.name
                if column in batch.column_names:
                    through[step.name] += batch.num_rows - batch[column].null_count
            for shard_id in pc.unique(batch["shard"]).to_pylist():
                part = batch.filter(pc.equal(batch["shard"], shard_id)).drop_columns(["shard"])
                buffers[shard_id].append(part)
                received[shard_id] += part.num_rows
                counts.update(part["status"].to_pylist())
                if received[shard_id] == by_id[shard_id].to_process:
                    finish(shard_id)
            if display:
                display.update(dict(counts), already_done + len(writes),
                               {s.name: through[s.name] for s in steps})
    ray.get(writes)
