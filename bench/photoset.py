"""Photos at web sizes for the stage-1 benchmark, made once from the COCO sample.

The 399 COCO sample photos are at most 300 px; real web images are mostly larger, and
decoding cost grows with pixels. ``photo_set`` re-encodes every photo with its longer side
at a size drawn (seeded) from 640-2,048 px, or at one fixed size, as JPEG q90, into a cache
folder under the system temp dir (world-readable, so nginx's worker can serve it). The
photos are upscales, so they compress better than camera photos of the same size; decode
time follows the pixel count more than the bytes.
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


def spec_name(spec: str) -> str:
    """``coco`` (as shipped), ``web`` (640-2,048 px) or a fixed size like ``1280``."""
    if spec not in ("coco", "web") and not spec.isdigit():
        raise ValueError(f"photo set {spec!r}: coco, web or a size in px")
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


def photo_set(spec: str = "web", source: Path = COCO) -> Path:
    """The folder of the set's photos (same names as the COCO sample), made if missing."""
    spec = spec_name(spec)
    if spec == "coco":
        return source
    folder = CACHE / f"photos-{spec}"
    files = sorted(source.glob("*.jpg"))
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for path in (CACHE, folder):
        os.chmod(path, 0o755)
    rng = random.Random(0)
    for path in files:
        target = folder / path.name
        target.write_bytes(_reencode(path, _longer_side(spec, rng)))
        os.chmod(target, 0o644)
    done.touch()
    return folder


def describe(folder: Path) -> str:
    """``N photos, longer side A-B px (median M), mean K KB``."""
    files = sorted(folder.glob("*.jpg"))
    sides = sorted(max(Image.open(f).size) for f in files)
    kb = sum(f.stat().st_size for f in files) / len(files) / 1024
    return (f"{len(files)} photos, longer side {sides[0]}-{sides[-1]} px "
            f"(median {sides[len(sides) // 2]}), mean {kb:.0f} KB")
