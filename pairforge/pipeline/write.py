"""Stage 3, writing: one task per finished shard joins the raw rows, the dedup decisions
and the steps' results (the shard's fragment files, pipeline/stream.py: images included,
so the raw tar is not read again), and writes the training shard (or, in a scoring pass,
the score file). The stats file is written last: it marks the shard complete; then the
fragments go.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import PairforgeConfig
from pairforge.pipeline.contract import step_config
from pairforge.pipeline.plan import ShardPlan
from pairforge.pipeline.settings import SCORES_DIGEST_KEY, settings_digest, settings_record
from pairforge.pipeline.stream import read_fragments, read_raw, remove_fragments
from pairforge.records import (
    PER_SHARD_STATS,
    SAMPLE_FIELDS,
    TOKEN_FIELDS,
    classifier_columns,
    process_fields,
)
from pairforge.shards.raw import shard_name
from pairforge.shards.storage import SCORES_FOLDER, OutputDir
from pairforge.shards.training import final_rows, write_embeddings, write_training_shard
from pairforge.stage import SECONDS_PREFIX, ScoringStep, Step, scoring_step, step_stats


def provided_columns(steps: list[type[Step]]) -> dict[str, pa.DataType]:
    """The columns the chain adds, in chain order, with their types."""
    return {name: dtype for step in steps for name, dtype in step.provides.items()}


def classifier_fields(cfg: PairforgeConfig) -> list[str]:
    """The classifiers' score columns, which every kept sample's json carries too."""
    return list(classifier_columns(*(c.name for c in cfg.process.classifiers)))


def _split_images(results: pa.Table) -> tuple[pa.Table, dict[str, tuple[str, Any]]]:
    """The results without their image column, and key -> (extension, bytes) from it."""
    if "image" not in results.column_names:
        return results, {}
    images = dict(zip(results["key"].to_pylist(),
                      zip(results["image_format"].to_pylist(), results["image"].to_pylist(),
                          strict=True), strict=True))
    return results.drop_columns(["image"]), images


def write_shard_task(cfg: PairforgeConfig, plan: ShardPlan, fragments: list[str],
                     stats_extra: dict[str, Any], steps: list[type[Step]]) -> dict[str, Any]:
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    raw = read_raw(out, plan.shard_id)
    results, images = _split_images(read_fragments(out, fragments))
    rows = final_rows(raw, plan.duplicates(), results)
    stats = {**stats_extra, "settings": settings_record(plan.settings),
             "step_stats": step_stats(steps, plan.to_process, rows)}
    for row in rows:
        for step in steps:
            row.pop(SECONDS_PREFIX + step.name, None)
        for column, key in PER_SHARD_STATS.items():
            value = row.pop(column, None)
            if value is not None:
                stats[key] = json.loads(value)
    for step in steps:
        finished = step.finish_shard(step_config(cfg), plan.shard_id, rows)
        if finished is not None:
            stats[step.name] = finished
    schema = pa.schema([*raw.schema, *process_fields(provided_columns(steps))])
    meta = (SAMPLE_FIELDS + classifier_fields(cfg)
            + (TOKEN_FIELDS if "n_image_tokens" in schema.names else []))
    saves = any(issubclass(s, ScoringStep) and s.saves_embeddings(step_config(cfg))
                for s in steps)
    written = write_training_shard(out, plan.shard_id, rows, schema, meta, stats,
                                   cfg.process.tasks, saves, images if fragments else None)
    remove_fragments(out, fragments)
    return written


def write_scores_task(cfg: PairforgeConfig, plan: ShardPlan, fragments: list[str],
                      stats_extra: dict[str, Any], steps: list[type[Step]]) -> dict[str, Any]:
    """A scoring pass: the scoring step's scores (and embeddings) of a shard, no training
    shard."""
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(SCORES_FOLDER)
    results = read_fragments(out, fragments)
    scorer = scoring_step(steps)
    table = results.select(["key", "status", scorer.score_column])
    if scorer.embedding_column in results.column_names:
        write_embeddings(out, plan.shard_id, table["key"].to_pylist(),
                         results[scorer.embedding_column].to_pylist())
    # The score file is the completion marker of this pass, so it is written last; it names
    # the settings it was made under (a rerun under others drops it: drop_stale_scores).
    table = table.replace_schema_metadata(
        {SCORES_DIGEST_KEY: settings_digest(plan.settings).encode()})
    with out.open_atomic(SCORES_FOLDER, f"{shard_name(plan.shard_id)}.parquet") as f:
        pq.write_table(table, f)
    remove_fragments(out, fragments)
    return {"shard": plan.shard_id, "count": table.num_rows}
