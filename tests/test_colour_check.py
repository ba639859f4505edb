"""The grid checks of near-duplicate decisions (issue 35, item 4; filters/grids.py):
phashes see luminance only, coarsely, so images that differ in colour or in a small
shape's outline can share a hash; stage 2 never merges two images whose colour grids
differ by more than ``dedup.max_colour_distance`` in a cell of the 8x8 grid, or by more
than ``dedup.max_structure_distance`` deviations in a cell of the 16x16 grid."""

from __future__ import annotations

import hashlib
import io
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
from conftest import COCO_IMAGES
from PIL import Image, ImageEnhance, ImageOps

from pairforge.config import DedupConfig, ImageConfig
from pairforge.dedup import grids
from pairforge.dedup.decide import ROWS_SCHEMA
from pairforge.dedup.grids import (
    FRAMES,
    GRID_BYTES,
    GRID_SIDE,
    GridCheck,
    colour_distance,
    colour_grid,
    legacy_form,
)
from pairforge.dedup.index import INDEX_SCHEMA
from pairforge.dedup.reference import find_duplicates
from pairforge.download.imageproc import ProcessedImage, process_image
from pairforge.scenes.world import COLOURS, render, scenes

CHECKS = GridCheck.of(DedupConfig())  # the defaults: colour, structure, mirrors count
COLOUR_ONLY = replace(CHECKS, max_structure_distance=None)
OFF = GridCheck()
T = DedupConfig().max_distance


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _jpeg(image: Image.Image, quality: int = 95) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _row(key: str, image: ProcessedImage) -> dict:
    return {"key": key, "exact": image.pixel_hash, "phash": image.phash,
            "phash_mirror": image.phash_mirror, "crop_phashes": list(image.crop_phashes),
            "colour_grid": image.colour_grid, "original_width": image.original_width,
            "original_height": image.original_height}


def _decide(rows: list[dict], check: GridCheck, index: pa.Table | None = None
            ) -> dict[str, dict]:
    table = pa.Table.from_pylist(rows, schema=ROWS_SCHEMA)
    result = find_duplicates(table, T, index, check=check)
    return {r["key"]: r for r in result.duplicates.to_pylist()}


def test_the_grid_and_its_distance() -> None:
    red = Image.new("RGB", (64, 64), (200, 40, 40))
    blue = Image.new("RGB", (64, 64), (40, 80, 200))
    assert len(colour_grid(red)) == GRID_BYTES == 3 * 16 * 16 * 3
    assert colour_distance(colour_grid(red), colour_grid(red.resize((128, 128)))) == 0
    assert colour_distance(colour_grid(red), colour_grid(blue)) > 100
    half = Image.new("RGB", (64, 64), (128, 128, 128))
    half.paste(red.crop((0, 0, 32, 64)), (0, 0))
    # the mirror is compared mirrored
    assert colour_distance(colour_grid(half), colour_grid(ImageOps.mirror(half))) == 0
    assert colour_distance(colour_grid(half), colour_grid(ImageOps.mirror(half)),
                           mirrors=False) > CHECKS.max_colour_distance


def test_recoloured_scenes_are_kept_and_copies_of_each_still_merge() -> None:
    """Scene-world scenes and the same scenes with their first object in another colour:
    phash merges many pairs, the colour check none; a 2x copy, a mirror and a PNG twin
    of every scene still merge with it."""
    cfg = ImageConfig()
    rows, scene_of = [], {}
    for i, s in enumerate(scenes(40)):
        other = next(c for c in COLOURS if c != s.things[0].colour)
        recoloured = replace(s, things=(replace(s.things[0], colour=other), *s.things[1:]))
        image = render(s, 64)
        variants = {"original": image, "recoloured": render(recoloured, 64),
                    "double": image.resize((128, 128), Image.LANCZOS),
                    "mirror": ImageOps.mirror(image)}
        for kind, picture in variants.items():
            key = f"{i:03d}{kind[:2]}"
            rows.append(_row(key, process_image(_png(picture), cfg)))
            scene_of[key] = (i, kind)
        rows.append({**rows[-4], "key": f"{i:03d}tw"})  # a PNG twin: the same pixels
        scene_of[f"{i:03d}tw"] = (i, "twin")

    def cluster(dropped: dict[str, dict], key: str) -> str:
        return dropped[key]["kept_key"] if key in dropped else key

    def recoloured_merged(dropped: dict[str, dict]) -> int:
        return sum(cluster(dropped, f"{i:03d}re") == cluster(dropped, f"{i:03d}or")
                   for i in range(40))

    without = _decide(rows, OFF)
    checked = _decide(rows, COLOUR_ONLY)
    assert recoloured_merged(without) >= 20  # phash alone merges most recolourings
    assert recoloured_merged(checked) == 0
    for key, (scene, kind) in scene_of.items():  # every copy in its original's cluster
        if kind in ("double", "mirror", "twin"):
            assert cluster(checked, key) == cluster(checked, f"{scene:03d}or"), key


@pytest.mark.parametrize("families", [30])
def test_photo_duplicates_keep_their_recall(families: int) -> None:
    """Re-encodes, resizes, small and 10 % crops, brightness and mirrors of real photos
    are all still caught with the check on, and no two photos merge."""
    cfg = ImageConfig()
    photos = sorted(COCO_IMAGES.glob("*.jpg"))[:families]
    rows, photo_of = [], {}
    for i, path in enumerate(photos):
        image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        w, h = image.size
        dx, dy = round(w * 0.1), round(h * 0.1)
        variants = {"original": path.read_bytes(), "q60": _jpeg(image, 60),
                    "half": _jpeg(image.resize((w // 2, h // 2), Image.LANCZOS), 90),
                    "double": _jpeg(image.resize((w * 2, h * 2), Image.LANCZOS), 90),
                    "crop2": _jpeg(image.crop((2, 2, w, h))),
                    "brighter": _jpeg(ImageEnhance.Brightness(image).enhance(1.05)),
                    "mirror": _jpeg(ImageOps.mirror(image)),
                    "crop10": _jpeg(image.crop((dx, dy, w - dx, h - dy)))}
        for j, data in enumerate(variants.values()):
            rows.append(_row(f"{i:03d}{j}", process_image(data, cfg)))
            photo_of[rows[-1]["key"]] = i
    checked = _decide(rows, CHECKS)
    assert len(checked) == families * 7  # every variant, or its original, dropped
    assert all(photo_of[k] == photo_of[r["kept_key"]] for k, r in checked.items())
    assert _decide(rows, OFF).keys() == checked.keys()
    # mirrors off: the mirrored copies stay (with the check on or off), nothing else moves
    no_mirrors = _decide(rows, replace(CHECKS, mirrors=False))
    mirrors = {f"{i:03d}6" for i in range(families)}
    assert no_mirrors.keys() == checked.keys() - mirrors
    assert not {r["kept_key"] for r in no_mirrors.values()} & mirrors
    assert "duplicate_mirror" not in {r["kind"] for r in no_mirrors.values()}


def test_an_index_without_grids_merges_as_before() -> None:
    """An index written before the grid existed has none: its rows match on the hashes
    only (the check needs both grids), as they did."""
    cfg = ImageConfig()
    for s in scenes(40):  # a scene whose recolouring has the same whole-image hash
        other = next(c for c in COLOURS if c != s.things[0].colour)
        red = process_image(_png(render(s, 64)), cfg)
        blue = process_image(_png(render(replace(
            s, things=(replace(s.things[0], colour=other), *s.things[1:])), 64)), cfg)
        if red.phash == blue.phash:
            break
    assert red.phash == blue.phash
    old = {"key": "old", "source": "earlier", "pixel_hash": "x" * 32, "phash": red.phash,
           "phash_mirror": red.phash_mirror, "crop_phashes": list(red.crop_phashes),
           "colour_grid": None, "original_width": 64, "original_height": 64}
    index = pa.Table.from_pylist([old], schema=INDEX_SCHEMA)
    assert set(_decide([_row("blue", blue)], CHECKS, index)) == {"blue"}
    with_grid = pa.Table.from_pylist([{**old, "colour_grid": red.colour_grid}],
                                     schema=INDEX_SCHEMA)
    assert _decide([_row("blue", blue)], CHECKS, with_grid) == {}
    # a grid in the layout written before the structure check is compared in that form
    legacy = pa.Table.from_pylist([{**old, "colour_grid": legacy_form(red.colour_grid)}],
                                  schema=INDEX_SCHEMA)
    assert len(legacy_form(red.colour_grid)) == 192 + 2 * 48
    assert _decide([_row("blue", blue)], CHECKS, legacy) == {}
    assert set(_decide([_row("red", red)], CHECKS, legacy)) == {"red"}


def test_scenes_that_differ_in_one_shape_are_kept_and_copies_still_merge() -> None:
    """The demo's case: scenes drawn at 32 px and the same scenes with their first object
    in another shape (same colour, same place): a 64-bit phash and the colour check merge
    many such pairs, the structure check none. With mirrors off (the demo: its captions
    say left and right) no row is dropped for a scene with another caption, and a PNG
    twin and a 2x copy of every scene merge with it."""
    cfg = ImageConfig(image_size=32, encode_format="png")
    rows, caption_of = [], {}
    for i, s in enumerate(scenes(60)):
        other = "square" if s.things[0].shape == "circle" else "circle"
        reshaped = replace(s, things=(replace(s.things[0], shape=other), *s.things[1:]))
        image = render(s, 32)
        for kind, picture in {"or": image, "re": render(reshaped, 32),
                              "do": image.resize((64, 64), Image.BICUBIC)}.items():
            rows.append(_row(f"{i:03d}{kind}", process_image(_png(picture), cfg)))
            caption_of[rows[-1]["key"]] = reshaped.caption if kind == "re" else s.caption
        rows.append({**rows[-3], "key": f"{i:03d}tw"})  # a PNG twin of the original
        caption_of[f"{i:03d}tw"] = s.caption

    def reshaped_merged(dropped: dict[str, dict]) -> int:
        cluster = {k: dropped[k]["kept_key"] if k in dropped else k for k in caption_of}
        return sum(cluster[f"{i:03d}re"] == cluster[f"{i:03d}or"] for i in range(60))

    assert reshaped_merged(_decide(rows, COLOUR_ONLY)) >= 15
    assert reshaped_merged(_decide(rows, CHECKS)) == 0
    checked = _decide(rows, replace(CHECKS, mirrors=False))
    assert reshaped_merged(checked) == 0
    assert all(caption_of[k] == caption_of[r["kept_key"]] for k, r in checked.items())
    for i in range(60):
        kept = checked.get(f"{i:03d}or", {}).get("kept_key", f"{i:03d}or")
        for copy in ("do", "tw"):
            assert checked.get(f"{i:03d}{copy}", {}).get("kept_key", f"{i:03d}{copy}") == kept


def _cover_one(length: int, factor: int, fraction: float) -> np.ndarray:
    """The grid's weights for one framing, as colour_grid made them before they were made
    for every framing at once and kept per size (2026-12-06)."""
    first = np.arange(-(-length // factor)) * factor
    last = np.minimum(first + factor, length)
    step = length * fraction / GRID_SIDE
    lo = length * (1 - fraction) / 2 + step * np.arange(GRID_SIDE)[:, None]
    overlap = np.clip(np.minimum(lo + step, last) - np.maximum(lo, first), 0, None)
    return (overlap / overlap.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 127, 256, 341, 480, 513, 1023, 2048,
                                    4097, 33000])
def test_grid_weights_are_those_made_one_framing_at_a_time(length: int) -> None:
    """The grids' bytes follow from these float weights: every framing at once (and from
    the cache) must give them bit for bit."""
    for factor in sorted({1, 2, 3, max(1, length // 64), max(1, length // 100)}):
        weights = grids._covers(length, factor)
        assert not weights.flags.writeable  # shared through the cache
        for i, fraction in enumerate(FRAMES):
            assert weights[i].tobytes() == _cover_one(length, factor, fraction).tobytes()


def _gradient(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([x * 255 // max(1, width - 1),
                                     y * 255 // max(1, height - 1),
                                     (x * 7 + y * 13) % 256], axis=-1).astype(np.uint8))


@pytest.mark.parametrize(("size", "digest"), [
    ((357, 268), "738ab4b76a529da6"), ((722, 448), "773e42e1eaac92a0"),
    ((1000, 37), "089f7d1e8024097d"), ((40, 30), "ed656f492eb47233")])
def test_grid_bytes_are_as_before(size: tuple[int, int], digest: str) -> None:
    """The grids of a few sizes, as the 2026-12-05 code made them (a dedup index keeps
    them: a faster grid must not move a byte)."""
    for _ in range(2):  # made, then from the cache
        assert hashlib.sha256(colour_grid(_gradient(*size))).hexdigest()[:16] == digest
