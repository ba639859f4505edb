"""Where stage 1's CPU goes per image: the Pillow floor, the image pass, fetching, a shard.

    python bench/stage1_profile.py                 # photos at 1,280 px (bench/common.py)
    python bench/stage1_profile.py --photos web    # 640-2,048 px; --photos coco: as shipped
    python bench/stage1_profile.py --decoders 15   # only 5. and 6., 15 interleaved rounds
    python bench/stage1_profile.py --resizers 6    # only 7., 6 interleaved rounds
    python bench/stage1_profile.py --parts --photos web   # only 8. and 9.

CPU time, not wall time: the build machine is shared, and CPU per image is what decides
how many images a core turns out. It is the whole process's CPU time, never one thread's:
libvips computes on its own worker thread, which a thread clock misses (this bench read
``thread_time`` before 2026-12-03 18:40 and put the libvips resize at 1.2-1.5 ms, not
~2.5). Four measurements, each the best of --repeats passes:

1. The Pillow floor: the calls an image pass cannot skip, one image at a time on one
   thread: open + JPEG draft + decode, Pillow bicubic resize to keep_ratio 256, JPEG q95
   encode, sha256 of the body, the pixel hash of the decoded pixels (XXH3-128 since
   2026-12-04 16:30; sha256 before), the 64-bit phash. The libvips
   resize the stage uses is timed beside Pillow's.
2. ``process_image`` (the stage's image pass: checks, EXIF, the three hashes, resize, encode).
3. ``Fetcher.fetch`` of the same photos from nginx (bench/common.py), 32 threads: the
   process's CPU per image (Python's HTTP client, the socket reads).
4. ``download_shard`` in this process (no Ray), 32 threads: the whole task of one shard
   (fetch, image pass, tar and parquet writing), with per-call CPU of its parts.

What Ray adds (starting it, each worker's imports, its own processes) is measured by
bench/download.py --verbose, which sums CPU over the whole process tree.

With ``--decoders ROUNDS``, instead (no server), JPEG decoders side by side: in each round
the variants take turns on every photo, so a round compares them under the same load:

5. Pillow (draft, decode, ``tobytes``) against simplejpeg at the same scale (the stage's
   ``_decode`` both ways), the same at full size (no draft), then ``process_image`` with
   ``turbo=False`` and as it runs.
6. simplejpeg's M/8 scales (its own choice: the smallest M/8 leaving both sides >= the
   target, e.g. 3/8 for 1,280 -> 341x256) against the draft scale, not used by the stage:
   CPU of decode + pixel hash + perceptual hashes + libvips resize, and PSNR of the
   resized pixels against a Lanczos resize of the full-size decode.

With ``--parts`` (no server):

8. ``process_image``'s steps in the order it takes them, each photo through all of them
   before the next (so each step meets the caches the one before left, as in the stage):
   the checked decode, pixel hash, perceptual hashes, resize, encode, sha256, colour
   grid, against the whole call on the same photos.
9. What the bound of issue 46 item 1 costs: the plan and ICO checks per image, and the
   memory guard (download/memory_guard.py) per second of a task, idle but for it.

With ``--resizers ROUNDS`` (no server):

7. Downscalers of the stage's decode (the draft scale) to keep_ratio 256, taking turns on
   every photo: libvips with each of its kernels, Pillow's Lanczos, and, when OpenCV is
   installed (``pip install opencv-python-headless``; not a pairforge dependency), its
   linear, cubic and area resizes and a Gaussian pre-blur before a cubic one (cv2 on one
   thread, as each of the stage's fetch threads would run it). CPU, and PSNR against
   Pillow's Lanczos of the full-size decode.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyvips
import simplejpeg
from common import BENCH, arg_parser, best_cpu_ms, describe, photo_set, read_stat, start_hosts
from PIL import Image

from pairforge.config import DownloadConfig, ImageConfig, load_config  # noqa: E402
from pairforge.dedup.grids import colour_grid  # noqa: E402
from pairforge.dedup.hashing import (  # noqa: E402
    perceptual_hashes,
    phash_u64,
    pixel_hash_hex,
    sha256_hex,
)
from pairforge.download import imageproc, jpegdecode  # noqa: E402
from pairforge.download import shard as download  # noqa: E402
from pairforge.download.fetch import Fetcher  # noqa: E402
from pairforge.download.imageproc import process_image  # noqa: E402
from pairforge.download.memory_guard import MemoryGuard  # noqa: E402
from pairforge.download.resample import downscale  # noqa: E402
from pairforge.pipeline.contract import shard_config  # noqa: E402
from pairforge.pipeline.download_stage import input_shards  # noqa: E402
from pairforge.pipeline.settings import settings_record, stage_settings  # noqa: E402
from pairforge.shards import raw  # noqa: E402

SIZE = 256


def keep_ratio(width: int, height: int) -> tuple[int, int]:
    scale = SIZE / min(width, height)
    return round(width * scale), round(height * scale)


def decode(body: bytes) -> tuple[Image.Image, tuple[int, int]]:
    image = Image.open(io.BytesIO(body))
    target = keep_ratio(*image.size)
    image.draft("RGB", target)
    image.load()
    return image, target


def encode(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def floor(bodies: list[bytes], repeats: int) -> None:
    decoded = [decode(b) for b in bodies]
    resized = [image.resize(target, Image.Resampling.BICUBIC) for image, target in decoded]
    parts = {
        "open + draft + decode": best_cpu_ms(decode, bodies, repeats),
        "resize, Pillow bicubic": best_cpu_ms(
            lambda d: d[0].resize(d[1], Image.Resampling.BICUBIC), decoded, repeats),
        "encode JPEG q95": best_cpu_ms(encode, resized, repeats),
        "sha256 of the body": best_cpu_ms(lambda b: hashlib.sha256(b).digest(), bodies, repeats),
        "pixel hash (XXH3-128)": best_cpu_ms(lambda d: pixel_hash_hex(d[0]), decoded, repeats),
        "phash": best_cpu_ms(lambda d: phash_u64(d[0]), decoded, repeats),
    }
    vips = best_cpu_ms(lambda d: downscale(d[0].tobytes(), d[0].size, d[1]), decoded, repeats)
    every_phash = best_cpu_ms(lambda d: perceptual_hashes(d[0]), decoded, repeats)
    grid = best_cpu_ms(lambda d: colour_grid(d[0]), decoded, repeats)
    print("1. Pillow floor, ms CPU per image:")
    for name, ms in parts.items():
        print(f"   {name:28s} {ms:6.2f}")
    total = sum(parts.values())
    with_vips = total - parts["resize, Pillow bicubic"] + vips
    print(f"   {'floor (sum)':28s} {total:6.2f}")
    print(f"   resize with libvips (stage) {vips:6.2f}  -> floor with it {with_vips:.2f}")
    print(f"   phash + mirror + crop hashes (stage) {every_phash:.2f}")
    print(f"   colour grid (stage) {grid:.2f}")


def image_pass(bodies: list[bytes], repeats: int) -> None:
    cfg = ImageConfig(image_size=SIZE, encode_quality=95)
    ms = best_cpu_ms(lambda b: process_image(b, cfg), bodies, repeats)
    print(f"2. process_image: {ms:.2f} ms CPU per image")


def fetching(urls: list[str], repeats: int) -> None:
    cfg = DownloadConfig(allow_addresses=["127.0.0.0/8"])
    best = float("inf")
    for _ in range(repeats):
        with Fetcher(cfg) as fetcher, ThreadPoolExecutor(32) as pool:
            start = time.process_time()
            results = list(pool.map(fetcher.fetch, urls))
            best = min(best, (time.process_time() - start) / len(urls) * 1e3)
    ok = sum(r.body is not None for r in results)
    print(f"3. Fetcher.fetch, 32 threads: {best:.2f} ms CPU per image ({ok}/{len(urls)} ok)")


def vips_worker_seconds() -> float:
    """CPU seconds so far of this process's libvips worker threads (the resize runs there,
    outside the thread clock of the caller that _Timers reads)."""
    stats = (read_stat(task / "stat") for task in Path("/proc/self/task").iterdir())
    return sum(s[2] for s in stats if s is not None and s[0].startswith("libvips"))


class _Timers:
    """Thread-CPU per call of some functions, summed over every thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[label] += time.thread_time() - start

        setattr(owner, name, timed)


def shard(urls: list[str], repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"URL": urls, "TEXT": [f"a photo, {i}" for i in range(len(urls))]}),
                       inp)
        timers = _Timers()
        timers.wrap(download.Fetcher, "fetch", "fetch")
        timers.wrap(download, "process_image", "process_image")
        timers.wrap(raw.RawShardWriter, "add", "tar + row (writer.add)")
        timers.wrap(raw.RawShardWriter, "close", "parquet + stats (writer.close)")
        best, parts = float("inf"), {}
        for run in range(repeats):
            cfg = load_config(BENCH / "dl.yaml", [
                f"input.path={inp}", f"output.path={Path(tmp) / f'out{run}'}",
                f"input.shard_size={len(urls)}"])
            timers.seconds.clear()
            with input_shards(cfg) as shards:
                start, vips = time.process_time(), vips_worker_seconds()
                settings = settings_record(stage_settings(cfg, "download"))
                download.download_shard(shards[0], shard_config(cfg), settings)
                cpu = (time.process_time() - start) / len(urls) * 1e3
                timers.seconds["libvips worker threads"] = vips_worker_seconds() - vips
            if cpu < best:
                best, parts = cpu, {k: v / len(urls) * 1e3 for k, v in timers.seconds.items()}
    print(f"4. download_shard, 32 threads, no Ray: {best:.2f} ms CPU per image; of it:")
    for name, ms in parts.items():
        print(f"   {name:32s} {ms:6.2f}")


def interleaved(variants: dict[str, Callable], items: list, rounds: int
                ) -> dict[str, list[float]]:
    """Process-CPU ms per item of each variant in each round. The variants take turns on
    every item, their order rotating, so each meets the same moments of a loaded
    machine (load drifts over seconds; a whole pass per variant would not share them)."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for i, item in enumerate(items):
            shift = (turn + i) % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.process_time()
                variants[name](item)
                spent[name] += time.process_time() - start
        for name in names:
            times[name].append(spent[name] / len(items) * 1e3)
    return times


def print_rounds(times: dict[str, list[float]]) -> None:
    """min / median of each variant, and its per-round ratio to the first variant."""
    first = next(iter(times.values()))
    for name, ms in times.items():
        ratios = sorted(m / f for m, f in zip(ms, first, strict=True))
        print(f"   {name:52s} min {min(ms):6.2f}  median {np.median(ms):6.2f} ms"
              f"   / first: median {np.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")


def stage_decode(body: bytes, turbo: bool, draft: bool = True
                 ) -> tuple[Image.Image, bytes | memoryview]:
    """The stage's decode of a photo for keep_ratio 256: Pillow's or simplejpeg's path."""
    image = Image.open(io.BytesIO(body))
    target = keep_ratio(*image.size) if draft else None
    decoded = imageproc._decode(image, body, target, turbo)
    if decoded is None:
        return imageproc._pillow_rgb(image)
    return imageproc._turbo_rgb(image, decoded)


def decoders(bodies: list[bytes], rounds: int) -> None:
    cfg = ImageConfig(image_size=SIZE, encode_quality=95)
    same = sum(process_image(b, cfg) == process_image(b, cfg, turbo=False) for b in bodies)
    print(f"5. Pillow against simplejpeg, {rounds} interleaved rounds, ms CPU per image "
          f"(results equal on {same}/{len(bodies)}):")
    print_rounds(interleaved({
        "decode: Pillow draft + decode + tobytes (before)": lambda b: stage_decode(b, False),
        "decode: simplejpeg + Pillow copy (now)": lambda b: stage_decode(b, True),
    }, bodies, rounds))
    print_rounds(interleaved({  # what a photo under 2x its target (no draft) costs
        "decode at full size: Pillow": lambda b: stage_decode(b, False, draft=False),
        "decode at full size: simplejpeg": lambda b: stage_decode(b, True, draft=False),
    }, bodies, rounds))
    print_rounds(interleaved({
        "process_image, turbo=False (before)": lambda b: process_image(b, cfg, turbo=False),
        "process_image (now)": lambda b: process_image(b, cfg),
    }, bodies, rounds))


def _after_decode(pixels: np.ndarray, target: tuple[int, int]) -> Image.Image:
    """The stage's work on decoded pixels short of the encode: pixel hash, perceptual
    hashes, libvips resize."""
    height, width = pixels.shape[:2]
    rgb = Image.frombuffer("RGB", (width, height), pixels, "raw", "RGB", 0, 1)
    flat = memoryview(pixels).cast("B")
    pixel_hash_hex(rgb, flat)
    perceptual_hashes(rgb)
    return downscale(flat, (width, height), target)


def at_scale(body: bytes, eighths: bool) -> tuple[np.ndarray, tuple[int, int]]:
    """simplejpeg's decode for keep_ratio 256: at the draft scale, or at its own M/8."""
    size = Image.open(io.BytesIO(body)).size
    target = keep_ratio(*size)
    if eighths:
        return simplejpeg.decode_jpeg(body, "rgb", min_width=target[0],
                                      min_height=target[1]), target
    return jpegdecode.decode(body, size, imageproc._draft_scale(size, target)), target


def psnr(ours: Image.Image, reference: np.ndarray) -> float:
    error = np.mean((np.asarray(ours, np.float64) - reference) ** 2)
    return float(10 * np.log10(255.0 ** 2 / error)) if error else float("inf")


def quality(bodies: list[bytes]) -> None:
    scores: dict[str, list[float]] = defaultdict(list)
    scales: dict[str, int] = defaultdict(int)
    for body in bodies:
        full = Image.open(io.BytesIO(body)).convert("RGB")
        target = keep_ratio(*full.size)
        reference = np.asarray(full.resize(target, Image.Resampling.LANCZOS), np.float64)
        flat = np.asarray(full)
        scores["full-size decode"].append(psnr(_after_decode(flat, target), reference))
        for name, eighths in (("draft scale (stage)", False), ("M/8 scale", True)):
            pixels, _ = at_scale(body, eighths)
            scales[f"{name} {round(8 * pixels.shape[1] / full.width)}/8"] += 1
            scores[name].append(psnr(_after_decode(pixels, target), reference))
    print("   PSNR of the libvips resize against Pillow's Lanczos of the full-size decode:")
    for name, values in scores.items():
        print(f"   libvips from the {name:24s} mean {np.mean(values):6.2f} dB, "
              f"min {min(values):6.2f}")
    print("   decode scales (photos):", ", ".join(f"{k}: {v}" for k, v in sorted(scales.items())))


def eighths_scales(bodies: list[bytes], rounds: int) -> None:
    print(f"6. simplejpeg's M/8 scales (not used), {rounds} interleaved rounds, ms CPU per "
          "image of decode + pixel hash + perceptual hashes + libvips resize:")
    print_rounds(interleaved({
        "draft scale (the stage)": lambda b: _after_decode(*at_scale(b, False)),
        "M/8 scale": lambda b: _after_decode(*at_scale(b, True)),
        "decode only, draft scale": lambda b: at_scale(b, False),
        "decode only, M/8 scale": lambda b: at_scale(b, True),
    }, bodies, rounds))
    quality(bodies)


def _vips(kernel: str) -> Callable:
    def resize(item: tuple[np.ndarray, tuple[int, int]]) -> Image.Image:
        pixels, target = item
        if kernel == "lanczos3":  # the stage's own call
            return downscale(memoryview(pixels).cast("B"), pixels.shape[1::-1], target)
        height, width = pixels.shape[:2]
        source = pyvips.Image.new_from_memory(memoryview(pixels).cast("B"), width, height,
                                              3, "uchar")
        out = source.resize(target[0] / width, vscale=target[1] / height, kernel=kernel)
        return Image.frombuffer("RGB", (out.width, out.height), out.write_to_memory(),
                                "raw", "RGB", 0, 1).crop((0, 0, *target))
    return resize


def _opencv_resizers() -> dict[str, Callable]:
    try:
        import cv2
    except ImportError:
        print("   (OpenCV not installed: its rows are left out)")
        return {}
    cv2.setNumThreads(1)

    def plain(flag: int) -> Callable:
        return lambda item: Image.fromarray(cv2.resize(*item, interpolation=flag))

    def blurred(item: tuple[np.ndarray, tuple[int, int]]) -> Image.Image:
        # sigma 0.5 (factor - 1), scikit-image's anti-aliasing rule
        pixels, target = item
        sigma_x = 0.5 * (pixels.shape[1] / target[0] - 1)
        sigma_y = 0.5 * (pixels.shape[0] / target[1] - 1)
        if sigma_x > 0:
            pixels = cv2.GaussianBlur(pixels, (0, 0), sigmaX=sigma_x, sigmaY=sigma_y)
        return Image.fromarray(cv2.resize(pixels, target, interpolation=cv2.INTER_CUBIC))

    return {f"OpenCV {cv2.__version__} INTER_LINEAR": plain(cv2.INTER_LINEAR),
            "OpenCV INTER_CUBIC": plain(cv2.INTER_CUBIC),
            "OpenCV INTER_AREA": plain(cv2.INTER_AREA),
            "OpenCV Gaussian blur + INTER_CUBIC": blurred}


def resizers(bodies: list[bytes], rounds: int) -> None:
    items = [(np.ascontiguousarray(pixels), target)
             for pixels, target in (at_scale(b, False) for b in bodies)]
    print(f"7. Downscalers from the draft scale, {rounds} interleaved rounds, ms CPU per "
          "image, and PSNR against Pillow's Lanczos of the full-size decode:")
    variants = {f"libvips {k}{' (the stage)' if k == 'lanczos3' else ''}": _vips(k)
                for k in ("lanczos3", "lanczos2", "cubic", "mitchell", "linear")}
    variants["Pillow LANCZOS"] = lambda item: Image.fromarray(item[0]).resize(
        item[1], Image.Resampling.LANCZOS)
    variants.update(_opencv_resizers())
    print_rounds(interleaved(variants, items, rounds))
    scores: dict[str, list[float]] = defaultdict(list)
    for body, item in zip(bodies, items, strict=True):
        full = Image.open(io.BytesIO(body)).convert("RGB")
        reference = np.asarray(full.resize(item[1], Image.Resampling.LANCZOS), np.float64)
        if item[0].shape[:2] == (full.height, full.width):
            continue  # no draft: Pillow's Lanczos would be the reference itself
        for name, resize in variants.items():
            scores[name].append(psnr(resize(item), reference))
    for name, values in scores.items():
        print(f"   PSNR {name:40s} mean {np.mean(values):6.2f} dB, min {min(values):6.2f} "
              f"({len(values)} photos)")

def _steps(body: bytes, cfg: ImageConfig, spent: dict[str, float]) -> None:
    """``imageproc._process``'s steps on one photo, each step's process CPU added up."""
    clock = time.process_time
    start = clock()
    d = imageproc._decode_checked(body, cfg, True, True)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("pixel hash", lambda: pixel_hash_hex(d.rgb, d.pixels)),
        ("perceptual hashes (6)", lambda: perceptual_hashes(d.rgb)),
        ("resize (libvips)", lambda: imageproc._apply_plan(d.rgb, d.pixels, d.plan,
                                                          cfg.image_size)),
    ]
    spent["open, checks, decode, EXIF"] += clock() - start
    for name, step in steps:
        start = clock()
        out = step()
        spent[name] += clock() - start
    for name, step in [("encode JPEG q95", lambda: imageproc._encode(out, cfg)),
                       ("sha256 of the body", lambda: sha256_hex(body)),
                       ("colour grid", lambda: colour_grid(d.rgb))]:
        start = clock()
        step()
        spent[name] += clock() - start


def parts(bodies: list[bytes], repeats: int) -> None:
    cfg = ImageConfig(image_size=SIZE, encode_quality=95)
    best: dict[str, float] = {}
    for _ in range(repeats):
        spent: dict[str, float] = defaultdict(float)
        for body in bodies:
            _steps(body, cfg, spent)
        if not best or sum(spent.values()) < sum(best.values()):
            best = dict(spent)
    whole = best_cpu_ms(lambda b: process_image(b, cfg), bodies, repeats)
    print("8. process_image step by step, ms CPU per image (the best pass):")
    for name, seconds in best.items():
        print(f"   {name:28s} {seconds / len(bodies) * 1e3:6.3f}")
    print(f"   {'sum':28s} {sum(best.values()) / len(bodies) * 1e3:6.3f}; the whole call "
          f"{whole:.3f}")
    bound(bodies, cfg)


def bound(bodies: list[bytes], cfg: ImageConfig) -> None:
    """Issue 46 item 1's checks per image and the memory guard's sampling per second."""
    opened = [imageproc._open(b) for b in bodies]
    plans = [imageproc._plan_resize(*image.size, cfg) for image in opened]
    pairs = list(zip(opened, plans, strict=True)) * 50
    plan_us = best_cpu_ms(lambda p: imageproc._check_plan(p[0], p[1], cfg, True), pairs, 5) * 1e3
    icon_us = best_cpu_ms(lambda b: imageproc._check_icon(b, cfg), bodies * 50, 5) * 1e3
    print(f"9. plan check {plan_us:.2f} us per image, ICO pre-check {icon_us:.2f} us; "
          "memory guard, process CPU per second of an otherwise idle task:")
    for _ in range(3):
        for guarded in (True, False):
            start = time.process_time()
            if guarded:
                with MemoryGuard(4096, None):  # type: ignore[arg-type]
                    time.sleep(5)
            else:
                time.sleep(5)
            print(f"   {'with the guard' if guarded else 'without':14s} "
                  f"{(time.process_time() - start) / 5 * 1e3:6.2f} ms")


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--photos", default="1280", help="web, coco, or a size in px")
    parser.add_argument("--images", type=int, default=200, help="photos in steps 1 and 2")
    parser.add_argument("--rows", type=int, default=1000, help="rows in steps 3 and 4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decoders", type=int, default=0, metavar="ROUNDS",
                        help="only JPEG decoders side by side (5. and 6.), in ROUNDS rounds")
    parser.add_argument("--parts", action="store_true",
                        help="only the image pass step by step and the bound's cost (8., 9.)")
    parser.add_argument("--resizers", type=int, default=0, metavar="ROUNDS",
                        help="only downscalers side by side (7.), in ROUNDS rounds")
    args = parser.parse_args()
    folder = photo_set(args.photos)
    files = sorted(folder.glob("*.jpg"))
    bodies = [f.read_bytes() for f in files[:args.images]]
    print(f"{describe(folder)}; keep_ratio {SIZE} jpg q95")
    if args.decoders:
        decoders(bodies, args.decoders)
        eighths_scales(bodies, args.decoders)
        return
    if args.resizers:
        resizers(bodies, args.resizers)
        return
    if args.parts:
        parts(bodies, args.repeats)
        return
    floor(bodies, args.repeats)
    image_pass(bodies, args.repeats)
    hosts = start_hosts(folder)
    try:
        urls = [f"{hosts.base_urls[0]}/{files[i % len(files)].name}" for i in range(args.rows)]
        print(f"(served by {hosts.server})")
        fetching(urls, args.repeats)
        shard(urls, args.repeats)
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
