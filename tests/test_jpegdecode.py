"""pipeline.jpegdecode and stage 1's simplejpeg path: Pillow's pixels exactly, or Pillow.

The stage decodes JPEGs with simplejpeg only where that changes nothing. So each case here
compares ``process_image`` as it runs (simplejpeg) with ``turbo=False`` (Pillow decodes
every JPEG, as before this path existed): the whole result, re-encoded bytes, sizes, every
hash, EXIF, or a failure's status and text, must be equal, and each case says which
decoder it expects to have decoded the image.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
from conftest import COCO_IMAGES
from PIL import Image, ImageCms

from pairforge.config import ImageConfig
from pairforge.download import jpegdecode
from pairforge.download.imageproc import ImageFailure, ProcessedImage, _draft_scale, process_image
from pairforge.records import Status

# --- images --------------------------------------------------------------------------------


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth structure plus fine noise, so every DCT coefficient (and each scale's
    IDCT) matters."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.int16)
    grain = rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    rgb = Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))
    return rgb.convert(mode)


def jpeg(image: Image.Image, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **{"quality": 90, **params})
    return buffer.getvalue()


def turbo_jpeg(width: int, height: int, subsampling: str) -> bytes:
    """Subsamplings Pillow cannot write (4:4:0, 4:1:1), by libjpeg-turbo's encoder."""
    return simplejpeg.encode_jpeg(np.asarray(photo(width, height)), 90,
                                  colorsubsampling=subsampling)


def oriented(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "Camera"
    return jpeg(photo(640, 480), exif=exif.tobytes())


def with_metadata() -> bytes:
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    return jpeg(photo(300, 200), comment=b"made by a test", icc_profile=icc, dpi=(300, 300))


def mpo() -> bytes:
    buffer = io.BytesIO()
    first = photo(640, 480)
    first.save(buffer, "MPO", save_all=True, append_images=[photo(640, 480, seed=1)])
    return buffer.getvalue()


def pillow_pixels(body: bytes, target: tuple[int, int] | None) -> np.ndarray:
    """What stage 1 decoded before simplejpeg: Pillow's draft (from 2x), then RGB."""
    image = Image.open(io.BytesIO(body))
    if target and image.width >= 2 * target[0] and image.height >= 2 * target[1]:
        image.draft("RGB", target)
    return np.asarray(image.convert("RGB"))


# --- the decode itself ---------------------------------------------------------------------

# (body, target for draft, the scale Pillow's draft picks for it)
DECODES = {
    "1/1 (under 2x)": (lambda: jpeg(photo(500, 400)), (300, 240), 1),
    "1/1 (no target)": (lambda: jpeg(photo(500, 400)), None, 1),
    "1/2": (lambda: jpeg(photo(1280, 960)), (341, 256), 2),
    "1/2 odd sides": (lambda: jpeg(photo(1281, 853)), (384, 256), 2),
    "1/4": (lambda: jpeg(photo(2000, 1500)), (341, 256), 4),
    "1/4 odd sides": (lambda: jpeg(photo(1001, 1333)), (192, 256), 4),
    "1/8": (lambda: jpeg(photo(2401, 1801)), (300, 225), 8),
    "1/8 tiny target": (lambda: jpeg(photo(333, 251)), (16, 12), 8),
    "4:4:4": (lambda: jpeg(photo(1280, 960), subsampling=0), (341, 256), 2),
    "4:2:2": (lambda: jpeg(photo(1280, 961), subsampling=1), (341, 256), 2),
    "4:4:0": (lambda: turbo_jpeg(1001, 777, "440"), (200, 155), 4),
    "4:1:1": (lambda: turbo_jpeg(1001, 777, "411"), (400, 310), 2),
    "greyscale 1/1": (lambda: jpeg(photo(333, 251, "L")), None, 1),
    "greyscale 1/2": (lambda: jpeg(photo(1281, 961, "L")), (341, 256), 2),
    "greyscale 1/8": (lambda: jpeg(photo(2049, 1537, "L")), (256, 192), 8),
    "progressive 1/2": (lambda: jpeg(photo(1280, 853), progressive=True), (384, 256), 2),
    "progressive 1/4": (lambda: jpeg(photo(1601, 1201), progressive=True), (341, 256), 4),
    "RGB colour space (Adobe)": (lambda: jpeg(photo(1280, 960), keep_rgb=True), (341, 256), 2),
    "restart markers": (lambda: jpeg(photo(1280, 960), restart_marker_rows=1), (341, 256), 2),
}


@pytest.mark.parametrize("case", DECODES)
def test_decode_is_pillows_draft_decode(case):
    make, target, scale = DECODES[case]
    body = make()
    size = Image.open(io.BytesIO(body)).size
    assert (_draft_scale(size, target) if target else 1) == scale
    expected = pillow_pixels(body, target)
    pixels = jpegdecode.decode(body, size, scale)
    assert pixels is not None, "simplejpeg refused a JPEG it should decode"
    assert pixels.shape == expected.shape
    assert np.array_equal(pixels, expected)


@pytest.mark.parametrize("size", [(5, 5), (7, 3), (2, 7)])
def test_a_size_simplejpeg_would_decode_at_another_scale_is_refused(size):
    # ceil(7 * 7/8) = 7: simplejpeg would pick 7/8 (other pixels) for a full-size request
    body = jpeg(photo(*size))
    assert jpegdecode.decode(body, size, 1) is None


def test_tiny_sizes_are_pillows_pixels_or_refused():
    for width in range(1, 13):
        for height in range(1, 13):
            body = jpeg(photo(width, height), quality=75)
            pixels = jpegdecode.decode(body, (width, height), 1)
            assert pixels is None or np.array_equal(pixels, pillow_pixels(body, None))


def test_cmyk_is_not_reproduced():
    # simplejpeg's CMYK to RGB differs from Pillow's by a level here and there, so the
    # stage never asks it (jpegdecode.MODES); this pins why.
    body = jpeg(photo(301, 201, "CMYK"))
    assert Image.open(io.BytesIO(body)).mode not in jpegdecode.MODES
    pillow = pillow_pixels(body, None)
    ours = simplejpeg.decode_jpeg(body, "rgb")
    assert ours.shape == pillow.shape and not np.array_equal(ours, pillow)


# --- process_image, with and without simplejpeg --------------------------------------------

@pytest.fixture
def decoded_by(monkeypatch):
    """Which decoder decoded each image: 'simplejpeg' or 'pillow', one entry a call."""
    calls: list[str] = []
    original = jpegdecode.decode

    def spy(body: bytes, size: tuple[int, int], scale: int) -> np.ndarray | None:
        pixels = original(body, size, scale)
        calls.append("pillow" if pixels is None else "simplejpeg")
        return pixels

    monkeypatch.setattr(jpegdecode, "decode", spy)
    return calls


def same_either_way(body: bytes, cfg: ImageConfig) -> ProcessedImage | ImageFailure:
    """process_image's result, asserted equal to the all-Pillow one."""
    result = process_image(body, cfg)
    assert result == process_image(body, cfg, turbo=False)
    return result


KEEP = ImageConfig(image_size=256)
# name: (body, config, what the stage's path did: "simplejpeg" decoded it, simplejpeg was
# asked and refused ("pillow"), or it was never asked (None: Pillow decodes, as before))
CASES = {
    **{f"decode {name}": (make, ImageConfig(image_size=min(target) if target else 256,
                                            resize_mode="keep_ratio" if target else "no"),
                          "simplejpeg")
       for name, (make, target, _) in DECODES.items()},
    "png out, no resize": (lambda: jpeg(photo(640, 480)),
                           ImageConfig(resize_mode="no", encode_format="png"), "simplejpeg"),
    "center crop": (lambda: jpeg(photo(1280, 853)),
                    ImageConfig(image_size=256, resize_mode="center_crop"), "simplejpeg"),
    "border": (lambda: jpeg(photo(1280, 853)),
               ImageConfig(image_size=256, resize_mode="border"), "simplejpeg"),
    "upscale": (lambda: jpeg(photo(200, 150)), KEEP, "simplejpeg"),
    "draft off": (lambda: jpeg(photo(1280, 960)), KEEP, "simplejpeg"),
    "comment, ICC, dpi kept as Pillow kept them (jpg)": (
        with_metadata, ImageConfig(image_size=200), "simplejpeg"),
    "comment, ICC, dpi kept as Pillow kept them (png)": (
        with_metadata, ImageConfig(image_size=200, encode_format="png"), "simplejpeg"),
    "EXIF orientation 1": (lambda: oriented(1), KEEP, "simplejpeg"),
    **{f"EXIF orientation {o}": (lambda o=o: oriented(o), KEEP, None)
       for o in range(2, 9)},
    "MPO (first frame)": (mpo, KEEP, "simplejpeg"),
    "CMYK": (lambda: jpeg(photo(1280, 960, "CMYK")), KEEP, None),
    "too small for simplejpeg's scales": (
        lambda: jpeg(photo(7, 7)), ImageConfig(image_size=4, min_image_size=0), "pillow"),
}


@pytest.mark.parametrize("case", CASES)
def test_process_image_is_the_same_with_simplejpeg(case, decoded_by):
    make, cfg, decoder = CASES[case]
    body, draft = make(), case != "draft off"
    result = process_image(body, cfg, draft=draft)
    assert isinstance(result, ProcessedImage)
    assert result == process_image(body, cfg, draft=draft, turbo=False)
    assert decoded_by == ([decoder] if decoder else [])  # turbo=False never asks it


def test_coco_photos_the_same_with_simplejpeg(decoded_by):
    files = sorted(COCO_IMAGES.glob("*.jpg"))[:40]
    for path in files:
        for cfg in (KEEP, ImageConfig(image_size=64), ImageConfig(resize_mode="no")):
            assert isinstance(same_either_way(path.read_bytes(), cfg), ProcessedImage)
    assert decoded_by.count("simplejpeg") >= 3 * len(files) - 3


@pytest.mark.parametrize("progressive", [False, True])
def test_truncated_jpeg_fails_as_before(progressive, decoded_by):
    body = jpeg(photo(1280, 960), progressive=progressive)
    for cut in (len(body) // 3, len(body) // 2, len(body) - 40):
        result = same_either_way(body[:cut], KEEP)
        assert isinstance(result, ImageFailure) and result.status == Status.DECODE_ERROR
    assert set(decoded_by) == {"pillow"}  # simplejpeg refused every one (strict)


def test_corrupt_jpeg_data_gives_the_same_result(decoded_by):
    body = jpeg(photo(1280, 960))
    rng = np.random.default_rng(5)
    for _ in range(40):
        corrupt = bytearray(body)
        at = int(rng.integers(600, len(body) - 8))  # past the headers: scan data
        corrupt[at: at + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        same_either_way(bytes(corrupt), KEEP)
    assert len(decoded_by) == 40


def test_random_sizes_and_modes_the_same(decoded_by):
    rng = np.random.default_rng(11)
    modes = ["keep_ratio", "center_crop", "border", "keep_ratio_largest", "no"]
    for i in range(24):
        width, height = (int(side) for side in rng.integers(8, 1800, 2))
        body = jpeg(photo(width, height, "L" if i % 4 == 0 else "RGB", seed=i),
                    progressive=i % 3 == 0, subsampling=int(rng.integers(0, 3)))
        cfg = ImageConfig(image_size=int(rng.choice([16, 64, 256])), min_image_size=0,
                          max_aspect_ratio=1000, resize_mode=str(rng.choice(modes)))
        assert isinstance(same_either_way(body, cfg), ProcessedImage)
    assert decoded_by.count("simplejpeg") >= 20
