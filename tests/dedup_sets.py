"""Generated hash tables with planted duplicates of every kind, and the single-process
decision (``filters/dedup.find_duplicates``) over raw shard files as the oracle that the
distributed stage 2 must equal.

A *family* is one photo's hashes (whole, mirror, two regions and their mirrors) plus
variants: exact copies (same pixel hash, or the same sha256 without one), near copies
(a few bits flipped in every hash), mirrors (whole and mirror swapped), crops (the whole
hash near the original's 80 % region), chains (each link a few bits from the last,
so the far end is linked to the start only through the others) and recolourings (near
hashes, another colour grid: never merged with the family). Members share the family's
colour grid within a few levels (a mirror's mirrored); older rows have none. Besides: rows with
blank-image hashes, rows without any perceptual hash, rows of older versions (whole hash
only), a dense bucket of distinct near-identical hashes, and one long chain of more than
a thousand rows (so the evidence of chained rows looks at its first members only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairforge.config import DedupConfig
from pairforge.dedup.grids import GridCheck
from pairforge.dedup.hashing import CROP_FRACTIONS
from pairforge.dedup.partitions import read_hash_columns, read_index
from pairforge.dedup.reference import find_duplicates, next_index
from pairforge.records import Status, make_key, raw_schema

REGIONS = 4


def _random_hashes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Hashes with 32 bits set, like a natural photo's phash."""
    bits = np.argsort(rng.random((*shape, 64)), axis=-1)[..., :32].astype(np.uint64)
    return np.bitwise_or.reduce(np.uint64(1) << bits, axis=-1)


def _flip(rng: np.random.Generator, values: np.ndarray, most: int) -> np.ndarray:
    """Each value with 1..most distinct bits flipped."""
    out = values.copy()
    flat = out.reshape(-1)
    for i in range(len(flat)):
        count = int(rng.integers(1, most + 1))
        for bit in rng.choice(64, count, replace=False):
            flat[i] ^= np.uint64(1) << np.uint64(bit)
    return out


COLOUR_BOUND = 32  # the default dedup.max_colour_distance (grids in the layout before format 2)


def _grid(rng: np.random.Generator, base: np.ndarray | None = None,
          mirrored: bool = False) -> bytes:
    """A colour grid: ``base`` within 4 levels (mirrored left-right), or a random one."""
    if base is None:
        return _with_regions(rng.integers(0, 256, (8, 8, 3), dtype=np.int16))
    grid = base[:, ::-1] if mirrored else base
    return _with_regions(np.clip(grid + rng.integers(-4, 5, grid.shape), 0, 255))


def _other_colour(rng: np.random.Generator, base: np.ndarray) -> bytes:
    """A grid one cell of which is more than COLOUR_BOUND from ``base``, in both
    orientations (a recoloured object)."""
    grid = base.copy()
    grid[3, 2:6, 1] = (grid[3, 2:6, 1] + 128) % 256
    return _with_regions(grid)


def _with_regions(whole: np.ndarray) -> bytes:
    """The 8x8 grid's bytes followed by each centre region's 4x4 grid, taken here as the
    whole grid pooled 2x2 (the generated hashes have no image to cut)."""
    pooled = whole.reshape(4, 2, 4, 2, 3).mean(axis=(1, 3)).round()
    regions = [pooled.astype(np.uint8).tobytes()] * len(CROP_FRACTIONS)
    return b"".join([whole.astype(np.uint8).tobytes(), *regions])


def generated_rows(seed: int, families: int = 60, chain_rows: int = 0) -> list[dict]:
    """Rows (dicts of the raw shard hash columns) of a generated set, in random order."""
    rng = np.random.default_rng(seed)
    t = 4
    rows: list[dict] = []
    colour: dict[str, np.ndarray | None] = {"base": None}

    def add(points: np.ndarray | None, exact: str | None, sha: str | None = None,
            size: int | None = None, older: bool = False, grid: bytes | None = None) -> None:
        side = int(size if size is not None else rng.choice([100, 200, 200, 300]))
        row = {"pixel_hash": exact, "sha256": sha, "original_width": side,
               "original_height": side if rng.random() < 0.9 else None,
               "phash": None, "phash_mirror": None, "crop_phashes": None,
               "colour_grid": None if older else grid or _grid(rng, colour["base"])}
        if points is not None:
            row["phash"] = int(points[0])
            if not older:
                row["phash_mirror"] = int(points[1])
                row["crop_phashes"] = [int(v) for v in points[2:]]
        rows.append(row)

    def fresh() -> str:
        return f"{rng.integers(0, 2**62):016x}{len(rows):08x}"

    bases = _random_hashes(rng, (families, 2 + REGIONS))
    for f in range(families):
        base = bases[f]
        colour["base"] = np.frombuffer(_grid(rng)[:192], np.uint8).reshape(8, 8, 3).astype(np.int16)
        add(base, fresh())
        for _ in range(int(rng.integers(0, 4))):
            kind = rng.choice(["exact", "sha", "near", "mirror", "crop", "chain", "older",
                               "far", "recoloured"])
            if kind == "exact":
                add(base, str(rows[-1]["pixel_hash"] or fresh()), grid=rows[-1]["colour_grid"])
            elif kind == "sha":
                sha = f"sha-{f}"
                add(base, None, sha)
                add(_flip(rng, base, t), None, sha)
            elif kind == "near":
                add(_flip(rng, base, t), fresh())
            elif kind == "mirror":
                swapped = base[[1, 0, 3, 2, 5, 4]]
                add(_flip(rng, swapped, 2), fresh(), grid=_grid(rng, colour["base"], True))
            elif kind == "crop":
                cropped = _random_hashes(rng, (2 + REGIONS,))
                cropped[0] = _flip(rng, base[4:5], 2)[0]  # the 0.8 region's hash
                add(cropped, fresh())
            elif kind == "chain":
                link = base
                for _ in range(int(rng.integers(2, 5))):
                    link = _flip(rng, link, t)
                    add(link, fresh())
            elif kind == "older":
                add(_flip(rng, base, t), fresh(), older=True)
            elif kind == "recoloured":
                add(_flip(rng, base, t), fresh(), grid=_other_colour(rng, colour["base"]))
            else:
                add(_random_hashes(rng, (2 + REGIONS,)), fresh())
    colour["base"] = None  # the rest: random grids
    blank = np.array([0x8000000000000000, 0, 0, 0, 0, 0], dtype=np.uint64)
    for i in range(6):  # blank images: only their pixels can match
        add(blank, f"blank-{i % 4}")
    for _ in range(4):
        add(None, fresh())  # no perceptual hash at all
    add(None, None, "sha-lonely")
    # a dense bucket: distinct hashes within 14 free bits of one another
    top = _random_hashes(rng, (1,))[0] & np.uint64(0xFFFFFFFFFFFFC000)
    low = rng.choice(1 << 14, 1400, replace=False).astype(np.uint64)
    for value in top | low:
        points = _random_hashes(rng, (2 + REGIONS,))
        points[0] = value
        add(points, fresh())
    link = _random_hashes(rng, (2 + REGIONS,))
    colour["base"] = np.frombuffer(_grid(rng)[:192], np.uint8).reshape(8, 8, 3).astype(np.int16)
    for _ in range(chain_rows):  # a long chain: one component, mostly indirect
        link = _flip(rng, link, 2)
        add(link, fresh(), size=int(rng.integers(50, 400)))
    return [rows[i] for i in rng.permutation(len(rows))]


def write_raw(folder: Path, rows: list[dict], shards: int, failed: int = 2) -> None:
    """Raw shard parquet files as stage 1 writes them, a few failed rows in each."""
    folder.mkdir(parents=True, exist_ok=True)
    schema = raw_schema()
    for shard in range(shards):
        part = rows[shard::shards]
        columns = {name: [None] * (len(part) + failed) for name in schema.names}
        columns["key"] = [make_key(shard, i) for i in range(len(part) + failed)]
        columns["status"] = ["ok"] * len(part) + [Status.TIMEOUT.value] * failed
        for name in ("sha256", "pixel_hash", "phash", "phash_mirror", "crop_phashes",
                     "colour_grid", "original_width", "original_height"):
            columns[name] = [r.get(name) for r in part] + [None] * failed
        pq.write_table(pa.table(columns, schema=schema), folder / f"{shard:05d}.parquet")


def index_files(path: Path) -> list[Path]:
    """The files of an index as the stage reads them: a folder's parts, in name order."""
    return sorted(path.glob("*.parquet")) if path.is_dir() else [path]


def oracle(raw: Path, indexes: list[Path], max_distance: int, source: str,
           perceptual: bool = True) -> tuple[pa.Table, dict, pa.Table]:
    """The single-process decision over the same files in the stage's order: duplicates,
    stats and the next index."""
    rows = pa.concat_tables([read_hash_columns(str(f), {})[0]
                             for f in sorted(raw.glob("*.parquet"))])
    files = [f for path in indexes for f in index_files(path)]
    index = pa.concat_tables([read_index(str(f), {}) for f in files]) if files else None
    result = find_duplicates(rows, max_distance, index, check=GridCheck.of(DedupConfig()),
                             perceptual=perceptual)
    return result.duplicates, result.stats, next_index(rows, result.duplicates, source,
                                                       index)


def read_index_folder(path: Path) -> pa.Table:
    """An index folder's rows: its parts in name order."""
    return pa.concat_tables([pq.read_table(f) for f in index_files(path)])
