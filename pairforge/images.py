"""Image helpers shared by the model steps (ground floor: no pipeline, no model code).

**One decode per row** (issue 48). A model step says which pictures of a row it reads as
``ImageView``s: the decoded RGB as it is (what a transformers processor takes), or that
picture already resized and cropped to a model's input (open_clip's resize + centre crop,
the VQ's square). Stage 3 decodes each row's image once, in a CPU task ahead of the model
pools (``decode_views``), prepares each distinct view once, and hands the arrays along in
``pixels.*`` columns; the steps read them with ``view_images``. So decoding and resizing
overlap the models' forward passes instead of running inside them, and a chain of CLIP,
a classifier, the captioner and the VQ decodes a row once, not five times. A step called
without those columns (a test, the service) decodes and prepares by itself, the same way.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from PIL import Image

from pairforge.config import ModelPoolConfig
from pairforge.records import Status, end_rows

if TYPE_CHECKING:
    import torch

DECODES = {"rows": 0}  # images decoded in this process: what the one-decode test counts
VIEW_PREFIX = "pixels."
PIXELS = pa.struct([("height", pa.int32()), ("width", pa.int32()),
                    ("data", pa.large_binary())])  # HWC uint8 RGB


# Stage 1 writes raw images within its own caps (download.image.max_output_pixels); a raw
# image past this one is not one it wrote, and is refused before its pixels are allocated.
MAX_RAW_PIXELS = 64 * 1024 * 1024  # 192 MiB of RGB at most


def decode_rgb(data: bytes | memoryview) -> Image.Image:
    """An encoded image (a raw shard's bytes) as an RGB Pillow image; ValueError for one
    whose header claims more than ``MAX_RAW_PIXELS``, before anything is decoded."""
    DECODES["rows"] += 1
    image = Image.open(io.BytesIO(data))
    if image.width * image.height > MAX_RAW_PIXELS:
        raise ValueError(f"{image.width}x{image.height} pixels is past stage 3's cap of "
                         f"{MAX_RAW_PIXELS} for a raw image")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageView:
    """A picture of a row that a step reads. ``key`` says what ``prepare`` does (the same
    key, the same pixels: two steps reading one view share its column); ``prepare`` maps
    the decoded RGB image to it (None: as decoded). It travels to Ray tasks by pickle."""

    key: str
    prepare: Callable[[Image.Image], Image.Image] | None = field(default=None, compare=False)

    @property
    def column(self) -> str:
        return VIEW_PREFIX + hashlib.sha1(self.key.encode()).hexdigest()[:12]

    def of(self, image: Image.Image) -> Image.Image:
        return image if self.prepare is None else self.prepare(image)


RGB = ImageView("rgb")  # the decoded image as it is


def resize_center_crop(image: Image.Image, side: int) -> Image.Image:
    """Shorter side to ``side`` (bicubic), then the centre ``side`` x ``side`` square, RGB."""
    image = image.convert("RGB")
    width, height = image.size
    scale = side / min(width, height)
    size = (max(side, round(width * scale)), max(side, round(height * scale)))
    image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - side) // 2, (size[1] - side) // 2
    return image.crop((left, top, left + side, top + side))


class SquarePicture:
    """``prepare`` of a square view (``resize_center_crop`` at ``side``): a picture that
    goes through it again comes back the same (Pillow copies a same-size resize)."""

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, image: Image.Image) -> Image.Image:
        return resize_center_crop(image, self.side)

    def on_tensor(self, image: torch.Tensor) -> torch.Tensor:
        """The same on a CHW uint8 tensor on its device (torch's bicubic, antialiased)."""
        from torchvision.transforms.v2 import InterpolationMode
        from torchvision.transforms.v2 import functional as tf

        height, width = image.shape[-2:]
        scale = self.side / min(width, height)
        size = [max(self.side, round(height * scale)), max(self.side, round(width * scale))]
        image = tf.resize(image, size, InterpolationMode.BICUBIC, antialias=True)
        top, left = (size[0] - self.side) // 2, (size[1] - self.side) // 2
        return image[..., top:top + self.side, left:left + self.side]


def square_view(side: int) -> ImageView:
    return ImageView(f"square-bicubic:{side}", SquarePicture(side))


def unique_views(views: Iterable[ImageView]) -> tuple[ImageView, ...]:
    """Each view once, in first-asked order."""
    return tuple(dict.fromkeys(views))


# The most picture bytes one table of decoded views holds: the decoding task hands Ray a
# table each time its rows' pictures pass this (Ray stores each as its own block), so
# what a task holds is bounded by bytes actually decoded, whatever size stage 1 wrote.
VIEW_BLOCK_BYTES = 64 * 1024**2


# Pictures some rows of a batch get elsewhere than from Pillow: (the image column, the
# ok rows, the views) -> {row: its pictures} (device_decode.py's, on a GPU)
Pictures = Callable[[pa.ChunkedArray, np.ndarray, tuple[ImageView, ...]],
                    dict[int, list[np.ndarray]]]


def decode_views(batch: pa.Table, views: tuple[ImageView, ...],
                 decoder: Pictures | None = None) -> pa.Table:
    """``batch`` with a ``pixels.*`` column per view: each ok row's image decoded once and
    prepared once per view; rows that left earlier get nulls. An image that no longer
    decodes (a raw tar damaged since stage 1 read it) ends its row ``decode_error``.
    ``decoder``: the rows it takes get their pictures from it, the others from Pillow."""
    return next(decode_view_blocks(batch, views, max_bytes=None, decoder=decoder))


def decode_view_blocks(batch: pa.Table, views: tuple[ImageView, ...],
                       max_bytes: int | None = VIEW_BLOCK_BYTES,
                       decoder: Pictures | None = None) -> Iterator[pa.Table]:
    """``decode_views`` of ``batch``, as consecutive tables of its rows, each ended as soon
    as its pictures pass ``max_bytes`` (None: one table). Every row once, in order; a
    batch of no rows gives one table of none."""
    ok = pc.equal(batch["status"], Status.OK.value).to_numpy(zero_copy_only=False)
    data = batch["image"]
    on_device = decoder(data, np.flatnonzero(ok), views) if decoder else {}
    start, size, pictures, failed = 0, 0, {}, {}
    for i in range(batch.num_rows):
        if ok[i]:
            try:
                pictures[i] = on_device.get(i) or pillow_pictures(data[i].as_py(), views)
                size += sum(picture.nbytes for picture in pictures[i])
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                failed[i] = f"stage 3 could not decode the image: {type(err).__name__}: {err}"
        if max_bytes is not None and size >= max_bytes and i + 1 < batch.num_rows:
            yield _with_views(batch, start, i + 1, views, pictures, failed)
            start, size, pictures, failed = i + 1, 0, {}, {}
    yield _with_views(batch, start, batch.num_rows, views, pictures, failed)


def pillow_pictures(data: bytes, views: tuple[ImageView, ...]) -> list[np.ndarray]:
    """One encoded image's pictures in ``views``, as HWC uint8 arrays, by Pillow."""
    image = decode_rgb(data)
    return [np.asarray(view.of(image), dtype=np.uint8) for view in views]


def _with_views(batch: pa.Table, start: int, end: int, views: tuple[ImageView, ...],
                pictures: dict[int, list[np.ndarray]], failed: dict[int, str]) -> pa.Table:
    """Rows ``start:end`` of ``batch`` with their views' columns (keys: rows of ``batch``)."""
    part = batch.slice(start, end - start)
    for k, view in enumerate(views):
        values = [_pixels(pictures[i][k]) if i in pictures else None for i in range(start, end)]
        part = part.append_column(view.column, pa.array(values, PIXELS))
    return end_rows(part, {i - start: (Status.DECODE_ERROR.value, message)
                           for i, message in failed.items()})


def _pixels(array: np.ndarray) -> dict:
    return {"height": array.shape[0], "width": array.shape[1], "data": array.tobytes()}


def view_images(rows: pa.Table, view: ImageView) -> list[Image.Image]:
    """The rows' pictures in ``view``: from its column when the chain decoded them, else
    decoded and prepared here (a step called on its own)."""
    if view.column not in rows.column_names:
        return [view.of(decode_rgb(b)) for b in rows["image"].to_pylist()]
    column = rows[view.column].combine_chunks()
    heights = column.field("height").to_numpy()
    widths = column.field("width").to_numpy()
    data = column.field("data")
    return [Image.fromarray(np.frombuffer(data[i].as_buffer(), np.uint8)
                            .reshape(int(heights[i]), int(widths[i]), 3))
            for i in range(len(column))]


def model_device(pool: ModelPoolConfig) -> str:
    """``cuda`` when the pool asks Ray for GPUs and one is visible, else ``cpu``."""
    import torch

    return "cuda" if pool.num_gpus and torch.cuda.is_available() else "cpu"


def model_dtype(name: str, device: str) -> torch.dtype:  # noqa: F821 - torch is lazy
    """A model section's ``dtype`` setting as a torch dtype (auto: bf16 on GPU, else fp32)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
