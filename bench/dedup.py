"""Near-duplicate search of stage 2: time, growth with size, and recall of planted pairs.

    python bench/dedup.py [--sizes 10000 100000 1000000] [--workers 1]
    python bench/dedup.py --parts kinds cost join semantic      (issue 19, see below)
    python bench/dedup.py --parts kinds scenes demo             (issue 35: the grid checks)

Stage 2 itself as Ray partition tasks, its driver's memory and its growth to 10^7 rows:
``bench/scale.py --stages dedup`` (issue 34).

Parts (``--parts``, default ``band``):

* ``band``: the band join over one 64-bit hash per image (what follows this list).
* ``kinds``: recall per planted variant kind (same file, PNG twin, JPEG q60, PNG
  re-encode, +5 % brightness, half, double, 2-px crop, mirror, 10 % crop) of ``--families``
  photos among all the COCO sample photos, hashed by stage 1's own image code
  (``process_image``) and decided by ``find_duplicates``; false merges among distinct
  photos and the closest distinct pairs (whole hash, and over every point the join uses).
* ``scenes``: the demo's 10,000 scenes drawn at 32 px (pairforge/sample), hashed by
  ``process_image`` and decided under each set of grid checks, mirrors counted or not:
  rows dropped, and dropped for a scene with another caption (the world's own caption).
* ``demo``: the same count from a finished ``make demo`` build (``--demo-out``), read from
  its ``dedup/duplicates.parquet`` and raw shards.
* ``cost``: CPU per image of the hashes in stage 1 (the whole-image phash alone, all
  perceptual hashes, the pre-issue-19 box-reduced phash, and ``process_image`` whole).
* ``join``: ``find_duplicates`` (all hash kinds: whole, mirror, regions) on ``--join-rows``
  images (default 10^6): COCO rows plus synthetic rows with random hashes and 1 % planted
  copies (a few bits flipped in every point).
* ``semantic``: semantic dedup (``filters/semantic``) of ``--semantic-rows`` (default 10^6)
  512-d embeddings around 1,000 topics with 1 % planted copies (cosine 0.97-0.995): time,
  planted copies found, and the k-means approximation against all pairs on a subset.
* ``semantic-ray``: the same embeddings through the stage's own pass on a local 2-CPU Ray
  (``pipeline/semantic_stage.run_semantic_dedup`` over shard files as CLIP writes them).

Each size holds the perceptual hashes of the 399 COCO sample photos, of planted variants
of some of them (re-encodes, resizes, 2-pixel crops, brightness, PNG/WebP), of a few
generated images (smooth random fields, so real phash structure), synthetic planted
near-duplicates (a hash with 1..t bits flipped) and, for the rest, random 64-bit values
with the top bit set (as in every real phash: the DC coefficient is the largest).

Reported: seconds of ``near_pairs`` per size, the growth exponent (slope of log time on
log size), the speedup over all-pairs comparison on the smallest size (which also checks
that both find the same number of pairs), and whether every planted pair within the
distance was found.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import time
from pathlib import Path

import numpy as np
from common import COCO_IMAGES, REPO, TESTS, arg_parser
from PIL import Image, ImageEnhance, ImageOps

from pairforge.config import DedupConfig
from pairforge.dedup.bands import HASH_BITS, plan_bands
from pairforge.dedup.hashing import phash_u64
from pairforge.dedup.reference import local_mapper, near_pairs

sys.path.insert(0, str(TESTS))  # the quadratic references
from references import all_pairs_count  # noqa: E402

TOP_BIT = np.uint64(1 << 63)


def _decode(data: bytes) -> Image.Image:
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def _reencoded(image: Image.Image, fmt: str, **options) -> Image.Image:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return _decode(out.getvalue())


def _variants(image: Image.Image) -> list[Image.Image]:
    w, h = image.size
    return [
        _reencoded(image, "JPEG", quality=60),
        _reencoded(image, "WEBP", quality=80),
        _reencoded(image, "PNG"),
        image.resize((w // 2, h // 2), Image.LANCZOS),
        image.resize((w * 2, h * 2), Image.LANCZOS),
        image.crop((2, 2, w, h)),
        ImageEnhance.Brightness(image).enhance(1.05),
    ]


def coco_hashes(families: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Phashes of the COCO photos and of variants of ``families`` of them, with the pairs."""
    files = sorted(COCO_IMAGES.iterdir())
    originals = [phash_u64(_decode(f.read_bytes())) for f in files]
    pairs = []
    for f, base in zip(files[:families], originals, strict=False):
        for variant in _variants(_decode(f.read_bytes())):
            pairs.append((base, phash_u64(variant)))
    return np.array(originals, dtype=np.uint64), pairs


def generated_hashes(count: int, rng: np.random.Generator) -> np.ndarray:
    """Phashes of smooth random images: structured like photos, none alike."""
    out = []
    for _ in range(count):
        small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((256, 192), Image.BICUBIC)
        out.append(phash_u64(image))
    return np.array(out, dtype=np.uint64)


def flip_bits(values: np.ndarray, distance: np.ndarray, rng: np.random.Generator
              ) -> np.ndarray:
    """Each value with exactly ``distance`` distinct bits flipped."""
    out = values.copy()
    for i, d in enumerate(distance.tolist()):
        for bit in rng.choice(HASH_BITS, d, replace=False).tolist():
            out[i] ^= np.uint64(1 << bit)
    return out


def build_set(n: int, base: np.ndarray, real_pairs: list[tuple[int, int]], t: int,
              rng: np.random.Generator) -> tuple[np.ndarray, set[tuple[int, int]]]:
    """n distinct hashes and the planted pairs (as value pairs) within distance t."""
    planted = {tuple(sorted(p)) for p in real_pairs if 0 < (p[0] ^ p[1]).bit_count() <= t}
    real = np.unique(np.concatenate([base, np.array([v for p in real_pairs for v in p],
                                                    dtype=np.uint64)]))
    synthetic = max(n // 100, 10)  # 1% of the set are planted near-duplicates
    pad = n - len(real) - 2 * synthetic
    random = rng.integers(0, 2**63, pad + synthetic, dtype=np.uint64) | TOP_BIT
    sources = random[:synthetic]
    copies = flip_bits(sources, rng.integers(1, t + 1, synthetic), rng)
    planted |= {tuple(sorted((int(a), int(b)))) for a, b in zip(sources, copies, strict=True)}
    values = np.unique(np.concatenate([real, random, copies]))
    rng.shuffle(values)
    return values, planted


def found_all(values: np.ndarray, pairs: np.ndarray, planted: set[tuple[int, int]]) -> int:
    """Number of planted pairs that the search did not return."""
    got = {tuple(sorted((int(values[a]), int(values[b])))) for a, b in pairs}
    return len(planted - got)


def time_search(values: np.ndarray, t: int, mapper, repeats: int) -> tuple[float, np.ndarray]:
    best, pairs = math.inf, None
    for _ in range(repeats):
        started = time.perf_counter()
        pairs = near_pairs(values, t, mapper).pairs
        best = min(best, time.perf_counter() - started)
    return best, pairs


def slope(sizes: list[int], seconds: list[float]) -> float:
    x, y = np.log(sizes), np.log(seconds)
    return float(np.polyfit(x, y, 1)[0])


def _parser() -> argparse.ArgumentParser:
    parser = arg_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6])
    parser.add_argument("--max-distance", type=int, default=DedupConfig().max_distance)
    parser.add_argument("--workers", type=int, default=1, help="threads (or Ray CPUs)")
    parser.add_argument("--families", type=int, default=30, help="COCO photos varied")
    parser.add_argument("--generated", type=int, default=500, help="generated images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", nargs="+", default=["band"],
                        choices=["band", "kinds", "scenes", "demo", "cost", "join", "semantic",
                                 "semantic-ray"])
    parser.add_argument("--demo-out", type=Path, default=REPO / "out" / "demo",
                        help="a finished `make demo` build (demo part)")
    parser.add_argument("--kind-families", type=int, default=300,
                        help="photos with planted variants (kinds part)")
    parser.add_argument("--join-rows", type=int, default=10**6)
    parser.add_argument("--semantic-rows", type=int, default=10**6)
    parser.add_argument("--probes", type=int, default=2, help="semantic: clusters per row")
    return parser


def main() -> None:
    args = _parser().parse_args()
    from dedup_kinds import run_parts  # issue 19's parts live beside this file

    if run_parts(args):
        return
    t, rng = args.max_distance, np.random.default_rng(args.seed)

    started = time.perf_counter()
    base, real_pairs = coco_hashes(args.families)
    base = np.concatenate([base, generated_hashes(args.generated, rng)])
    print(f"hashed {len(base)} images and {len(real_pairs)} COCO variants in "
          f"{time.perf_counter() - started:.1f}s; max_distance {t}, {args.workers} workers")
    rows, sizes, seconds = [], [], []
    for n in sorted(args.sizes):
        values, planted = build_set(n, base, real_pairs, t, rng)
        repeats = 3 if n <= 10**5 else 1
        took, pairs = time_search(values, t, local_mapper(args.workers), repeats)
        missed = found_all(values, pairs, planted)
        row = {"n": len(values), "seconds": took, "pairs": len(pairs), "planted": len(planted),
               "missed": missed, "plan": plan_bands(len(values), HASH_BITS, t).describe()}
        if n == min(args.sizes):
            begun = time.perf_counter()
            reference = all_pairs_count(values, t)
            row["all_pairs_seconds"] = time.perf_counter() - begun
            assert reference == len(pairs), (reference, len(pairs))
        rows.append(row)
        sizes.append(len(values))
        seconds.append(took)
        print(f"  n={len(values):>9,}  {took:8.3f}s  pairs {len(pairs):>7,}  "
              f"planted {len(planted):>6,} missed {missed}  ({row['plan']})", flush=True)

    print("\n| hashes | seconds | pairs found | planted pairs | missed | band plan |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['n']:,} | {r['seconds']:.3f} | {r['pairs']:,} | {r['planted']:,} | "
              f"{r['missed']} | {r['plan']} |")
    if len(sizes) > 1:
        pairwise = [math.log(seconds[i + 1] / seconds[i]) / math.log(sizes[i + 1] / sizes[i])
                    for i in range(len(sizes) - 1)]
        print(f"\ngrowth exponent (fit over all sizes): {slope(sizes, seconds):.2f}; "
              f"between sizes: {', '.join(f'{p:.2f}' for p in pairwise)}")
    first = rows[0]
    brute, fast = first["all_pairs_seconds"], first["seconds"]
    extrapolated = brute * (sizes[-1] / sizes[0]) ** 2
    print(f"all-pairs on {first['n']:,} hashes: {brute:.3f}s, band join {fast:.4f}s: "
          f"speedup {brute / fast:.0f}x (all-pairs would take ~{extrapolated:,.0f}s "
          f"on {sizes[-1]:,})")
    print("every planted pair found:", all(r["missed"] == 0 for r in rows))


if __name__ == "__main__":
    main()
