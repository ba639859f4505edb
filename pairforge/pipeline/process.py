"""Stage 3: raw shards through the step chain on Ray Data, into training shards.

Rows to process (ok after download and dedup) stream from the raw shards through the
steps with Ray Data's backpressure; model steps are actor pools. Only small result
columns come back to the driver (never images), which hands each shard, once all its rows
are in, to a writer task that re-reads the images from the raw tar. A shard is complete
when its stats file exists; a rerun skips complete shards.

CLIP's ``top_fraction`` mode needs the score distribution over the whole dataset first:
a first pass scores every shard into ``OUT/clip/NNNNN.parquet`` (complete per shard), the
threshold is the quantile of those scores, and the second pass reads the cached scores
instead of running the model again.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.filters.basic import BasicFilterStep
from pairforge.filters.clip import ClipStep
from pairforge.pipeline.preflight import check_model_sources
from pairforge.pipeline.progress import StageDisplay
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.steps import TASK_CPUS, Step, add_steps, fit_actor_cpus
from pairforge.recaption import cache as recaption_cache
from pairforge.recaption.registry import start_registry
from pairforge.recaption.step import RecaptionStep, recaption_stats, registry_name
from pairforge.records import Status
from pairforge.shards.manifest import build_manifest, write_dataset_files
from pairforge.shards.raw import completed_shards, shard_name
from pairforge.shards.storage import (
    DEDUP_FOLDER,
    EMBEDDINGS_FOLDER,
    RAW_FOLDER,
    SCORES_FOLDER,
    SHARDS_FOLDER,
    OutputDir,
)
from pairforge.shards.training import (
    final_rows,
    read_raw_images,
    write_embeddings,
    write_training_shard,
)
from pairforge.tokenizers.step import TokenizeStep

# What the steps see of a raw row; the writer gets the rest back from the raw parquet.
# Step outputs written to their own per-shard files rather than the parquet.
PER_SHARD_FILES = {"clip_embedding"}
STEP_INPUT_COLUMNS = ["key", "caption", "status", "error", "image_format", "width", "height",
                      "original_width", "original_height", "pixel_hash", "phash"]
SAMPLE_FIELDS = ["key", "url", "caption", "width", "height", "original_width",
                 "original_height", "image_format", "sha256", "pixel_hash", "phash",
                 "clip_score", "recaption", "recaption_flags", "caption_source"]
TOKEN_FIELDS = ["task", "n_image_tokens", "token_grid", "n_caption_tokens"]


def enabled_steps(cfg: PairforgeConfig) -> list[type[Step]]:
    """The step chain, in order. A new step adds one line here and a config section."""
    chain: list[tuple[bool, type[Step]]] = [
        (cfg.process.basic.enabled, BasicFilterStep),
        (cfg.process.clip.enabled, ClipStep),
        (cfg.process.recaption.enabled, RecaptionStep),
        (cfg.process.tokenize.enabled, TokenizeStep),
    ]
    return [step for enabled, step in chain if enabled]


@dataclass(frozen=True)
class ShardPlan:
    shard_id: int
    to_process: int  # rows the steps must return before the shard can be written
    duplicates: dict[str, tuple[str, str]]  # key -> (status, kept key)


def read_duplicates(out: OutputDir, cfg: PairforgeConfig) -> dict[str, tuple[str, str]]:
    if not cfg.dedup.enabled:
        return {}
    if not out.exists(DEDUP_FOLDER, "dedup_stats.json"):
        raise RuntimeError("dedup is enabled but OUT/dedup is not complete: run "
                           "`pairforge dedup` (or `build`) first, or set dedup.enabled=false")
    with out.fs.open(out.path(DEDUP_FOLDER, "duplicates.parquet"), "rb") as f:
        table = pq.read_table(f, columns=["key", "kind", "kept_key"])
    return {k: (kind, kept) for k, kind, kept in zip(
        table["key"].to_pylist(), table["kind"].to_pylist(), table["kept_key"].to_pylist(),
        strict=True)}


def plan_shards(out: OutputDir, cfg: PairforgeConfig, folder: str) -> list[ShardPlan]:
    """Complete raw shards not yet complete in ``folder``, with their row counts."""
    duplicates = read_duplicates(out, cfg)
    pending = sorted(completed_shards(out, RAW_FOLDER) - completed_shards(out, folder))
    plans = []
    for shard_id in pending:
        raw = _read_raw(out, shard_id, ["key", "status"])
        keys = [k for k, s in zip(raw["key"].to_pylist(), raw["status"].to_pylist(), strict=True)
                if s == Status.OK and k not in duplicates]
        dups = {k: duplicates[k] for k in raw["key"].to_pylist() if k in duplicates}
        plans.append(ShardPlan(shard_id, len(keys), dups))
    return plans


def _read_raw(out: OutputDir, shard_id: int, columns: list[str] | None = None) -> pa.Table:
    with out.fs.open(out.path(RAW_FOLDER, f"{shard_name(shard_id)}.parquet"), "rb") as f:
        return pq.read_table(f, columns=columns)


def _cached_scores(out: OutputDir, shard_id: int) -> pa.Table | None:
    if not out.exists(SCORES_FOLDER, f"{shard_name(shard_id)}.parquet"):
        return None
    with out.fs.open(out.path(SCORES_FOLDER, f"{shard_name(shard_id)}.parquet"), "rb") as f:
        return pq.read_table(f, columns=["key", "clip_score"])


def load_rows(batch: pa.Table, out_url: str, storage_options: dict,
              duplicates: dict[int, set[str]]) -> pa.Table:
    """Ray Data map: shard ids in, the rows the steps must process out (with images)."""
    out = OutputDir(out_url, storage_options)
    tables = []
    for shard_id in batch["shard"].to_pylist():
        raw = _read_raw(out, shard_id, STEP_INPUT_COLUMNS)
        keep = [s == Status.OK and k not in duplicates.get(shard_id, ()) for k, s in zip(
            raw["key"].to_pylist(), raw["status"].to_pylist(), strict=True)]
        rows = raw.filter(pa.array(keep, pa.bool_()))
        images = read_raw_images(out, shard_id, set(rows["key"].to_pylist()))
        rows = rows.append_column("image", pa.array(
            [images[k][1] for k in rows["key"].to_pylist()], pa.binary()))
        rows = rows.append_column("shard", pa.array([shard_id] * rows.num_rows, pa.int32()))
        scores = _cached_scores(out, shard_id)
        if scores is not None:
            lookup = dict(zip(scores["key"].to_pylist(), scores["clip_score"].to_pylist(),
                              strict=True))
            rows = rows.append_column("clip_score", pa.array(
                [lookup.get(k) for k in rows["key"].to_pylist()], pa.float32()))
        tables.append(rows)
    return pa.concat_tables(tables, promote_options="permissive")


def output_fields(steps: list[type[Step]]) -> list[pa.Field]:
    """Columns stage 3 adds to the raw record, the same in every shard."""
    fields = [pa.field("duplicate_of", pa.string())]
    for step in steps:
        fields += [pa.field(n, t) for n, t in step.provides.items() if n not in PER_SHARD_FILES]
    if "caption_source" not in {f.name for f in fields}:
        fields.append(pa.field("caption_source", pa.string()))
    if any("n_image_tokens" in step.provides for step in steps):
        fields.append(pa.field("task", pa.string()))
    return fields


def _write_task(cfg: PairforgeConfig, plan: ShardPlan, results: pa.Table,
                stats_extra: dict[str, Any], fields: list[pa.Field]) -> dict[str, Any]:
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    raw = _read_raw(out, plan.shard_id)
    rows = final_rows(raw, plan.duplicates, results)
    for row in rows:
        if row["status"] == Status.OK and "caption_source" not in row:
            row["caption_source"] = "original" if row["caption"] else None
    stats = dict(stats_extra)
    if cfg.process.recaption.enabled:
        # cached before the stats file: a complete shard's captions are always in the cache
        if cfg.process.recaption.cache.enabled:
            recaption_cache.write_part(cfg, plan.shard_id, rows)
        stats["recaption"] = recaption_stats(rows)
    schema = pa.schema([*raw.schema, *fields])
    meta = SAMPLE_FIELDS + (TOKEN_FIELDS if "n_image_tokens" in schema.names else [])
    return write_training_shard(out, plan.shard_id, rows, schema, meta, stats,
                                cfg.process.tasks)


def _write_scores_task(cfg: PairforgeConfig, plan: ShardPlan, results: pa.Table,
                       stats_extra: dict[str, Any], fields: list[pa.Field]) -> dict[str, Any]:
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(SCORES_FOLDER)
    table = results.select(["key", "status", "clip_score"])
    if "clip_embedding" in results.column_names:
        write_embeddings(out, plan.shard_id, table["key"].to_pylist(),
                         results["clip_embedding"].to_pylist())
    # The score file is the completion marker of this pass, so it is written last.
    with out.open_atomic(SCORES_FOLDER, f"{shard_name(plan.shard_id)}.parquet") as f:
        pq.write_table(table, f)
    return {"shard": plan.shard_id, "count": table.num_rows}


def _stream(cfg: PairforgeConfig, out: OutputDir, plans: list[ShardPlan], steps: list[type[Step]],
            writer: Callable, stats_extra: dict[str, Any], display: StageDisplay | None) -> None:
    """Run the step chain over the planned shards, handing each full shard to ``writer``."""
    import ray

    write = ray.remote(num_cpus=TASK_CPUS, max_retries=cfg.ray.max_task_retries)(writer)
    by_id = {p.shard_id: p for p in plans}
    buffers: dict[int, list[pa.Table]] = defaultdict(list)
    received: Counter = Counter()
    counts: Counter = Counter()
    writes: list = []
    already_done = (display.shards_done if display else 0)

    def finish(shard_id: int) -> None:
        parts = buffers.pop(shard_id, [])
        results = (pa.concat_tables(parts, promote_options="permissive") if parts
                   else pa.table({"key": pa.array([], pa.string())}))
        writes.append(write.remote(cfg, by_id[shard_id], results, stats_extra,
                                   output_fields(steps)))

    for plan in plans:
        if plan.to_process == 0:
            finish(plan.shard_id)
    todo = [p for p in plans if p.to_process]
    if todo:
        dups = {p.shard_id: set(p.duplicates) for p in todo}
        ds = ray.data.from_items([{"shard": p.shard_id} for p in todo],
                                 override_num_blocks=len(todo))
        ds = ds.map_batches(load_rows, batch_size=1, batch_format="pyarrow", num_cpus=TASK_CPUS,
                            fn_args=(out.url, cfg.output.storage_options, dups))
        actor_cpus = fit_actor_cpus(steps, cfg, ray.cluster_resources().get("CPU", 1.0))
        ds = add_steps(ds, steps, cfg, actor_cpus, drop_after=("image",))
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for shard_id in pc.unique(batch["shard"]).to_pylist():
                part = batch.filter(pc.equal(batch["shard"], shard_id)).drop_columns(["shard"])
                buffers[shard_id].append(part)
                received[shard_id] += part.num_rows
                counts.update(part["status"].to_pylist())
                if received[shard_id] == by_id[shard_id].to_process:
                    finish(shard_id)
            if display:
                display.update(dict(counts), already_done + len(writes))
    ray.get(writes)


def _score_threshold(out: OutputDir, cfg: PairforgeConfig) -> float:
    """The score that keeps ``top_fraction`` of all scored rows (DataComp's top 30%)."""
    scores = []
    for name in out.glob(f"{SCORES_FOLDER}/*.parquet"):
        with out.fs.open(out.path(SCORES_FOLDER, name), "rb") as f:
            column = pq.read_table(f, columns=["clip_score"])["clip_score"]
        scores.append(column.drop_null().to_numpy())
    values = np.concatenate(scores) if scores else np.array([], np.float32)
    if not len(values):
        return float("-inf")
    # Keep the k highest scores; ties at the boundary are all kept.
    k = max(1, int(round(cfg.process.clip.top_fraction * len(values))))
    return float(np.sort(values)[::-1][k - 1])


def vocab_layout(cfg: PairforgeConfig) -> dict[str, Any] | None:
    """The vocabulary of the tokenize step (DESIGN.md section 6), for the manifest."""
    tok = cfg.process.tokenize
    if not tok.enabled:
        return None
    from pairforge.tokenizers.registry import load_image_tokenizer, load_text_tokenizer
    from pairforge.tokenizers.vocab import VocabLayout

    image = load_image_tokenizer({**tok.image.model_dump(), "device": "cpu"})
    text = load_text_tokenizer(tok.text.model_dump())
    return VocabLayout.from_tokenizers(text, image).to_manifest()


def run_process(cfg: PairforgeConfig, show_progress: bool = True) -> dict[str, Any]:
    """Stage 3 over every complete raw shard that has no complete output shard yet."""
    check_model_sources(cfg)
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(SHARDS_FOLDER)
    out.remove_temporaries(SHARDS_FOLDER)
    init_ray(cfg.ray)
    steps = enabled_steps(cfg)
    started = time.time()
    clip = cfg.process.clip
    stats_extra: dict[str, Any] = {"stage": "process", "steps": [s.name for s in steps]}
    if clip.enabled:
        stats_extra["clip_model"] = f"{clip.model}/{clip.pretrained}"
    if clip.enabled and clip.mode == "top_fraction":
        scoring = cfg.model_copy(deep=True)
        scoring.process.clip.mode = "score_only"
        score_plans = plan_shards(out, cfg, SCORES_FOLDER)
        # the threshold needs the scores only: later (costlier) steps wait for pass two
        score_steps = steps[:steps.index(ClipStep) + 1]
        _stream(scoring, out, score_plans, score_steps, _write_scores_task, {}, None)
        threshold = _score_threshold(out, cfg)
        cfg = cfg.model_copy(deep=True)
        cfg.process.clip.mode, cfg.process.clip.threshold = "threshold", threshold
        stats_extra["clip_threshold"] = threshold
        stats_extra["clip_top_fraction"] = clip.top_fraction
    elif clip.enabled and clip.mode == "threshold":
        stats_extra["clip_threshold"] = clip.threshold
    plans = plan_shards(out, cfg, SHARDS_FOLDER)
    all_ids = sorted(completed_shards(out, RAW_FOLDER))
    rows = sum(p.to_process for p in plans)
    display = (StageDisplay("process", len(all_ids), rows, len(all_ids) - len(plans))
               if show_progress else None)
    registry = start_registry(registry_name(cfg)) if cfg.process.recaption.enabled else None
    try:
        if display:
            with display:
                _stream(cfg, out, plans, steps, _write_task, stats_extra, display)
        else:
            _stream(cfg, out, plans, steps, _write_task, stats_extra, None)
    finally:
        if registry is not None:
            import ray

            ray.kill(registry)
    # a writer attempt lost with its node leaves its temporary file; its retry wrote the shard
    for folder in (SHARDS_FOLDER, SCORES_FOLDER, EMBEDDINGS_FOLDER):
        out.remove_temporaries(folder)
    seconds = time.time() - started
    from pairforge.pipeline.runner import summarise

    write_dataset_files(out, build_manifest(out, cfg, vocab_layout(cfg)))
    summary = summarise(out, SHARDS_FOLDER, all_ids)
    return {**summary, "shards_skipped": len(all_ids) - len(plans), "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds, 1) if rows else None, **stats_extra}
