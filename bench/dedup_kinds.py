"""Issue 19's parts of ``bench/dedup.py``: recall per duplicate kind, hashing cost in
stage 1, the all-kinds join at 10^6 images and semantic dedup of 10^6 embeddings.
Run through ``python bench/dedup.py --parts ...`` (its docstring says what each does)."""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
from common import COCO_IMAGES, TESTS, best_cpu_ms, max_rss_mib
from PIL import Image, ImageEnhance, ImageOps

from pairforge.config import DedupConfig, ImageConfig
from pairforge.dedup.decide import ROWS_SCHEMA
from pairforge.dedup.grids import GridCheck
from pairforge.dedup.hashing import perceptual_hashes, phash_u64
from pairforge.dedup.reference import find_duplicates, local_mapper, semantic_duplicates
from pairforge.dedup.semantic import default_clusters
from pairforge.download.imageproc import ProcessedImage, process_image
from pairforge.records import make_key

sys.path.insert(0, str(TESTS))  # the quadratic references
from references import brute_force_pairs  # noqa: E402

KINDS = ("copy", "png_twin", "jpeg_q60", "png_reencode", "brighter", "half", "double",
         "crop2", "mirror", "crop10")


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def variants(data: bytes) -> dict[str, bytes]:
    """The issue's ten planted kinds, as files a web server would serve."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    w, h = image.size
    dx, dy = round(w * 0.1), round(h * 0.1)
    q60 = _encode(image, "JPEG", quality=60)
    return {
        "copy": data, "png_twin": _encode(image, "PNG"), "jpeg_q60": q60,
        "png_reencode": _encode(Image.open(io.BytesIO(q60)), "PNG"),
        "brighter": _encode(ImageEnhance.Brightness(image).enhance(1.05), "JPEG", quality=95),
        "half": _encode(image.resize((w // 2, h // 2), Image.LANCZOS), "JPEG", quality=90),
        "double": _encode(image.resize((w * 2, h * 2), Image.LANCZOS), "JPEG", quality=90),
        "crop2": _encode(image.crop((2, 2, w, h)), "JPEG", quality=95),
        "mirror": _encode(ImageOps.mirror(image), "JPEG", quality=95),
        "crop10": _encode(image.crop((dx, dy, w - dx, h - dy)), "JPEG", quality=95),
    }


def _row(key: str, image: ProcessedImage) -> dict:
    return {"key": key, "exact": image.pixel_hash, "phash": image.phash,
            "phash_mirror": image.phash_mirror, "crop_phashes": list(image.crop_phashes),
            "colour_grid": image.colour_grid, "original_width": image.original_width,
            "original_height": image.original_height}


def kinds_part(families: int) -> None:
    cfg = ImageConfig()
    files = sorted(COCO_IMAGES.iterdir())
    rows, origin = [], {}  # origin: key -> (photo, kind)
    for i, f in enumerate(files):
        rows.append(_row(make_key(0, i), process_image(f.read_bytes(), cfg)))
        origin[rows[-1]["key"]] = (f.name, "original")
    for n, f in enumerate(files[:families]):
        for j, (kind, data) in enumerate(variants(f.read_bytes()).items()):
            rows.append(_row(make_key(1 + n, j), process_image(data, cfg)))
            origin[rows[-1]["key"]] = (f.name, kind)
    table = pa.Table.from_pylist(rows, schema=ROWS_SCHEMA)
    print(f"\n{len(files)} photos, {families} with {len(KINDS)} planted variants each "
          f"({len(rows):,} rows)")
    for name, check in _CHECKS.items():
        print(f"\n### {name}")
        _recall(table, origin, check)
    _closest(rows[:len(files)])


_CHECKS = {"grid checks off": GridCheck(),
           "colour check only": replace(GridCheck.of(DedupConfig()), max_structure_distance=None),
           "colour and structure checks (the defaults)": GridCheck.of(DedupConfig())}


def _recall(table: pa.Table, origin: dict, check: GridCheck) -> None:
    started = time.perf_counter()
    dropped = {r["key"]: r for r in find_duplicates(
        table, DedupConfig().max_distance, check=check).duplicates.to_pylist()}
    took = time.perf_counter() - started
    cluster = {k: dropped[k]["cluster_id"] if k in dropped else k for k in origin}
    original = {photo: k for k, (photo, kind) in origin.items() if kind == "original"}
    hits, labels = defaultdict(list), defaultdict(lambda: defaultdict(int))
    for key, (photo, kind) in origin.items():
        if kind != "original":
            hits[kind].append(cluster[key] == cluster[original[photo]])
            if key in dropped:
                labels[kind][dropped[key]["kind"].removeprefix("duplicate_")] += 1
    wrong = [k for k, r in dropped.items() if origin[k][0] != origin[r["kept_key"]][0]]
    print(f"find_duplicates {took:.2f}s")
    print("\n| variant | caught | recall | labelled as |\n|---|---:|---:|---|")
    for kind in KINDS:
        got = hits[kind]
        named = ", ".join(f"{k} {v}" for k, v in sorted(labels[kind].items()))
        print(f"| {kind} | {sum(got)}/{len(got)} | {sum(got) / len(got):.3f} | {named} |")
    print(f"\nfalse merges (dropped for another photo): {len(wrong)} {wrong[:5]}")


def scenes_part() -> None:
    """The demo's bundled sample (10,000 scenes drawn at 32 px, pairforge/sample): hashed
    as stage 1 hashes them, decided under each set of checks; how many rows are dropped,
    and how many for a scene with another caption (the world's own caption of each
    image, not its alt-text)."""
    from pairforge.sample.generate import HERE
    from pairforge.scenes.world import scenes

    truth = [s.caption for s in scenes(9000, "train") + scenes(1000, "heldout")]
    cfg = ImageConfig(image_size=32, resize_mode="keep_ratio", encode_format="png")
    rows = [_row(make_key(0, i), process_image(
        (HERE / "images" / f"scene_{i:05d}.png").read_bytes(), cfg)) for i in range(len(truth))]
    table = pa.Table.from_pylist(rows, schema=ROWS_SCHEMA)
    print(f"\n{len(rows):,} scenes of the bundled sample; max_distance "
          f"{DedupConfig().max_distance}\n")
    row_of = {r["key"]: i for i, r in enumerate(rows)}
    print("| checks | mirrors | dropped | for another scene | by kind |\n|---|---|---:|---:|---|")
    for name, check in _CHECKS.items():
        for mirrors in (True, False):
            started = time.perf_counter()
            found = find_duplicates(table, DedupConfig().max_distance,
                                    check=replace(check, mirrors=mirrors)).duplicates
            took = time.perf_counter() - started
            dropped = found.to_pylist()
            wrong = sum(truth[row_of[d["key"]]] != truth[row_of[d["kept_key"]]] for d in dropped)
            kinds = Counter(d["kind"].removeprefix("duplicate_") for d in dropped)
            print(f"| {name} | {mirrors} | {len(dropped):,} | {wrong:,} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} ({took:.1f} s) |")


def demo_part(out: Path) -> None:
    """A finished demo build (``make demo``): its rows dropped by dedup, and how many of
    them for a scene with another caption or across the training and held-out scenes
    (the world's own caption of each image, by the scene number in its URL)."""
    import re

    import pyarrow.parquet as pq

    from pairforge.scenes.world import scenes

    truth = [s.caption for s in scenes(9000, "train") + scenes(1000, "heldout")]
    raw = pq.read_table(sorted((out / "raw").glob("*.parquet")), columns=["key", "url"])
    scene_of = {k: int(re.search(r"scene_(\d+)", u).group(1))
                for k, u in zip(raw["key"].to_pylist(), raw["url"].to_pylist(), strict=True)}
    dropped = pq.read_table(out / "dedup" / "duplicates.parquet").to_pylist()
    other = sum(truth[scene_of[d["key"]]] != truth[scene_of[d["kept_key"]]] for d in dropped)
    across = sum((scene_of[d["key"]] >= 9000) != (scene_of[d["kept_key"]] >= 9000)
                 for d in dropped)
    kinds = Counter(d["kind"] for d in dropped)
    print(f"\n{out}: {len(scene_of):,} raw rows, {len(dropped):,} dropped ({dict(kinds)}); "
          f"for a scene with another caption: {other}; across training and held-out: {across}")


def _closest(originals: list[dict]) -> None:
    whole = np.array([r["phash"] for r in originals], dtype=np.uint64)
    points = np.array([[r["phash"], r["phash_mirror"], *r["crop_phashes"]] for r in originals],
                      dtype=np.uint64)
    d = np.bitwise_count(whole[:, None] ^ whole[None, :]).astype(np.int64)
    every = np.bitwise_count(points[:, None, :, None] ^ points[None, :, None, :]
                             ).min(axis=(2, 3)).astype(np.int64)
    upper = np.triu(np.ones(d.shape, bool), 1)
    for name, m in (("whole hash to whole hash", d), ("any point to any point", every)):
        values, counts = np.unique(m[upper], return_counts=True)
        print(f"closest distinct photos, {name}: " + ", ".join(
            f"{v} bits: {c}" for v, c in list(zip(values.tolist(), counts.tolist(),
                                                  strict=True))[:5]))


def _old_phash(image: Image.Image) -> int:
    """The phash before issue 19 (integer box pre-reduction), for its cost only."""
    from pairforge.dedup.hashing import _DCT_ROWS, _bits

    grey = image.convert("L")
    factor = min(grey.size) // 64
    if factor >= 2:
        grey = grey.reduce(factor)
    thumb = grey.resize((32, 32), Image.Resampling.LANCZOS)
    return _bits(np.round(_DCT_ROWS @ np.asarray(thumb, dtype=np.float64) @ _DCT_ROWS.T, 6))


def cost_part() -> None:
    files = sorted(COCO_IMAGES.iterdir())
    bodies = [f.read_bytes() for f in files]
    big = [_encode(Image.open(io.BytesIO(b)).convert("RGB").resize((1280, 960), Image.LANCZOS),
                   "JPEG", quality=90) for b in bodies[:100]]
    cfg = ImageConfig()
    print("\n| input | decoded size hashed | phash, before (box pre-reduction) | phash now | "
          "all hashes now (whole, mirror, 2 regions + mirrors) | process_image whole |")
    print("|---|---|---:|---:|---:|---:|")
    for name, items in (("COCO sample (<= 300 px)", bodies), ("COCO at 1,280x960", big)):
        decoded = [_decoded_as_stage1(b, cfg) for b in items]
        size = f"{decoded[0].width}x{decoded[0].height}"
        print(f"| {name} | {size} | {best_cpu_ms(_old_phash, decoded, 3):.3f} ms | "
              f"{best_cpu_ms(phash_u64, decoded, 3):.3f} ms | "
              f"{best_cpu_ms(perceptual_hashes, decoded, 3):.3f} ms"
              f" | {best_cpu_ms(lambda b: process_image(b, cfg), items, 2):.2f} ms |")


def _decoded_as_stage1(body: bytes, cfg: ImageConfig) -> Image.Image:
    """The image stage 1 hashes: drafted by libjpeg as process_image drafts it."""
    from pairforge.download.imageproc import _draft, _plan_resize

    image = Image.open(io.BytesIO(body))
    plan = _plan_resize(image.width, image.height, cfg)
    if plan.resize is not None:
        _draft(image, plan.resize)
    return image.convert("RGB")


def _random_hashes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # 32 set bits like a real phash's; the top bit set, as the DC coefficient always is
    return rng.integers(0, 2**63, shape, dtype=np.uint64) | np.uint64(1 << 63)


def join_part(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    regions = 4
    copies = n // 100
    base = n - copies
    whole, mirror = _random_hashes(rng, (base,)), _random_hashes(rng, (base,))
    crops = _random_hashes(rng, (base, regions))
    source = rng.choice(base, copies, replace=False)
    flips = np.zeros((copies, 2 + regions), np.uint64)
    for _ in range(3):  # up to 3 bits flipped in every point of a copy
        flips |= np.uint64(1) << rng.integers(0, 63, flips.shape).astype(np.uint64)
    whole = np.concatenate([whole, whole[source] ^ flips[:, 0]])
    mirror = np.concatenate([mirror, mirror[source] ^ flips[:, 1]])
    crops = np.concatenate([crops, crops[source] ^ flips[:, 2:]])
    table = pa.table({
        "key": pa.array([make_key(i // 10_000, i % 10_000) for i in range(n)], pa.string()),
        "exact": pa.array([f"{i:032x}" for i in range(n)], pa.string()),
        "phash": pa.array(whole, pa.uint64()), "phash_mirror": pa.array(mirror, pa.uint64()),
        "crop_phashes": pa.FixedSizeListArray.from_arrays(pa.array(crops.reshape(-1),
                                                                   pa.uint64()), regions
                                                          ).cast(pa.list_(pa.uint64())),
        "original_width": pa.array(np.full(n, 640), pa.int32()),
        "original_height": pa.array(np.full(n, 480), pa.int32()),
    }, schema=ROWS_SCHEMA)
    for workers in (1, 2):
        started = time.perf_counter()
        result = find_duplicates(table, DedupConfig().max_distance, mapper=local_mapper(workers))
        took = time.perf_counter() - started
        dropped = set(result.duplicates["key"].to_pylist())
        found = sum(make_key((base + i) // 10_000, (base + i) % 10_000) in dropped
                    for i in range(copies))
        print(f"\njoin of {n:,} images x {2 + regions} hashes ({result.stats['distinct_phashes']:,}"
              f" distinct values, {result.stats['band_plan']}), {workers} thread(s): "
              f"{took:.1f}s; planted copies dropped {found:,}/{copies:,}; near pairs "
              f"{result.stats['near_pairs']:,}; peak RSS {max_rss_mib() / 1024:.1f} GiB")


def _embeddings(n: int, seed: int, dim: int = 512, topics: int = 1000
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """``n`` embeddings around ``topics`` directions, the last 1 % planted copies of
    ``source`` rows (cosine ~0.97-0.995); returns (x, source, first copy's index)."""
    rng = np.random.default_rng(seed)
    copies = n // 100
    base = n - copies
    x = np.empty((n, dim), np.float32)
    centres = rng.standard_normal((topics, dim), dtype=np.float32)
    for start in range(0, base, 100_000):  # in chunks: one float64 copy would be 4 GB
        stop = min(base, start + 100_000)
        x[start:stop] = 0.6 * centres[rng.integers(0, topics, stop - start)]
        x[start:stop] += rng.standard_normal((stop - start, dim), dtype=np.float32)
    source = rng.choice(base, copies, replace=False)
    scale = rng.uniform(0.05, 0.2, (copies, 1)).astype(np.float32)
    x[base:] = x[source] + scale * np.linalg.norm(x[source], axis=1, keepdims=True) / np.sqrt(
        dim) * rng.standard_normal((copies, dim), dtype=np.float32)
    return x, source, base


def semantic_part(n: int, seed: int, probes: int) -> None:
    x, source, base = _embeddings(n, seed)
    keys = pa.array([make_key(i // 10_000, i % 10_000) for i in range(n)], pa.string())
    k = default_clusters(n, 1000)
    started = time.perf_counter()
    result = semantic_duplicates(keys, x, np.full(n, 10_000), 0.95, k, probes=probes)
    took = time.perf_counter() - started
    dropped = set(result.duplicates["key"].to_pylist())
    found = sum(keys[base + i].as_py() in dropped or keys[int(s)].as_py() in dropped
                for i, s in enumerate(source))
    print(f"\nsemantic dedup of {n:,} x {x.shape[1]} embeddings, {k:,} clusters, {probes} "
          f"probe(s): {took:.1f}s; "
          f"{result.stats}; planted copies caught {found:,}/{len(source):,}; peak RSS "
          f"{max_rss_mib() / 1024:.1f} GiB")
    del x
    _semantic_vs_all_pairs(20_000, seed)


def _semantic_vs_all_pairs(n: int, seed: int) -> None:
    """The k-means approximation against comparing all pairs, on a set small enough."""
    x, _, _ = _embeddings(n, seed + 1)
    keys = pa.array([make_key(i // 10_000, i % 10_000) for i in range(n)], pa.string())
    k = default_clusters(n, 1000)
    reference = brute_force_pairs(x, 0.95)
    for probes in (1, 2):
        result = semantic_duplicates(keys, x, np.full(n, 10_000), 0.95, k, probes=probes)
        print(f"{n:,} embeddings in {k} clusters, {probes} probe(s): {result.stats['pairs']:,} "
              f"pairs found of the {len(reference):,} that all-pairs comparison finds "
              f"({result.stats['pairs'] / max(1, len(reference)):.4f})")


def _write_scored_shards(root: Path, x: np.ndarray, keys: list[str], shard_size: int) -> None:
    """OUT/raw, OUT/clip and OUT/embeddings as stage 1 and CLIP's scoring pass leave them."""
    import json

    import pyarrow.parquet as pq

    from pairforge.records import raw_schema
    from pairforge.shards.storage import OutputDir
    from pairforge.shards.training import write_embeddings

    out = OutputDir(str(root))
    for name in ("raw", "clip"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(keys), shard_size)):
        part = keys[start:start + shard_size]
        columns = {n: pa.nulls(len(part)) for n in raw_schema().names}
        columns.update(key=pa.array(part), status=pa.array(["ok"] * len(part)),
                       original_width=pa.array([640] * len(part), pa.int32()),
                       original_height=pa.array([480] * len(part), pa.int32()))
        table = pa.table({n: columns[n].cast(raw_schema().field(n).type)
                          for n in raw_schema().names})
        pq.write_table(table, root / "raw" / f"{shard:05d}.parquet")
        (root / "raw" / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": len(part), "status": {"ok": len(part)}}))
        pq.write_table(pa.table({"key": part, "status": ["ok"] * len(part),
                                 "clip_score": pa.array([0.3] * len(part), pa.float32())}),
                       root / "clip" / f"{shard:05d}.parquet")
        write_embeddings(out, shard, part, x[start:start + shard_size])


def semantic_ray_part(n: int, seed: int, probes: int) -> None:
    """The stage's own pass (pipeline/semantic_stage.py) on a local 2-CPU Ray: shard
    files read by tasks, k-means on the driver on a sample, the rest as Ray tasks."""
    import shutil
    import tempfile

    from pairforge.config import parse_config
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.ray_runtime import init_ray
    from pairforge.pipeline.semantic_stage import run_semantic_dedup
    from pairforge.shards.storage import OutputDir

    shard_size = 10_000
    x, _, _ = _embeddings(n, seed)
    keys = [make_key(i // shard_size, i % shard_size) for i in range(n)]
    root = Path(tempfile.mkdtemp(prefix="semantic-bench-"))
    try:
        started = time.perf_counter()
        _write_scored_shards(root, x, keys, shard_size)
        print(f"\nwrote {n:,} embeddings in {n // shard_size} shards in "
              f"{time.perf_counter() - started:.0f}s")
        del x
        cfg = parse_config({"input": {"path": "unused", "shard_size": shard_size},
                            "output": {"path": str(root)},
                            "ray": {"num_cpus": 2, "object_store_memory": 5 * 1024**3},
                            "dedup": {"enabled": False,
                                      "semantic": {"enabled": True, "probes": probes}},
                            "process": {"clip": {"enabled": True, "mode": "score_only"}}})
        init_ray(cfg.ray)
        started = time.perf_counter()
        stats = run_semantic_dedup(cfg, OutputDir(str(root)), steps=[ClipStep])
        took = time.perf_counter() - started
        print(f"semantic pass on Ray (2 CPUs), {n:,} x 512, {probes} probe(s): {took:.1f}s "
              f"(Ray start not counted); {stats}; peak RSS of the driver "
              f"{max_rss_mib() / 1024:.1f} GiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_parts(args: argparse.Namespace) -> bool:
    """Run issue 19's parts; True when nothing else (the band part) is asked for."""
    if "kinds" in args.parts:
        kinds_part(args.kind_families)
    if "scenes" in args.parts:
        scenes_part()
    if "demo" in args.parts:
        demo_part(args.demo_out)
    if "cost" in args.parts:
        cost_part()
    if "join" in args.parts:
        join_part(args.join_rows, args.seed)
    if "semantic" in args.parts:
        semantic_part(args.semantic_rows, args.seed, args.probes)
    if "semantic-ray" in args.parts:
        semantic_ray_part(args.semantic_rows, args.seed, args.probes)
    return "band" not in args.parts
