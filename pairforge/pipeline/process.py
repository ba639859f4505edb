"""Stage 3 (process): plan the shards, stream them through the step chain, write them.

``run_process`` is the stage's one entry. Planning (pipeline/plan.py) reads stats files,
streaming (pipeline/stream.py) places the steps on Ray Data, and each finished shard goes
to a writer task (pipeline/write.py). A shard is complete when its stats file exists; a
rerun skips complete shards.

CLIP's ``top_fraction`` mode runs the chain up to CLIP once over every shard to learn the
threshold (the scores are cached per shard in ``OUT/clip``), then the whole chain with
that threshold, reading the cached scores instead of running CLIP again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.filters.basic import BasicFilterStep
from pairforge.filters.classify import classifier_steps
from pairforge.filters.clip import ClipStep
from pairforge.pipeline.entry import RunOptions, summarise
from pairforge.pipeline.plan import plan_shards, score_threshold
from pairforge.pipeline.preflight import check_model_sources
from pairforge.pipeline.progress import StageDisplay, say
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.runlog import log_shard, run_log
from pairforge.pipeline.semantic_stage import run_semantic_dedup
from pairforge.pipeline.settings import check_settings
from pairforge.pipeline.stream import stream_shards
from pairforge.pipeline.write import write_scores_task, write_shard_task
from pairforge.recaption.choice import TrainingCaptionStep
from pairforge.recaption.step import RecaptionStep
from pairforge.shards.manifest import build_manifest, write_dataset_files
from pairforge.shards.raw import completed_shards, stats_name
from pairforge.shards.storage import (
    EMBEDDINGS_FOLDER,
    RAW_FOLDER,
    SCORES_FOLDER,
    SHARDS_FOLDER,
    OutputDir,
)
from pairforge.stage import ModelStep, Step
from pairforge.tokenizers.step import TokenizeStep


def enabled_steps(cfg: PairforgeConfig) -> list[type[Step]]:
    """The step chain, in order. A new step adds one line here and a config section."""
    chain: list[tuple[bool, type[Step]]] = [
        (cfg.process.basic.enabled, BasicFilterStep),
        (cfg.process.clip.enabled, ClipStep),
        # after the cheap filters and CLIP (a clip-head reads its embedding), before the
        # recaption step, so dropped rows cost no generation
        *((True, step) for step in classifier_steps(cfg)),
        (cfg.process.recaption.enabled, RecaptionStep),
        (True, TrainingCaptionStep),
        (cfg.process.tokenize.enabled, TokenizeStep),
    ]
    return [step for enabled, step in chain if enabled]


def _clip_stats(cfg: PairforgeConfig) -> dict[str, Any]:
    clip = cfg.process.clip
    if not clip.enabled:
        return {}
    stats: dict[str, Any] = {"clip_model": f"{clip.model}/{clip.pretrained}"}
    if clip.mode == "threshold":
        stats["clip_threshold"] = clip.threshold
    return stats


def _learn_clip_threshold(cfg: PairforgeConfig, out: OutputDir,
                          steps: list[type[Step]]) -> PairforgeConfig:
    """The scoring pass of ``top_fraction`` mode; returns the config with the threshold that
    keeps that fraction of all scores, for the second pass."""
    scoring = cfg.model_copy(deep=True)
    scoring.process.clip.mode = "score_only"
    # semantic dedup reads the embeddings of this pass (pipeline/semantic_stage.py), and
    # clip-head classifiers read them in pass two (pipeline/stream.py), so no image is
    # encoded twice
    scoring.process.clip.save_embeddings |= (cfg.dedup.semantic.enabled
                                             or cfg.process.uses_clip_embedding())
    scoring.process.classifiers = []  # they run in pass two
    # the threshold needs the scores only: later (costlier) steps wait for pass two
    score_steps = steps[:steps.index(ClipStep) + 1]
    stream_shards(scoring, out, plan_shards(out, cfg, SCORES_FOLDER), score_steps,
                  write_scores_task, {}, None)
    resolved = cfg.model_copy(deep=True)
    resolved.process.clip.mode = "threshold"
    resolved.process.clip.threshold = score_threshold(out, cfg.process.clip.top_fraction)
    return resolved


def run_process(cfg: PairforgeConfig, run: RunOptions) -> dict[str, Any]:
    """Stage 3 over every complete raw shard that has no complete output shard made under
    these settings (``run.force``: redo the shards made under others; else they stop it)."""
    check_model_sources(cfg)
    check_settings(cfg, ("process",), run)
    with run_log(cfg, "process") as log:
        return {**_process(cfg, run.show_progress, log), "log": log}


def _step_line(step: type[Step], cfg: PairforgeConfig) -> str:
    """A step as the start-up line names it: the model and the actors that load it."""
    if not issubclass(step, ModelStep):
        return step.name
    models = {"clip": cfg.process.clip.model, "recaption": cfg.process.recaption.model,
              "tokenize": (cfg.process.tokenize.image.path_or_id
                           if cfg.process.tokenize.image else None)}
    model = models.get(step.name)
    size = step.pool_config(cfg).pool_size
    return f"{step.name} ({model + ' on ' if model else ''}{size} actor{'s' * (size != 1)})"


def _process(cfg: PairforgeConfig, show_progress: bool, log: str) -> dict[str, Any]:
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(SHARDS_FOLDER)
    out.remove_temporaries(SHARDS_FOLDER)
    say("process: starting Ray…")
    init_ray(cfg.ray)
    steps = enabled_steps(cfg)
    say("process: steps " + ", ".join(_step_line(s, cfg) for s in steps)
        + "; each actor loads its model before the first batch…")
    started = time.time()
    stats_extra: dict[str, Any] = {"stage": "process", "steps": [s.name for s in steps],
                                   **_clip_stats(cfg)}
    if cfg.process.clip.enabled and cfg.process.clip.mode == "top_fraction":
        cfg = _learn_clip_threshold(cfg, out, steps)
        stats_extra["clip_threshold"] = cfg.process.clip.threshold
        stats_extra["clip_top_fraction"] = cfg.process.clip.top_fraction
    if cfg.dedup.semantic.enabled:
        semantic = run_semantic_dedup(cfg, out, steps)
        stats_extra["semantic_dedup"] = {k: v for k, v in semantic.items()
                                         if k not in ("seconds", "inputs_digest", "stage")}
    plans = plan_shards(out, cfg, SHARDS_FOLDER)
    all_ids = sorted(completed_shards(out, RAW_FOLDER))
    rows = sum(p.to_process for p in plans)
    display = StageDisplay("process", len(all_ids), rows, len(all_ids) - len(plans),
                           live=show_progress)
    with contextlib.ExitStack() as scope:
        for step in steps:
            scope.enter_context(step.build_scope(cfg))
        with display:
            stream_shards(cfg, out, plans, steps, write_shard_task, stats_extra, display)
    for plan in plans:
        log_shard(out, SHARDS_FOLDER, out.read_json(SHARDS_FOLDER, stats_name(plan.shard_id)))
    # a writer attempt lost with its node leaves its temporary file; its retry wrote the shard
    for folder in (SHARDS_FOLDER, SCORES_FOLDER, EMBEDDINGS_FOLDER):
        out.remove_temporaries(folder)
    seconds = time.time() - started
    manifest = build_manifest(out, cfg)
    manifest["log"] = log  # this run's log file, relative to OUT (each stage run has one)
    write_dataset_files(out, manifest)
    summary = summarise(out, SHARDS_FOLDER, all_ids)
    return {**summary, "shards_skipped": len(all_ids) - len(plans), "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds, 1) if rows else None, **stats_extra}
