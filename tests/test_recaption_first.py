"""Recaption-first builds (issue 35): junk alt-text decides nothing; the checks judge the
training caption after recaptioning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import yaml
from golden import tiny_clip
from loopback_server import LoopbackServer

from pairforge.config import BasicFilterConfig, ConfigError, load_config
from pairforge.download.alt_text import (
    BOILERPLATE,
    EMPTY,
    FILE_NAME,
    NOT_UTF8,
    invalid_error,
    junk_kind,
    read_alt_text,
)
from pairforge.filters.clip import ClipScorer, ClipStep, ClipTrainingStep
from pairforge.images import decode_rgb
from pairforge.recaption.choice import Choice, TrainingCaptionStep, recaption_first_choice
from pairforge.records import Status
from pairforge.scenes.world import render, scenes
from pairforge.shards.report import render_report

SAMPLE = Path(__file__).resolve().parents[1] / "pairforge" / "sample"


@pytest.mark.parametrize("text", ["IMG_0001.jpg", "DSC1234.JPG", "image-0042.png",
                                  "upload_0001.jpeg", "photo0001.jpg", "DSC_0042", "20190301_1215",
                                  "3f2a9c1b7e4d", "my holiday.webp"])
def test_file_names_are_junk(text: str) -> None:
    assert junk_kind(text) == FILE_NAME


@pytest.mark.parametrize("text", ["image", "Photo", "untitled", "Click here!", "stock image",
                                  "img", "thumbnail", "Image 3", "photo #12", "N/A"])
def test_boilerplate_is_junk(text: str) -> None:
    assert junk_kind(text) == BOILERPLATE


@pytest.mark.parametrize("text", ["A small red circle on the left on a grey background.",
                                  "photo of a dog on a beach", "Image of the Eiffel tower",
                                  "red", "2 cats", "jpg artefacts explained"])
def test_real_alt_text_is_not_junk(text: str) -> None:
    assert junk_kind(text) is None


def test_what_stage_1_records_and_when_it_ends_the_row() -> None:
    assert read_alt_text(b"  ").issue == EMPTY
    assert read_alt_text(b"caf\xe9").issue == NOT_UTF8
    junk = read_alt_text(b" IMG_0001.jpg ")
    assert (junk.text, junk.issue) == ("IMG_0001.jpg", FILE_NAME)
    # alt-text-first: as always (unreadable ends the row where captions are read)
    assert invalid_error(read_alt_text(b""), True, False) == "empty caption"
    assert invalid_error(read_alt_text(None), True, False) == "missing caption"
    assert invalid_error(read_alt_text(None), False, False) is None
    assert invalid_error(read_alt_text(b"caf\xe9"), False, False).startswith("caption is not")
    assert invalid_error(junk, True, False) is None  # stage 3's caption rules judge it
    # recaption-first: nothing ends a row
    for raw in (b"", None, b"caf\xe9", b"IMG_0001.jpg"):
        assert invalid_error(read_alt_text(raw), True, True) is None


RULES = BasicFilterConfig(min_caption_words=2, min_caption_chars=5)


@pytest.mark.parametrize(("choice", "original", "issue", "recaption", "expected"), [
    ("recaption", "a red ball", None, "a blue cube", Choice("a blue cube", "recaption")),
    # the recaption abstained on an image with usable alt-text: an img sample, as always
    ("recaption", "a red ball", None, None, Choice()),
    ("recaption", "ball", None, None, Choice()),  # the alt-text is not judged: not trained
    # ... without usable alt-text: the row has no caption at all
    ("recaption", "IMG_1.jpg", "file_name", None,
     Choice(status=Status.CAPTION_ABSTAINED,
            error="the captioner abstained and the alt-text is file_name")),
    ("recaption", None, "empty", "a blue cube", Choice("a blue cube", "recaption")),
    # the caption rules judge the training caption
    ("recaption", "a red ball", None, "cube",
     Choice(status=Status.CAPTION_TOO_SHORT, error="recaption: 1 words, 4 characters")),
    # mix: the draw (here the recaption, share 1), else the other
    ("mix", "a red ball", None, "cube", Choice("a red ball", "original")),
    ("mix", "a red ball", None, None, Choice("a red ball", "original")),
    ("mix", "ball", None, "cube",
     Choice(status=Status.CAPTION_TOO_SHORT, error="recaption: 1 words, 4 characters")),
    ("mix", None, "empty", None,
     Choice(status=Status.CAPTION_ABSTAINED,
            error="the captioner abstained and the alt-text is empty")),
])
def test_the_recaption_first_choice(choice, original, issue, recaption, expected) -> None:
    assert recaption_first_choice(choice, 1.0, 0, "000000001", original, issue, recaption,
                                  RULES) == expected


def test_mix_tries_its_draw_first_then_the_other() -> None:
    keys = [f"{i:09d}" for i in range(400)]
    drawn = [recaption_first_choice("mix", 0.5, 3, k, "a red ball", None, "a blue cube",
                                    RULES).source for k in keys]
    assert 150 < drawn.count("original") < 250  # the seeded draw, both sources used
    # where the draw is the alt-text but it is junk, the recaption trains: no row is lost
    junk = [recaption_first_choice("mix", 0.5, 3, k, "IMG_1.jpg", "file_name", "a blue cube",
                                   RULES).source for k in keys]
    assert junk == ["recaption"] * len(keys)


def test_top_fraction_cannot_judge_the_training_caption(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "input": {"path": "in.csv"}, "output": {"path": "out"},
        "process": {"clip": {"enabled": True, "mode": "top_fraction"},
                    "recaption": {"enabled": True}}}))
    with pytest.raises(ConfigError, match="clip.score: original"):
        load_config(path)
    config = yaml.safe_load(path.read_text())
    config["process"]["clip"]["score"] = "original"
    path.write_text(yaml.safe_dump(config))
    assert load_config(path).process.recaption_first()


def _png(image) -> bytes:  # noqa: ANN001
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("score", ["training", "both", "original"])
def test_clip_judges_the_caption_clip_score_names(tmp_path: Path, score: str) -> None:
    """The clip steps' scores are the bare open_clip cosine of the image and the caption
    clip.score names, computed in a plain loop with the same model."""
    clip = tiny_clip(tmp_path / "clip")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "input": {"path": "in.csv"}, "output": {"path": "out"},
        "process": {"clip": {"enabled": True, "threshold": -1.0, "score": score, **clip},
                    "recaption": {"enabled": True, "model": str(SAMPLE / "captioner")}}}))
    cfg = load_config(config)
    drawn = scenes(6)
    images = [_png(render(s, 32)) for s in drawn]
    recaptions = ["a large red circle", None, "a small blue cross", "two green squares",
                  "a purple cross", "a white circle"]
    rows = pa.table({
        "key": [f"{i:09d}" for i in range(6)], "image": images,
        "caption": ["a red circle", "a square", "IMG_3.jpg", None, "one shape", "blue"],
        "caption_issue": [None, None, "file_name", "empty", None, None],
        "status": ["ok"] * 6, "error": [None] * 6, "recaption": recaptions})
    rows = ClipStep(cfg)(rows)
    rows = TrainingCaptionStep(cfg)(rows)
    if ClipTrainingStep.enabled(cfg):
        rows = ClipTrainingStep(cfg)(rows)
    scorer = ClipScorer(cfg.process.clip)

    def bare(texts: list[str | None]) -> list[float | None]:
        out: list[float | None] = []
        for image, text in zip(images, texts, strict=True):
            if text is None:
                out.append(None)
                continue
            sim, _ = scorer.score([decode_rgb(image)], [text])
            out.append(float(sim[0]))
        return out

    usable = ["a red circle", "a square", None, None, "one shape", "blue"]
    train = rows["train_caption"].to_pylist()
    judged = {"training": bare(train), "both": bare(train), "original": bare(usable)}[score]
    np.testing.assert_allclose(np.array(rows["clip_score"].to_pylist(), dtype=float),
                               np.array(judged, dtype=float), atol=1e-5)
    originals = bare(usable) if score == "both" else [None] * 6
    np.testing.assert_allclose(np.array(rows["clip_score_original"].to_pylist(), dtype=float),
                               np.array(originals, dtype=float), atol=1e-5)
    # row 1: the recaption abstained on an image with usable alt-text: an img sample
    assert rows["caption_source"].to_pylist() == ["recaption", None, "recaption",
                                                  "recaption", "recaption", "recaption"]


def _junk_alt_text_build(tmp_path: Path, recaption: bool) -> Path:
    """200 scene-world images over loopback; alt-text half empty, half camera file names;
    the demo's captioner, tokenizer and p_drop."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i, s in enumerate(scenes(200)):
        render(s, 32).save(folder / f"scene_{i:03d}.png")
    with LoopbackServer(folder) as server:
        lines = [f"{server.url(f'/img/scene_{i:03d}.png')},{'' if i % 2 else f'IMG_{i:04d}.jpg'}"
                 for i in range(200)]
        (tmp_path / "in.csv").write_text("url,caption\n" + "\n".join(lines) + "\n")
        demo = yaml.safe_load((SAMPLE.parents[1] / "examples" / "demo.yaml").read_text())
        process = demo["process"]
        process["recaption"]["enabled"] = recaption
        for section in ("image", "text"):
            tokenizer = process["tokenize"][section]
            tokenizer["path_or_id"] = str(SAMPLE.parents[1] / tokenizer["path_or_id"])
        process["recaption"]["model"] = str(SAMPLE / "captioner")
        cfg = {**demo, "input": {"path": str(tmp_path / "in.csv"), "shard_size": 100},
               "output": {"path": str(tmp_path / "out")},
               "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
               "dedup": {"enabled": False}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                                 str(tmp_path / "c.yaml"), "-q"], capture_output=True,
                                text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return tmp_path / "out"


def _rows(out: Path) -> list[dict]:
    return pq.read_table(sorted((out / "shards").glob("*.parquet"))).to_pylist()


def test_a_recaptioning_build_keeps_every_image_whose_alt_text_is_junk(tmp_path: Path) -> None:
    out = _junk_alt_text_build(tmp_path, recaption=True)
    rows = _rows(out)
    statuses = [r["status"] for r in rows]
    assert len(rows) == 200 and statuses.count("ok") >= 199
    assert not [s for s in statuses if s.startswith("caption_") and s != "caption_abstained"]
    issues = [r["caption_issue"] for r in rows]
    assert (issues.count("empty"), issues.count("file_name")) == (100, 100)
    kept = [r for r in rows if r["status"] == "ok"]
    assert {r["caption_source"] for r in kept} == {"recaption"}
    assert all(r["train_caption"] == r["recaption"] for r in kept)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recaption"]["rescued"] == len(kept)
    page = render_report(str(out))
    assert f"no usable alt-text, recaptioned</td><td class=\"n\">{len(kept)}</td>" in page
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    texts = {s["__key__"]: s["txt"].decode() for s in wds.WebDataset(tars, shardshuffle=False)}
    assert texts == {r["key"]: r["train_caption"] for r in kept}


def test_without_recaption_junk_alt_text_ends_rows_as_before(tmp_path: Path) -> None:
    rows = _rows(_junk_alt_text_build(tmp_path, recaption=False))
    statuses = [r["status"] for r in rows]
    assert (statuses.count("caption_invalid"), statuses.count("caption_too_short")) == (100, 100)
