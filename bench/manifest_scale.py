"""The driver's peak RSS and wall time of build_manifest + write_dataset_files over many
synthetic shards (issue 34, item 5).

Writes N synthetic training-shard stats files (shards/) and raw stats files (raw/) shaped
like stage 3's and stage 1's, once per N under --root, then times each N in a fresh
process (so ru_maxrss is that N's peak) and prints one JSON line per N:

    python bench/manifest_scale.py --shards 10000 100000 1000000

Each line has the RSS after the imports, before the build (baseline_rss_mib), so the
growth with N can be told from the interpreter's own size. Run it against another tree
with PYTHONPATH=that-tree.

Writing the files takes ~2 ms each here, so 10^6 shards (2·10^6 files) take over an hour:
``--in-memory`` instead makes the same stats in the process as they are read (the listing
and the reads replaced, a batch at a time, the rest of the build as it is; it needs the
folded build_manifest) and writes the dataset files to an empty folder.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import arg_parser, json_from_child, max_rss_mib

TASKS = ("i2t", "img", "t2i", "txt")


def _shard_stats(shard_id: int) -> dict:
    ok = 80 + shard_id % 17
    tasks = {t: {"samples": ok // 4, "image_tokens": 256 * (ok // 4) + i,
                 "caption_tokens": 11 * (ok // 4), "sequence_tokens": 300 * (ok // 4)}
             for i, t in enumerate(TASKS)}
    return {
        "clip_model": "ViT-B-32/laion2b_s34b_b79k", "clip_threshold": 0.28,
        "settings": {"digest": f"{shard_id * 2654435761 % 2**32:08x}", "values": {}},
        "step_stats": {name: {"rows_in": 100, "rows_out": 100 - k, "seconds": 0.123 + k,
                              "ended": {"too_small": k} if k else {}}
                       for k, name in enumerate(("basic", "clip", "recaption"))},
        "recaption": {"rows": ok, "abstained": shard_id % 3,
                      "origin": {"model": ok - 5, "cache": 5},
                      "caption_source": {"recaption": ok - 2, "original": 2}},
        "vocab": {"text": 32000, "image": 8192, "specials": 4},
        "budget": {"p_drop": 0.1, "realized": 0.1, "max_image_tokens": 256,
                   "max_prefix_deviation": float(shard_id % 97)},
        "tasks": tasks, "shard": shard_id, "count": 100, "successes": ok,
        "status": {"ok": ok, "too_small": 100 - ok},
    }


def _raw_stats(shard_id: int) -> dict:
    return {"shard": shard_id, "count": 110, "successes": 100, "parts": 1,
            "start_time": 1.7e9, "end_time": 1.7e9 + 5, "duration_s": 5.0,
            "status": {"ok": 100, "failed_download": 7, "failed_resize": 3}}


def make_folder(root: Path, shards: int) -> Path:
    folder = root / str(shards)
    done = folder / "complete"
    if done.exists():
        return folder
    for sub in ("shards", "raw"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for shard_id in range(shards):
        name = f"{shard_id:05d}_stats.json"
        (folder / "shards" / name).write_text(json.dumps(_shard_stats(shard_id), indent=2))
        (folder / "raw" / name).write_text(json.dumps(_raw_stats(shard_id), indent=2))
    done.write_text("")
    return folder


def _synthetic_stats(shards: int) -> None:
    """Replace the listing and the reads of the stats files by stats made here."""
    from array import array

    from pairforge.shards import manifest

    def batches(out: object, ids: array):
        for shard_id in ids:
            yield _shard_stats(shard_id), _raw_stats(shard_id)

    manifest.stats_ids = lambda out, folder: array("i", range(shards))
    manifest._stats_batches = batches


def measure(folder: Path, in_memory: int | None = None) -> dict:
    """In this process: build and write the dataset files of ``folder``."""
    from pairforge.config import PairforgeConfig
    from pairforge.pipeline.chain import stage_steps
    from pairforge.pipeline.process import dataset_manifest
    from pairforge.shards.manifest import write_dataset_files
    from pairforge.shards.storage import OutputDir

    if in_memory:
        _synthetic_stats(in_memory)
        (folder / "shards").mkdir(parents=True, exist_ok=True)

    cfg = PairforgeConfig(input={"path": "in.csv"}, output={"path": str(folder)},
                          process={"clip": {"enabled": True}})
    out = OutputDir(str(folder))
    baseline = max_rss_mib()
    started = time.perf_counter()
    manifest = dataset_manifest(out, cfg, stage_steps(cfg))
    write_dataset_files(out, manifest)
    seconds = time.perf_counter() - started
    return {"baseline_rss_mib": round(baseline, 1),
            "driver_peak_rss_mib": round(max_rss_mib(), 1), "seconds": round(seconds, 2)}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--shards", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--root", type=Path, default=Path("/tmp/pairforge-manifest-scale"))
    parser.add_argument("--in-memory", action="store_true")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--synthetic", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.synthetic)))
        return
    for shards in args.shards:
        made = time.perf_counter()
        if args.in_memory:
            folder = args.root / f"in-memory-{shards}"
            command = ["--measure", str(folder), "--synthetic", str(shards)]
        else:
            folder = make_folder(args.root, shards)
            command = ["--measure", str(folder)]
        made = time.perf_counter() - made
        figures = json_from_child([__file__, *command], f"{shards} shards")
        print(json.dumps({"shards": shards, "in_memory": args.in_memory, **figures,
                          "made_in_s": round(made, 1)}), flush=True)


if __name__ == "__main__":
    main()
