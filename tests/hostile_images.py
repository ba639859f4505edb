"""Hostile images, generated: strips, spacers, frame and page bombs, decompression bombs.

Each is a few bytes to a few hundred KB that a naive resizer or decoder turns into
gigabytes or minutes: a 65535x1 PNG is 274 bytes, and keep_ratio at 256 px asks for a
16.7-million x 256 image. ``HOSTILE`` names each with the status stage 1 must give it.
Generated here (no file is shipped), so tests never depend on anything beside the clone.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

from PIL import Image


def png_bytes(width: int, height: int, mode: str = "L", colour: int = 0) -> bytes:
    """A PNG of one colour written chunk by chunk: a 30000x30000 one costs no 900 MB
    buffer to make (one row is compressed and repeated)."""
    bits = {"1": (1, 0), "L": (8, 0), "RGB": (8, 2)}[mode]
    row_bytes = {"1": (width + 7) // 8, "L": width, "RGB": 3 * width}[mode]
    row = b"\x00" + bytes([colour]) * row_bytes  # filter type 0, then the pixels
    compressor = zlib.compressobj(9)
    chunks = [compressor.compress(row * min(height, 64)) for _ in range(height // 64)]
    chunks.append(compressor.compress(row * (height % 64)))
    chunks.append(compressor.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, bits[0], bits[1], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(chunks))
            + _chunk(b"IEND", b""))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def pillow_bytes(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def strip(fmt: str, long_side: int, vertical: bool = False) -> bytes:
    """A one-pixel-high (or -wide) strip, the web's spacers, rules and gradient bars."""
    size = (1, long_side) if vertical else (long_side, 1)
    if fmt == "PNG":
        return png_bytes(*size)
    return pillow_bytes(Image.new("RGB", size, (200, 30, 30)), fmt)


def gif_frames(frames: int, side: int = 1) -> bytes:
    """An animated GIF of ``frames`` frames, alternating red and blue; the first red."""
    first = Image.new("P", (side, side), 0)
    first.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    rest = []
    for i in range(1, frames):
        frame = Image.new("P", (side, side), i % 2)
        frame.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
        rest.append(frame)
    return pillow_bytes(first, "GIF", save_all=True, append_images=rest, duration=10,
                        optimize=False, disposal=1)


def gif_screen(width: int, height: int) -> bytes:
    """A GIF whose logical screen is ``width`` x ``height`` around a 1x1 frame: the screen,
    not the frame, is what a decoder allocates."""
    small = bytearray(pillow_bytes(Image.new("P", (1, 1), 0), "GIF"))
    small[6:10] = struct.pack("<HH", width, height)
    return bytes(small)


def tiff_pages(pages: int, side: int = 8) -> bytes:
    first = Image.new("RGB", (side, side), (255, 0, 0))
    rest = [Image.new("RGB", (side, side), (0, 0, 255)) for _ in range(pages - 1)]
    return pillow_bytes(first, "TIFF", save_all=True, append_images=rest)


def apng_frames(frames: int, side: int = 8) -> bytes:
    first = Image.new("RGB", (side, side), (255, 0, 0))
    rest = [Image.new("RGB", (side, side), (0, 0, 255 - i % 2)) for i in range(frames - 1)]
    return pillow_bytes(first, "PNG", save_all=True, append_images=rest, duration=10)


def webp_frames(frames: int, side: int = 8) -> bytes:
    first = Image.new("RGB", (side, side), (255, 0, 0))
    rest = [Image.new("RGB", (side, side), (0, 0, 255 - i % 2)) for i in range(frames - 1)]
    return pillow_bytes(first, "WEBP", save_all=True, append_images=rest, duration=10,
                        lossless=True)


def ico_with_png(width: int, height: int) -> bytes:
    """An ICO whose directory says 256x256 but whose embedded PNG is ``width`` x
    ``height``: the directory is all a header check sees."""
    png = png_bytes(width, height)
    directory = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 6 + 16)
    return directory + entry + png


def jpeg_header(width: int, height: int) -> bytes:
    """A real small JPEG whose frame header claims ``width`` x ``height``, data cut short."""
    data = bytearray(pillow_bytes(Image.new("RGB", (16, 16), (10, 200, 10)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


# (name, bytes factory, the status stage 1 gives it at the default image settings)
HOSTILE: list[tuple[str, Callable[[], bytes], str]] = [
    *[(f"strip_{fmt.lower()}", lambda fmt=fmt: strip(fmt, 65535 if fmt in ("PNG", "GIF",
       "BMP", "TIFF") else 16383), "too_large") for fmt in ("PNG", "GIF", "WEBP", "BMP",
                                                             "TIFF", "JPEG")],
    ("strip_png_vertical", lambda: strip("PNG", 65535, vertical=True), "too_large"),
    ("spacer_gif_1x1", lambda: strip("GIF", 1), "ok"),
    ("gif_10000_frames", lambda: gif_frames(10_000), "ok"),
    ("gif_screen_65535", lambda: gif_screen(65535, 65535), "too_large"),
    ("tiff_2000_pages", lambda: tiff_pages(2_000), "ok"),
    ("apng_2000_frames", lambda: apng_frames(2_000), "ok"),
    ("webp_2000_frames", lambda: webp_frames(2_000), "ok"),
    ("png_bomb_40000", lambda: png_bytes(40_000, 40_000, "1"), "too_large"),
    ("png_bomb_over_decode_cap", lambda: png_bytes(9_000, 9_000, "1"), "too_large"),
    ("png_bomb_under_decode_cap", lambda: png_bytes(5_700, 5_700, "1"), "ok"),
    ("ico_png_20000", lambda: ico_with_png(20_000, 20_000), "too_large"),
    ("ico_png_12000", lambda: ico_with_png(12_000, 12_000), "too_large"),
    ("jpeg_header_65500", lambda: jpeg_header(65500, 65500), "too_large"),
]
