"""Internet scale (issue 34): the driver's peak RSS and the wall time of each stage as the
number of rows grows, and the growth exponent of the time.

    python bench/scale.py [--stages plan dedup semantic] [--sizes 100000 1000000 10000000] [--quick]
                          [--check] [--json FILE] [--work DIR]

Each stage is a function ``measure_<stage>(rows, work, args) -> {"driver_peak_rss_mib":
…, "seconds": …, …}`` registered in ``STAGES``; a new stage adds its function there.
The driver is a fresh Python process per measurement (its VmHWM, see PEAK); Ray's own
processes and the task workers are not the driver and are not counted.

``plan``: stage 1's planning (parquet with row groups, parquet in one group and csv, the
last two through the splitting pass) and an end-to-end ``pairforge download`` of rows the
address guard refuses at once; bench/scale_plan.py says how.

``dedup``: stage 2 (``pipeline/dedup_stage.run_dedup``, local Ray with 2 CPUs) on raw
shard parquet files of 10^4 rows (key, status, pixel_hash, phash, phash_mirror, four
region hashes, sizes) written to disk first: random 64-bit hashes with the top bit set
and 1 % planted duplicates of every kind (exact copies, near copies with up to 3 bits
flipped in every hash, mirrors, crops, and chains of three). ``--check`` also runs the
single-process decision (``filters/dedup.find_duplicates``) on the same files and
compares the duplicates and the stats (sizes up to 10^6).

``semantic``: stage 3's semantic dedup pass over synthetic 512-d embeddings, up to
2·10^6 rows (a larger size is measured at 2·10^6); bench/scale_semantic.py says how.

``shards``: stage 3's plan (``pipeline/plan.Decisions``) over a duplicates table of a
tenth of the rows in 10^4-row shards: the per-shard counts it holds, and one shard's
key range as its task reads it, against the dict of every decision the plan held before
(both in fresh processes; the same counts checked).

``--quick`` stops at 10^6 rows. ``--json FILE`` writes
``{"<stage>": {"<rows>": {"driver_peak_rss_mib": …, "seconds": …}}}``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from common import PEAK_RSS_EXPR, arg_parser, json_from_child

SHARD_ROWS = 10_000
REGIONS = 4
HEX = np.frombuffer(b"0123456789abcdef", dtype="S1")


# ------------------------------------------------------------------------------ dedup


def _hashes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 2**63, shape, dtype=np.uint64) | np.uint64(1 << 63)


def _flips(rng: np.random.Generator, shape: tuple[int, ...], most: int = 3) -> np.ndarray:
    """Masks of up to ``most`` bits below the top one (the same bit may come twice)."""
    mask = np.zeros(shape, np.uint64)
    for _ in range(most):
        mask |= np.uint64(1) << rng.integers(0, 63, shape).astype(np.uint64)
    return mask


def _hex(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random 32-digit hex strings (pixel hashes), as bytes."""
    raw = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    digits = np.stack([raw >> 4, raw & 15], axis=-1).reshape(n, 32)
    return HEX[digits].view("S32").ravel()


def planted_points(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, 6) hashes and, per row, the row whose pixels it copies (itself for most): 1 %
    of the rows are planted duplicates of unplanted ones, a fifth of them of each kind
    (exact, near, mirror, crop, and chains of three whose ends are up to 6 bits apart)."""
    rng = np.random.default_rng(seed)
    points = _hashes(rng, (n, 2 + REGIONS))
    same_pixels = np.arange(n)
    planted = rng.choice(n, n // 100, replace=False)
    originals = np.setdiff1d(np.arange(n), planted)
    exact, near, mirror, crop, chain = np.array_split(planted, 5)

    def source(rows: np.ndarray) -> np.ndarray:
        return rng.choice(originals, len(rows))

    same_pixels[exact] = source(exact)
    points[exact] = points[same_pixels[exact]]
    points[near] = points[source(near)] ^ _flips(rng, (len(near), 2 + REGIONS))
    swapped = points[source(mirror)][:, [1, 0, 3, 2, 5, 4]]
    points[mirror] = swapped ^ _flips(rng, (len(mirror), 2 + REGIONS), 2)
    points[crop, 0] = points[source(crop), 4] ^ _flips(rng, (len(crop),), 2)
    middle, end = chain[: len(chain) // 2], chain[len(chain) // 2:][: len(chain) // 2]
    points[middle] = points[source(middle)] ^ _flips(rng, (len(middle), 2 + REGIONS))
    points[end] = points[middle[: len(end)]] ^ _flips(rng, (len(end), 2 + REGIONS))
    return points, same_pixels


def write_raw_shards(folder: Path, n: int, seed: int = 0) -> None:
    """Raw shard parquet files of n rows of hash columns, SHARD_ROWS each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    points, same_pixels = planted_points(n, seed)
    pixel = pa.array(_hex(rng, n)[same_pixels]).cast(pa.string())
    suffixes = pa.array([f"{i:04d}" for i in range(SHARD_ROWS)])
    crops = pa.FixedSizeListArray.from_arrays(pa.array(points[:, 2:].reshape(-1)),
                                              REGIONS).cast(pa.list_(pa.uint64()))
    sides = rng.choice(np.array([256, 320, 480, 640], np.int32), n)
    for shard, start in enumerate(range(0, n, SHARD_ROWS)):
        end = min(n, start + SHARD_ROWS)
        table = pa.table({
            "key": pc.binary_join_element_wise(
                pa.array([f"{shard:05d}"] * (end - start)), suffixes[: end - start], ""),
            "status": pa.array(["ok"] * (end - start)),
            "sha256": pa.nulls(end - start, pa.string()),
            "pixel_hash": pixel[start:end],
            "phash": pa.array(points[start:end, 0]),
            "phash_mirror": pa.array(points[start:end, 1]),
            "crop_phashes": crops[start:end],
            "original_width": pa.array(sides[start:end]),
            "original_height": pa.array(sides[start:end]),
        })
        pq.write_table(table, folder / f"{shard:05d}.parquet")


# The peak is VmHWM, this process's own high-water mark: ru_maxrss would also count the
# pages of the parent at fork time (Linux carries the old mm's peak over the exec), i.e.
# this script's generated arrays (313 instead of 178 MiB at 10^6 rows).
PEAK = PEAK_RSS_EXPR

STAGE2_DRIVER = textwrap.dedent("""
    import json, sys, time
    from pairforge.config import DedupConfig, RayConfig
    from pairforge.pipeline.dedup_stage import run_dedup
    raw, out = sys.argv[1:3]
    started = time.perf_counter()
    stats = run_dedup(raw, out, DedupConfig(), RayConfig(num_cpus=2), force=True)
    seconds = time.perf_counter() - started
    rss = PEAK
    print(json.dumps({"seconds": seconds, "driver_peak_rss_mib": rss, "stats": stats}))
""").replace("PEAK", PEAK)

ORACLE = textwrap.dedent("""
    import json, sys, time
    import pyarrow as pa, pyarrow.parquet as pq
    from pathlib import Path
    from pairforge.dedup.reference import find_duplicates
    from pairforge.dedup.partitions import read_hash_columns
    raw, out = Path(sys.argv[1]), Path(sys.argv[2])
    started = time.perf_counter()
    rows = pa.concat_tables([read_hash_columns(str(f), {})[0]
                             for f in sorted(raw.glob("*.parquet"))])
    result = find_duplicates(rows, 4)
    seconds = time.perf_counter() - started
    same = pq.read_table(out / "duplicates.parquet").equals(result.duplicates)
    rss = PEAK
    print(json.dumps({"seconds": seconds, "peak_rss_mib": rss, "same_rows": same,
                      "stats": result.stats}))
""").replace("PEAK", PEAK)


def _python(code: str, *args: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (this checkout's pairforge); its last line."""
    return json_from_child(["-c", code, *args])


def measure_dedup(rows: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    raw, out = work / f"raw-{rows}", work / f"out-{rows}" / "dedup"
    started = time.perf_counter()
    write_raw_shards(raw, rows, args.seed)
    print(f"  dedup {rows:,}: wrote {math.ceil(rows / SHARD_ROWS)} raw shards in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    found = _python(STAGE2_DRIVER, str(raw), str(out))
    stats = found.pop("stats")
    result = {**found, "duplicates": stats["duplicates"], "near_pairs": stats["near_pairs"],
              "band_plan": stats["band_plan"], "phases": stats["seconds"]["phases"],
              "kinds": {k: stats[k] for k in ("duplicate_exact", "duplicate_near",
                                              "duplicate_mirror", "duplicate_crop")}}
    if args.check and rows <= 10**6:
        oracle = _python(ORACLE, str(raw), str(out))
        same_stats = all(stats[k] == v for k, v in oracle["stats"].items())
        result["identical_to_single_process"] = oracle["same_rows"] and same_stats
        result["single_process"] = {"seconds": oracle["seconds"],
                                    "peak_rss_mib": oracle["peak_rss_mib"]}
    shutil.rmtree(raw)
    shutil.rmtree(out.parent)
    return result


def measure_plan(rows: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from scale_plan import measure_plan as plan  # bench/scale_plan.py

    return plan(rows, work)


SHARDS_PLAN_DRIVER = textwrap.dedent("""
    import json, sys, time
    from collections import defaultdict
    import pyarrow.parquet as pq
    from pairforge.pipeline.plan import Decisions
    from pairforge.records import shard_of_key
    path, how = sys.argv[1], sys.argv[2]
    started = time.perf_counter()
    if how == "counts":  # what plan_shards does now: counts per shard, no key kept
        counts = Decisions((path,)).counts()
        one = len(Decisions((path,)).of_shard(7))  # what one shard's task reads
        found = {"shards": len(counts), "dropped": sum(counts.values()), "shard_7": one}
    else:  # what it did before: every decision in a dict per shard on the driver
        table = pq.read_table(path, columns=["key", "kind", "kept_key"])
        by_shard = defaultdict(dict)
        for key, kind, kept in zip(table["key"].to_pylist(), table["kind"].to_pylist(),
                                   table["kept_key"].to_pylist()):
            by_shard[shard_of_key(key, 4)][key] = (kind, kept)
        found = {"shards": len(by_shard), "dropped": sum(map(len, by_shard.values())),
                 "shard_7": len(by_shard[7])}
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "driver_peak_rss_mib": PEAK, **found}))
""").replace("PEAK", PEAK)


def measure_shards(rows: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Stage 3's plan over a duplicates table of a tenth of ``rows`` (10^4-row shards):
    the counts it holds now against the dict of every decision it held before."""
    from pairforge.dedup.decide import DUPLICATES_SCHEMA
    from pairforge.records import make_key

    rng = np.random.default_rng(args.seed)
    path = work / f"duplicates-{rows}.parquet"
    dropped = np.sort(rng.choice(rows, rows // 10, replace=False))
    with pq.ParquetWriter(path, DUPLICATES_SCHEMA) as writer:
        for chunk in np.array_split(dropped, max(1, len(dropped) // 1_000_000)):
            keys = [make_key(int(i) // SHARD_ROWS, int(i) % SHARD_ROWS) for i in chunk]
            writer.write_table(pa.table({
                "key": keys, "kind": ["duplicate_near"] * len(keys), "cluster_id": keys,
                "kept_key": keys, "kept_source": pa.nulls(len(keys), pa.string()),
                "distance": pa.array(np.ones(len(keys), np.int32))}, schema=DUPLICATES_SCHEMA))
    now = _python(SHARDS_PLAN_DRIVER, str(path), "counts")
    before = _python(SHARDS_PLAN_DRIVER, str(path), "dict")
    path.unlink()
    assert {k: now[k] for k in ("shards", "dropped", "shard_7")} == \
        {k: before[k] for k in ("shards", "dropped", "shard_7")}
    return {**now, "before": {k: before[k] for k in ("seconds", "driver_peak_rss_mib")}}


SEMANTIC_LARGEST = 2 * 10**6  # x 512 floats: 4 GiB of embeddings on disk


def measure_semantic(rows: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from scale_semantic import measure_semantic as semantic  # bench/scale_semantic.py

    return semantic(min(rows, SEMANTIC_LARGEST), work, args.check and rows <= 10**6)


STAGES: dict[str, Callable[[int, Path, argparse.Namespace], dict[str, Any]]] = {
    "plan": measure_plan,
    "dedup": measure_dedup,
    "semantic": measure_semantic,
    "shards": measure_shards,
}


def _stage_sizes(stage: str, sizes: list[int]) -> list[int]:
    """The semantic pass stops at SEMANTIC_LARGEST (a larger size is measured there)."""
    if stage != "semantic":
        return sizes
    return sorted({min(s, SEMANTIC_LARGEST) for s in sizes})


def growth(sizes: list[int], seconds: list[float]) -> list[float]:
    """Exponent of the time's growth between consecutive sizes."""
    return [math.log(seconds[i + 1] / seconds[i]) / math.log(sizes[i + 1] / sizes[i])
            for i in range(len(sizes) - 1)]


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    parser.add_argument("--quick", action="store_true", help="stop at 10^6 rows")
    parser.add_argument("--check", action="store_true",
                        help="dedup, semantic: compare with the single-process decision "
                        "(<= 10^6 rows)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--work", type=Path, help="folder for the generated files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = sorted(s for s in args.sizes if not args.quick or s <= 10**6)
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=args.work))
    results: dict[str, dict[str, Any]] = {}
    try:
        for stage in args.stages:
            results[stage] = {}
            for rows in _stage_sizes(stage, sizes):
                results[stage][str(rows)] = STAGES[stage](rows, work, args)
                print(f"{stage} {rows:,}: {json.dumps(results[stage][str(rows)])}",
                      flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| stage | rows | driver peak RSS (MiB) | seconds | growth exponent |")
    print("|---|---:|---:|---:|---:|")
    for stage, by_rows in results.items():
        rows = [int(r) for r in by_rows]
        exponents = [None, *growth(rows, [by_rows[str(r)]["seconds"] for r in rows])]
        for r, exponent in zip(rows, exponents, strict=True):
            figures = by_rows[str(r)]
            print(f"| {stage} | {r:,} | {figures['driver_peak_rss_mib']:.0f} | "
                  f"{figures['seconds']:.1f} | "
                  f"{'' if exponent is None else f'{exponent:.2f}'} |")


if __name__ == "__main__":
    main()
