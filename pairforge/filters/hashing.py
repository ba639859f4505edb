"""The hashes of DESIGN.md section 3, computed in the download pass."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image


def sha256_hex(data: bytes) -> str:
    """sha256 of the downloaded bytes, as img2dataset writes it."""
    return hashlib.sha256(data).hexdigest()


def pixel_hash_hex(image: Image.Image, pixels: bytes | None = None) -> str:
    """Exact hash of decoded RGB pixels and their shape: equal for any lossless re-encode.

    ``pixels`` is ``image.tobytes()`` when the caller already has it (the download pass
    hands the same bytes to the resize), so the pixels are copied out of Pillow once.
    """
    if pixels is None:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        pixels = rgb.tobytes()
    # sha256 runs on the CPU's SHA extensions here: 2.5x faster than blake2b on 200 KB.
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode())
    digest.update(pixels)
    return digest.hexdigest()[:32]


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


def _low_frequencies(grey: Image.Image, box: tuple[float, ...] | None = None) -> np.ndarray:
    """The 8x8 lowest DCT frequencies of the 32x32 thumbnail of ``grey`` (or of its
    fractional ``box`` region: no rounding of the region to whole pixels)."""
    thumb = grey.resize((_PHASH_SIDE, _PHASH_SIDE), Image.Resampling.LANCZOS, box=box)
    low = _DCT_ROWS @ np.asarray(thumb, dtype=np.float64) @ _DCT_ROWS.T
    # Rounding zeroes the products' float noise (~1e-12), where the FFT gives exact zeros:
    # a flat image must keep its one-bit hash (dedup skips such degenerate hashes).
    return np.round(low, 6)


def _bits(low: np.ndarray) -> int:
    bits = low > np.median(low)  # row-major, first bit most significant: imagehash's order
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def _centre(fraction: float) -> tuple[float, float, float, float]:
    margin = _INTERMEDIATE_SIDE * (1 - fraction) / 2
    return (margin, margin, _INTERMEDIATE_SIDE - margin, _INTERMEDIATE_SIDE - margin)


def phash_u64(image: Image.Image) -> int:
    """64-bit perceptual hash (imagehash.phash's 8x8 DCT bits, of the 128x128 intermediate)
    as an unsigned integer."""
    return _bits(_low_frequencies(_intermediate(image)))


def perceptual_hashes(image: Image.Image) -> PerceptualHashes:
    """The whole-image phash, its mirror's, and the centre regions' (with mirrors)."""
    grey = _intermediate(image)
    low = _low_frequencies(grey)
    crops: list[int] = []
    for fraction in CROP_FRACTIONS:
        region = _low_frequencies(grey, _centre(fraction))
        crops += [_bits(region), _bits(region * _MIRROR_SIGN)]
    return PerceptualHashes(_bits(low), _bits(low * _MIRROR_SIGN), tuple(crops))


def hamming_u64(a: int, b: int) -> int:
    return (a ^ b).bit_count()
