"""`pairforge show`: a contact sheet of training samples, with VQ reconstructions.

Each tile shows the image labelled "original", beside it what the image tokenizer's decoder
makes of its codes labelled "VQ reconstruction" (when the tokenizer has a decoder), and
below them the key, task (or status), every score the row has, which caption trains
(recaption or original) and that caption, wrapped to the tile in DejaVu Sans (the TrueType
font matplotlib ships: Pillow's built-in bitmap font is tiny and drops spaces).
``--status STATUS`` shows the rows that left with that status instead (e.g. what a
classifier dropped as ``unsafe``): the image from the raw shard, why it was dropped, and
its original caption.
"""

from __future__ import annotations

import io
import posixpath
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
from PIL import Image, ImageDraw, ImageFont, ImageOps

from pairforge.config import ConfigError
from pairforge.records import Status
from pairforge.shards.dataset import check_output_folder, open_dataset
from pairforge.shards.storage import MANIFEST, SHARDS_FOLDER, OutputDir
from pairforge.shards.training import IMAGE_EXTENSIONS

TILE = 192
FONT_SIZE = 12
LINE_HEIGHT = 15
LABEL_HEIGHT = 16  # the "original" / "VQ reconstruction" line above the images
TEXT_LINES = 6  # key and task, scores, caption source, then the caption's first lines
PAD = 4
SAMPLE_LABELS = ("original", "VQ reconstruction")
DUPLICATE_LABELS = ("dropped duplicate", "kept")


def select_samples(out: OutputDir, task: str | None, grep: str | None,
                   n: int) -> list[dict[str, Any]]:
    """The first ``n`` samples (in key order) matching the task and caption word."""
    manifest = out.read_json(MANIFEST)
    urls = [out.uri(SHARDS_FOLDER, s["name"]) for s in manifest["shards"]]
    chosen = []
    for sample in wds.WebDataset(urls, shardshuffle=False).decode():
        meta = sample["json"]
        if task and meta.get("task") != task:
            continue
        if grep and grep.lower() not in sample["txt"].lower():
            continue
        chosen.append(sample)
        if len(chosen) == n:
            break
    return chosen


def select_dropped(out: OutputDir, status: str, grep: str | None,
                   n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows (in key order) that left stage 3 with ``status``, as samples: the
    training tars hold only kept samples, so images come from the raw tars."""
    import pyarrow.parquet as pq

    from pairforge.shards.training import read_raw_images

    chosen: list[dict[str, Any]] = []
    for shard in out.read_json(MANIFEST)["shards"]:
        if len(chosen) == n:
            break
        if not shard["status"].get(status):
            continue
        parquet = shard["name"].replace(".tar", ".parquet")
        with out.fs.open(out.path(SHARDS_FOLDER, parquet), "rb") as f:
            rows = [r for r in pq.read_table(f).to_pylist() if r["status"] == status
                    and (not grep or grep.lower() in (r["caption"] or "").lower())]
        rows = rows[:n - len(chosen)]
        images = read_raw_images(out, int(shard["name"][:-4]), {r["key"] for r in rows})
        for row in rows:
            ext, data = images[row["key"]]
            meta = {k: v for k, v in row.items()
                    if k in ("status", "error", "clip_score") or k.endswith("_score")}
            chosen.append({ext: bytes(data), "__key__": row["key"],
                           "txt": row["caption"] or "", "json": meta})
    return chosen


def sample_image(sample: dict[str, Any]) -> Image.Image:
    # webdataset's default decode() turns .npy and .json into objects, leaves images as bytes
    ext = next(e for e in IMAGE_EXTENSIONS if e in sample)
    return Image.open(io.BytesIO(sample[ext])).convert("RGB")


def reconstructions(out: OutputDir, samples: list[dict[str, Any]],
                    notes: list[str] | None = None) -> list[Image.Image | None]:
    """Decoded VQ codes of each sample, when the dataset's image tokenizer can decode.

    The manifest names the tokenizer as the build's config did, maybe by a path relative
    to where the build ran; when it cannot be loaded from here the sheet goes without
    reconstructions and ``notes`` says why."""
    manifest = out.read_json(MANIFEST)
    image_cfg = (manifest["config"]["process"]["tokenize"] or {}).get("image")
    if not manifest.get("vocab") or not image_cfg:
        return [None] * len(samples)
    from pairforge.tokenizers.registry import load_image_tokenizer

    try:
        tokenizer = load_image_tokenizer({**image_cfg, "device": "cpu"})
    except (OSError, ValueError) as err:
        if notes is not None:
            notes.append(f"no VQ reconstructions: the image tokenizer "
                         f"{image_cfg.get('path_or_id')} does not load from here ({err}); run "
                         "show where the build ran, or where that path exists")
        return [None] * len(samples)
    if not tokenizer.has_decoder:
        return [None] * len(samples)
    return tokenizer.decode([np.asarray(s["vq.npy"]) for s in samples])


def _fit(image: Image.Image, side: int) -> Image.Image:
    # Up or down: a 32 px reconstruction is shown at the size of the image beside it.
    return ImageOps.contain(image, (side, side), Image.Resampling.NEAREST
                            if max(image.size) < side // 2 else Image.Resampling.BICUBIC)


@cache
def sheet_font(size: int = FONT_SIZE) -> ImageFont.FreeTypeFont:
    """DejaVu Sans from matplotlib's data folder: a real TrueType font on every install."""
    import matplotlib

    return ImageFont.truetype(str(Path(matplotlib.get_data_path(), "fonts", "ttf",
                                       "DejaVuSans.ttf")), size)


def wrap_pixels(text: str, font: ImageFont.FreeTypeFont, width: float) -> list[str]:
    """``text`` in lines no wider than ``width`` px, broken between words (a word wider
    than a line is broken between characters)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if font.getlength(candidate) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        while font.getlength(word) > width:
            cut = max(1, max(i for i in range(1, len(word) + 1)
                             if font.getlength(word[:i]) <= width or i == 1))
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    return [*lines, line] if line else lines


def _scores(meta: dict[str, Any]) -> str:
    scores = [f"{k.removesuffix('_score')} {v:.3f}" for k, v in sorted(meta.items())
              if k.endswith("_score") and isinstance(v, float | int)]
    return " · ".join(scores) or "no scores"


def tile_lines(sample: dict[str, Any], font: ImageFont.FreeTypeFont, width: float,
               max_lines: int = TEXT_LINES) -> list[str]:
    """The text under a tile: key and task or status, scores, what dropped the row or
    which caption trains, then the caption wrapped; the last line ends in … if cut."""
    meta = sample["json"]
    head = f"{sample['__key__']} · " + (f"task {meta['task']}" if meta.get("task")
                                       else f"status {meta.get('status') or 'ok'}")
    why = meta.get("error") or (f"caption: {meta['caption_source']}"
                                if meta.get("caption_source") else "")
    fixed = [head, _scores(meta)] + ([why] if why else [])
    fixed = [line for text in fixed for line in wrap_pixels(text, font, width)]
    caption = wrap_pixels(sample["txt"], font, width) or ["(no caption)"]
    lines = fixed + caption
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and font.getlength(last + " …") > width:
            last = last[:-1]
        lines[-1] = last.rstrip() + " …"
    return lines


def contact_sheet(samples: list[dict[str, Any]], recons: list[Image.Image | None],
                  columns: int = 4, labels: tuple[str, str] = SAMPLE_LABELS) -> Image.Image:
    """Tiles of ``columns`` per row: the image (and ``recons`` beside it when any), each
    headed by its label in ``labels``, and the tile's text below."""
    paired = any(r is not None for r in recons)
    tile_w = TILE * (2 if paired else 1)
    tile_h = LABEL_HEIGHT + TILE + TEXT_LINES * LINE_HEIGHT + 2 * PAD
    rows = max(1, -(-len(samples) // columns))
    sheet = Image.new("RGB", (columns * tile_w, rows * tile_h), "white")
    draw = ImageDraw.Draw(sheet)
    font = sheet_font()
    for i, (sample, recon) in enumerate(zip(samples, recons, strict=True)):
        x, y = (i % columns) * tile_w, (i // columns) * tile_h
        draw.text((x + PAD, y + 1), labels[0], fill="#555555", font=font)
        sheet.paste(_fit(sample_image(sample), TILE), (x, y + LABEL_HEIGHT))
        if paired:
            draw.text((x + TILE + PAD, y + 1), labels[1], fill="#555555", font=font)
            if recon is not None:
                sheet.paste(_fit(recon.convert("RGB"), TILE), (x + TILE, y + LABEL_HEIGHT))
        top = y + LABEL_HEIGHT + TILE + PAD
        for j, line in enumerate(tile_lines(sample, font, tile_w - 2 * PAD)):
            draw.text((x + PAD, top + j * LINE_HEIGHT), line, fill="black", font=font)
    return sheet


def _check_status(status: str | None, task: str | None) -> None:
    if status is None or status == Status.OK:
        return
    if status not in set(Status):
        raise ConfigError(f"--status {status}: not a status (known: "
                          f"{', '.join(s.value for s in Status)})")
    if task:
        raise ConfigError("--task picks among kept samples; a dropped row has no task")


def show(path: str, output: str, task: str | None = None, grep: str | None = None,
         n: int = 16, storage_options: dict | None = None,
         notes: list[str] | None = None, status: str | None = None,
         duplicates: bool = False) -> int:
    """Write the sheet to ``output``; returns how many samples it shows. ``notes`` collects
    what the sheet leaves out and why. ``status``: rows that left with it instead of kept
    samples (what a filter dropped, images from the raw shards). ``duplicates``: dropped
    duplicates (of kind ``status``, or all), each beside the row that was kept."""
    suffix = posixpath.splitext(output)[1].lower()
    if suffix not in Image.registered_extensions():
        raise ConfigError(f"-o {output}: not an image file name (use .png or .jpg)")
    check_output_folder(output)
    _check_status(status, task)
    out, _ = open_dataset(path, storage_options)
    if duplicates:
        return _duplicates_sheet(out, output, status, grep, n)
    dropped = status not in (None, Status.OK)
    samples = (select_dropped(out, status, grep, n) if dropped
               else select_samples(out, task, grep, n))
    if not samples:
        return 0
    recons = [None] * len(samples) if dropped else reconstructions(out, samples, notes)
    sheet = contact_sheet(samples, recons)
    try:
        sheet.save(output)
    except OSError as err:
        raise ConfigError(f"-o {output}: cannot write ({err.strerror or err})") from None
    return len(samples)


def _duplicates_sheet(out: OutputDir, output: str, kind: str | None, grep: str | None,
                      n: int) -> int:
    """Dropped duplicates, each with the image of the row it was dropped for beside it."""
    from pairforge.inspection.duplicates import DUPLICATE_KINDS, duplicate_pairs

    if kind is not None and kind not in DUPLICATE_KINDS:
        raise ConfigError(f"--duplicates --status {kind}: not a duplicate kind (known: "
                          f"{', '.join(k.value for k in DUPLICATE_KINDS)})")
    pairs = duplicate_pairs(out, kind, grep, n)
    if not pairs:
        return 0
    sheet = contact_sheet([s for s, _ in pairs], [kept for _, kept in pairs],
                          labels=DUPLICATE_LABELS)
    try:
        sheet.save(output)
    except OSError as err:
        raise ConfigError(f"-o {output}: cannot write ({err.strerror or err})") from None
    return len(pairs)
