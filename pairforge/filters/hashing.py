"""The three hashes of DESIGN.md section 3, computed in the download pass."""

from __future__ import annotations

import hashlib

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


# phash looks at a 32x32 Lanczos thumbnail. Lanczos from a 300 px photo down to 32 px is
# the most expensive step of the whole download pass after the resize, so the grey image
# is first box-reduced (cheap, exact averaging) to a smaller side of at least this.
PHASH_SOURCE_SIDE = 64
_PHASH_SIDE, _PHASH_BITS_SIDE = 32, 8
# imagehash.phash takes scipy.fftpack's unnormalised DCT-II of the 32x32 thumbnail along
# both axes and keeps the 8x8 lowest frequencies: y[k] = 2 sum_n x[n] cos(pi k (2n+1) / 2N).
# These are its first 8 rows as a matrix: two small products instead of two FFT calls, and
# no scipy import in every download worker (0.35 s of CPU and 27 MiB each). Same bits.
_DCT_ROWS = 2 * np.cos(np.pi * np.arange(_PHASH_BITS_SIDE)[:, None]
                       * (2 * np.arange(_PHASH_SIDE)[None, :] + 1) / (2 * _PHASH_SIDE))


def phash_u64(image: Image.Image) -> int:
    """64-bit perceptual hash (imagehash.phash, 8x8 DCT) as an unsigned integer."""
    grey = image.convert("L")
    factor = min(grey.size) // PHASH_SOURCE_SIDE
    if factor >= 2:
        grey = grey.reduce(factor)
    thumb = grey.resize((_PHASH_SIDE, _PHASH_SIDE), Image.Resampling.LANCZOS)
    low = _DCT_ROWS @ np.asarray(thumb, dtype=np.float64) @ _DCT_ROWS.T
    # Rounding zeroes the products' float noise (~1e-12), where the FFT gives exact zeros:
    # a flat image must keep its one-bit hash (dedup skips such degenerate hashes).
    low = np.round(low, 6)
    bits = low > np.median(low)  # row-major, first bit most significant: imagehash's order
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def hamming_u64(a: int, b: int) -> int:
    return (a ^ b).bit_count()
