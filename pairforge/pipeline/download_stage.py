"""Stage 1 (download) on Ray: one task per input shard (or part of the last round's), with
resume, live progress and a summary; the shard's work itself is ``download.shard``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.config import DownloadConfig, InputConfig, OutputConfig, PairforgeConfig
from pairforge.download.consent import remove_cache
from pairforge.download.folder_server import bundled_sample_table, serve_directory
from pairforge.download.inputs import (
    BUNDLED_SAMPLE,
    InputFile,
    InputShard,
    plan_input,
    shards_of,
    tail_parts,
)
from pairforge.download.lists import Lists, load_lists
from pairforge.download.memory_guard import guard_file
from pairforge.download.parts import merge_parts
from pairforge.download.shard import ShardConfig, download_shard
from pairforge.download.split import SPLIT_FOLDER, SplitJob, normalise_table, run_split, write_split
from pairforge.pipeline.contract import DOWNLOAD, shard_config
from pairforge.pipeline.entry import RunOptions, summarise
from pairforge.pipeline.executors import cluster_cpus, run_bounded, task_errors_raised
from pairforge.pipeline.progress import ProgressCounter, StageDisplay, say
from pairforge.pipeline.ray_runtime import driver_local_actor, init_ray
from pairforge.pipeline.runlog import log_shard, run_log
from pairforge.pipeline.settings import check_settings, settings_record, stage_settings
from pairforge.shards.raw import completed_shards, remove_parts
from pairforge.shards.storage import RAW_FOLDER, OutputDir


@contextmanager
def input_shards(cfg: PairforgeConfig) -> Iterator[list[InputShard]]:
    """The input planned into shards from its metadata, inputs without row groups split
    on Ray first; the bundled sample is served while the block runs."""
    if cfg.input.path != BUNDLED_SAMPLE:
        yield plan_input(cfg.input, cfg.output, lambda jobs: _split(jobs, cfg))
        return
    from pairforge.download.folder_server import SAMPLE_DIR

    with serve_directory(SAMPLE_DIR) as base_url:
        # a few dozen rows whose URLs name this run's port: written again by every run
        out = OutputDir(cfg.output.path, cfg.output.storage_options)
        table = normalise_table(bundled_sample_table(base_url), cfg.input, BUNDLED_SAMPLE)
        rows = write_split(out, f"{BUNDLED_SAMPLE}.parquet", [table],
                           cfg.input.save_additional_columns, cfg.input.shard_size)
        sample = InputFile(out.uri(SPLIT_FOLDER, f"{BUNDLED_SAMPLE}.parquet"), rows, split=True)
        yield list(shards_of([sample], cfg.input.shard_size))


# Inputs to split of at most this many bytes in all are split by the driver itself: a
# split streams (about one row group in memory), and a Ray task's start and round trip
# would come before the first download of a small run.
SPLIT_HERE_BYTES = 16 << 20


def _split(jobs: list[SplitJob], cfg: PairforgeConfig) -> list[int]:
    """The splitting pass (download/split.py) of ``jobs``; their rows."""
    sizes = [job.size for job in jobs]
    if None not in sizes and sum(sizes) <= SPLIT_HERE_BYTES:
        return [run_split(job, cfg.input, cfg.output) for job in jobs]
    return _split_on_ray(jobs, cfg)


def _split_on_ray(jobs: list[SplitJob], cfg: PairforgeConfig) -> list[int]:
    """The splitting pass (download/split.py): one Ray task per input; their rows."""
    import ray

    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    say(f"input: splitting {len(jobs)} input file(s) into {out.uri(SPLIT_FOLDER)}; "
        "starting Ray…")
    init_ray(cfg.ray)
    task = ray.remote(num_cpus=DOWNLOAD.resources.task_cpus,
                      max_retries=cfg.ray.max_task_retries)(_split_task)
    rows: dict[SplitJob, int] = {}
    started = time.time()
    with task_errors_raised():
        run_bounded(jobs, lambda job: task.remote(job, cfg.input, cfg.output), cluster_cpus(),
                    lambda _: None, lambda result: rows.update([result]))
    say(f"input: {len(jobs)} file(s), {sum(rows.values()):,} rows split in "
        f"{time.time() - started:.1f} s")
    return [rows[job] for job in jobs]


def _split_task(job: SplitJob, source: InputConfig,
                output: OutputConfig) -> tuple[SplitJob, int]:
    return job, run_split(job, source, output)


def _download_task(shard: InputShard, cfg: ShardConfig, settings: dict[str, Any],
                   counter: Any, lists: Lists | None, run_id: str) -> dict[str, Any]:
    import ray

    return download_shard(shard, cfg, settings,
                          progress=lambda c: ray.get(counter.add.remote(dict(c))), lists=lists,
                          run_id=run_id)


def _lists_task(download: DownloadConfig,
                storage_options: dict[str, Any]) -> tuple[int, Lists | None]:
    lists = load_lists(download, storage_options)
    return (len(lists.opt_out or []) + len(lists.block or [])) if lists else 0, lists


def load_lists_once(cfg: PairforgeConfig) -> Any:  # a Ray ObjectRef, or None
    """The run's lists, parsed once by a Ray task and shared with every shard task through
    the object store (the driver holds only the reference); a list that does not parse
    stops the run here, before any shard starts. None when the run has none."""
    import ray

    if not (cfg.download.opt_out_lists or cfg.download.block_lists):
        return None
    init_ray(cfg.ray)
    with task_errors_raised():
        count, lists = ray.remote(num_cpus=DOWNLOAD.resources.task_cpus, num_returns=2)(
            _lists_task).remote(cfg.download, cfg.input.storage_options)
        say(f"download: {ray.get(count):,} opt-out and block list entries loaded")
    return lists


def run_download(cfg: PairforgeConfig, run: RunOptions) -> dict[str, Any]:
    """Stage 1 over every shard not yet complete under these settings (``run.force``: redo
    the shards made under others, else they stop it; ``run.redo_all``: redo every shard);
    returns the funnel of all shards."""
    check_settings(cfg, ("download",), run)
    with run_log(cfg, "download") as log:
        return {**_download(cfg, run.show_progress), "log": log}


class _Merger:
    """Takes each finished task's stats: a whole shard is complete, a split shard's parts
    are merged once all are back (``shards/raw.py``)."""

    def __init__(self, out: OutputDir) -> None:
        self.out = out
        self.merged: list[int] = []  # shards complete, parts merged
        self.parts: dict[int, list[dict[str, Any]]] = {}

    def __call__(self, stats: dict[str, Any]) -> None:
        if "part" in stats:
            written = self.parts.setdefault(stats["shard"], [])
            written.append(stats)
            if len(written) < stats["part"][1]:
                return
            stats = merge_parts(self.out, RAW_FOLDER, written)
            self.out.remove(RAW_FOLDER, guard_file(stats["shard"]))
        log_shard(self.out, RAW_FOLDER, stats)
        self.merged.append(stats["shard"])


def _download(cfg: PairforgeConfig, show_progress: bool) -> dict[str, Any]:
    import ray

    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(RAW_FOLDER)
    out.remove_temporaries(RAW_FOLDER)
    remove_parts(out, RAW_FOLDER)
    lists = load_lists_once(cfg)  # a list that does not parse: before any other work
    with input_shards(cfg) as shards:
        done = completed_shards(out, RAW_FOLDER)
        todo = [s for s in shards if s.shard_id not in done]
        say(f"download: {len(todo)} of {len(shards)} shards to fetch; starting Ray…")
        init_ray(cfg.ray)
        counter = driver_local_actor(ProgressCounter)
        # Retried by Ray when the task's worker or node dies (system failures only: a
        # Python exception in the task fails the stage, it is not a node loss).
        task = ray.remote(num_cpus=DOWNLOAD.resources.task_cpus,
                          max_retries=cfg.ray.max_task_retries)(_download_task)
        limit = DOWNLOAD.resources.in_flight(cfg, cluster_cpus())
        skipped = len(shards) - len(todo)
        rows_todo = sum(s.num_rows for s in todo)
        display = StageDisplay("download", len(shards), rows_todo, skipped, live=show_progress)
        merger = _Merger(out)

        def tick(_: int) -> None:
            display.update(ray.get(counter.total.remote()), skipped + len(merger.merged))

        job, settings = shard_config(cfg), settings_record(stage_settings(cfg, "download"))
        # names the node-local cache of robots.txt and tdmrep.json the run's tasks share
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}"
        started = time.time()
        try:
            with display, task_errors_raised():
                run_bounded(tail_parts(todo, limit),
                            lambda s: task.remote(s, job, settings, counter, lists, run_id),
                            limit, tick, merger, on_slots=counter.share.remote)
        finally:
            remove_cache(run_id)  # this node's; the temp folders of others keep theirs
        ray.kill(counter)
        seconds = time.time() - started
    # A task attempt killed with its node leaves its temporary file; its retry wrote the
    # shard under another temporary name. Nothing of this run is still writing now.
    out.remove_temporaries(RAW_FOLDER)
    summary = summarise(out, RAW_FOLDER, [s.shard_id for s in shards])
    return {**summary, "shards_skipped": skipped, "seconds": round(seconds, 2),
            "rows_per_s": round(rows_todo / seconds, 1) if rows_todo else None}
