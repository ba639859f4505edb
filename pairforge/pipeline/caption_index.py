"""The caption cache's compaction at the start of stage 3, as Ray tasks.

Before any recaption actor starts, each recaption step's cache folder gets a new index
generation if log parts exist that the newest one does not hold
(recaption/cache_index.py: the plan, the tasks and the commit). The driver lists and
counts; the rows go from task to task through partitioned files, never through it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pairforge.pipeline.executors import Waves
from pairforge.pipeline.progress import say
from pairforge.recaption import cache_index
from pairforge.recaption.cache import cache_dir
from pairforge.recaption.step import RecaptionStep
from pairforge.shards.storage import OutputDir
from pairforge.stage import Step

if TYPE_CHECKING:
    from pairforge.stage import StepConfig

COUNT_GROUP = 256  # log parts whose footers one task reads


def compact_caption_caches(cfg: StepConfig, steps: list[type[Step]],
                           retries: int) -> dict[str, Any]:
    """Compact the cache of each recaption step that reads one; returns what each did."""
    done: dict[str, Any] = {}
    for step in steps:
        if not (issubclass(step, RecaptionStep) and step.enabled(cfg)):
            continue
        own = step.step_config(cfg)
        cache = own.process.recaption.cache
        if cache.enabled:
            done[step.name] = compact_cache(cache_dir(own), own.output.storage_options,
                                            cache.phash_distance, retries)
    return done


def _for_tasks(plan: cache_index.Compaction) -> cache_index.Compaction:
    """The plan without the lists of log parts held (only the commit needs them)."""
    previous = plan.previous and {k: v for k, v in plan.previous.items() if k != "logs"}
    return replace(plan, logs={}, previous=previous)


def compact_cache(folder: OutputDir, storage_options: dict[str, Any], phash_distance: int,
                  retries: int) -> dict[str, Any] | None:
    """One folder's compaction (None: its index already holds every log part)."""
    plan = cache_index.plan_compaction(folder, storage_options, phash_distance)
    if plan is None:
        return None
    started = time.perf_counter()
    waves = Waves(retries)
    plan = _laid_out(plan, waves)
    if cache_index.outgrown(plan):  # the vectors need new clusters: from every log part
        plan = _laid_out(cache_index.plan_compaction(folder, storage_options, phash_distance,
                                                     rebuild=True), waves)
    cache_index.pin_compaction(plan)
    try:
        plan, totals = _fold(plan, waves)
    except BaseException:
        cache_index.unpin_compaction(plan)
        raise
    marker = cache_index.commit(plan, totals)
    seconds = round(time.perf_counter() - started, 2)
    parts = sum(len(unit) for unit in plan.units)
    say(f"process: caption cache {folder.url}: generation {marker['generation']} "
        f"({parts} new log parts, {plan.new_rows} rows) in {seconds} s")
    return {"generation": marker["generation"], "log_parts": parts,
            "rows": plan.new_rows, "index_rows": totals, "seconds": seconds}


def _laid_out(plan: cache_index.Compaction, waves: Waves) -> cache_index.Compaction:
    """The plan with its layout, from the new log parts' row counts (tasks read footers)."""
    names = [name for unit in plan.units for name in unit]
    groups = [names[i:i + COUNT_GROUP] for i in range(0, len(names), COUNT_GROUP)]
    counts = waves.run(cache_index.count_rows, [(_for_tasks(plan), g) for g in groups])
    return cache_index.with_layout(plan, dict(zip(
        names, [n for group in counts for n in group], strict=True)))


def _fold(plan: cache_index.Compaction, waves: Waves
          ) -> tuple[cache_index.Compaction, dict[str, int]]:
    """The compaction's tasks: the vectors' centroids, scatter, merge; the plan as
    committed, and the index rows of each kind."""
    units = [(_for_tasks(plan), unit) for unit in range(len(plan.units))]
    if plan.trains:
        waves.run(cache_index.sample_vectors, units, name="sample_vectors")
        plan = replace(plan, clusters=waves.run(cache_index.train_centroids,
                                                [(_for_tasks(plan),)])[0])
    else:
        waves.run(cache_index.keep_centroids, [(_for_tasks(plan),)])
    sent = _for_tasks(plan)
    waves.run(cache_index.scatter, [(sent, unit) for unit in range(len(plan.units))])
    totals = {kind: sum(waves.run(cache_index.merge, [
        (sent, kind, group) for group in cache_index.merge_groups(getattr(plan, f"{kind}_bits"))
    ], name=f"merge_{kind}")) for kind in ("exact", "bands")}
    totals["vectors"] = sum(waves.run(cache_index.merge_vectors, [
        (sent, group) for group in cache_index.cluster_groups(plan.clusters)],
        name="merge_vectors"))
    return plan, totals
