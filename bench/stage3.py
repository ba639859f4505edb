"""Stage 3 at scale (issue 48): the driver's CPU and memory, and rows/s, on a cheap chain.

    python bench/stage3.py [--rows 100000 1000000] [--quick] [--json FILE] [--work DIR]
                           [--cache-entries 100000 10000000] [--cache-embedding]
                           [--cache-before] [--only-cache]

For each size, raw shards of 32-px scenes (the bundled sample's images, each through stage
1's image pass once, then repeated under new keys: dedup is off) are written to disk in
shards of ``--shard-size`` rows, then ``pairforge process`` runs in a fresh driver process
with the cheap chain: basic filters, the demo's VQ (pairforge/sample/vq32) and caption BPE
(pairforge/sample/text), t2i/i2t labels. The driver's CPU seconds and peak RSS
(getrusage of that process: Ray's own processes and the workers are not counted) are
measured for that run and for a rerun with nothing left to do; the difference is what the
rows cost the driver. Ray Data's executor runs in stage 3's coordinator task, whose CPU the
summary reports (``coordinator_cpu_s``; the JSON's ``coordinator_cpu_s_per_1e5_rows``,
run less rerun). ``--quick`` stops at 10^6 rows. ``--json FILE`` writes
``{"driver_cpu_s_per_1e5_rows": {"<rows>": …}, "driver_peak_rss_mib": {"<rows>": …},
"rows_per_s": {"<rows>": …}, "decodes_per_row": …, "recaption_actor_peak_rss_mib":
{"<cache entries>": …}}`` (issue 48's layout). ``decodes_per_row`` counts image decodes
through CLIP, a classifier, the captioner with CLIP grounding and the VQ
(tests/test_one_decode.py's tiny models, in this process). ``--decode-arms`` runs each size
again under each ``process.decode.where`` (tasks: the decoding task, the default; actor: the
first model step's actors decode in a second thread; steps: every step decodes for itself,
the layout before issue 48), the arms alternating ``--repeats`` times over one set of raw
shards: ``decode_in`` {arm: {rows: [{rows_per_s, tree_cpu_ms_per_row, load} of each
repeat]}}, the CPU of the driver's whole process tree (Ray's processes, tasks, actors).
``--image-size 256`` writes 256-px JPEGs instead of the 32-px PNG scenes (the VQ's square
view then resizes them where the row is decoded).

The recaption actor's peak RSS with a caption cache of ``--cache-entries`` entries, and
the cache compaction's wall time, are bench/stage3_cache.py's (``--quick``: at most 10^6
entries; ``--only-cache``: nothing else).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from common import SAMPLE, arg_parser, child_env, json_from_child, run_sampled
from stage3_cache import measure as measure_cache

_DRIVER = """
import json, resource, sys, time
from pairforge.config import load_config
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.process import run_process
started = time.time()
summary = run_process(load_config(sys.argv[1]), RunOptions(show_progress=False))
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime,
                  "peak_rss_mib": usage.ru_maxrss / 1024, "seconds": time.time() - started,
                  "rows_ok": summary.get("successes"),
                  "coordinator_cpu_s": summary.get("coordinator_cpu_s")}))
"""


def config(out: Path, image_size: int = 32, decode_in: str = "tasks") -> dict[str, Any]:
    encode = {"encode_format": "png"} if image_size == 32 else {"encode_format": "jpg",
                                                                  "resize_mode": "center_crop"}
    return {"input": {"path": "unused", "shard_size": 10_000},
            "output": {"path": str(out)}, "ray": {"num_cpus": 2},
            "dedup": {"enabled": False},
            "download": {"image": {"image_size": image_size, **encode}},
            "process": {"basic": {"min_image_side": 16},
                        "tokenize": {"enabled": True,
                                     "image": {"backend": "pairforge-vq",
                                               "path_or_id": str(SAMPLE / "vq32")},
                                     "text": {"backend": "hf",
                                              "path_or_id": str(SAMPLE / "text")}},
                        "tasks": {"p_drop": 0.3}, "decode": {"where": decode_in}}}


def _distinct_rows(cfg: Any, limit: int) -> list[tuple[dict[str, Any], Any]]:
    """(record fields, processed image) of up to ``limit`` sample scenes."""
    from pairforge.download.imageproc import process_image

    with open(SAMPLE / "captions.csv", newline="") as f:
        rows = list(csv.DictReader(f))[:limit]
    made = []
    for row in rows:
        image = process_image((SAMPLE / "images" / row["filename"]).read_bytes(),
                              cfg.download.image)
        fields = dict(url=f"http://127.0.0.1/{row['filename']}", caption=row["caption"],
                      caption_issue=None, status="ok", error=None, http_status=200,
                      image_format=image.format, width=image.width, height=image.height,
                      original_width=image.original_width,
                      original_height=image.original_height, sha256=image.sha256,
                      pixel_hash=image.pixel_hash, phash=image.phash,
                      phash_mirror=image.phash_mirror, crop_phashes=list(image.crop_phashes),
                      colour_grid=image.colour_grid, exif=None)
        made.append((fields, image))
    return made


def write_raw(out: Path, rows: int, shard_size: int, image_size: int = 32) -> None:
    """Raw shards of ``rows`` rows, as stage 1 writes them."""
    from pairforge.config import parse_config
    from pairforge.download.shard import sample_meta
    from pairforge.pipeline.settings import settings_record, stage_settings
    from pairforge.records import index_digits, make_key
    from pairforge.shards.raw import RawShardWriter
    from pairforge.shards.storage import RAW_FOLDER, OutputDir

    cfg = parse_config({**config(out, image_size),
                        "input": {"path": "unused", "shard_size": shard_size}})
    distinct = _distinct_rows(cfg, 1000)
    settings = settings_record(stage_settings(cfg, "download"))
    target = OutputDir(str(out))
    target.makedirs(RAW_FOLDER)
    digits = index_digits(shard_size)
    for shard in range(-(-rows // shard_size)):
        writer = RawShardWriter(target, RAW_FOLDER, shard, [])
        for i in range(shard * shard_size, min(rows, (shard + 1) * shard_size)):
            fields, image = distinct[i % len(distinct)]
            record = {"key": make_key(shard, i, digits), **fields}
            writer.add(record, image.data, image.format, sample_meta(record))
        writer.close({"stage": "download", "settings": settings, "start_time": 0,
                      "end_time": 0, "duration_s": 0})


def drive(cfg_path: Path) -> dict[str, Any]:
    return json_from_child(["-c", _DRIVER, str(cfg_path)], "pairforge process")


def drive_sampled(cfg_path: Path) -> dict[str, Any]:
    """``drive``, with the CPU seconds of the driver's whole process tree (Ray's processes,
    the tasks and the actors: common.TreeSampler) as ``tree_cpu_s``."""
    with tempfile.TemporaryFile("w+") as output:
        _, sampler = run_sampled([sys.executable, "-c", _DRIVER, str(cfg_path)],
                                 env=child_env(), stdout=output, stderr=subprocess.DEVNULL)
        output.seek(0)
        run = json.loads(output.read().strip().splitlines()[-1])
    return {**run, "tree_cpu_s": round(sampler.cpu_s, 1)}


def measure(rows: int, work: Path, shard_size: int, image_size: int = 32) -> dict[str, Any]:
    out = work / f"rows{rows}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    write_raw(out, rows, shard_size, image_size)
    print(f"{rows:,} rows: raw shards written in {time.time() - started:.0f} s", flush=True)
    cfg_path = work / f"rows{rows}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(out, image_size)))
    run, rerun = drive(cfg_path), drive(cfg_path)
    result = {"rows": rows, "run": run, "rerun": rerun,
              "driver_cpu_s_per_1e5_rows": round((run["cpu_s"] - rerun["cpu_s"]) / rows * 1e5, 3),
              "driver_peak_rss_mib": round(run["peak_rss_mib"], 1),
              "coordinator_cpu_s_per_1e5_rows": round(
                  ((run["coordinator_cpu_s"] or 0) - (rerun["coordinator_cpu_s"] or 0))
                  / rows * 1e5, 3),
              "rows_per_s": round(rows / run["seconds"], 1)}
    print(json.dumps(result), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return result


DECODE_ARMS = ("tasks", "actor", "steps")


def measure_decode_arms(rows: int, work: Path, shard_size: int, image_size: int,
                        repeats: int) -> dict[str, list[dict[str, float]]]:
    """rows/s and the process tree's CPU per row of each ``process.decode.where`` arm,
    alternating, over one set of raw shards (stage 3's outputs removed before each run)."""
    from pairforge.shards.storage import RAW_FOLDER

    out = work / f"arms{rows}"
    shutil.rmtree(out, ignore_errors=True)
    write_raw(out, rows, shard_size, image_size)
    found: dict[str, list[dict[str, float]]] = {arm: [] for arm in DECODE_ARMS}
    for _ in range(repeats):
        for arm in DECODE_ARMS:
            for made in out.iterdir():
                if made.name != RAW_FOLDER:
                    shutil.rmtree(made) if made.is_dir() else made.unlink()
            cfg_path = work / f"arms{rows}-{arm}.yaml"
            cfg_path.write_text(yaml.safe_dump(config(out, image_size, arm)))
            run = drive_sampled(cfg_path)
            found[arm].append({"rows_per_s": round(rows / run["seconds"], 1),
                               "tree_cpu_ms_per_row": round(run["tree_cpu_s"] / rows * 1e3, 3),
                               "load": os.getloadavg()[0]})
            print(json.dumps({"rows": rows, "decode_in": arm, **found[arm][-1]}), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return found


def cache_report(args: Any, work: Path) -> dict[str, Any]:
    """The recaption actor's peak RSS by cache entries (bench/stage3_cache.py)."""
    entries = [n for n in args.cache_entries if not args.quick or n <= 1_000_000]
    # the whole-load cache holds every entry in dicts: measured up to 10^6 entries
    found = [measure_cache(n, work, before=args.cache_before and n <= 1_000_000)
             for n in entries]
    report: dict[str, Any] = {
        "recaption_actor_peak_rss_mib": {str(r["entries"]): round(r["actor"]["peak_rss_mib"], 1)
                                         for r in found},
        "cache_compaction_s": {str(r["entries"]): r["compaction_s"] for r in found}}
    if args.cache_before:
        report["recaption_actor_peak_rss_mib_before"] = {
            str(r["entries"]): round(r["before"]["peak_rss_mib"], 1) for r in found
            if "before" in r}
    if args.cache_embedding is not None:
        embedded = [measure_cache(n, work, embedding=True, before=args.cache_before)
                    for n in args.cache_embedding or [100_000]]
        report["recaption_actor_peak_rss_mib_embedding"] = {
            str(r["entries"]): round(r["actor"]["peak_rss_mib"], 1) for r in embedded}
        report["embedding_lookup_ms_per_batch"] = {
            str(r["entries"]): round(r["actor"]["lookup_ms_per_batch"], 1) for r in embedded}
    return report


def decodes_per_row(work: Path) -> float:
    """Image decodes per row through CLIP, a transformers classifier, the captioner with
    CLIP grounding and the VQ, as stage 3 lays the chain out (tests/test_one_decode.py's
    tiny models; in this process, so the decode counter sees every step)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_one_decode as chain

    from pairforge import images

    cfg = chain.chain_config(work / "decodes")
    rows = chain._rows(chain.N_ROWS)
    images.DECODES["rows"] = 0
    chain._run_chain(cfg, rows, decode_first=True)
    return images.DECODES["rows"] / (chain.N_ROWS - 1)  # its last row is ended by stage 1


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--quick", action="store_true", help="stop at 10^6 rows")
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--cache-entries", type=int, nargs="*", default=[100_000, 10_000_000])
    parser.add_argument("--cache-embedding", type=int, nargs="*", metavar="ENTRIES",
                        help="also the embedding tier, at these sizes (none given: 10^5)")
    parser.add_argument("--cache-before", action="store_true",
                        help="also the whole-load cache (CaptionCache.load), up to 10^6")
    parser.add_argument("--only-cache", action="store_true")
    parser.add_argument("--image-size", type=int, default=32,
                        help="raw images' side (32: PNG scenes; else JPEG q90 crops)")
    parser.add_argument("--decode-arms", action="store_true",
                        help="also each size under each process.decode.where, alternating")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the decode arms")
    args = parser.parse_args()
    sizes = [r for r in args.rows if not args.quick or r <= 1_000_000]
    work = args.work or Path(tempfile.mkdtemp(prefix="pf-stage3-"))
    results = [] if args.only_cache else [measure(rows, work, args.shard_size, args.image_size)
                                          for rows in sizes]
    report = {key: {str(r["rows"]): r[key] for r in results}
              for key in ("driver_cpu_s_per_1e5_rows", "driver_peak_rss_mib", "rows_per_s",
                          "coordinator_cpu_s_per_1e5_rows")}
    if not args.only_cache:
        report["decodes_per_row"] = decodes_per_row(work)
    if args.decode_arms:
        arms = {rows: measure_decode_arms(rows, work, args.shard_size, args.image_size,
                                          args.repeats) for rows in sizes}
        report["decode_in"] = {arm: {str(rows): found[arm]
                                                for rows, found in arms.items()}
                                          for arm in DECODE_ARMS}
    report.update(cache_report(args, work))
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
