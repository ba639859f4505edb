"""`pairforge show`'s sheet is readable: a TrueType font, captions wrapped to the tile with
their spaces, "original" / "VQ reconstruction" labels, status and scores on every tile."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageFont
from tiny_dataset import write_tiny_dataset
from typer.testing import CliRunner

from pairforge.cli import app
from pairforge.inspection.contact_sheet import (
    LABEL_HEIGHT,
    LINE_HEIGHT,
    PAD,
    TEXT_LINES,
    TILE,
    contact_sheet,
    sheet_font,
    tile_lines,
    wrap_pixels,
)

CAPTION = ("a red circle on a grey background next to two small blue squares and a "
           "yellow triangle near the upper left corner of the picture")


def _sample(meta: dict, text: str = CAPTION) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buffer, format="PNG")
    return {"png": buffer.getvalue(), "__key__": "000000007", "txt": text, "json": meta}


def test_the_font_is_dejavu_sans_truetype():
    font = sheet_font()
    assert isinstance(font, ImageFont.FreeTypeFont)
    assert font.getname() == ("DejaVu Sans", "Book")


def test_wrapping_keeps_every_word_and_space_and_fits_the_width():
    font = sheet_font()
    lines = wrap_pixels(CAPTION, font, 180)
    assert len(lines) > 2
    assert " ".join(lines) == CAPTION  # no word lost, no two words glued together
    assert all(font.getlength(line) <= 180 for line in lines)
    assert wrap_pixels("x" * 80, font, 60) == [
        line for line in wrap_pixels("x" * 80, font, 60) if font.getlength(line) <= 60]
    assert "".join(wrap_pixels("x" * 80, font, 60)) == "x" * 80


def test_a_kept_sample_shows_key_task_scores_caption_source_and_caption():
    font = sheet_font()
    meta = {"task": "i2t", "clip_score": 0.3127, "nsfw_score": 0.01, "aesthetic_score": 5.5,
            "caption_source": "recaption"}
    lines = tile_lines(_sample(meta, "a red circle"), font, 2 * TILE - 2 * PAD)
    assert lines == ["000000007 · task i2t", "aesthetic 5.500 · clip 0.313 · nsfw 0.010",
                     "caption: recaption", "a red circle"]


def test_a_dropped_row_shows_its_status_and_why():
    meta = {"status": "unsafe", "error": "nsfw_score 0.97 > 0.5", "nsfw_score": 0.97}
    lines = tile_lines(_sample(meta, "a photo"), sheet_font(), TILE - 2 * PAD)
    assert lines == ["000000007 · status unsafe", "nsfw 0.970", "nsfw_score 0.97 > 0.5",
                     "a photo"]


def test_a_long_caption_is_cut_with_an_ellipsis_at_the_last_line():
    meta = {"task": "t2i", "clip_score": 0.3}
    lines = tile_lines(_sample(meta), sheet_font(), TILE - 2 * PAD)
    assert len(lines) == TEXT_LINES
    assert lines[-1].endswith(" …")
    assert lines[1] == "clip 0.300"


def _ink(region: Image.Image) -> int:
    """Pixels of the region that are not white (drawn text)."""
    return int((np.asarray(region.convert("L")) < 200).sum())


def test_labels_head_the_original_and_the_reconstruction():
    meta = {"task": "t2i", "clip_score": 0.3}
    sheet = contact_sheet([_sample(meta)], [Image.new("RGB", (32, 32), "blue")], columns=1)
    assert sheet.size == (2 * TILE, LABEL_HEIGHT + TILE + TEXT_LINES * LINE_HEIGHT + 2 * PAD)
    left = sheet.crop((0, 0, TILE, LABEL_HEIGHT))
    right = sheet.crop((TILE, 0, 2 * TILE, LABEL_HEIGHT))
    font = sheet_font()
    # each label strip holds about as much ink as its word drawn alone
    assert _ink(left) > 0 and _ink(right) > _ink(left)
    assert font.getlength("VQ reconstruction") > font.getlength("original")
    assert sheet.getpixel((TILE // 2, LABEL_HEIGHT + TILE // 2)) == (255, 0, 0)  # red original
    assert sheet.getpixel((TILE + TILE // 2, LABEL_HEIGHT + TILE // 2)) == (0, 0, 255)


def test_show_draws_the_tiny_dataset_with_labels_and_text(tmp_path):
    out = write_tiny_dataset(tmp_path / "data")
    result = CliRunner().invoke(app, ["show", str(out), "-o", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "2 samples → " in result.stderr
    sheet = Image.open(tmp_path / "s.png")
    assert sheet.size == (4 * TILE, LABEL_HEIGHT + TILE + TEXT_LINES * LINE_HEIGHT + 2 * PAD)
    text_band = sheet.crop((0, LABEL_HEIGHT + TILE, TILE, sheet.size[1]))
    assert _ink(text_band) > 500  # four lines of 12 px text
