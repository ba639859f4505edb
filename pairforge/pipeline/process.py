"""Stage 3 (process): plan the shards, stream them through the step chain, write them.

``run_process`` is the stage's one entry. Planning (pipeline/plan.py) reads stats files,
streaming (pipeline/stream.py) places the steps on Ray Data, and each finished shard goes
to a writer task (pipeline/write.py). A shard is complete when its stats file exists; a
rerun skips complete shards.

A step whose decisions need the whole stage first (a ``ScoringStep`` asking for a scoring
pass) gets one before the writing pass: the chain up to it runs over every shard, its
scores are cached per shard (a score file in ``SCORES_FOLDER``), and what it learns from
them (per-shard states, merged) gives the config of the writing pass, which reads the
cached scores instead of scoring again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.pipeline.caption_index import compact_caption_caches
from pairforge.pipeline.chain import enabled_steps, stage_steps
from pairforge.pipeline.contract import PROCESS, step_config, with_step_config
from pairforge.pipeline.entry import RunOptions, summarise
from pairforge.pipeline.placement import check_decode_device, check_gpu_demand
from pairforge.pipeline.plan import plan_shards
from pairforge.pipeline.preflight import check_model_sources
from pairforge.pipeline.progress import StageDisplay, say
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.runlog import log_shard, run_log
from pairforge.pipeline.semantic_stage import run_semantic_dedup
from pairforge.pipeline.settings import check_settings
from pairforge.pipeline.stream import map_scores, remove_fragment_folder, stream_shards
from pairforge.pipeline.write import write_scores_task, write_shard_task
from pairforge.shards.manifest import Manifest, build_manifest, write_dataset_files
from pairforge.shards.raw import completed_shards, stats_name
from pairforge.shards.storage import (
    RAW_FOLDER,
    SCORES_FOLDER,
    SHARDS_FOLDER,
    OutputDir,
)
from pairforge.stage import ModelStep, ScoringStep, Step, scoring_step


def _learn_from_scores(cfg: PairforgeConfig, out: OutputDir, steps: list[type[Step]],
                       scorer: type[ScoringStep]) -> tuple[PairforgeConfig, dict[str, Any]]:
    """The scoring pass: the chain up to ``scorer`` (later, costlier steps wait for the
    writing pass) over every shard; returns the config the writing pass runs under, with
    what the step learned from every shard's scores, and the stats that record it."""
    scoring = scorer.scoring_config(step_config(cfg), for_embeddings=False)
    stream_shards(with_step_config(cfg, scoring), out,
                  plan_shards(out, cfg, SCORES_FOLDER), steps[:steps.index(scorer) + 1],
                  write_scores_task, {}, None)
    learned, stats = scorer.learn(step_config(cfg), map_scores(
        out, cfg.output.storage_options, scorer.score_column, cfg.ray.max_task_retries))
    return with_step_config(cfg, learned), stats


def _writer_drops(cfg: PairforgeConfig, steps: list[type[Step]]) -> tuple[str, ...]:
    """The columns the last step drops before the writing pass's fragments: an embedding
    the writer will not save (it served the steps only). The image stays: the writer puts
    it in the tar, and the raw tar is read once."""
    scorer = scoring_step(steps)
    if scorer and scorer.embedding_column and not scorer.saves_embeddings(step_config(cfg)):
        return (scorer.embedding_column,)
    return ()


def dataset_manifest(out: OutputDir, cfg: PairforgeConfig,
                     steps: list[type[Step]]) -> Manifest:
    """The manifest of the shards in OUT, made under ``cfg`` (the one the writing pass ran
    under); ``steps``: every step of the stage, on or off, each saying what it records."""
    # serve: is the service's, not the build's (and leaves built manifests as they were)
    return build_manifest(out, cfg.model_dump(mode="json", exclude={"serve"}),
                          step_config(cfg), steps)


def run_process(cfg: PairforgeConfig, run: RunOptions) -> dict[str, Any]:
    """Stage 3 over every complete raw shard that has no complete output shard made under
    these settings (``run.force``: redo the shards made under others, else they stop it;
    ``run.redo_all``: redo every shard)."""
    check_model_sources(cfg)
    check_settings(cfg, ("process",), run)
    with run_log(cfg, "process") as log:
        return {**_process(cfg, run.show_progress, log), "log": log}


def _cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def check_process_placement(cfg: PairforgeConfig) -> None:
    """Stage 3's pools against the cluster's GPUs, for ``build`` to ask before stage 1:
    an over-asking config stops before hours of downloading, not after them."""
    steps = enabled_steps(cfg)
    check_decode_device(steps, cfg)
    init_ray(cfg.ray)
    check_gpu_demand(steps, cfg, _cluster_gpus())


def _step_line(step: type[Step], cfg: PairforgeConfig) -> str:
    """A step as the start-up line names it: the model and the actors that load it."""
    if not issubclass(step, ModelStep):
        return step.name
    model = step.requirements(step_config(cfg)).display
    size = step.pool_config(step_config(cfg)).pool_size
    return f"{step.name} ({model + ' on ' if model else ''}{size} actor{'s' * (size != 1)})"


def _process(cfg: PairforgeConfig, show_progress: bool, log: str) -> dict[str, Any]:
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(SHARDS_FOLDER)
    out.remove_temporaries(SHARDS_FOLDER)
    remove_fragment_folder(out)
    steps = enabled_steps(cfg)
    check_decode_device(steps, cfg)
    say("process: starting Ray…")
    init_ray(cfg.ray)
    check_gpu_demand(steps, cfg, _cluster_gpus())
    say("process: steps " + ", ".join(_step_line(s, cfg) for s in steps)
        + "; each actor loads its model before the first batch…")
    started = time.time()
    stats_extra: dict[str, Any] = {"stage": "process", "steps": [s.name for s in steps]}
    for step in steps:
        stats_extra.update(step.stage_stats(step_config(cfg)))
    scorer = scoring_step(steps)
    if scorer is not None and scorer.needs_scoring_pass(step_config(cfg)):
        cfg, learned = _learn_from_scores(cfg, out, steps, scorer)
        stats_extra.update(learned)
    if cfg.dedup.semantic.enabled:
        semantic = run_semantic_dedup(cfg, out, steps)
        stats_extra["semantic_dedup"] = {k: v for k, v in semantic.items()
                                         if k not in ("seconds", "inputs_digest", "stage")}
    plans = plan_shards(out, cfg, SHARDS_FOLDER)
    all_ids = sorted(completed_shards(out, RAW_FOLDER))
    rows = sum(p.to_process for p in plans)
    display = StageDisplay("process", len(all_ids), rows, len(all_ids) - len(plans),
                           live=show_progress)
    if plans:  # before any recaption actor starts: it reads its cache's index by lookup
        compact_caption_caches(step_config(cfg), steps, cfg.ray.max_task_retries)
    with contextlib.ExitStack() as scope:
        for step in steps:
            scope.enter_context(step.build_scope(step_config(cfg), rows))
        with display:
            coordinator_cpu_s = stream_shards(cfg, out, plans, steps, write_shard_task,
                                              stats_extra, display, _writer_drops(cfg, steps))
    for plan in plans:
        log_shard(out, SHARDS_FOLDER, out.read_json(SHARDS_FOLDER, stats_name(plan.shard_id)))
    # a writer attempt lost with its node leaves its temporary file; its retry wrote the shard
    for folder in PROCESS.outputs:
        out.remove_temporaries(folder)
    remove_fragment_folder(out)
    seconds = time.time() - started
    with dataset_manifest(out, cfg, stage_steps(cfg)) as manifest:
        manifest.fields["log"] = log  # this run's log file, relative to OUT (one a stage run)
        write_dataset_files(out, manifest)
    summary = summarise(out, SHARDS_FOLDER, all_ids)
    return {**summary, "shards_skipped": len(all_ids) - len(plans), "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds, 1) if rows else None,
            "coordinator_cpu_s": round(coordinator_cpu_s, 2), **stats_extra}
