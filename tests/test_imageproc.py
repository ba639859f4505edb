"""download.imageproc: img2dataset-compatible checks, resize modes, hashes and failures."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import COCO_IMAGES
from PIL import Image, JpegImagePlugin

from pairforge.config import ImageConfig
from pairforge.dedup.hashing import PIXEL_HASH, phash_u64
from pairforge.download import jpegdecode
from pairforge.download.imageproc import (
    ImageFailure,
    ProcessedImage,
    caption_pixels,
    process_image,
)
from pairforge.download.resample import downscale
from pairforge.records import Status

COCO = COCO_IMAGES  # the repository's real test photos (tests/data/README.md)


# --- helpers -------------------------------------------------------------------------------

def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def smooth(width: int, height: int) -> Image.Image:
    """A gradient photo stand-in (compresses well, survives resizes recognisably)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def blobs(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth random structure: a photo stand-in with a well-defined perceptual hash."""
    return noise(16, 12, seed).resize((width, height), Image.Resampling.BICUBIC)


def ok(result: ProcessedImage | ImageFailure) -> ProcessedImage:
    assert isinstance(result, ProcessedImage), result
    return result


def failed(result: ProcessedImage | ImageFailure, status: Status) -> ImageFailure:
    assert isinstance(result, ImageFailure), result
    assert result.status == status, result
    assert result.error
    return result


def decoded(result: ProcessedImage) -> Image.Image:
    image = Image.open(io.BytesIO(result.data))
    image.load()
    return image


def bilevel_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of any size that stays a few kB (all-black rows compress away)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data)))

    row = b"\x00" + bytes((width + 7) // 8)
    packer = zlib.compressobj(9)
    rows_per_part = 1000
    parts = [packer.compress(row * rows_per_part) for _ in range(height // rows_per_part)]
    parts.append(packer.compress(row * (height % rows_per_part)))
    parts.append(packer.flush())
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts))
            + chunk(b"IEND", b""))


def coco_bodies(n: int) -> list[bytes]:
    return [p.read_bytes() for p in sorted(COCO.glob("*.jpg"))[:n]]


# --- resize modes --------------------------------------------------------------------------

@pytest.mark.parametrize(("mode", "only_if_bigger", "source", "expected"), [
    # 400x300 down to 256
    ("no", False, (400, 300), (400, 300)),
    ("keep_ratio", False, (400, 300), (341, 256)),
    ("keep_ratio_largest", False, (400, 300), (256, 192)),
    ("center_crop", False, (400, 300), (256, 256)),
    ("border", False, (400, 300), (256, 256)),
    ("keep_ratio", True, (400, 300), (341, 256)),
    ("center_crop", True, (400, 300), (256, 256)),
    ("keep_ratio_largest", True, (400, 300), (256, 192)),
    ("border", True, (400, 300), (256, 256)),
    # portrait, and albumentations' rounding (333 * 256/250 = 340.99 -> 341)
    ("keep_ratio", False, (250, 333), (256, 341)),
    ("keep_ratio_largest", False, (250, 333), (192, 256)),
    # 100x50 up to 256, unless resize_only_if_bigger (which also skips crop and pad)
    ("keep_ratio", False, (100, 50), (512, 256)),
    ("keep_ratio_largest", False, (100, 50), (256, 128)),
    ("center_crop", False, (100, 50), (256, 256)),
    ("border", False, (100, 50), (256, 256)),
    ("keep_ratio", True, (100, 50), (100, 50)),
    ("keep_ratio_largest", True, (100, 50), (100, 50)),
    ("center_crop", True, (100, 50), (100, 50)),
    ("border", True, (100, 50), (100, 50)),
    # keep_ratio_largest/border look at the larger side: 300x200 is "bigger" than 256 there
    ("border", True, (300, 200), (256, 256)),
    ("keep_ratio", True, (300, 200), (300, 200)),
    # already the right size
    ("keep_ratio", False, (256, 300), (256, 300)),
    ("center_crop", False, (256, 300), (256, 256)),
])
def test_resize_mode_sizes(mode, only_if_bigger, source, expected):
    cfg = ImageConfig(resize_mode=mode, image_size=256, resize_only_if_bigger=only_if_bigger,
                      encode_format="png")
    result = ok(process_image(encode(smooth(*source)), cfg))
    assert (result.width, result.height) == expected
    assert (result.original_width, result.original_height) == source
    assert decoded(result).size == expected


def test_border_is_black_and_centred():
    cfg = ImageConfig(resize_mode="border", image_size=256, encode_format="png")
    red = Image.new("RGB", (400, 300), (200, 30, 30))
    out = np.asarray(decoded(ok(process_image(encode(red), cfg))))
    # 400x300 -> 256x192, padded by 32 rows above and below
    assert (out[:31] == 0).all() and (out[-31:] == 0).all()
    assert tuple(out[128, 128]) == (200, 30, 30)
    assert tuple(out[33, 0]) == (200, 30, 30) and tuple(out[-34, -1]) == (200, 30, 30)


def test_center_crop_equals_resize_then_crop():
    source = noise(800, 500, seed=1)
    cfg = ImageConfig(resize_mode="center_crop", image_size=256, encode_format="png")
    out = np.asarray(decoded(ok(process_image(encode(source), cfg))), dtype=np.int16)
    full = downscale(source.tobytes(), source.size, (410, 256))
    expected = np.asarray(full.crop((77, 0, 333, 256)), dtype=np.int16)
    assert (out == expected).all()


@pytest.mark.parametrize("size", [(800, 600), (2000, 1500), (333, 250)])
def test_downscale_is_close_to_pillow_lanczos(size):
    """libvips' Lanczos-3 and Pillow's Lanczos agree on a photo-like image: same pixel
    centres, same support (a shift or a box filter would be far off on this)."""
    source = smooth(*size)
    target = (round(size[0] * 256 / size[1]), 256)
    ours = np.asarray(downscale(source.tobytes(), source.size, target), np.int16)
    pillow = np.asarray(source.resize(target, Image.Resampling.LANCZOS), np.int16)
    assert ours.shape == pillow.shape
    assert np.abs(ours - pillow).mean() < 0.5


@pytest.mark.parametrize("fmt", ["jpg", "webp", "png"])
def test_encode_formats(fmt):
    cfg = ImageConfig(image_size=64, encode_format=fmt, encode_quality=90)
    result = ok(process_image(encode(smooth(128, 96)), cfg))
    assert result.format == fmt
    image = decoded(result)
    assert image.format == {"jpg": "JPEG", "webp": "WEBP", "png": "PNG"}[fmt]
    assert image.size == (85, 64) and image.mode == "RGB"


@pytest.mark.parametrize("fmt", ["jpg", "png"])
def test_caption_pixels_are_the_shards_pixels_without_the_dedup_hashes(fmt):
    """pairforge serve's image pass: the pixels a raw shard holds (re-encoded when the
    format is lossy, skipped when lossless), the same pixel hash and phash, the same
    refusals."""
    cfg = ImageConfig(image_size=64, encode_format=fmt, encode_quality=80)
    for body in [encode(smooth(128, 96)), *(p.read_bytes() for p in sorted(
            COCO.glob("*.jpg"))[:3]), oriented_jpeg(smooth(90, 60), 6)]:
        full = ok(process_image(body, cfg))
        pixels = caption_pixels(body, cfg, with_phash=True)
        assert np.array_equal(np.asarray(pixels.image), np.asarray(decoded(full)))
        assert (pixels.pixel_hash, pixels.phash) == (full.pixel_hash, full.phash)
        assert caption_pixels(body, cfg, with_phash=False).phash is None
    refused = caption_pixels(b"not an image", cfg, with_phash=False)
    assert refused == process_image(b"not an image", cfg)
    assert isinstance(refused, ImageFailure) and refused.status == Status.NOT_AN_IMAGE


# --- orientation, colour modes -------------------------------------------------------------

def oriented_jpeg(image: Image.Image, orientation: int,
                  tags: dict[int, str] | None = None) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    for tag, value in (tags or {}).items():
        exif[tag] = value
    return encode(image, "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_rotates():
    stored = Image.new("RGB", (200, 100), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 50, 50))  # red square top-left as stored
    body = oriented_jpeg(stored, 6, {0x010F: "Canon", 0x0110: "EOS"})
    cfg = ImageConfig(resize_mode="no", encode_format="png")
    result = ok(process_image(body, cfg))
    assert (result.width, result.height) == (100, 200)
    assert (result.original_width, result.original_height) == (100, 200)
    out = decoded(result)
    # orientation 6 = rotate 90 degrees clockwise to display: top-left goes to top-right
    assert out.getpixel((90, 10))[0] > 200 and out.getpixel((10, 10))[2] > 200
    assert '"Orientation": 6' in result.exif and '"Make": "Canon"' in result.exif


def test_exif_orientation_with_draft_and_resize():
    body = oriented_jpeg(smooth(2000, 1000), 6)
    result = ok(process_image(body, ImageConfig(resize_mode="keep_ratio", image_size=256)))
    assert (result.original_width, result.original_height) == (1000, 2000)
    assert (result.width, result.height) == (256, 512)


def test_rgba_composited_on_white():
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half transparent black
    cfg = ImageConfig(resize_mode="no", encode_format="png")
    out = decoded(ok(process_image(encode(rgba), cfg)))
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert all(abs(c - 127) <= 1 for c in out.getpixel((1, 0)))
    assert out.getpixel((10, 10)) == (255, 0, 0)


@pytest.mark.parametrize("make", [
    lambda: Image.new("LA", (32, 32), (0, 0)),
    lambda: Image.new("RGBA", (32, 32), (9, 9, 9, 0)).convert("P"),
])
def test_other_alpha_modes_composited_on_white(make):
    image = make()
    if image.mode == "P":
        image.info["transparency"] = image.getpixel((0, 0))
    fmt = "GIF" if image.mode == "P" else "PNG"
    cfg = ImageConfig(resize_mode="no", encode_format="png")
    out = decoded(ok(process_image(encode(image, fmt), cfg)))
    assert out.getpixel((5, 5)) == (255, 255, 255)


def test_sixteen_bit_grey_is_scaled_not_clipped():
    grey = Image.fromarray(np.full((40, 40), 32768, dtype=np.uint16))
    cfg = ImageConfig(resize_mode="no", encode_format="png")
    out = decoded(ok(process_image(encode(grey), cfg)))
    assert all(abs(c - 128) <= 1 for c in out.getpixel((3, 3)))


def test_cmyk_jpeg():
    cmyk = Image.new("CMYK", (64, 48), (0, 255, 255, 0))  # red
    result = ok(process_image(encode(cmyk, "JPEG"), ImageConfig(image_size=32)))
    red = decoded(result).getpixel((20, 16))
    assert red[0] > 200 and red[1] < 60


# --- failures ------------------------------------------------------------------------------

def test_truncated_jpeg_is_decode_error():
    body = coco_bodies(1)[0]
    failed(process_image(body[: len(body) // 2], ImageConfig()), Status.DECODE_ERROR)


def test_truncated_png_is_decode_error():
    body = encode(noise(200, 200))
    failed(process_image(body[: len(body) // 2], ImageConfig()), Status.DECODE_ERROR)


@pytest.mark.parametrize("body", [
    b"<!DOCTYPE html><html><head><title>404</title></head><body>Not found</body></html>",
    b"",
    b"\x00" * 100,
    b'{"error": "forbidden"}',
])
def test_not_an_image(body):
    failed(process_image(body, ImageConfig()), Status.NOT_AN_IMAGE)


def test_garbage_after_a_valid_signature_never_raises():
    body = encode(noise(64, 64))
    rng = np.random.default_rng(3)
    for cut in range(0, len(body), max(1, len(body) // 40)):
        corrupt = bytearray(body)
        corrupt[cut: cut + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        for candidate in (bytes(corrupt), body[:cut]):
            result = process_image(candidate, ImageConfig())
            assert isinstance(result, ProcessedImage | ImageFailure)


def test_decompression_bomb_rejected_before_decoding():
    cfg = ImageConfig(max_pixels=10_000_000)
    failed(process_image(bilevel_png(20_000, 20_000), cfg), Status.TOO_LARGE)


def test_over_max_pixels_but_under_pillows_limit():
    cfg = ImageConfig(max_pixels=10_000_000)
    assert Image.MAX_IMAGE_PIXELS > 4000 * 4000
    failed(process_image(bilevel_png(4000, 4000), cfg), Status.TOO_LARGE)


def test_decompression_bomb_warning_as_error_is_too_large():
    # cfg allows more than Pillow does; Pillow's warning, raised as an error, still counts.
    cfg = ImageConfig(max_pixels=10**9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        failed(process_image(bilevel_png(10_000, 10_000), cfg), Status.TOO_LARGE)


def test_too_small():
    cfg = ImageConfig(min_image_size=100)
    failed(process_image(encode(smooth(80, 200)), cfg), Status.TOO_SMALL)
    ok(process_image(encode(smooth(100, 200)), cfg))


def test_bad_aspect():
    cfg = ImageConfig(max_aspect_ratio=3.0)
    failed(process_image(encode(smooth(400, 100)), cfg), Status.BAD_ASPECT)
    failed(process_image(encode(smooth(100, 400)), cfg), Status.BAD_ASPECT)
    ok(process_image(encode(smooth(300, 100)), cfg))


# --- draft decoding ------------------------------------------------------------------------

@pytest.fixture
def draft_calls(monkeypatch):
    """(size, decoded size) of each reduced-scale JPEG decode, by Pillow's draft or by
    simplejpeg at the scale draft picks (pipeline.jpegdecode)."""
    calls: list[tuple[tuple[int, int], tuple[int, int]]] = []
    original = JpegImagePlugin.JpegImageFile.draft
    turbo = jpegdecode.decode

    def spy(self, mode, size):
        before = self.size
        result = original(self, mode, size)
        calls.append((before, self.size))
        return result

    def turbo_spy(body, size, scale):
        pixels = turbo(body, size, scale)
        if pixels is not None and scale > 1:
            calls.append((size, (pixels.shape[1], pixels.shape[0])))
        return pixels

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    monkeypatch.setattr(jpegdecode, "decode", turbo_spy)
    return calls


def test_draft_used_for_large_jpeg(draft_calls):
    body = encode(blobs(2000, 1500), "JPEG", quality=90)
    cfg = ImageConfig(resize_mode="keep_ratio", image_size=256)
    result = ok(process_image(body, cfg))
    # 341x256 needed: libjpeg decodes at 1/4 (500x375), never below the target
    assert draft_calls == [((2000, 1500), (500, 375))]
    assert (result.original_width, result.original_height) == (2000, 1500)
    assert (result.width, result.height) == (341, 256)
    assert decoded(result).size == (341, 256)

    plain = ok(process_image(body, cfg, draft=False))
    assert len(draft_calls) == 1  # draft=False never calls it
    assert (plain.width, plain.height, plain.original_width) == (341, 256, 2000)
    assert plain.sha256 == result.sha256
    assert (plain.phash ^ result.phash).bit_count() <= 4
    diff = np.abs(np.asarray(decoded(plain), np.int16) - np.asarray(decoded(result), np.int16))
    assert diff.mean() < 2


@pytest.mark.parametrize(("mode", "size", "drafted"), [
    ("center_crop", 256, (500, 375)),  # crop needs the keep_ratio size first
    ("border", 256, (500, 375)),  # 256x192: 1/8 would be 250x188, too small
    ("keep_ratio_largest", 1100, None),  # 1100x825 is not 2x smaller
    ("keep_ratio_largest", 1000, (1000, 750)),  # exactly 2x smaller: 1/2
    ("no", 256, None),
])
def test_draft_scale_follows_the_resize(draft_calls, mode, size, drafted):
    body = encode(smooth(2000, 1500), "JPEG", quality=90)
    result = ok(process_image(body, ImageConfig(resize_mode=mode, image_size=size)))
    assert [after for _, after in draft_calls] == ([drafted] if drafted else [])
    assert (result.original_width, result.original_height) == (2000, 1500)


def test_no_draft_for_png(draft_calls):
    result = ok(process_image(encode(smooth(2000, 1500)), ImageConfig(image_size=256)))
    assert draft_calls == [] and (result.width, result.height) == (341, 256)


# --- hashes --------------------------------------------------------------------------------

def test_lossless_reencode_keeps_pixel_hash():
    cfg = ImageConfig(image_size=256)  # COCO photos are ~300 px: no draft at 256
    for body in coco_bodies(5):
        as_png = encode(Image.open(io.BytesIO(body)).convert("RGB"))
        jpeg, png = ok(process_image(body, cfg)), ok(process_image(as_png, cfg))
        assert jpeg.pixel_hash == png.pixel_hash
        assert jpeg.sha256 != png.sha256
        assert jpeg.phash == png.phash


def test_pixel_hash_is_xxh3_128_of_the_shape_and_pixels():
    """The function DESIGN's exact hash uses (filters/hashing.PIXEL_HASH), pinned: the
    dedup index files name it, and another one silently matches nothing."""
    import xxhash

    body = coco_bodies(1)[0]
    rgb = Image.open(io.BytesIO(body)).convert("RGB")
    expected = xxhash.xxh3_128(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes())
    result = ok(process_image(body, ImageConfig(image_size=256)))  # no draft: ~300 px
    assert result.pixel_hash == expected.hexdigest() and len(result.pixel_hash) == 32
    assert PIXEL_HASH == "xxh3-128"


def test_same_bytes_same_hashes():
    body = coco_bodies(1)[0]
    a = ok(process_image(body, ImageConfig(image_size=64)))
    b = ok(process_image(body, ImageConfig(image_size=64)))
    assert (a.sha256, a.pixel_hash, a.phash) == (b.sha256, b.pixel_hash, b.phash)
    assert 0 <= a.phash < 2**64


def test_recompressed_jpeg_phash_is_near():
    cfg = ImageConfig(image_size=256)
    for body in coco_bodies(20):
        original = ok(process_image(body, cfg))
        recompressed = encode(Image.open(io.BytesIO(body)), "JPEG", quality=60)
        again = ok(process_image(recompressed, cfg))
        assert again.sha256 != original.sha256
        assert again.pixel_hash != original.pixel_hash
        assert (original.phash ^ again.phash).bit_count() <= 4


def test_phash_is_the_shared_phash_of_the_decoded_image():
    body = coco_bodies(1)[0]
    expected = phash_u64(Image.open(io.BytesIO(body)).convert("RGB"))
    assert ok(process_image(body, ImageConfig())).phash == expected


def _imagehash_u64(image: Image.Image) -> int:
    import imagehash

    # imagehash of the intermediate our phash takes (filters/hashing.py)
    grey = image.convert("L").resize((128, 128), Image.Resampling.BILINEAR)
    return int("".join("1" if b else "0" for b in imagehash.phash(grey).hash.flatten()), 2)


@pytest.mark.parametrize("image", [
    noise(300, 200, seed=3), smooth(640, 480), blobs(1200, 900, seed=2), blobs(50, 40),
    Image.new("RGB", (100, 100), (3, 4, 5)),  # flat: one bit (dedup skips such hashes)
    Image.fromarray(np.tile(np.arange(200, dtype=np.uint8)[None, :, None], (150, 1, 3))),
], ids=["noise", "smooth", "blobs", "small", "flat", "gradient"])
def test_phash_is_imagehash_phash(image):
    """Our matrix DCT gives imagehash's bits, flat and one-directional images included."""
    assert phash_u64(image) == _imagehash_u64(image)


def _pillow_hashes(image: Image.Image) -> tuple[int, ...]:
    """perceptual_hashes as it was written before the thumbnails became matrix products:
    Pillow's Lanczos resize of each box, np.median of each block."""
    from pairforge.dedup import hashing

    grey = hashing._intermediate(image)
    side = hashing._INTERMEDIATE_SIDE
    hashes = []
    for fraction in (1.0, *hashing.CROP_FRACTIONS):
        margin = side * (1 - fraction) / 2
        box = (margin, margin, side - margin, side - margin)
        thumb = grey.resize((32, 32), Image.Resampling.LANCZOS, box=box)
        low = np.round(hashing._DCT_ROWS @ np.asarray(thumb, dtype=np.float64)
                       @ hashing._DCT_ROWS.T, 6)
        for block in (low, low * hashing._MIRROR_SIGN):
            bits = block > np.median(block)
            hashes.append(int.from_bytes(np.packbits(bits).tobytes(), "big"))
    return tuple(hashes)


@pytest.mark.parametrize("seed", range(6))
def test_thumbnails_are_pillows_lanczos_bit_for_bit(seed):
    from pairforge.dedup import hashing

    rng = np.random.default_rng(seed)
    kinds = [rng.integers(0, 256, (128, 128)),  # noise: every rounding and clip in play
             (rng.random((128, 128)) > 0.5) * 255,  # hard edges: overshoot past 0 and 255
             np.full((128, 128), rng.integers(0, 256))]
    for pixels in kinds:
        grey = Image.fromarray(pixels.astype(np.uint8), "L")
        ours = hashing._thumbnails(grey)
        for thumb, fraction in zip(ours, (1.0, *hashing.CROP_FRACTIONS), strict=True):
            margin = 128 * (1 - fraction) / 2
            box = (margin, margin, 128 - margin, 128 - margin)
            expected = grey.resize((32, 32), Image.Resampling.LANCZOS, box=box)
            assert np.array_equal(thumb, np.asarray(expected)), (seed, fraction)


@pytest.mark.parametrize("image", [
    noise(300, 200, seed=4), smooth(640, 480), blobs(1200, 900, seed=5), blobs(50, 40),
    Image.new("RGB", (100, 100), (3, 4, 5)),
], ids=["noise", "smooth", "blobs", "small", "flat"])
def test_perceptual_hashes_match_the_pillow_reference(image):
    from pairforge.dedup.hashing import perceptual_hashes

    found = perceptual_hashes(image)
    assert (found.phash, found.phash_mirror, *found.crop_phashes) == _pillow_hashes(image)
    assert phash_u64(image) == found.phash


def test_exif_none_without_exif():
    assert ok(process_image(encode(smooth(64, 64), "JPEG"), ImageConfig())).exif is None


def test_threads_give_the_same_results():
    bodies = coco_bodies(24) + [encode(blobs(1200, 900), "JPEG"), b"<html>"]
    cfg = ImageConfig(image_size=128, resize_mode="center_crop")
    serial = [process_image(b, cfg) for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda b: process_image(b, cfg), bodies))
    assert parallel == serial
