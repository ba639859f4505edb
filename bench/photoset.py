"""Photos at web sizes for the stage-1 benchmark, made once from the COCO sample.

The 399 COCO sample photos are at most 300 px; real web images are mostly larger, and
decoding cost grows with pixels. ``photo_set`` re-encodes every photo with its longer side
at a size drawn (seeded) from 640-2,048 px, or at one fixed size, as JPEG q90, into a cache
folder under the system temp dir (world-readable, so nginx's worker can serve it). The
photos are upscales, so they compress better than camera photos of the same size; decode
time follows the pixel count more than the bytes.

Upscales have no detail finer than the 300 px originals, so they flatter anything that
throws detail away (a coarser decode scale, a cheaper filter). ``mosaic`` is a set with
camera detail at 1,280 px: 1,280x960 mosaics of 5x5 photos at their own resolution (the
centre 256x192 of landscape photos), photos drawn seeded, JPEG q90.
"""

from __future__ import annotations

import io
import os
import random
import tempfile
from pathlib import Path

from PIL import Image

COCO = Path("/work/shared/data/coco-sample/images")
CACHE = Path(tempfile.gettempdir()) / "pairforge-bench"
QUALITY = 90


MOSAIC_TILE, MOSAIC_GRID, MOSAICS = (256, 192), 5, 80


def spec_name(spec: str) -> str:
    """``coco`` (as shipped), ``web`` (640-2,048 px), ``mosaic`` or a size like ``1280``."""
    if spec not in ("coco", "web", "mosaic") and not spec.isdigit():
        raise ValueError(f"photo set {spec!r}: coco, web, mosaic or a size in px")
    return spec


def _longer_side(spec: str, rng: random.Random) -> int:
    return rng.randint(640, 2048) if spec == "web" else int(spec)


def _reencode(source: Path, side: int) -> bytes:
    image = Image.open(source).convert("RGB")
    scale = side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def _mosaic(sources: list[Path]) -> bytes:
    (tile_w, tile_h), grid = MOSAIC_TILE, MOSAIC_GRID
    canvas = Image.new("RGB", (tile_w * grid, tile_h * grid))
    for i, path in enumerate(sources):
        image = Image.open(path).convert("RGB")
        left, top = (image.width - tile_w) // 2, (image.height - tile_h) // 2
        tile = image.crop((left, top, left + tile_w, top + tile_h))
        canvas.paste(tile, (i % grid * tile_w, i // grid * tile_h))
    buffer = io.BytesIO()
    canvas.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def _mosaic_set(source: Path, folder: Path) -> None:
    wide = [p for p in sorted(source.glob("*.jpg"))
            if all(a >= b for a, b in zip(Image.open(p).size, MOSAIC_TILE, strict=True))]
    rng = random.Random(0)
    for i in range(MOSAICS):
        target = folder / f"mosaic_{i:03d}.jpg"
        target.write_bytes(_mosaic(rng.sample(wide, MOSAIC_GRID * MOSAIC_GRID)))
        os.chmod(target, 0o644)


def _reencoded_set(spec: str, source: Path, folder: Path) -> None:
    rng = random.Random(0)
    for path in sorted(source.glob("*.jpg")):
        target = folder / path.name
        target.write_bytes(_reencode(path, _longer_side(spec, rng)))
        os.chmod(target, 0o644)


def photo_set(spec: str = "web", source: Path = COCO) -> Path:
    """The folder of the set's photos (the COCO sample's names; ``mosaic_N.jpg`` for
    mosaics), made if missing."""
    spec = spec_name(spec)
    if spec == "coco":
        return source
    folder = CACHE / f"photos-{spec}"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for path in (CACHE, folder):
        os.chmod(path, 0o755)
    if spec == "mosaic":
        _mosaic_set(source, folder)
    else:
        _reencoded_set(spec, source, folder)
    done.touch()
    return folder


def describe(folder: Path) -> str:
    """``N photos, longer side A-B px (median M), mean K KB``."""
    files = sorted(folder.glob("*.jpg"))
    sides = sorted(max(Image.open(f).size) for f in files)
    kb = sum(f.stat().st_size for f in files) / len(files) / 1024
    return (f"{len(files)} photos, longer side {sides[0]}-{sides[-1]} px "
            f"(median {sides[len(sides) // 2]}), mean {kb:.0f} KB")
