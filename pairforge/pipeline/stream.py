"""Stage 3, streaming: raw rows through the step chain on Ray Data, written by workers.

Rows to process (ok after download and dedup) stream from the raw shards through the
steps with Ray Data's backpressure; model steps are actor pools. No row reaches the
driver: the chain's last tasks write each shard's rows of their block, images included,
as a fragment file (``OUT/process-work/NNNNN/FIRSTKEY.parquet``) and return one small
record per fragment (its shard, rows, statuses, the rows each step passed). The driver
adds those up; once a shard's fragments hold all its rows, a writer task joins them
with the raw parquet and writes the shard, then deletes them. Each raw tar is read once,
by the reading task; the driver holds counts and the names of the fragments of the
shards in flight. A shard a scoring pass scored comes with the scoring step's cached
columns (pairforge/stage.py's ``ScoringStep``).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.pipeline import placement
from pairforge.pipeline.executors import data_items, data_tasks
from pairforge.pipeline.placement import TASK_CPUS, add_steps, fit_actor_cpus
from pairforge.pipeline.plan import Decisions, ShardPlan
from pairforge.pipeline.progress import StageDisplay
from pairforge.pipeline.ray_runtime import on_driver_node, quiet_ray_data
from pairforge.records import RAW_COLUMNS, STEP_INPUT_COLUMNS, Status
from pairforge.shards.raw import shard_name
from pairforge.shards.storage import FRAGMENTS_FOLDER, RAW_FOLDER, SCORES_FOLDER, OutputDir
from pairforge.shards.training import read_embeddings, read_raw_images
from pairforge.stage import SECONDS_PREFIX, ScoreMap, Step, scoring_step

# (config, plan, the shard's fragment files, stats for every shard, the step chain)
Writer = Callable[[PairforgeConfig, ShardPlan, list[str], dict[str, Any], list[type[Step]]],
                  dict[str, Any]]
# what the chain's last tasks return: one record per fragment file, never a row
_FRAGMENT_RECORD = pa.schema([("shard", pa.int32()), ("fragment", pa.string()),
                              ("rows", pa.int64()), ("statuses", pa.string()),
                              ("through", pa.string())])


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


def write_fragments(batch: pa.Table, out_url: str, storage_options: dict,
                    step_names: list[str]) -> pa.Table:
    """Ray Data map, after the chain: each shard's rows of this block, as they are (results
    and images), into one fragment file; one record per fragment out. The file is named
    by the fragment's first key, so a retried task writes the same file again."""
    out = OutputDir(out_url, storage_options)
    records = []
    for shard_id in pc.unique(batch["shard"]).to_pylist():
        part = batch.filter(pc.equal(batch["shard"], shard_id)).drop_columns(["shard"])
        folder = shard_name(shard_id)
        name = f"{part['key'][0].as_py()}.parquet"
        out.makedirs(FRAGMENTS_FOLDER, folder)
        with out.open_atomic(FRAGMENTS_FOLDER, folder, name) as f:
            pq.write_table(part, f)
        through = {s: part.num_rows - part[SECONDS_PREFIX + s].null_count
                   for s in step_names if SECONDS_PREFIX + s in part.column_names}
        records.append({"shard": shard_id, "fragment": f"{folder}/{name}",
                        "rows": part.num_rows,
                        "statuses": json.dumps(Counter(part["status"].to_pylist())),
                        "through": json.dumps(through)})
    return pa.Table.from_pylist(records, schema=_FRAGMENT_RECORD)


def read_fragments(out: OutputDir, fragments: list[str]) -> pa.Table:
    """A shard's fragment files as one table (no rows: an empty table with a key)."""
    tables = []
    for fragment in fragments:
        with out.fs.open(out.path(FRAGMENTS_FOLDER, fragment), "rb") as f:
            tables.append(pq.read_table(f))
    if not tables:
        return pa.table({"key": pa.array([], pa.string())})
    return pa.concat_tables(tables, promote_options="permissive")


def remove_fragments(out: OutputDir, fragments: list[str]) -> None:
    for fragment in fragments:
        out.remove(FRAGMENTS_FOLDER, fragment)


def remove_fragment_folder(out: OutputDir) -> None:
    """Fragments a stopped run left: their shards have no stats file and are redone whole."""
    if out.exists(FRAGMENTS_FOLDER):
        out.fs.rm(out.path(FRAGMENTS_FOLDER), recursive=True)


# How often the coordinator task hands the driver a snapshot of its progress: the driver's
# work is per snapshot, never per row, block or fragment. A snapshot costs the driver ~1.9
# ms of CPU (its generator item through Ray); at 0.5 s they were half of its CPU in a
# 10^5-row run (bench/stage3.py: 0.63 -> 0.30 CPU-s at 2 s, the rest Ray's idle driver).
SNAPSHOT_S = 2.0


class _Progress:
    """What the coordinator knows of the shards in flight: their fragments and row counts."""

    def __init__(self, done: int) -> None:
        self.fragments: dict[int, list[str]] = defaultdict(list)
        self.received: Counter = Counter()
        self.statuses: Counter = Counter()
        self.through: Counter = Counter()  # rows each step has passed
        self.done = done
        self.sent = 0.0  # when the last snapshot left

    def add(self, record: dict[str, Any]) -> int:
        """One fragment's record; returns its shard's rows received so far."""
        shard_id = record["shard"]
        self.fragments[shard_id].append(record["fragment"])
        self.received[shard_id] += record["rows"]
        self.statuses.update(json.loads(record["statuses"]))
        self.through.update(json.loads(record["through"]))
        return self.received[shard_id]

    def finished(self, shard_id: int) -> list[str]:
        self.done += 1
        self.received.pop(shard_id, None)
        return self.fragments.pop(shard_id, [])

    def snapshot(self, force: bool = False) -> dict[str, Any] | None:
        """The counts for the display, at most every ``SNAPSHOT_S`` unless ``force``."""
        if not force and time.monotonic() - self.sent < SNAPSHOT_S:
            return None
        self.sent = time.monotonic()
        return {"statuses": dict(self.statuses), "done": self.done,
                "through": dict(self.through)}


def stream_shards(cfg: PairforgeConfig, out: OutputDir, plans: list[ShardPlan],
                  steps: list[type[Step]], writer: Writer, stats_extra: dict[str, Any],
                  display: StageDisplay | None, drop: tuple[str, ...] = ("image",)) -> float:
    """Run the step chain over the planned shards, handing each full shard's fragments to
    ``writer``; ``drop``: the columns the last step drops (the image, where the writer
    does not write it). The chain runs from a coordinator task on the driver's node
    (``_coordinate``): Ray Data's streaming executor spends CPU on every block of every
    operator wherever the dataset is iterated, so the driver only shows snapshots.
    Returns the coordinator's CPU seconds."""
    done = display.shards_done if display else 0
    cpu_s = 0.0
    chain = _ChainSettings(drop, placement.BLOCK_ROWS, _driver_data_context())
    for snapshot in on_driver_node(_coordinate, cfg, out, plans, steps, writer,
                                   stats_extra, chain, done):
        if display:
            display.update(snapshot["statuses"], snapshot["done"],
                           {s.name: snapshot["through"].get(s.name, 0) for s in steps})
        cpu_s = snapshot.get("cpu_s", cpu_s)
    return cpu_s


@dataclass(frozen=True)
class _ChainSettings:
    """What the coordinator's chain takes from the driver's process: the columns the last
    step drops, the rows per block, and the driver's Ray Data settings where it made any
    (a program that sets ``DataContext`` before it runs a stage expects them to hold)."""

    drop: tuple[str, ...]
    block_rows: int
    data_context: dict[str, Any] | None


def _driver_data_context() -> dict[str, Any] | None:
    data = sys.modules.get("ray.data")  # not imported: nothing was set, and none is needed
    if data is None:
        return None
    context = data.DataContext.get_current()
    return {f.name: getattr(context, f.name) for f in fields(context)}


def _coordinate(cfg: PairforgeConfig, out: OutputDir, plans: list[ShardPlan],
                steps: list[type[Step]], writer: Writer, stats_extra: dict[str, Any],
                chain: _ChainSettings, done: int) -> Iterator[dict[str, Any]]:
    """The coordinator: the chain's fragment records in, writer tasks out, snapshots of
    the counts yielded to the driver; the last one carries this task's CPU seconds."""
    import ray
    from ray.data import DataContext

    started = time.process_time()
    context = DataContext.get_current()
    for name, value in (chain.data_context or {}).items():
        setattr(context, name, value)
    quiet_ray_data()
    write = ray.remote(num_cpus=TASK_CPUS, max_retries=cfg.ray.max_task_retries)(writer)
    by_id = {p.shard_id: p for p in plans}
    progress = _Progress(done)
    writes = [write.remote(cfg, p, [], stats_extra, steps) for p in plans if not p.to_process]
    progress.done += len(writes)
    todo = [p for p in plans if p.to_process]
    if todo:
        for batch in _chain(cfg, out, todo, steps, chain).iter_batches(
                batch_format="pyarrow", batch_size=None):
            for record in batch.to_pylist():
                shard_id = record["shard"]
                if progress.add(record) == by_id[shard_id].to_process:
                    writes.append(write.remote(cfg, by_id[shard_id],
                                               progress.finished(shard_id), stats_extra, steps))
            writes = _running(writes)
            snapshot = progress.snapshot()
            if snapshot:
                yield snapshot
    ray.get(writes)
    yield {**progress.snapshot(force=True), "cpu_s": time.process_time() - started}


def _running(writes: list[Any]) -> list[Any]:
    """The writer tasks still running: the coordinator holds the shards in flight, not one
    reference per shard of the run, and a failed writer raises here, not at the end."""
    import ray

    if not writes:
        return writes
    done, running = ray.wait(writes, num_returns=len(writes), timeout=0)
    ray.get(done)
    return running


def _chain(cfg: PairforgeConfig, out: OutputDir, todo: list[ShardPlan],
           steps: list[type[Step]], chain: _ChainSettings) -> Any:
    """The Ray Data pipeline: read each shard, the steps, the fragment writers."""
    import ray

    # each reading task reads its own shard's duplicates, the driver none
    ds = data_items([{"shard": p.shard_id} for p in todo])
    ds = data_tasks(ds, load_rows, TASK_CPUS, batch_size=1,
                    fn_args=(out.url, cfg.output.storage_options, todo[0].decisions,
                             *_cached_columns(steps)))
    actor_cpus = fit_actor_cpus(steps, cfg, ray.cluster_resources().get("CPU", 1.0))
    ds = add_steps(ds, steps, cfg, actor_cpus, drop_after=chain.drop,
                   block_rows=chain.block_rows)
    return data_tasks(ds, write_fragments, TASK_CPUS,
                      fn_args=(out.url, cfg.output.storage_options, [s.name for s in steps]))
