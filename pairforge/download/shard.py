"""Stage 1: fetch, verify, resize, re-encode and hash one shard of input rows.

One shard is one Ray task; inside it a thread pool overlaps network waits, and at most
``image_threads`` of those threads (one by default: the CPU the task holds) run the image
pass at a time. Thirty-two images decoded at once, each thread switched out mid-image,
cost 14-31 % more CPU per image than one at a time (bench/RESULTS.md, stage 1), most
likely because every switch brings another ~1 MB of pixels through the caches. In the
run's tail, when no shard waits for a slot, the runner hands the CPUs of finished tasks to
those still running (``progress`` answers with the task slots this one may use), and the
image pass widens to match, up to the node's cores.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import fsspec

from pairforge.config import DownloadConfig, InputConfig, OutputConfig
from pairforge.download.alt_text import invalid_error, read_alt_text
from pairforge.download.consent import ConsentGate, make_gate
from pairforge.download.fetch import Fetcher, FetchResult
from pairforge.download.host_actors import run_link
from pairforge.download.imageproc import ImageFailure, ProcessedImage, process_image
from pairforge.download.inputs import InputShard, read_shard_rows
from pairforge.download.lists import Lists
from pairforge.download.memory_guard import GuardedRows, MemoryGuard
from pairforge.download.politeness import HostPolicy
from pairforge.machine import usable_cores
from pairforge.records import Status, index_digits, json_safe, make_key
from pairforge.shards.failures import SHARD_TOP, HostFailures, host_of
from pairforge.shards.raw import RawShardWriter
from pairforge.shards.storage import RAW_FOLDER, OutputDir
from pairforge.shards.tar import iter_samples, split_member_name

# Reports rows done by status; answers with the task slots this task may use (or None).
ProgressFn = Callable[[Counter], "int | None"]


def read_tar_members(sources: list[str], storage_options: dict[str, Any]) -> dict[str, bytes]:
    """Bytes of every ``tar:LOCATION#MEMBER`` source, one sequential pass per tar.

    Members are matched as the input reader named them: by sample key and extension,
    the extension's case ignored (``split._tar_batches`` keys them the same way). A
    ``.tar.gz`` is decompressed on the fly by fsspec.
    """
    wanted: dict[str, dict[tuple[str | None, str], str]] = defaultdict(dict)
    for source in sources:
        location, member = source[len("tar:"):].rsplit("#", 1)
        key, extension = split_member_name(member)
        wanted[location][(key, (extension or "").lower())] = source
    found: dict[str, bytes] = {}
    for location, members in wanted.items():
        with fsspec.open(location, "rb", compression="infer", **storage_options) as f:
            for key, files in iter_samples(f):
                for extension, data in files.items():
                    source = members.get((key, extension))
                    if source is not None:
                        found[source] = data
    return found


@dataclass(frozen=True)
class ShardConfig:
    """What a stage-1 shard task reads: the input and download sections, where OUT is,
    and ``recaption_first``, the one setting stage 1 shares with stage 3 (then no alt-text
    ends a row here: stage 3 may caption it). pipeline/contract.py builds it."""

    input: InputConfig
    download: DownloadConfig
    output: OutputConfig
    recaption_first: bool


class ShardDownloader:
    def __init__(self, cfg: ShardConfig, fetcher: Fetcher, tar_bytes: dict[str, bytes],
                 lists: Lists | None = None, guard: MemoryGuard | None = None):
        self.cfg, self.fetcher, self.lists, self.guard = cfg, fetcher, lists, guard
        self.caption_required = cfg.input.caption_col is not None
        self.recaption_first = cfg.recaption_first
        self.tar_bytes = tar_bytes  # images of rows that come from existing tars
        self.image_slots = threading.Semaphore(cfg.download.image_threads)
        self.image_capacity = cfg.download.image_threads

    def use_slots(self, slots: int) -> None:
        """Let ``slots`` times ``image_threads`` image passes run at once, within the
        node's cores (never fewer than configured). Only ever widens: the tail's slots
        only grow as tasks finish."""
        wanted = min(slots * self.cfg.download.image_threads,
                     max(self.cfg.download.image_threads, usable_cores()))
        for _ in range(wanted - self.image_capacity):
            self.image_slots.release()
        self.image_capacity = max(self.image_capacity, wanted)

    def _guarded(self, key: str):  # noqa: ANN202 - a context manager
        return self.guard.processing(key) if self.guard else nullcontext()

    def _fetch(self, url: str | None, source: str | None) -> FetchResult:
        if source is None:
            return self.fetcher.fetch(url or "")
        if source.startswith("tar:"):
            return FetchResult(Status.OK, None, self.tar_bytes[source], None, source)
        try:
            with fsspec.open(source, "rb", **self.cfg.input.storage_options) as f:
                return FetchResult(Status.OK, None, f.read(), None, source)
        except OSError as err:
            return FetchResult(Status.DOWNLOAD_ERROR, f"cannot read {source}: {err}",
                               None, None, source)

    def one(self, row: dict[str, Any]) -> tuple[dict[str, Any], ProcessedImage | None]:
        """The parquet record of one input row, and its image when it is ok."""
        alt = read_alt_text(row.pop("caption"))
        source = row.pop("source")
        record: dict[str, Any] = {**row, "caption": alt.text, "caption_issue": alt.issue,
                                  "status": Status.OK.value, "error": None}
        caption_error = invalid_error(alt, self.caption_required, self.recaption_first)
        if caption_error:
            return {**record, "status": Status.CAPTION_INVALID.value,
                    "error": caption_error}, None
        guarded = self.guard and self.guard.rows.reason(row["key"])
        if guarded:  # an earlier try of this task was ended on this row's image
            return {**record, "status": Status.TOO_LARGE.value, "error": guarded}, None
        if source is None and self.lists and self.lists.opted_out(row["url"]):
            return {**record, "status": Status.OPTED_OUT.value, "opt_out_reason": "list",
                    "error": "the URL is on an opt-out list (download.opt_out_lists)"}, None
        fetched = self._fetch(row["url"], source)
        record["http_status"] = fetched.http_status
        if fetched.status != Status.OK:
            return {**record, "status": fetched.status.value, "error": fetched.error,
                    "opt_out_reason": fetched.opt_out_reason}, None
        with self.image_slots, self._guarded(row["key"]):
            image = process_image(fetched.body, self.cfg.download.image)
        if isinstance(image, ImageFailure):
            return {**record, "status": image.status.value, "error": image.error}, None
        blocked = self.lists and self.lists.blocked(image.sha256, image.pixel_hash, image.phash)
        if blocked:  # nothing of the image is written, not even its hashes
            return {**record, "status": Status.BLOCKED.value,
                    "error": f"its {blocked} is on a block list (download.block_lists)"}, None
        record.update(
            image_format=image.format, width=image.width, height=image.height,
            original_width=image.original_width, original_height=image.original_height,
            sha256=image.sha256, pixel_hash=image.pixel_hash, phash=image.phash,
            phash_mirror=image.phash_mirror, crop_phashes=list(image.crop_phashes),
            colour_grid=image.colour_grid, exif=image.exif)
        return record, image


def sample_meta(record: dict[str, Any]) -> dict[str, Any]:
    # The dedup-only hashes stay in the parquet: a sample's json keeps img2dataset's fields.
    skip = {"http_status", "phash_mirror", "crop_phashes", "colour_grid"}
    return json_safe({k: v for k, v in record.items() if v is not None and k not in skip})


def _opt_out_counts(opted_out: Counter) -> dict[str, Any]:
    """Opted-out rows per reason, and per host and reason (``opted_out``: (host, reason))."""
    hosts: dict[str, dict[str, int]] = defaultdict(dict)
    for (host, reason), count in sorted(opted_out.items()):
        hosts[host][reason] = count
    reasons: Counter = Counter()
    for (_, reason), count in opted_out.items():
        reasons[reason] += count
    return {"opted_out": dict(sorted(reasons.items())), "hosts": dict(hosts)}


def shard_fetcher(download: DownloadConfig, run_id: str | None,
                  rows: list[dict[str, Any]]) -> tuple[Fetcher, ConsentGate | None]:
    """A shard task's fetcher and consent gate. In run ``run_id`` on Ray they take their
    hosts' leases and files from the run's host coordinators, so one rate, connection
    budget, breaker and robots.txt per host hold for every task (none are asked when no
    row of ``rows`` is fetched over the network)."""
    link = run_link(download, run_id) if any(r["source"] is None for r in rows) else None
    gate = make_gate(download, run_id, link)
    return Fetcher(download, gate=gate, hosts=HostPolicy(download, link)), gate


def download_shard(shard: InputShard, cfg: ShardConfig, settings: dict[str, Any],
                   progress: ProgressFn | None = None, lists: Lists | None = None,
                   run_id: str | None = None) -> dict[str, Any]:
    """Download one shard and write its tar, parquet and (last) stats file; a part of a
    shard (``shard.parts`` > 1) writes its tar and parquet, and its stats are returned for
    ``shards.raw.merge_parts``. ``settings``: the run's settings record, written into the
    stats so that reruns know what made the shard (the runner computes it once);
    ``lists``: the run's opt-out and block lists (``download/lists.py``), loaded once;
    ``run_id``: names the run's host coordinators (``download/host_actors.py``) and the
    node's cache of robots.txt and tdmrep.json files that the run's tasks share
    (``download/consent.py``)."""
    started = time.time()
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    out.makedirs(RAW_FOLDER)
    rows = read_shard_rows(shard, cfg.input, cfg.output).to_pylist()  # read by its task
    digits = index_digits(cfg.input.shard_size)
    for i, row in enumerate(rows, start=shard.first_row):
        row["key"] = make_key(shard.shard_id, i, digits)
    fetcher, gate = shard_fetcher(cfg.download, run_id, rows)
    guard = MemoryGuard(cfg.download.max_task_memory_mb,
                        GuardedRows(out, shard.shard_id, settings))
    worker = ShardDownloader(cfg, fetcher, read_tar_members(
        [r["source"] for r in rows if (r["source"] or "").startswith("tar:")],
        cfg.input.storage_options), lists, guard)
    writer = RawShardWriter(out, RAW_FOLDER, shard.shard_id, cfg.input.save_additional_columns,
                            (shard.part, shard.parts) if shard.parts > 1 else None)
    try:
        with guard:
            opted_out, failures = _write_rows(worker, rows, writer, progress)
    except BaseException as exc:
        writer.abort(exc)
        raise
    finally:
        fetcher.close()
        if gate:
            gate.close()
    stats = writer.close({"stage": "download",
                          "settings": settings,
                          "start_time": started, "end_time": time.time(),
                          "duration_s": round(time.time() - started, 3),
                          "config": json.loads(cfg.download.model_dump_json()),
                          "consent": {**_opt_out_counts(opted_out),
                                      **(gate.stats() if gate else {})},
                          "politeness": fetcher.hosts.stats(),
                          "failures_by_host": failures.section(SHARD_TOP),
                          "peak_resident_mib": guard.peak_mib})
    if shard.parts == 1:  # a part's shard is complete only once merged (download_stage)
        guard.rows.remove()
    return stats


def _write_rows(worker: ShardDownloader, rows: list[dict[str, Any]], writer: RawShardWriter,
                progress: ProgressFn | None) -> tuple[Counter, HostFailures]:
    """Every row through ``worker`` into ``writer``, in input order; the opted-out rows by
    (host, reason) and the failures by host."""
    pending: Counter = Counter()
    opted_out: Counter = Counter()  # (host, reason)
    failures = HostFailures()
    last_report = time.monotonic()
    with ThreadPoolExecutor(worker.cfg.download.threads) as pool:
        # map() keeps input order, so keys are written in order whatever finishes first.
        for record, image in pool.map(worker.one, rows):
            writer.add(record, image.data if image else None,
                       image.format if image else None, sample_meta(record))
            pending[record["status"]] += 1
            if record.get("opt_out_reason"):
                opted_out[host_of(record.get("url")), record["opt_out_reason"]] += 1
            if record["status"] != Status.OK:
                failures.add_row(host_of(record.get("url")), record["status"])
            if progress and time.monotonic() - last_report > 0.5:
                worker.use_slots(progress(pending) or 1)
                pending, last_report = Counter(), time.monotonic()
    if progress and pending:
        progress(pending)
    return opted_out, failures
