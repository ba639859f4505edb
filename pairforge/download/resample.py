"""Downscaling decoded RGB pixels with libvips: Lanczos quality at a third of Pillow's CPU.

The resize is the largest cost of the download pass after decoding. Measured on this
project's build machine (bench/stage1_profile.py, photos at 1,280 px drafted to 640x480,
down to 341x256): Pillow bicubic 3.4-3.5 ms, libvips Lanczos-3 1.3-1.5 ms with the copies
in and out, and libvips is the closer of the two to a Lanczos resize of the full-size
decode (46 against 43 dB PSNR). Upscaling stays with Pillow: libvips places upsampled
pixel centres differently from Pillow and albumentations (28 dB apart).

libvips runs each call on one of its own worker threads with the GIL released; the fetch
threads are the parallelism, so it gets one worker, and no operation cache (every image
is new, and a cached operation would hold its pixels).

Most of a call's cost at these sizes is fixed (~0.6 ms for a 20x16 image: libvips
building the operation, its thread hand-off, pyvips' Python): the resize is called as an
operation by name, not as ``image.resize``, whose attribute lookup first asks libvips for
an image property of that name and builds an error for it (~40 us per call).
"""

from __future__ import annotations

import pyvips
from PIL import Image

pyvips.concurrency_set(1)
pyvips.cache_set_max(0)

KERNEL = "lanczos3"


def downscale(pixels: bytes | memoryview, size: tuple[int, int], target: tuple[int, int]
              ) -> Image.Image:
    """``pixels`` (RGB, ``size``; any C-contiguous buffer, read in place) resized to
    ``target``, an RGB Pillow image.

    libvips shrinks by the integer part of a large factor first (box, like Pillow's
    ``reducing_gap``), then applies the kernel.
    """
    width, height = size
    source = pyvips.Image.new_from_memory(pixels, width, height, 3, "uchar")
    out = pyvips.Operation.call("resize", source, target[0] / width,
                                vscale=target[1] / height, kernel=KERNEL)
    if (out.width, out.height) != target:  # libvips rounds the size itself; never trust it
        out = out.crop(0, 0, min(out.width, target[0]), min(out.height, target[1]))
        if (out.width, out.height) != target:
            out = out.embed(0, 0, target[0], target[1], extend="copy")
    return Image.frombuffer("RGB", target, out.write_to_memory(), "raw", "RGB", 0, 1)
