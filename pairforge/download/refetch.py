"""``pairforge download --retry-failed`` for one finished raw shard: fetch again the rows
whose failure may pass (records.is_transient_failure) and rewrite the shard with the same
keys; rows that were ok keep their tar members byte for byte and are not fetched.

The rewrite cannot leave a shard that lies: its stats file (what makes it complete) goes
first, then the tar and the parquet are replaced (each written to a temporary and
renamed), then the stats are written again. A run stopped in between leaves the shard
incomplete, and the next ``pairforge download`` redoes it whole. The training shard made
from it is marked incomplete too, so the next ``process`` or ``build`` remakes it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.download.inputs import InputShard, read_shard_rows
from pairforge.download.lists import Lists
from pairforge.download.shard import (
    ShardConfig,
    ShardDownloader,
    read_tar_members,
    sample_meta,
    shard_fetcher,
)
from pairforge.records import Status, index_digits, is_transient_failure, make_key
from pairforge.shards.failures import SHARD_TOP, HostFailures, host_of
from pairforge.shards.raw import row_counts, shard_name, stats_name
from pairforge.shards.storage import RAW_FOLDER, SHARDS_FOLDER, OutputDir
from pairforge.shards.tar import SampleTarWriter, iter_samples, tar_mtime


def transient_keys(table: pa.Table) -> set[str]:
    """The keys of a raw shard's rows that ``--retry-failed`` fetches again."""
    return {key for key, status, http, error in zip(
        table["key"].to_pylist(), table["status"].to_pylist(),
        table["http_status"].to_pylist(), table["error"].to_pylist(), strict=True)
        if is_transient_failure(status, http, error)}


def refetch_shard(shard: InputShard, cfg: ShardConfig, lists: Lists | None = None,
                run_id: str | None = None) -> dict[str, Any] | None:
    """Retry one complete raw shard's transient rows; None when it has none (the shard is
    not touched), else what was retried and how many are ok now."""
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    name = shard_name(shard.shard_id)
    with out.fs.open(out.path(RAW_FOLDER, f"{name}.parquet"), "rb") as f:
        table = pq.read_table(f)
    keys = transient_keys(table)
    if not keys:
        return None
    started = time.time()
    records = _refetch(shard, cfg, keys, lists, run_id)
    old_rows = table.to_pylist()
    rows = [records[r["key"]][0] if r["key"] in records else r for r in old_rows]
    stats = out.read_json(RAW_FOLDER, stats_name(shard.shard_id))
    # complete no longer: a stop from here on leaves a shard that the next run redoes
    out.remove(RAW_FOLDER, stats_name(shard.shard_id))
    out.remove(SHARDS_FOLDER, stats_name(shard.shard_id))
    _write_tar(out, name, rows, {k: image for k, (_, image) in records.items()})
    with out.open_atomic(RAW_FOLDER, f"{name}.parquet") as f:
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), f)
    now_ok = sum(records[k][0]["status"] == Status.OK for k in records)
    earlier = stats.get("retried") or {"runs": 0, "rows": 0, "ok": 0}
    stats.update(row_counts(r["status"] for r in rows))
    stats["failures_by_host"] = _failures(rows)
    stats["retried"] = {"runs": earlier["runs"] + 1, "rows": earlier["rows"] + len(records),
                        "ok": earlier["ok"] + now_ok,
                        "last": {"rows": len(records), "ok": now_ok, "start_time": started,
                                 "end_time": time.time()}}
    out.write_json(stats, RAW_FOLDER, stats_name(shard.shard_id))
    return {"shard": shard.shard_id, "rows": len(records), "ok": now_ok}


def _refetch(shard: InputShard, cfg: ShardConfig, keys: set[str], lists: Lists | None,
             run_id: str | None) -> dict[str, tuple[dict[str, Any], Any]]:
    """key -> (parquet record, processed image or None) of the input rows under ``keys``,
    fetched again as stage 1 fetches them."""
    digits = index_digits(cfg.input.shard_size)
    rows = []
    read = read_shard_rows(shard, cfg.input, cfg.output).to_pylist()
    for i, row in enumerate(read, start=shard.first_row):
        row["key"] = make_key(shard.shard_id, i, digits)
        if row["key"] in keys:
            rows.append(row)
    fetcher, gate = shard_fetcher(cfg.download, run_id, rows)
    tars = read_tar_members([r["source"] for r in rows
                             if (r["source"] or "").startswith("tar:")],
                            cfg.input.storage_options)
    worker = ShardDownloader(cfg, fetcher, tars, lists)
    try:
        with ThreadPoolExecutor(cfg.download.threads) as pool:
            return {record["key"]: (record, image)
                    for record, image in pool.map(worker.one, rows)}
    finally:
        fetcher.close()
        if gate:
            gate.close()


def _write_tar(out: OutputDir, name: str, rows: list[dict[str, Any]],
               images: dict[str, Any]) -> None:
    """The shard's tar again, in key order: each earlier sample copied as it was (with
    the old archive's header time), each newly ok row encoded as stage 1 writes it."""
    with out.fs.open(out.path(RAW_FOLDER, f"{name}.tar"), "rb") as old:
        mtime = tar_mtime(old)
    with out.fs.open(out.path(RAW_FOLDER, f"{name}.tar"), "rb") as old, \
            out.open_atomic(RAW_FOLDER, f"{name}.tar") as f:
        earlier = iter_samples(old)
        writer = SampleTarWriter(f, mtime=mtime)
        for row in rows:
            if row["status"] != Status.OK:
                continue
            image = images.get(row["key"])
            if image is None:  # ok before: the next sample of the old tar is this row's
                key, files = next(earlier)
                if key != row["key"]:
                    raise RuntimeError(f"{name}.tar holds {key} where {row['key']} belongs")
                writer.write(key, files)
            else:
                writer.write(row["key"], {image.format: image.data,
                                          "txt": row["caption"] or "",
                                          "json": sample_meta(row)})
        writer.close()


def _failures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fold = HostFailures()
    for row in rows:
        if row["status"] != Status.OK:
            fold.add_row(host_of(row.get("url")), row["status"])
    return fold.section(SHARD_TOP)

