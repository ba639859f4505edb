"""One decode per row (issue 48): the chain decodes each row's image once, ahead of the
model pools, and prepares each picture a step reads once (``images.ImageView``); CLIP, a
transformers classifier, the captioner with CLIP grounding and the VQ read those arrays
and give the bytes they give when each decodes by itself."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import golden
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from test_classifiers import _save_vit

from pairforge import images
from pairforge.config import parse_config
from pairforge.pipeline.chain import enabled_steps
from pairforge.pipeline.contract import step_config
from pairforge.pipeline.placement import chain_views
from pairforge.stage import ModelStep

SAMPLE = Path(__file__).resolve().parents[1] / "pairforge" / "sample"
N_ROWS = 10


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return chain_config(tmp_path_factory.mktemp("one_decode"))


def chain_config(folder: Path):  # noqa: ANN201 - a PairforgeConfig
    """CLIP, a transformers classifier, the captioner with CLIP grounding and our VQ, all
    tiny (bench/stage3.py counts the decodes of the same chain)."""
    return parse_config({
        "input": {"path": "unused"}, "output": {"path": str(folder / "out")},
        "dedup": {"enabled": True},  # no claim registry: the steps run without Ray
        "process": {
            "basic": {"min_image_side": 32},
            "clip": {"enabled": True, "mode": "score_only", "batch_size": 4,
                     **golden.tiny_clip(folder / "clip", name="pf-one-decode-clip")},
            "classifiers": [{"name": "nsfw", "backend": "transformers", "label": "nsfw",
                             "model": _save_vit(folder / "nsfw", ["normal", "nsfw"], 1),
                             "batch_size": 4}],
            "recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                          "batch_size": 4, "max_new_tokens": 8, "cache": {"enabled": False},
                          "grounding": {"enabled": True, "backend": "clip"}},
            "tokenize": {"enabled": True, "batch_size": 4,
                         "image": {"backend": "pairforge-vq", "path_or_id": str(SAMPLE / "vq32")},
                         "text": {"backend": "hf", "path_or_id": str(SAMPLE / "text")}}}})


def _rows(n: int) -> pa.Table:
    """Raw rows of the sample's scenes (PNG, 32 px), the last one already ended by stage 1."""
    data, hashes = [], []
    for path in sorted((SAMPLE / "images").glob("*.png"))[:n]:
        buffer = io.BytesIO()
        Image.open(path).convert("RGB").resize((48, 40)).save(buffer, "PNG")  # not square
        data.append(buffer.getvalue())
        hashes.append(hashlib.sha256(data[-1]).hexdigest())
    status = ["ok"] * (n - 1) + ["decode_error"]
    return pa.table({
        "key": [f"{i:09d}" for i in range(n)], "caption": ["a red circle"] * n,
        "caption_issue": pa.array([None] * n, pa.string()), "status": status,
        "error": pa.array([None] * n, pa.string()), "image_format": ["png"] * n,
        "width": [48] * n, "height": [40] * n, "original_width": [48] * n,
        "original_height": [40] * n, "pixel_hash": hashes,
        "phash": [f"{i:016x}" for i in range(n)], "image": pa.array(data, pa.large_binary())})


def _run_chain(cfg, rows: pa.Table, decode_first: bool) -> pa.Table:
    """The chain in this process, as placement.add_steps lays it out on Ray Data: the views
    decoded right before the first model step (or not at all: each step decodes itself)."""
    handed = step_config(cfg)
    steps = enabled_steps(cfg)
    decoded = False
    for step in steps:
        if decode_first and issubclass(step, ModelStep) and not decoded:
            rows = images.decode_views(rows, chain_views(steps, handed))
            decoded = True
        instance = step(handed)
        try:
            rows = instance(rows)
        finally:
            instance.teardown()
    return rows


def test_the_chain_names_each_picture_once(cfg):
    views = chain_views(enabled_steps(cfg), step_config(cfg))
    kinds = sorted(v.key.split(":")[0] for v in views)
    # CLIP's resize + crop (its step, grounding and the classifier share none with it),
    # the decoded image (classifier, captioner), the VQ's 32-px square
    assert kinds == ["open_clip", "rgb", "square-bicubic"]
    assert len({v.column for v in views}) == 3


def test_the_decoding_task_hands_on_a_table_per_max_bytes_of_pictures(cfg):
    """Ray stores each table the decoding task yields as a block: what the task holds is
    bounded by the bytes it decoded (each ok row here: 48x40 + 32x32 + 32x32 px of RGB),
    not by a guess at the raw images' size. Every row once, in order, as decode_views."""
    rows = _rows(N_ROWS)
    views = chain_views(enabled_steps(cfg), step_config(cfg))
    per_row = 3 * (48 * 40 + 32 * 32 + 32 * 32)
    images.DECODES["rows"] = 0
    parts = list(images.decode_view_blocks(rows, views, max_bytes=2 * per_row))
    assert images.DECODES["rows"] == N_ROWS - 1
    # two ok rows a table; the ninth and the ended tenth (no pictures) end the batch
    assert [p.num_rows for p in parts] == [2, 2, 2, 2, 2]
    assert pa.concat_tables(parts).equals(images.decode_views(rows, views))
    assert [p.num_rows for p in images.decode_view_blocks(rows.slice(0, 0), views)] == [0]


def test_four_model_steps_decode_each_row_once_and_write_the_same_bytes(cfg):
    rows = _rows(N_ROWS)
    images.DECODES["rows"] = 0
    by_steps = _run_chain(cfg, rows, decode_first=False)
    each_decodes = images.DECODES["rows"]
    images.DECODES["rows"] = 0
    once = _run_chain(cfg, rows, decode_first=True)
    assert images.DECODES["rows"] == N_ROWS - 1  # every ok row once; the ended row never
    assert each_decodes >= 4 * (N_ROWS - 1)  # CLIP, classifier, captioner, VQ: today's cost
    for column in ("clip_score", "clip_embedding", "nsfw_score", "recaption",
                   "recaption_flags", "image_tokens", "caption_tokens", "status"):
        assert once[column].to_pylist() == by_steps[column].to_pylist(), column
    kept = [i for i, s in enumerate(once["status"].to_pylist()) if s == "ok"]
    assert kept and all(len(once["image_tokens"][i]) == 8 * 8 for i in kept)  # 32 px / 4


def test_a_view_column_holds_the_prepared_pixels(cfg):
    rows = _rows(3)
    views = chain_views(enabled_steps(cfg), step_config(cfg))
    decoded = images.decode_views(rows, views)
    square = next(v for v in views if v.key.startswith("square"))
    (first, _, _) = images.view_images(decoded.slice(0, 3), square)
    expected = images.resize_center_crop(images.decode_rgb(rows["image"][0].as_py()), 32)
    assert first.size == (32, 32) and np.array_equal(np.asarray(first), np.asarray(expected))
    assert decoded[square.column].to_pylist()[2] is None  # the ended row: not decoded
    rgb = images.view_images(decoded.slice(0, 1), images.RGB)[0]
    assert rgb.size == (48, 40)


def test_an_image_that_no_longer_decodes_ends_its_row_not_the_stage(cfg):
    """A raw tar damaged after stage 1 read it, or an image past stage 3's pixel cap: the
    row ends decode_error with a message, before a pixel is allocated; the others go on."""
    rows = _rows(4)
    data = rows["image"].to_pylist()
    data[1] = data[1][:40]  # a PNG cut short
    huge = io.BytesIO()
    Image.new("1", (8192, 8193)).save(huge, "PNG")  # a few KB claiming 67.1 M pixels
    data[2] = huge.getvalue()
    rows = rows.set_column(rows.column_names.index("image"), "image",
                           pa.array(data, pa.large_binary()))
    views = chain_views(enabled_steps(cfg), step_config(cfg))
    decoded = images.decode_views(rows, views)
    assert decoded["status"].to_pylist() == ["ok", "decode_error", "decode_error",
                                              "decode_error"]
    error = decoded["error"].to_pylist()[1]
    assert error.startswith("stage 3 could not decode the image: ")
    assert "8192x8193 pixels is past stage 3's cap" in decoded["error"].to_pylist()[2]
    assert decoded["error"].to_pylist()[3] is None  # ended by stage 1: left as it was
    column = decoded[views[0].column].to_pylist()
    assert column[0] is not None and column[1] is None and column[2] is None
    handed = step_config(cfg)
    after = enabled_steps(cfg)[1](handed)(decoded)  # the first model step skips the row
    assert after["status"].to_pylist()[1] == "decode_error"
