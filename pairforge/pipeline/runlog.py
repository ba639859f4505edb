"""A log file per stage run: ``OUT/logs/STAGE-YYYYmmddTHHMMSSZ.log``.

It holds what scrolls past (or never shows, in quiet mode) and is gone when the terminal
closes: the config digest and the versions the run used, start-up and phase lines, a line
per shard (rows, seconds, rate, failures with example keys), the periodic progress lines,
warnings, and an error's traceback. Every record of the ``pairforge`` logger during the
run goes into it. A local output folder gets the file as it grows (a killed run leaves its
log); an fsspec URL gets it copied when the run ends.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pairforge.config import PairforgeConfig
from pairforge.shards.storage import OutputDir

LOG = logging.getLogger("pairforge")
LOGS_FOLDER = "logs"
VERSIONED = ("pairforge", "ray", "torch", "open_clip_torch", "transformers", "pyarrow")
EXAMPLE_KEYS = 5  # failed rows named per status and shard


def config_digest(cfg: PairforgeConfig) -> str:
    """sha256 (16 hex digits) of the config as validated: two logs of one setup match."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _versions() -> str:
    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join([f"python {platform.python_version()}", *found])


def log_name(stage: str) -> str:
    return f"{LOGS_FOLDER}/{stage}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.log"


@contextmanager
def run_log(cfg: PairforgeConfig, stage: str) -> Iterator[str]:
    """Collect the ``pairforge`` logger's records of the block into the stage's log file;
    yields its name relative to OUT (what the manifest records)."""
    out = OutputDir(cfg.output.path, cfg.output.storage_options)
    name = log_name(stage)
    out.makedirs(LOGS_FOLDER)
    local = out.path(name) if out.local else os.path.join(tempfile.mkdtemp(), "run.log")
    handler = logging.FileHandler(local, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                           "%Y-%m-%dT%H:%M:%S"))
    level = LOG.level
    LOG.setLevel(logging.INFO)
    LOG.addHandler(handler)
    try:
        LOG.info("pairforge %s: output %s", stage, cfg.output.path)
        LOG.info("config digest %s; %s", config_digest(cfg), _versions())
        yield name
        LOG.info("%s finished", stage)
    except BaseException as err:
        LOG.error("%s stopped: %s: %s", stage, type(err).__name__, err, exc_info=True)
        raise
    finally:
        LOG.removeHandler(handler)
        LOG.setLevel(level)
        handler.close()
        if not out.local:
            with open(local, "rb") as src, out.open_atomic(name) as dst:
                dst.write(src.read())
            shutil.rmtree(os.path.dirname(local), ignore_errors=True)


def log_shard(out: OutputDir, folder: str, stats: dict[str, Any]) -> None:
    """One line per finished shard: rows, seconds and rate from its stats, failures by
    status with up to EXAMPLE_KEYS keys each (from the shard's parquet)."""
    shard = f"{stats['shard']:05d}"
    seconds = stats.get("seconds") or stats.get("duration_s")
    rate = f", {stats['count'] / seconds:,.1f} rows/s" if seconds else ""
    timing = f" in {seconds:.2f} s{rate}" if seconds else ""
    failed = {s: n for s, n in stats["status"].items() if s != "ok"}
    steps = ", ".join(f"{name} {part['rows_in']} rows {part['seconds']:.2f} s"
                      for name, part in (stats.get("step_stats") or {}).items())
    LOG.info("%s/%s: %s rows, %s ok%s%s", folder, shard, stats["count"], stats.get(
        "successes", stats["status"].get("ok", 0)), timing, f"; steps: {steps}" if steps else "")
    if failed:
        for status, keys in _failed_keys(out, folder, shard, failed).items():
            LOG.warning("%s/%s: %s %s, e.g. %s", folder, shard, failed[status], status,
                        "; ".join(keys))


def _failed_keys(out: OutputDir, folder: str, shard: str,
                 failed: dict[str, int]) -> dict[str, list[str]]:
    import pyarrow.parquet as pq

    if not out.exists(folder, f"{shard}.parquet"):
        return {s: [] for s in failed}
    with out.fs.open(out.path(folder, f"{shard}.parquet"), "rb") as f:
        rows = pq.read_table(f, columns=["key", "status", "error"]).to_pylist()
    found: dict[str, list[str]] = {s: [] for s in failed}
    for row in rows:
        keys = found.get(row["status"])
        if keys is not None and len(keys) < EXAMPLE_KEYS:
            keys.append(f"{row['key']} ({row['error']})" if row["error"] else row["key"])
    return found
