"""The colour grid of every image (DESIGN.md section 3) and the checks stage 2 runs on two
grids before it merges their images (dedup/decide.colour_groups).

The perceptual hashes see luminance only, and coarsely: two images they call near can
differ in colour (a red and a blue circle), in where a small shape sits, or in a shape's
outline (a small circle and a small square drawn at 32 px share a 64-bit phash). The grid
is the mean Y, Cb and Cr of each cell of a 16x16 grid over the whole image, then over each
CROP_FRACTIONS centre region (2,304 bytes, row-major): Pillow's box filter with
fractional cell edges, so a copy at another size, or with a few pixels cut, lies on nearly
the same cells, and a copy cut to a region on the cells of that region's grid.

Two checks, each in the better orientation (as given, or mirrored when mirrors count):
* colour: the largest difference of one cell's Y, Cb or Cr on the 8x8 grid (2x2 cells
  pooled) must stay within ``max_colour_distance`` levels;
* structure: with each grid's mean taken out, the largest difference of one 16x16 cell,
  in units of the two images' standard deviation over the cells (per channel, at least
  STRUCTURE_FLOOR levels), must stay within ``max_structure_distance``. A shape's corner
  in a flat drawing is several deviations; a photo resized, re-encoded, brightened or cut
  by a few pixels moves a cell by about one (bench/RESULTS.md, issue 35 item 4).

A copy with its borders cut meets its original through a region's hash (CROP_FRACTIONS):
the checks then compare what the two linked points see (the region's grid against the cut
copy's whole one), each at half its bound (the colour on 4x4 cells).

Grids written before the structure check (``LEGACY_GRID_BYTES``: 8x8 of the whole image
and 4x4 of each region, after an integer reduce) are still read: a pair with one is
compared in that form, by colour only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pairforge.config import DedupConfig
from pairforge.dedup.hashing import CROP_FRACTIONS

GRID_SIDE, _CHANNELS = 16, 3
# what each perceptual point (dedup/decide.points_of's columns) sees: the whole image,
# its mirror, then each CROP_FRACTIONS region and its mirror
POINT_FRACTIONS = (1.0, 1.0, *(f for f in CROP_FRACTIONS for _ in range(2)))
POINTS = len(POINT_FRACTIONS)
FRAMES = (1.0, *CROP_FRACTIONS)  # the grids' framings: the whole image, then each region
GRID_BYTES = len(FRAMES) * GRID_SIDE * GRID_SIDE * _CHANNELS
LEGACY_WHOLE, LEGACY_REGION = 8, 4
LEGACY_GRID_BYTES = (LEGACY_WHOLE ** 2 + len(CROP_FRACTIONS) * LEGACY_REGION ** 2) * _CHANNELS
STRUCTURE_FLOOR = 8.0  # levels: a flat channel's JPEG noise is not structure


@dataclass(frozen=True)
class GridCheck:
    """The bounds two rows' grids must meet to merge (None: that check off)."""

    max_colour_distance: int | None = None
    max_structure_distance: float | None = None
    mirrors: bool = True  # a mirrored copy may merge (compared mirrored)

    @classmethod
    def of(cls, cfg: DedupConfig) -> GridCheck:
        return cls(cfg.max_colour_distance, cfg.max_structure_distance, cfg.mirrors)

    @property
    def active(self) -> bool:
        return self.max_colour_distance is not None or self.max_structure_distance is not None


def colour_grid(image: Image.Image) -> bytes:
    """The 16x16 YCbCr cell means of an RGB image, then of each centre region."""
    w, h = image.size
    # An integer reduce that keeps at least 4 pixels per cell, then exact cell means by
    # the share of each reduced pixel inside each cell: Pillow's box filter rounds cell
    # edges to whole pixels, which left a mirrored copy up to 60 levels off. At ordinary
    # aspect ratios the products stay under OpenBLAS's threading size
    # (dedup/hashing._ROWS_PER_PRODUCT).
    factor = max(1, min(w, h) // (GRID_SIDE * 4))
    small = (image.reduce(factor) if factor > 1 else image).convert("YCbCr")
    channels = np.asarray(small, dtype=np.float32).transpose(2, 0, 1)
    rows, columns = _covers(h, factor), _covers(w, factor)
    grids = [rows[i] @ channels @ columns[i].T for i in range(len(FRAMES))]
    return np.round(np.stack(grids).transpose(0, 2, 3, 1)).astype(np.uint8).tobytes()


# The weights depend only on a side's length and the reduce factor, and a crawl's images
# share a few sizes: kept for sides of up to _CACHED_PIXELS reduced pixels (at most
# 128 x 96 KiB). Made one framing and one side at a time they cost 0.11 ms per image;
# with both changes the grid took 0.45 ms against 0.50 (bench/RESULTS.md, "Stage 1's
# CPU per image won back").
_CACHED_PIXELS = 512
_FRACTIONS = np.array(FRAMES)[:, None, None]


def _covers(length: int, factor: int) -> np.ndarray:
    """(FRAMES, GRID_SIDE, reduced pixels) weights of each framing (``_cover_weights``),
    read-only."""
    if -(-length // factor) > _CACHED_PIXELS:
        return _cover_weights(length, factor)
    return _cached_covers(length, factor)


@functools.lru_cache(maxsize=128)
def _cached_covers(length: int, factor: int) -> np.ndarray:
    return _cover_weights(length, factor)


def _cover_weights(length: int, factor: int) -> np.ndarray:
    """For each framing in FRAMES, (GRID_SIDE, reduced pixels) weights: how much of each
    cell over the centre fraction of a side of ``length`` pixels each reduced pixel
    (``factor`` of them, fewer at the end) covers, as shares of the cell. Every framing
    at once, element by element the same float64 operations as one at a time (the
    grids' bytes depend on them; tests/test_colour_check.py compares)."""
    first = np.arange(-(-length // factor)) * factor
    last = np.minimum(first + factor, length)
    step = length * _FRACTIONS / GRID_SIDE
    lo = length * (1 - _FRACTIONS) / 2 + step * np.arange(GRID_SIDE)[:, None]
    overlap = np.clip(np.minimum(lo + step, last) - np.maximum(lo, first), 0, None)
    weights = (overlap / overlap.sum(axis=2, keepdims=True)).astype(np.float32)
    weights.flags.writeable = False  # shared through the cache
    return weights


def _pool(cells: np.ndarray, side: int) -> np.ndarray:
    """(..., GRID_SIDE, GRID_SIDE, 3) cells averaged down to (..., side, side, 3)."""
    k = cells.shape[-2] // side
    return cells.reshape(*cells.shape[:-3], side, k, side, k, _CHANNELS).mean(axis=(-4, -2))


@dataclass(frozen=True)
class Grids:
    """Decoded grids of some rows (none legacy), ready for vectorised comparison."""

    cells: np.ndarray  # (n, FRAMES, 16, 16, 3) with each channel's mean taken out
    variance: np.ndarray  # (n, FRAMES, 3) over the cells
    coarse: np.ndarray  # (n, FRAMES, 8, 8, 3) 2x2 cells pooled, means kept (colour)
    views: np.ndarray  # (n, FRAMES, 4, 4, 3) 4x4 pooled, means kept (a crop link's colour)

    @classmethod
    def of(cls, grids: list[bytes]) -> Grids:
        raw = np.frombuffer(b"".join(grids), np.uint8).reshape(
            len(grids), len(FRAMES), GRID_SIDE, GRID_SIDE, _CHANNELS).astype(np.float32)
        mean = raw.mean(axis=(2, 3), keepdims=True)
        return cls(raw - mean, raw.var(axis=(2, 3)), _pool(raw, LEGACY_WHOLE),
                   _pool(raw, LEGACY_REGION))


def _frame(point: int) -> int:
    return FRAMES.index(POINT_FRACTIONS[point])


def _seen(cells: np.ndarray, point: int) -> np.ndarray:
    """What ``point`` sees of (n, FRAMES, side, side, 3) cells: its framing, mirrored for
    odd points."""
    view = cells[:, _frame(point)]
    return view[:, :, ::-1] if point % 2 else view


def structure_distance(a: np.ndarray, a_var: np.ndarray, b: np.ndarray, b_var: np.ndarray
                       ) -> np.ndarray:
    """Largest cell difference of mean-free grids in units of their pooled deviation,
    per channel at least STRUCTURE_FLOOR levels; broadcast over leading axes."""
    spread = np.maximum(np.sqrt((a_var + b_var) / 2), STRUCTURE_FLOOR)
    return (np.abs(a - b).max(axis=(-3, -2)) / spread).max(axis=-1)


def compatible(g: Grids, row: int, point: int, others: np.ndarray, other_point: int,
               check: GridCheck) -> np.ndarray:
    """Per row of ``others``: whether what ``row``'s ``point`` sees and what their
    ``other_point`` sees pass both checks. Two whole images compare their 8x8 colours at
    the bound; a crop link (a region on either side) its 4x4 colours at half of it: a 4x4
    cell averages a recoloured object over more background (true crops of 300 COCO
    photos: at most 15; the recoloured scenes of tests/test_colour_check.py: 26 and
    more)."""
    ok = np.ones(len(others), dtype=bool)
    one = np.array([row])
    crop = max(point, other_point) >= 2
    if check.max_colour_distance is not None:
        colours, bound = ((g.views, check.max_colour_distance // 2) if crop
                          else (g.coarse, check.max_colour_distance))
        ok &= (np.abs(_seen(colours[one], point) - _seen(colours[others], other_point))
               .max(axis=(1, 2, 3)) <= bound)
    if check.max_structure_distance is not None and ok.any():
        rest = others[ok]  # the colour check is 12x cheaper: it goes first
        frame, other_frame = _frame(point), _frame(other_point)
        bound = check.max_structure_distance / (2 if crop else 1)
        ok[ok] = structure_distance(
            _seen(g.cells[one], point), g.variance[row, frame],
            _seen(g.cells[rest], other_point), g.variance[rest, other_frame],
        ) <= bound
    return ok


# ------------------------------------------------------------------- grids before format 2
def is_legacy(grid: bytes) -> bool:
    return len(grid) == LEGACY_GRID_BYTES


def readable(grid: bytes | None) -> bytes | None:
    """The grid, or None when it has neither layout this version reads (as no grid)."""
    return grid if grid is not None and len(grid) in (GRID_BYTES, LEGACY_GRID_BYTES) else None


def legacy_form(grid: bytes) -> bytes:
    """A grid in the layout written before the structure check: 8x8 of the whole image,
    then 4x4 of each region, so that an old grid can be compared with a new one."""
    if is_legacy(grid):
        return grid
    raw = np.frombuffer(grid, np.uint8).reshape(
        len(FRAMES), GRID_SIDE, GRID_SIDE, _CHANNELS).astype(np.float32)
    parts = [_pool(raw[0], LEGACY_WHOLE), *(_pool(r, LEGACY_REGION) for r in raw[1:])]
    return b"".join(np.round(p).astype(np.uint8).tobytes() for p in parts)


def _cells(data: bytes, side: int) -> np.ndarray:
    return np.frombuffer(data, np.uint8).reshape(side, side, _CHANNELS).astype(np.int16)


def colour_distance(a: bytes, b: bytes, mirrors: bool = True) -> int:
    """The largest difference of one cell's Y, Cb or Cr between two grids' 8x8 forms, in
    the better of the two orientations (as given, or, when ``mirrors``, ``b`` mirrored
    left-right)."""
    whole = LEGACY_WHOLE * LEGACY_WHOLE * _CHANNELS
    first = _cells(legacy_form(a)[:whole], LEGACY_WHOLE)
    second = _cells(legacy_form(b)[:whole], LEGACY_WHOLE)
    as_given = int(np.abs(first - second).max())
    return min(as_given, int(np.abs(first - second[:, ::-1]).max())) if mirrors else as_given


def view_grid(grid: bytes, point: int) -> np.ndarray:
    """The 4x4 grid of what perceptual point ``point`` sees in a legacy-form grid: the
    whole image's 8x8 pooled to 4x4, or the region's, mirrored for odd points."""
    whole = LEGACY_WHOLE * LEGACY_WHOLE * _CHANNELS
    region = LEGACY_REGION * LEGACY_REGION * _CHANNELS
    if point < 2:
        cells = _cells(grid[:whole], LEGACY_WHOLE).reshape(
            LEGACY_REGION, 2, LEGACY_REGION, 2, _CHANNELS).mean(axis=(1, 3))
    else:
        start = whole + (point - 2) // 2 * region
        cells = _cells(grid[start:start + region], LEGACY_REGION)
    return cells[:, ::-1] if point % 2 else cells
