"""ms/image of download.imageproc.process_image, with and without JPEG draft decoding.

    python bench/imageproc.py                     # COCO sample as is, 256 keep_ratio jpg
    python bench/imageproc.py --source-scale 6    # the same photos as ~1800 px JPEGs
    python bench/imageproc.py --threads 8         # throughput with a thread pool

The COCO sample photos are about 300 px, so at image_size 256 the resize is at most 1.2x
and draft never applies; --source-scale re-encodes them larger (in memory, JPEG q90) to
stand for camera-size web images, where it does.
"""

from __future__ import annotations

import argparse
import io
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from PIL import Image

from pairforge.config import ImageConfig
from pairforge.download.imageproc import ImageFailure, process_image

COCO = Path("/work/shared/data/coco-sample/images")


def load_bodies(folder: Path, limit: int, source_scale: float) -> list[bytes]:
    files = sorted(folder.glob("*.jpg"))[:limit]
    bodies = [f.read_bytes() for f in files]
    if source_scale == 1:
        return bodies
    scaled = []
    for body in bodies:
        image = Image.open(io.BytesIO(body)).convert("RGB")
        size = (round(image.width * source_scale), round(image.height * source_scale))
        buffer = io.BytesIO()
        image.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
        scaled.append(buffer.getvalue())
    return scaled


def run(bodies: list[bytes], cfg: ImageConfig, draft: bool, threads: int,
        repeats: int) -> tuple[float, float]:
    """Best (wall, CPU) ms/image over ``repeats`` passes.

    CPU time (all threads of this process) is the steadier number on a shared machine;
    wall time is the throughput when --threads > 1.
    """
    job = partial(process_image, cfg=cfg, draft=draft)
    best_wall = best_cpu = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            results = list(pool.map(job, bodies)) if threads > 1 else [job(b) for b in bodies]
            best_wall = min(best_wall, (time.perf_counter() - wall) / len(bodies) * 1e3)
            best_cpu = min(best_cpu, (time.process_time() - cpu) / len(bodies) * 1e3)
    failed = sum(isinstance(r, ImageFailure) for r in results)
    if failed:
        print(f"  ({failed} of {len(bodies)} images failed)")
    return best_wall, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, default=COCO)
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--resize-mode", default="keep_ratio")
    parser.add_argument("--format", default="jpg", choices=["jpg", "webp", "png"])
    parser.add_argument("--source-scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-draft", action="store_true", help="only the run without draft")
    args = parser.parse_args()

    bodies = load_bodies(args.images, args.limit, args.source_scale)
    first = Image.open(io.BytesIO(bodies[0]))
    cfg = ImageConfig(image_size=args.image_size, resize_mode=args.resize_mode,
                      encode_format=args.format)
    print(f"{len(bodies)} images (first {first.size[0]}x{first.size[1]}), "
          f"{args.resize_mode} {args.image_size} {args.format}, {args.threads} thread(s)")
    for draft in ([False] if args.no_draft else [True, False]):
        wall, cpu = run(bodies, cfg, draft, args.threads, args.repeats)
        print(f"  draft={'on ' if draft else 'off'}  {wall:6.2f} ms/image wall, "
              f"{cpu:6.2f} ms/image CPU")


if __name__ == "__main__":
    main()
