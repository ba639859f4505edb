"""The ``plan`` stage of bench/scale.py: stage 1's planning, and a download of refused
rows end to end. Each measurement runs in a fresh driver process (``python
bench/scale_plan.py --child VARIANT ROWS DIR``), which reports its own peak RSS.

- ``plan``: stage 1's planning alone (``download_stage.input_shards``: metadata, and the
  splitting pass for inputs without usable row groups) on synthetic (url, caption) files
  of 10^6 rows each: parquet in row groups of 10^4 rows (read in place), parquet as
  ``pq.write_table`` writes it by default (one row group per file: split), and csv
  (split). Ray is started before the clock for the split inputs, as a run does before
  planning. Then ``pairforge download`` end to end (``run_download``, shards of 10^4
  rows, local Ray on 2 CPUs) of parquet rows whose URLs the address guard refuses at
  once (http://127.0.0.2:9/..., only 127.0.0.1/32 allowed: no request is made), at 10^5
  and 10^6 rows. The entry's ``driver_peak_rss_mib`` and ``seconds`` are the largest of
  the three planning measurements; each is under its own key, with ``download``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from common import json_from_child, peak_rss_mib

FILE_ROWS = 10**6  # rows per synthetic input file
SHARD_SIZE = 10**4


def _measure(stage: str, variant: str, rows: int, workdir: Path,
             timeout: float = 3600) -> dict[str, Any]:
    """One measurement in a fresh driver process: its peak RSS and the call's seconds."""
    return json_from_child([__file__, "--child", variant, str(rows), str(workdir)],
                           f"{stage}/{variant} at {rows} rows", timeout)


# -- plan: stage 1 planning, and a download of refused rows end to end --------------------

_PLAN_VARIANTS = ("parquet", "parquet-one-group", "csv")


def _plan_inputs(rows: int, workdir: Path) -> Path:
    """Synthetic (url, caption) inputs of ``rows`` rows in files of FILE_ROWS, in every
    planning variant's format, made once per size."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    folder = workdir / f"plan-{rows}"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    for variant in _PLAN_VARIANTS:
        (folder / variant).mkdir(parents=True)
    for start in range(0, rows, FILE_ROWS):
        ids = range(start, min(start + FILE_ROWS, rows))
        table = pa.table({
            "url": [f"http://127.0.0.2:9/img/{i:09d}.jpg" for i in ids],
            "caption": [f"a photo of item {i}, seen from the side on a wooden table"
                        for i in ids]})
        name = f"part-{start // FILE_ROWS:05d}"
        pq.write_table(table, folder / "parquet" / f"{name}.parquet", row_group_size=SHARD_SIZE)
        pq.write_table(table, folder / "parquet-one-group" / f"{name}.parquet")
        pacsv.write_csv(table, folder / "csv" / f"{name}.csv")
    (folder / "done").touch()
    return folder


def _plan_config(folder: Path, variant: str, out: Path):  # noqa: ANN202
    from pairforge.config import parse_config

    pattern = "*.csv" if variant == "csv" else "*.parquet"
    source = "parquet" if variant == "download" else variant
    return parse_config({
        "input": {"path": str(folder / source / pattern), "shard_size": SHARD_SIZE},
        "output": {"path": str(out)},
        "ray": {"num_cpus": 2},
        "download": {"allow_addresses": ["127.0.0.1/32"], "timeout": 2, "retries": 0}})


def _plan_child(variant: str, rows: int, workdir: Path) -> dict[str, Any]:
    from pairforge.pipeline.download_stage import input_shards, run_download
    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.ray_runtime import init_ray

    folder = workdir / f"plan-{rows}"
    out = workdir / f"out-{variant}-{rows}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = _plan_config(folder, variant, out)
    try:
        if variant == "download":
            started = time.perf_counter()
            summary = run_download(cfg, RunOptions(show_progress=False))
            seconds = time.perf_counter() - started
            assert summary["rows"] == rows, summary
            return {"driver_peak_rss_mib": round(peak_rss_mib(), 1), "seconds": round(seconds, 2),
                    "status": summary["status"]}
        if variant != "parquet":
            init_ray(cfg.ray)  # as a run does before planning; not planning's cost
        started = time.perf_counter()
        with input_shards(cfg) as shards:
            seconds = time.perf_counter() - started
            assert sum(s.num_rows for s in shards) == rows
            count = len(shards)
        return {"driver_peak_rss_mib": round(peak_rss_mib(), 1), "seconds": round(seconds, 2),
                "shards": count}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def measure_plan(rows: int, work: Path) -> dict[str, Any]:
    """bench/scale.py's ``plan`` entry at ``rows``."""
    _plan_inputs(rows, work)
    entry: dict[str, Any] = {variant: _measure("plan", variant, rows, work)
                             for variant in _PLAN_VARIANTS}
    if rows <= 10**6:
        entry["download"] = _measure("plan", "download", rows, work)
    for key in ("driver_peak_rss_mib", "seconds"):
        entry[key] = max(entry[v][key] for v in _PLAN_VARIANTS)
    return entry


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _, variant, n, folder = sys.argv[1:5]
    print(json.dumps(_plan_child(variant, int(n), Path(folder))))
