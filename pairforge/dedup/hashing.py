"""The hashes of DESIGN.md section 3, computed in the download pass."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import xxhash
from PIL import Image


def sha256_hex(data: bytes) -> str:
    """sha256 of the downloaded bytes, as img2dataset writes it."""
    return hashlib.sha256(data).hexdigest()


# The function behind ``pixel_hash``, recorded in the dedup index files that carry it: an
# index written with another one (sha256 before download output version 4) cannot match.
PIXEL_HASH = "xxh3-128"


def pixel_hash_hex(image: Image.Image, pixels: bytes | memoryview | None = None) -> str:
    """Exact hash of decoded RGB pixels and their shape: equal for any lossless re-encode.

    ``pixels`` is ``image.tobytes()`` (or the same bytes in another buffer, e.g. the
    array simplejpeg decoded into) when the caller already has it: the download pass hands
    the same bytes to the resize, so the pixels are copied out of Pillow at most once.

    XXH3-128, 32 hex digits: 0.007 ms for the 0.9 MB of a 640x480 decode, where sha256 (on
    the CPU's SHA extensions) took 0.42 ms of stage 1's ~5.5 ms per image. A chance
    collision of two images is as unlikely as with a cryptographic hash; a deliberate one
    is not: someone could craft pixels that hash like a given image's, so that one of the
    two is dropped as the other's duplicate. ``sha256``, of the downloaded bytes, stays
    cryptographic.
    """
    if pixels is None:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        pixels = rgb.tobytes()
    digest = xxhash.xxh3_128(f"{image.width}x{image.height}:".encode())
    digest.update(pixels)
    return digest.hexdigest()


# phash looks at a 32x32 Lanczos thumbnail of a fixed 128x128 grey intermediate, made with
# Pillow's antialiased bilinear filter, whose kernel widens with the reduction: a photo and
# its 0.5x or 2x copy give nearly the same intermediate, so their hashes move by at most 2
# bits. Until issue 19 the image was box-reduced by an integer factor (min side // 64)
# instead, which put 0.5x/2x copies on other grids and past 4 bits. The intermediate is
# also what keeps the cost flat: Lanczos straight from a 640x480 decode (a kernel 120 px
# wide) cost 1.5 ms per hash, the bilinear step ~0.3 ms once for all six hashes.
_INTERMEDIATE_SIDE = 128
_PHASH_SIDE, _PHASH_BITS_SIDE = 32, 8
# imagehash.phash takes scipy.fftpack's unnormalised DCT-II of the 32x32 thumbnail along
# both axes and keeps the 8x8 lowest frequencies: y[k] = 2 sum_n x[n] cos(pi k (2n+1) / 2N).
# These are its first 8 rows as a matrix: two small products instead of two FFT calls, and
# no scipy import in every download worker (0.35 s of CPU and 27 MiB each).
_DCT_ROWS = 2 * np.cos(np.pi * np.arange(_PHASH_BITS_SIDE)[:, None]
                       * (2 * np.arange(_PHASH_SIDE)[None, :] + 1) / (2 * _PHASH_SIDE))
# Mirroring x -> N-1-x multiplies the DCT coefficient of horizontal frequency v by (-1)^v,
# so a mirrored image's coefficients are the original's with odd columns negated: its
# phash costs one more median, not another thumbnail.
_MIRROR_SIGN = np.where(np.arange(_PHASH_BITS_SIDE) % 2, -1.0, 1.0)[None, :]
# Centre regions hashed besides the whole image (fraction of each side kept). A copy with
# 10 % cut off every side is the 0.8 region of its original, so its whole-image hash meets
# the original's 0.8 hash; the 0.9 region covers 5 % cuts and, region against region, the
# few-pixel crops whose shifted grid moves the whole-image hash.
CROP_FRACTIONS = (0.9, 0.8)


@dataclass(frozen=True, slots=True)
class PerceptualHashes:
    """Every perceptual hash of one image (unsigned 64-bit values)."""

    phash: int  # the whole image (DESIGN.md's phash)
    phash_mirror: int  # the whole image mirrored left-right
    crop_phashes: tuple[int, ...]  # per CROP_FRACTIONS region: its hash, then its mirror's


def _intermediate(image: Image.Image) -> Image.Image:
    side = _INTERMEDIATE_SIDE
    return image.convert("L").resize((side, side), Image.Resampling.BILINEAR)


# The 32x32 thumbnails are Pillow's Lanczos resize (libImaging/Resample.c) written out as
# matrix products, bit for bit: Pillow spent ~0.2 ms per thumbnail on setting up its kernel
# (sin() per tap) for 128 -> 32 pixels, three times per image; the weights depend only on
# the fixed intermediate and regions, so they are made once. Resample.c turns each output
# pixel's kernel weights into integers scaled by 2^22, sums weight x pixel from 1/2 (the
# rounding), shifts right by 22 and clips to 0-255, horizontal pass first. Those sums are
# integers below 2^53, so float64 products give them exactly (tests/test_imageproc.py
# compares with Pillow).
_PRECISION_BITS = 22  # Resample.c: 32 - 8 - 2
_LANCZOS_SUPPORT = 3.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x *= math.pi
    return math.sin(x) / x  # libm's sin, as Pillow's C code calls it


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


def _resample_weights(in_size: int, in0: float, in1: float, out_size: int) -> np.ndarray:
    """Resample.c's precompute_coeffs + normalize_coeffs_8bpc for Lanczos: (out, in)
    integer weights. The box edges are C floats there, hence float32."""
    start, end = np.float32(in0), np.float32(in1)
    scale = float(end - start) / out_size
    filterscale = max(scale, 1.0)
    support = _LANCZOS_SUPPORT * filterscale
    inverse = 1.0 / filterscale  # C multiplies by it; dividing could differ in the last bit
    weights = np.zeros((out_size, in_size))
    for xx in range(out_size):
        center = float(start) + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)  # int() truncates, as the C cast
        xmax = min(int(center + support + 0.5), in_size) - xmin
        kernel = [_lanczos((x + xmin - center + 0.5) * inverse) for x in range(xmax)]
        total = 0.0
        for k in kernel:  # summed in order, as in C
            total += k
        for x, k in enumerate(kernel):
            k = k / total if total != 0.0 else k
            weights[xx, xmin + x] = int(k * (1 << _PRECISION_BITS) + (-0.5 if k < 0 else 0.5))
    return weights


def _resample_pass(weighted: np.ndarray) -> np.ndarray:
    """Resample.c's rounding and clip8 of the weighted sums."""
    half = 1 << (_PRECISION_BITS - 1)
    return np.clip(np.floor((weighted + half) * (1.0 / (1 << _PRECISION_BITS))), 0, 255)


def _region_box(fraction: float) -> tuple[float, float, float, float]:
    margin = _INTERMEDIATE_SIDE * (1 - fraction) / 2
    return (margin, margin, _INTERMEDIATE_SIDE - margin, _INTERMEDIATE_SIDE - margin)


_BOXES = ((0.0, 0.0, float(_INTERMEDIATE_SIDE), float(_INTERMEDIATE_SIDE)),
          *(_region_box(f) for f in CROP_FRACTIONS))
# Per box: horizontal weights (in, out) and vertical weights (out, in).
_ROW_WEIGHTS = [np.ascontiguousarray(
    _resample_weights(_INTERMEDIATE_SIDE, b[0], b[2], _PHASH_SIDE).T) for b in _BOXES]
_COLUMN_WEIGHTS = [_resample_weights(_INTERMEDIATE_SIDE, b[1], b[3], _PHASH_SIDE)
                   for b in _BOXES]
# OpenBLAS runs a product of more than 2^18 multiply-adds on all its threads, which here
# wait longer than they compute (a 128x128 by 128x32 product took 3-9x the CPU of one
# thread on the 2-core build machine). Products of 64 rows stay on the calling thread.
_ROWS_PER_PRODUCT = 64


def _thumbnails(grey: Image.Image, count: int = len(_BOXES)) -> list[np.ndarray]:
    """32x32 Lanczos thumbnails of the whole intermediate, then of each CROP_FRACTIONS
    region (fractional boxes: no rounding of a region to whole pixels), the first
    ``count``; each exactly ``grey.resize((32, 32), LANCZOS, box=...)``."""
    pixels = np.asarray(grey, dtype=np.float64)
    step = _ROWS_PER_PRODUCT
    thumbs = []
    for rows_w, columns_w in zip(_ROW_WEIGHTS[:count], _COLUMN_WEIGHTS, strict=False):
        rows = np.concatenate([pixels[i:i + step] @ rows_w
                               for i in range(0, len(pixels), step)])
        thumbs.append(_resample_pass(columns_w @ _resample_pass(rows)))
    return thumbs


def _low_frequencies(thumb: np.ndarray) -> np.ndarray:
    """The 8x8 lowest DCT frequencies of a 32x32 thumbnail."""
    low = _DCT_ROWS @ thumb @ _DCT_ROWS.T
    # Rounding zeroes the products' float noise (~1e-12), where the FFT gives exact zeros:
    # a flat image must keep its one-bit hash (dedup skips such degenerate hashes).
    return np.round(low, 6)


def _bits_of(lows: np.ndarray) -> list[int]:
    """imagehash's bits of each 8x8 block in ``lows`` (n, 8, 8): above the block's median,
    row-major, first bit most significant."""
    flat = lows.reshape(len(lows), -1)
    ordered = np.sort(flat, axis=1)
    middle = flat.shape[1] // 2
    # np.median of an even count: the mean of the two middle values, (a + b) / 2; a sort
    # of 64 values is a tenth of np.median's call overhead.
    medians = (ordered[:, middle - 1] + ordered[:, middle]) / 2
    packed = np.packbits(flat > medians[:, None], axis=1)
    return [int.from_bytes(row.tobytes(), "big") for row in packed]


def _bits(low: np.ndarray) -> int:
    return _bits_of(low[None])[0]


def phash_u64(image: Image.Image) -> int:
    """64-bit perceptual hash (imagehash.phash's 8x8 DCT bits, of the 128x128 intermediate)
    as an unsigned integer."""
    return _bits(_low_frequencies(_thumbnails(_intermediate(image), 1)[0]))


def perceptual_hashes(image: Image.Image) -> PerceptualHashes:
    """The whole-image phash, its mirror's, and the centre regions' (with mirrors)."""
    lows = [_low_frequencies(t) for t in _thumbnails(_intermediate(image))]
    bits = _bits_of(np.stack([v for low in lows for v in (low, low * _MIRROR_SIGN)]))
    return PerceptualHashes(bits[0], bits[1], tuple(bits[2:]))
