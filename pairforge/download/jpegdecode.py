"""JPEG decoding through libjpeg-turbo's TurboJPEG API (simplejpeg), pixel for pixel Pillow's.

Stage 1 decodes most of its images as JPEGs, and the decode is the largest cost of the
image pass. Pillow's ``draft`` + ``load`` + ``tobytes`` and simplejpeg run the same
libjpeg-turbo code (the same scaled IDCT, fancy upsampling and colour conversion), but
simplejpeg decodes in one call straight into a numpy array, without Pillow's chunked
reads, its per-row unpacking into 4-byte pixels and the ``tobytes`` copy back out: with
the Pillow copy the stage still makes, 2-8 % less CPU at 1/2 scale and 11-25 % at full
size for a 1,280 px photo (bench/RESULTS.md, "CPU per image at 1,280 px").

``decode`` returns pixels only where they are Pillow's: at the reduction Pillow's draft
would pick, for the colour spaces tests/test_jpegdecode.py proves equal (YCbCr, RGB,
greyscale; CMYK/YCCK differ by one level: Pillow converts CMYK to RGB its own way), and
only when libjpeg-turbo reports no warning at all. Everything else is None, and the
caller decodes with Pillow as before, so no image gets a new status or new pixels.
"""

from __future__ import annotations

import numpy as np
import simplejpeg

# Pillow image modes of JPEGs whose pixels simplejpeg reproduces (CMYK does not).
MODES = frozenset({"RGB", "L"})


def _scaled(side: int, num: int, denom: int) -> int:
    """TurboJPEG's TJSCALED: a side at scale num/denom, rounded up (libjpeg's own rule)."""
    return (side * num + denom - 1) // denom


def _scale_is_reachable(size: tuple[int, int], scale: int) -> bool:
    """Whether simplejpeg, asked for the 1/``scale`` size, decodes at 1/``scale``.

    simplejpeg does not take a scale: it picks the smallest of TurboJPEG's factors (1/8,
    2/8, ... 7/8, then 1) whose size reaches min_width and min_height. For tiny sides a
    smaller factor rounds up to the same size (ceil(5 * 7/8) = 5) and would be picked,
    with other pixels. Sizes only grow with the factor, so checking the factor just
    below 1/scale is enough.
    """
    below = 8 // scale - 1  # in eighths; 1/8 has nothing below it
    if below == 0:
        return True
    width, height = size
    return (_scaled(width, below, 8) < _scaled(width, 1, scale)
            or _scaled(height, below, 8) < _scaled(height, 1, scale))


def decode(body: bytes, size: tuple[int, int], scale: int) -> np.ndarray | None:
    """RGB pixels (height, width, 3) of JPEG ``body`` (``size`` from its header) decoded
    at 1/``scale`` (1, 2, 4 or 8), as Pillow's draft decode gives them; None where
    simplejpeg could differ or refuses."""
    if not _scale_is_reachable(size, scale):
        return None
    width, height = _scaled(size[0], 1, scale), _scaled(size[1], 1, scale)
    try:
        # strict: libjpeg's warnings (truncated data, corrupt segments) raise; Pillow
        # decides those images, so their status and error text stay what they were.
        pixels = simplejpeg.decode_jpeg(body, "rgb", min_width=width, min_height=height,
                                        strict=True)
    except Exception:  # whatever simplejpeg refuses, Pillow gets to decode
        return None
    # The header Pillow parsed and the one libjpeg reads could disagree on odd files.
    return pixels if pixels.shape == (height, width, 3) else None
