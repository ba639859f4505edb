"""Decoding stage 3's JPEGs on a model's GPU (``process.decode.device: cuda``, issue 48).

The first model step's actors (``process.decode.where: actor``) hand a batch's JPEGs to
torchvision's nvJPEG decoder on their own device, in calls of at most ``MAX_RAW_PIXELS``
pixels in all (from the headers, before any decoding), prepare each view there
(``on_tensor`` of a view's ``prepare``: torch's antialiased bicubic resize and the crop)
and copy the small pictures back to the host, so the CPUs do no decoding and no resizing
of full images. What the device cannot take goes to Pillow, row by row, as on the CPU
path: other formats, an image whose header is past ``images.MAX_RAW_PIXELS`` (where it
ends ``decode_error`` before a pixel is allocated), a batch the decoder refuses, and a view
with no tensor path. The pictures differ from Pillow's in their last bits (another IDCT
and resize), which is why ``process.decode.device`` is in the settings digest.

The same code runs on ``cpu`` (torchvision's libjpeg-turbo decoder), which is how the
tests check it on a machine without a GPU.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from PIL import Image

from pairforge.images import DECODES, MAX_RAW_PIXELS, ImageView, Pictures

if TYPE_CHECKING:
    import torch

JPEG_MAGIC = b"\xff\xd8\xff"


def on_device(device: str) -> Pictures:
    """``images.decode_views``'s ``decoder`` for JPEGs on ``device``."""
    return functools.partial(device_pictures, device=device)


def device_pictures(data: pa.ChunkedArray, rows: np.ndarray, views: tuple[ImageView, ...],
                    device: str) -> dict[int, list[np.ndarray]]:
    """``{row: its pictures in views}`` for the JPEGs among ``rows`` of ``data`` that
    ``device`` decodes; the rows it leaves out are Pillow's. The JPEGs are decoded in
    calls of at most ``MAX_RAW_PIXELS`` pixels in all (their headers say, before any
    decoding), so a batch of large images never holds more than one image's cap at once."""
    found: dict[int, list[np.ndarray]] = {}
    for group in _calls(data, rows):
        found.update(_decode_call(group, views, device))
    return found


def _calls(data: pa.ChunkedArray, rows: np.ndarray) -> Iterator[dict[int, bytes]]:
    """The JPEGs within the cap among ``rows``, as groups of at most MAX_RAW_PIXELS."""
    group: dict[int, bytes] = {}
    pixels = 0
    for i in rows:
        encoded = data[int(i)].as_py()
        size = _header_pixels(encoded) if encoded[:3] == JPEG_MAGIC else None
        if size is None or size > MAX_RAW_PIXELS:
            continue  # Pillow's: it decodes it or ends the row with its status
        if group and pixels + size > MAX_RAW_PIXELS:
            yield group
            group, pixels = {}, 0
        group[int(i)] = encoded
        pixels += size
    if group:
        yield group


def _decode_call(group: dict[int, bytes], views: tuple[ImageView, ...],
                 device: str) -> dict[int, list[np.ndarray]]:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = {i: torch.frombuffer(bytearray(b), dtype=torch.uint8) for i, b in group.items()}
    try:
        decoded = dict(zip(tensors, decode_jpeg(list(tensors.values()), mode=ImageReadMode.RGB,
                                                device=device), strict=True))
    except RuntimeError:  # one JPEG it refuses (damaged, CMYK) fails the call: row by row
        decoded = {}
        for i, tensor in tensors.items():
            try:
                decoded[i] = decode_jpeg(tensor, mode=ImageReadMode.RGB, device=device)
            except RuntimeError:
                continue  # Pillow's: it decodes it or ends the row decode_error
    DECODES["rows"] += len(decoded)
    return {i: [_to_host(_prepared(view, image)) for view in views]
            for i, image in decoded.items()}


def _header_pixels(data: bytes) -> int | None:
    try:
        width, height = Image.open(io.BytesIO(data)).size  # the header only
    except (OSError, ValueError):
        return None
    return width * height


def _prepared(view: ImageView, image: torch.Tensor) -> torch.Tensor | np.ndarray:
    """``image`` (CHW uint8) in ``view``: on its device where the view has a tensor path,
    else through Pillow on the host."""
    if view.prepare is None:
        return image
    on_tensor = getattr(view.prepare, "on_tensor", None)
    prepared = on_tensor(image) if on_tensor else None
    if prepared is not None:
        return prepared
    picture = Image.fromarray(_to_host(image))
    return np.asarray(view.of(picture), dtype=np.uint8)


def _to_host(image: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image
    return image.permute(1, 2, 0).contiguous().cpu().numpy()
