"""``pairforge download CONFIG --retry-failed`` on Ray: one task per complete raw shard
(``download/refetch.py``), at most as many in flight as the cluster has CPUs; the driver
holds the plan of shards and the counts, never the rows."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.download.consent import remove_cache
from pairforge.download.inputs import InputShard
from pairforge.download.lists import Lists
from pairforge.download.refetch import refetch_shard
from pairforge.download.shard import ShardConfig
from pairforge.pipeline.contract import DOWNLOAD, shard_config
from pairforge.pipeline.download_stage import input_shards, load_lists_once
from pairforge.pipeline.entry import RunOptions, summarise
from pairforge.pipeline.executors import cluster_cpus, run_bounded, task_errors_raised
from pairforge.pipeline.progress import say
from pairforge.pipeline.ray_runtime import init_ray
from pairforge.pipeline.runlog import run_log
from pairforge.pipeline.settings import check_settings
from pairforge.shards.raw import completed_shards
from pairforge.shards.storage import RAW_FOLDER, OutputDir


def _retry_task(shard: InputShard, cfg: ShardConfig, lists: Lists | None,
                run_id: str) -> dict[str, Any] | None:
    return refetch_shard(shard, cfg, lists, run_id)


def run_retry_failed(cfg: PairforgeConfig, run: RunOptions) -> dict[str, Any]:
    """Fetch again the transient failures of every complete raw shard made under this
    run's settings (others stop it, or with ``run.force`` are marked incomplete, as for a
    rerun); returns the funnel of all shards and what was retried."""
    check_settings(cfg, ("download",), run)
    with run_log(cfg, "download") as log:
        return {**_retry(cfg), "log": log}


def _retry(cfg: PairforgeConfig) -> dict[str, Any]:
    import ray

    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    init_ray(cfg.ray)
    lists = load_lists_once(cfg)
    with input_shards(cfg) as shards:
        done = completed_shards(out, RAW_FOLDER)
        todo = [s for s in shards if s.shard_id in done]
        missing = len(shards) - len(todo)
        say(f"download --retry-failed: {len(todo)} complete shards to look through"
            + (f" ({missing} not complete: `pairforge download` fetches them whole)"
               if missing else ""))
        task = ray.remote(num_cpus=DOWNLOAD.resources.task_cpus,
                          max_retries=cfg.ray.max_task_retries)(_retry_task)
        limit = DOWNLOAD.resources.in_flight(cfg, cluster_cpus())
        job = shard_config(cfg)
        run_id = f"retry-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}"
        retried: list[dict[str, Any]] = []
        started = time.time()
        try:
            with task_errors_raised():
                run_bounded(todo, lambda s: task.remote(s, job, lists, run_id), limit,
                            lambda _: None, lambda r: r and retried.append(r))
        finally:
            remove_cache(run_id)
        seconds = time.time() - started
    summary = summarise(out, RAW_FOLDER, [s.shard_id for s in shards])
    rows, ok = sum(r["rows"] for r in retried), sum(r["ok"] for r in retried)
    say(f"download --retry-failed: {rows:,} rows in {len(retried)} shards fetched again, "
        f"{ok:,} ok now; {len(todo) - len(retried)} shards had none to retry")
    return {**summary, "retried": {"shards": len(retried), "rows": rows, "ok": ok},
            "seconds": round(seconds, 2)}
