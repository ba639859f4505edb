"""Decode, check, resize and re-encode one downloaded image (img2dataset's resizer, on Pillow).

``process_image`` runs on every downloaded body, from many threads at once; Pillow releases
the GIL while it decodes, resizes and encodes, so the work here is kept to those calls plus
the three hashes of DESIGN.md section 3, computed in the same pass.

Order of work, cheapest rejection first:

1. ``Image.open`` reads only the header: unrecognised bytes are ``not_an_image``; more
   pixels than ``max_pixels`` are ``too_large`` before any pixel is decoded; a smaller side
   under ``min_image_size`` is ``too_small``; long/short over ``max_aspect_ratio`` is
   ``bad_aspect``. Then the plan (the resize, the decode scale) is checked against its caps
   before anything is allocated: more pixels decoded at once than ``max_decoded_pixels``,
   or a resize making more than ``max_output_pixels`` (a 65535x1 spacer at keep_ratio
   asks for 16.7 million x 256), are ``too_large``. Only the first frame or page of an
   animation or multi-page file is ever read, and an ICO is sized by the image it
   embeds, not by its directory.
2. For a JPEG that will be shrunk at least 2x, ``Image.draft`` makes libjpeg decode at a
   reduced DCT scale (1/2, 1/4, 1/8), never below the size the resize needs.
3. Decode; truncated or corrupt data is ``decode_error`` (``LOAD_TRUNCATED_IMAGES`` is
   never set: a half-grey image is not a training sample). A JPEG is decoded by
   simplejpeg (``download.jpegdecode``: the same libjpeg-turbo with less overhead) at the
   scale step 2 picks, into the very pixels Pillow would give; whatever simplejpeg does
   not reproduce exactly or refuses (CMYK, EXIF rotation, warnings, corrupt data) goes
   to Pillow.
4. EXIF orientation is applied, the image becomes RGB, alpha is composited onto white.
5. ``pixel_hash`` and ``phash`` of that decoded image, then the resize (downscaling with
   libvips, see ``download.resample``; upscaling with Pillow), then re-encoding with Pillow.

Sizes are computed exactly as img2dataset (albumentations' ``smallest_max_size`` /
``longest_max_size``, ``center_crop``, ``pad``), always from the true original size, so a
drafted decode changes neither ``width``/``height`` nor ``original_width``/``original_height``.
The original size is reported as displayed, i.e. after EXIF orientation.

Hash semantics: ``sha256`` is of the input bytes (img2dataset compatible). ``pixel_hash`` is
of the decoded RGB pixels before the resize -- with draft decoding, of the pixels at the
decode scale. Identical bytes therefore still hash identically, and a lossless re-encode
(e.g. JPEG to PNG) hashes identically whenever no draft happens for the JPEG (a target less
than 2x smaller than the source, or resize_mode ``no``); a draft-decoded JPEG and its PNG
twin get different pixel hashes. ``phash`` (with ``phash_mirror`` and ``crop_phashes``, see
``filters.hashing.perceptual_hashes``) is of the same decoded image, through an antialiased
Lanczos thumbnail whose kernel widens with the reduction, so neither the decode scale nor a
resized copy moves it past a bit or two.

Differences from img2dataset worth knowing: EXIF orientation is applied (cv2's
IMREAD_UNCHANGED ignores it); size and aspect checks happen before decoding, so a corrupt
but too-small image is ``too_small``; ``border`` pads with black (img2dataset now pads with
white); only common raster formats are opened (see ``OPEN_FORMATS``).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import numpy as np
from PIL import (
    ExifTags,
    IcoImagePlugin,
    Image,
    ImageOps,
    JpegImagePlugin,
    UnidentifiedImageError,
)

from pairforge.config import ImageConfig
from pairforge.dedup.grids import colour_grid
from pairforge.dedup.hashing import (
    perceptual_hashes,
    phash_u64,
    pixel_hash_hex,
    sha256_hex,
)
from pairforge.download import jpegdecode
from pairforge.download.resample import downscale as _downscale
from pairforge.records import Status

# Formats a web image can reasonably be. Others Pillow knows are refused as not_an_image:
# EPS would run Ghostscript on untrusted input, and scientific formats (FITS, GRIB, ...)
# are not photos.
Image.init()
OPEN_FORMATS: tuple[str, ...] = tuple(
    f for f in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "JPEG2000", "ICO", "PPM",
                "TGA", "QOI", "PCX", "DIB")
    if f in Image.OPEN)

BORDER_COLOR = (0, 0, 0)
BACKGROUND_COLOR = (255, 255, 255)  # alpha is composited onto white, as img2dataset does

# Downscaling is libvips' Lanczos-3 (download.resample). Upscaling: Pillow's bicubic.
# Lanczos (img2dataset's choice) cost 2 of the ~5 ms per COCO photo (300 px to 256 px
# keep_ratio upscales the short side) for no visible difference.
UPSCALE_FILTER = Image.Resampling.BICUBIC

_ICO_MAGIC = b"\x00\x00\x01\x00"
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that rotate by 90 degrees
_TRANSPOSES = frozenset(range(2, 9))  # EXIF orientations ImageOps.exif_transpose acts on

# The few EXIF tags kept (IFD0, then the Exif sub-IFD): what made the photo, when, by whom.
_EXIF_BASE_TAGS = (ExifTags.Base.Make, ExifTags.Base.Model, ExifTags.Base.Software,
                   ExifTags.Base.DateTime, ExifTags.Base.Orientation, ExifTags.Base.Artist,
                   ExifTags.Base.Copyright)
_EXIF_IFD_TAGS = (ExifTags.Base.DateTimeOriginal,)


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    data: bytes  # re-encoded image
    format: str  # 'jpg' | 'webp' | 'png'
    width: int  # after resize
    height: int
    original_width: int  # as displayed (after EXIF orientation), never the drafted size
    original_height: int
    sha256: str  # of the input bytes
    pixel_hash: str  # of the decoded RGB pixels (at the decode scale)
    phash: int  # unsigned 64-bit perceptual hash
    phash_mirror: int  # the phash of the image mirrored left-right
    crop_phashes: tuple[int, ...]  # centre regions' phashes (filters.hashing.CROP_FRACTIONS)
    colour_grid: bytes  # 16x16 YCbCr cell means (filters.grids.colour_grid)
    exif: str | None  # JSON of a few EXIF tags


@dataclass(frozen=True, slots=True)
class ImageFailure:
    status: Status
    error: str


@dataclass(frozen=True, slots=True)
class _Plan:
    """What to do to an image of the original size (axes as stored or as displayed)."""

    resize: tuple[int, int] | None  # keep-ratio size, or None to keep the size
    downscale: bool
    crop: bool  # center crop to a square of image_size
    pad: bool  # pad to a square of image_size

    def output_pixels(self, size: int) -> int:
        """Pixels the resize allocates: the resized image (a center crop cuts it after),
        or the padded canvas; 0 when the decoded image is kept as it is."""
        if self.resize is None:
            return 0
        width, height = self.resize
        if self.pad:
            width, height = max(width, size), max(height, size)
        return width * height

    def swapped(self) -> _Plan:
        if self.resize is None:
            return self
        return _Plan((self.resize[1], self.resize[0]), self.downscale, self.crop, self.pad)


class _Reject(Exception):
    """Internal: carries an ImageFailure out of a helper."""

    def __init__(self, status: Status, error: str):
        super().__init__(error)
        self.failure = ImageFailure(status, error)


def process_image(body: bytes, cfg: ImageConfig, *, draft: bool = True, turbo: bool = True
                  ) -> ProcessedImage | ImageFailure:
    """Decode, check, hash, resize and re-encode ``body``; never raises.

    ``draft=False`` disables reduced-scale JPEG decoding, ``turbo=False`` decoding JPEGs
    with simplejpeg (Pillow decodes them all); both for benchmarks and comparisons.
    """
    return _guarded(_process, body, cfg, draft, turbo)


@dataclass(frozen=True, slots=True)
class CaptionPixels:
    """What a captioner reads of an image, and the keys a caption cache finds it by."""

    image: Image.Image  # RGB, the pixels of the raw shard's re-encoded image
    pixel_hash: str
    phash: int | None  # only when asked for


def caption_pixels(body: bytes, cfg: ImageConfig, *, with_phash: bool
                   ) -> CaptionPixels | ImageFailure:
    """``process_image``'s checks and pixels without the hashes only dedup reads (the
    mirror's and the regions' phashes, the colour grid): ``pairforge serve``'s image pass.
    A lossless ``encode_format`` skips the encode and decode, whose pixels are the same."""
    return _guarded(_caption_pixels, body, cfg, with_phash)


def _guarded(fn, *args):  # noqa: ANN001, ANN202
    """``fn(*args)``, with every failure an ``ImageFailure``: one bad image must never
    stop a shard."""
    try:
        return fn(*args)
    except _Reject as rejected:
        return rejected.failure
    except MemoryError:
        return ImageFailure(Status.TOO_LARGE, "out of memory decoding the image")
    except Exception as err:
        return ImageFailure(Status.DECODE_ERROR, f"{type(err).__name__}: {err}")


@dataclass(frozen=True, slots=True)
class _Decoded:
    rgb: Image.Image  # at the decode scale, upright
    pixels: bytes | memoryview  # its RGB bytes
    plan: _Plan
    width: int  # as displayed, never the drafted size
    height: int
    exif: str | None


def _decode_checked(body: bytes, cfg: ImageConfig, draft: bool, turbo: bool) -> _Decoded:
    _check_icon(body, cfg)
    image = _open(body)  # no context manager: closing would discard the decoded pixels
    stored_w, stored_h = image.size
    _check_size(stored_w, stored_h, cfg)
    plan = _plan_resize(stored_w, stored_h, cfg)
    _check_plan(image, plan, cfg, draft)
    decoded = _decode(image, body, plan.resize if draft else None, turbo)
    # Read after load: PNG's eXIf chunk may follow the pixel data (a JPEG's EXIF is in
    # its header, so the simplejpeg path has it without Pillow decoding).
    swap = _orientation(image) in _SWAPS_AXES
    exif = _exif_json(image)
    rgb, pixels = _pillow_rgb(image) if decoded is None else _turbo_rgb(image, decoded)
    if swap:
        plan = plan.swapped()
        stored_w, stored_h = stored_h, stored_w
    return _Decoded(rgb, pixels, plan, stored_w, stored_h, exif)


def _process(body: bytes, cfg: ImageConfig, draft: bool, turbo: bool) -> ProcessedImage:
    d = _decode_checked(body, cfg, draft, turbo)
    pixel_hash = pixel_hash_hex(d.rgb, d.pixels)
    hashes = perceptual_hashes(d.rgb)
    out = _apply_plan(d.rgb, d.pixels, d.plan, cfg.image_size)
    return ProcessedImage(
        data=_encode(out, cfg), format=cfg.encode_format, width=out.width, height=out.height,
        original_width=d.width, original_height=d.height, sha256=sha256_hex(body),
        pixel_hash=pixel_hash, phash=hashes.phash, phash_mirror=hashes.phash_mirror,
        crop_phashes=hashes.crop_phashes, colour_grid=colour_grid(d.rgb), exif=d.exif)


def _caption_pixels(body: bytes, cfg: ImageConfig, with_phash: bool) -> CaptionPixels:
    d = _decode_checked(body, cfg, True, True)
    pixel_hash = pixel_hash_hex(d.rgb, d.pixels)
    phash = phash_u64(d.rgb) if with_phash else None
    out = _apply_plan(d.rgb, d.pixels, d.plan, cfg.image_size)
    if cfg.encode_format != "png":  # lossy: the captioner sees what the shard holds
        out = Image.open(io.BytesIO(_encode(out, cfg))).convert("RGB")
    return CaptionPixels(out, pixel_hash, phash)


def _open(body: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(body), formats=OPEN_FORMATS)
    except UnidentifiedImageError:
        raise _Reject(Status.NOT_AN_IMAGE, "not a recognised image format") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        # The warning only arrives here as an exception when warnings are errors.
        raise _Reject(Status.TOO_LARGE, str(err)) from None
    except Exception as err:  # a recognised header that fails to parse
        raise _Reject(Status.DECODE_ERROR, f"bad header: {type(err).__name__}: {err}") from None


def _check_size(width: int, height: int, cfg: ImageConfig) -> None:
    if width <= 0 or height <= 0:
        raise _Reject(Status.DECODE_ERROR, f"image has no pixels ({width}x{height})")
    if width * height > cfg.max_pixels:
        raise _Reject(Status.TOO_LARGE,
                      f"{width}x{height} is over max_pixels={cfg.max_pixels}")
    if min(width, height) < cfg.min_image_size:
        raise _Reject(Status.TOO_SMALL,
                      f"{width}x{height} has a side under min_image_size={cfg.min_image_size}")
    if max(width, height) / min(width, height) > cfg.max_aspect_ratio:
        raise _Reject(Status.BAD_ASPECT,
                      f"{width}x{height} is over max_aspect_ratio={cfg.max_aspect_ratio}")


def _check_icon(body: bytes, cfg: ImageConfig) -> None:
    """Pillow decodes an ICO as it opens it, at the size of the PNG or bitmap it embeds,
    which its directory (at most 256x256) does not give: that size is checked first."""
    if not body.startswith(_ICO_MAGIC) or "ICO" not in OPEN_FORMATS:
        return
    try:
        icon = IcoImagePlugin.IcoFile(io.BytesIO(body))  # the directory and headers only
        width, height = icon.frame(icon.getentryindex(icon.entry[0].dim)).size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _Reject(Status.TOO_LARGE, str(err)) from None
    except Exception:
        return  # not an icon after all, or a broken one: Image.open decides
    _check_size(width, height, cfg)
    _check_decoded(width, height, width * height, cfg)


def _check_decoded(width: int, height: int, decoded: int, cfg: ImageConfig) -> None:
    if decoded > cfg.max_decoded_pixels:
        raise _Reject(Status.TOO_LARGE, f"{width}x{height} decodes {decoded} pixels at once, "
                      f"over max_decoded_pixels={cfg.max_decoded_pixels}")


def _check_plan(image: Image.Image, plan: _Plan, cfg: ImageConfig, draft: bool) -> None:
    """The work the plan asks for, against its caps, before any pixel is allocated."""
    width, height = image.size
    scale = 1
    if draft and plan.resize is not None and isinstance(image, JpegImagePlugin.JpegImageFile):
        scale = _draft_scale((width, height), plan.resize)
    _check_decoded(width, height, -(-width // scale) * -(-height // scale), cfg)
    output, cap = plan.output_pixels(cfg.image_size), cfg.output_pixel_cap()
    if output > cap:
        out_w, out_h = plan.resize or (width, height)
        raise _Reject(Status.TOO_LARGE, f"{width}x{height} at {cfg.resize_mode} "
                      f"{cfg.image_size} makes {out_w}x{out_h} ({output} pixels), over "
                      f"max_output_pixels={cap}")


def _plan_resize(width: int, height: int, cfg: ImageConfig) -> _Plan:
    """img2dataset's resize decision for an original of ``width`` x ``height``."""
    size, mode = cfg.image_size, cfg.resize_mode
    if mode == "no":
        return _Plan(None, False, False, False)
    # keep_ratio/center_crop fit the smaller side, keep_ratio_largest/border the larger one.
    side = min(width, height) if mode in ("keep_ratio", "center_crop") else max(width, height)
    downscale = side > size
    if cfg.resize_only_if_bigger and not downscale:
        return _Plan(None, False, False, False)  # img2dataset skips crop and pad too
    scale = size / side
    # albumentations rounds each side with Python's round() and skips an exact scale of 1.
    target = (width, height) if scale == 1.0 else (
        max(1, round(width * scale)), max(1, round(height * scale)))
    return _Plan(target, downscale, mode == "center_crop", mode == "border")


def _decode(image: Image.Image, body: bytes, target: tuple[int, int] | None,
            turbo: bool) -> np.ndarray | None:
    """Decode the pixels, for a target size in stored axes (None: full size).

    A JPEG simplejpeg decodes exactly as Pillow comes back as an RGB array at the scale
    Pillow's draft would pick; for any other image, or any JPEG simplejpeg refuses,
    Pillow decodes into ``image`` (drafted as before) and this returns None.
    """
    is_jpeg = isinstance(image, JpegImagePlugin.JpegImageFile)
    if is_jpeg and turbo and _turbo_decodes(image):
        scale = _draft_scale(image.size, target) if target is not None else 1
        pixels = jpegdecode.decode(body, image.size, scale)
        if pixels is not None:
            return pixels
    if is_jpeg and target is not None:
        _draft(image, target)
    _load(image)
    return None


def _turbo_decodes(image: Image.Image) -> bool:
    """Whether simplejpeg may decode this JPEG: a colour space it reproduces, and pixels
    displayed as stored. A rotated or mirrored one stays with Pillow, whose
    exif_transpose, on the image it decoded, decides (and may fail on) the result."""
    if image.mode not in jpegdecode.MODES:
        return False
    try:  # the lookup exif_transpose makes; broken EXIF: Pillow's path decides
        return image.getexif().get(ExifTags.Base.Orientation, 1) not in _TRANSPOSES
    except Exception:
        return False


def _draft_scale(size: tuple[int, int], target: tuple[int, int]) -> int:
    """The reduction ``_draft`` makes libjpeg decode at: JpegImageFile.draft's rule, the
    largest of 1/8, 1/4, 1/2 leaving each side >= the target, from 2x only."""
    (width, height), (target_w, target_h) = size, target
    if width < 2 * target_w or height < 2 * target_h:
        return 1
    fit = min(width // target_w, height // target_h)
    return next(scale for scale in (8, 4, 2) if fit >= scale)


def _draft(image: JpegImagePlugin.JpegImageFile, target: tuple[int, int]) -> None:
    # Only worth it from 2x: libjpeg's scales are 1/2, 1/4, 1/8, and draft() picks the
    # largest reduction that still leaves each side >= the target, so quality is kept.
    if _draft_scale(image.size, target) > 1:
        image.draft("RGB", target)


def _load(image: Image.Image) -> None:
    try:
        image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _Reject(Status.TOO_LARGE, str(err)) from None
    except MemoryError:
        raise
    except Exception as err:  # truncated, corrupt, unsupported variant
        raise _Reject(Status.DECODE_ERROR, f"{type(err).__name__}: {err}") from None


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # broken EXIF: show the pixels as stored
        return 1


def _exif_json(image: Image.Image) -> str | None:
    """A few EXIF tags as JSON, or None; broken EXIF is ignored, never an error."""
    try:
        exif = image.getexif()
        if not exif:
            return None
        tags = {t.name: exif[t] for t in _EXIF_BASE_TAGS if t in exif}
        if ExifTags.IFD.Exif in exif:
            sub = exif.get_ifd(ExifTags.IFD.Exif)
            tags.update({t.name: sub[t] for t in _EXIF_IFD_TAGS if t in sub})
        clean = {k: _exif_value(v) for k, v in tags.items()}
        clean = {k: v for k, v in clean.items() if v not in (None, "")}
        return json.dumps(clean, ensure_ascii=False, sort_keys=True) if clean else None
    except Exception:
        return None


def _exif_value(value: object) -> str | int | float | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value.replace("\x00", "").strip()[:256]
    if isinstance(value, int):
        return value
    try:
        number = float(value)  # IFDRational and friends
    except (TypeError, ValueError, ZeroDivisionError):
        return str(value)[:256]
    return number if math.isfinite(number) else None  # 0/0 rationals: not valid JSON


def _pillow_rgb(image: Image.Image) -> tuple[Image.Image, bytes]:
    """The decoded image as displayed, in RGB, and its pixels copied out of Pillow once
    (for the pixel hash and the resize)."""
    ImageOps.exif_transpose(image, in_place=True)
    rgb = _to_rgb(image)
    return rgb, rgb.tobytes()


def _turbo_rgb(image: Image.Image, decoded: np.ndarray) -> tuple[Image.Image, memoryview]:
    """``_pillow_rgb`` for simplejpeg's pixels (never transposed: ``_turbo_decodes``), with
    ``image``, the undecoded header, for the metadata. The array serves the pixel hash
    and the resize as it is; Pillow gets a copy for the perceptual hashes and the encode."""
    height, width = decoded.shape[:2]
    rgb = Image.frombuffer("RGB", (width, height), decoded, "raw", "RGB", 0, 1)
    # The encoders read some of it (a JPEG's comment, an ICC profile into a PNG) from an
    # image that reaches them unresized, as the image Pillow decoded would have it.
    rgb.info = dict(image.info)
    return rgb, memoryview(decoded).cast("B")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels; transparency composited onto white; 16-bit/float scaled to 8 bits."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image if mode == "RGBA" else image.convert("RGBA")
        background = Image.new("RGB", rgba.size, BACKGROUND_COLOR)
        background.paste(rgba, mask=rgba)  # out = a*src + (1-a)*white
        return background
    if mode.startswith("I") or mode == "F":
        image = _to_8bit(image)
    return image.convert("RGB")


def _to_8bit(image: Image.Image) -> Image.Image:
    # Pillow's convert() clips 16-bit values at 255 (a white image); scale them instead.
    pixels = np.asarray(image)
    if image.mode == "F":
        pixels = np.clip(pixels, 0, 255)
    elif pixels.max(initial=0) > 255:
        pixels = np.clip(pixels.astype(np.int64) >> 8, 0, 255)
    return Image.fromarray(pixels.astype(np.uint8), "L")


def _apply_plan(image: Image.Image, pixels: bytes | memoryview, plan: _Plan,
                size: int) -> Image.Image:
    if plan.resize is None:
        return image
    resized = _resize(image, pixels, plan.resize, plan.downscale)
    if plan.crop:
        return _center_crop(resized, size)
    return _pad(resized, size) if plan.pad else resized


def _resize(image: Image.Image, pixels: bytes | memoryview, target: tuple[int, int],
            downscale: bool) -> Image.Image:
    if image.size == target:
        return image
    if downscale:
        return _downscale(pixels, image.size, target)
    return image.resize(target, UPSCALE_FILTER)


def _center_crop(image: Image.Image, size: int) -> Image.Image:
    """albumentations' CenterCrop of a ``size`` square (a smaller side stays whole)."""
    crop_w, crop_h = min(size, image.width), min(size, image.height)
    left, top = (image.width - crop_w) // 2, (image.height - crop_h) // 2
    return image.crop((left, top, left + crop_w, top + crop_h))


def _pad(image: Image.Image, size: int) -> Image.Image:
    if image.width >= size and image.height >= size:
        return image
    width, height = max(size, image.width), max(size, image.height)
    canvas = Image.new("RGB", (width, height), BORDER_COLOR)
    # albumentations: the top/left border gets the smaller half.
    canvas.paste(image, ((width - image.width) // 2, (height - image.height) // 2))
    return canvas


def _encode(image: Image.Image, cfg: ImageConfig) -> bytes:
    buffer = io.BytesIO()
    if cfg.encode_format == "jpg":
        # optimize (an extra Huffman pass) is off, as in cv2; 4:2:0 chroma like cv2's default
        image.save(buffer, "JPEG", quality=cfg.encode_quality, optimize=False)
    elif cfg.encode_format == "webp":
        image.save(buffer, "WEBP", quality=cfg.encode_quality)
    else:
        image.save(buffer, "PNG", compress_level=_png_compress_level(cfg.encode_quality))
    return buffer.getvalue()


def _png_compress_level(quality: int) -> int:
    """PNG is lossless, so quality cannot mean quality.

    0-9 is taken as img2dataset does (the zlib level); anything above is our 0-100 quality
    scale, where it has no meaning, so zlib's balanced default level 6 is used.
    """
    return quality if quality <= 9 else 6
